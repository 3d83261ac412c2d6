// Deterministic pseudo-random test data: `n` bytes from std::mt19937(`seed`), as
// a vector of `Byte` (unsigned char or char).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace cairn::test_util {

template <typename Byte = unsigned char>
std::vector<Byte> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Byte> v(n);
  for (auto& b : v) b = static_cast<Byte>(rng());
  return v;
}

}  // namespace cairn::test_util
