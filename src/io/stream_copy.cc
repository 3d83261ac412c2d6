#include "io/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace cairn::internal {

#if defined(__x86_64__)

namespace {

// The aligned middle: `n` a multiple of 128, dst 32-byte aligned.
__attribute__((target("avx2"))) void StreamAvx2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 64));
    __m256i d = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 96), d);
  }
}

// SSE2, which every x86-64 CPU has.
void StreamSse2(char* dst, const char* src, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
}

const bool kHasAvx2 = __builtin_cpu_supports("avx2");

}  // namespace

void StreamCopy(char* dst, const char* src, size_t n) {
  constexpr size_t kAlign = 32, kStep = 128;
  const size_t head = (kAlign - reinterpret_cast<uintptr_t>(dst) % kAlign) % kAlign;
  if (n < head + kStep) {
    std::memcpy(dst, src, n);
    return;
  }
  std::memcpy(dst, src, head);
  const size_t body = (n - head) / kStep * kStep;
  if (kHasAvx2) {
    StreamAvx2(dst + head, src + head, body);
  } else {
    StreamSse2(dst + head, src + head, body);
  }
  std::memcpy(dst + head + body, src + head + body, n - head - body);
  _mm_sfence();
}

#else

void StreamCopy(char* dst, const char* src, size_t n) { std::memcpy(dst, src, n); }

#endif

}  // namespace cairn::internal
