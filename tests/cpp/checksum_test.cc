// Tests of the checkpoint checksum (cairn/checksum.h): whichever xxHash kernel
// the engine's runtime dispatch picks on this CPU (src/io/xxh3.h), every
// digest equals the portable scalar XXH3-64, so checkpoints written on one
// machine verify on any other. (A save's one-shot digests and a load's
// streamed ones meet in every read test.)
#include "cairn/checksum.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

// The reference: xxHash's scalar kernel, compiled into this file only.
#define XXH_INLINE_ALL
#define XXH_VECTOR 0  // XXH_SCALAR
#define XXH_NAMESPACE cairn_ref_
#include <xxhash.h>

#include "random_bytes.h"

namespace cairn {
namespace {

using test_util::RandomBytes;

TEST(ChecksumTest, EmptyInputHasXxh3sKnownDigest) {
  EXPECT_EQ(Checksum(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(Checksum("", 0), 0x2D06800538D394C2ull);
}

TEST(ChecksumTest, EveryKernelGivesTheScalarDigest) {
  // Lengths on both sides of XXH3's size classes (16, 128, 240 bytes, one
  // stripe block of 1 KiB, one 64 KiB+ stream) and a 16 MiB checkpoint block.
  const std::vector<size_t> lengths = {1,   3,    16,   17,   128,   129,     240,
                                       241, 1023, 1024, 1025, 65537, 1 << 20, 16 << 20};
  const std::vector<unsigned char> data = RandomBytes(16 << 20, 7);
  for (size_t n : lengths) {
    for (size_t misalign : {size_t{0}, size_t{3}}) {
      if (n + misalign > data.size()) continue;
      const unsigned char* p = data.data() + misalign;
      const uint64_t want = XXH3_64bits(p, n);
      EXPECT_EQ(Checksum(p, n), want) << n << " bytes at +" << misalign;
    }
  }
  // The block checksums a save stores (the readers' streamed digests are
  // checked against these by every read test).
  auto blocks = BlockChecksums(data.data(), data.size(), 1 << 20);
  ASSERT_TRUE(blocks.ok()) << blocks.status().ToString();
  ASSERT_EQ(blocks->size(), 16u);
  for (size_t b = 0; b < blocks->size(); ++b) {
    EXPECT_EQ((*blocks)[b], XXH3_64bits(data.data() + (b << 20), 1 << 20)) << "block " << b;
  }
}

}  // namespace
}  // namespace cairn
