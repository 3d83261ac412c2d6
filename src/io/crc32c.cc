// CRC-32C (see crc32c.h).
//
// The CRC register here is the "raw" one: Crc32c(data, n, crc) starts from
// ~crc and returns the final register inverted, as every CRC-32C API does,
// so chaining works. Reflected polynomial 0x82F63B78.
#include "io/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define CAIRN_CRC32C_X86 1
#endif

namespace cairn::internal {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

// tables[k][b]: the register after feeding byte b then k zero bytes into a
// zero register (slicing-by-8).
using Tables = std::array<std::array<uint32_t, 256>, 8>;

constexpr Tables MakeTables() {
  Tables t{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t r = b;
    for (int i = 0; i < 8; ++i) r = (r >> 1) ^ ((r & 1) ? kPoly : 0);
    t[0][b] = r;
  }
  for (size_t k = 1; k < 8; ++k) {
    for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  }
  return t;
}

constexpr Tables kTables = MakeTables();

uint32_t Bytewise(uint32_t r, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) r = kTables[0][(r ^ p[i]) & 0xff] ^ (r >> 8);
  return r;
}

#if CAIRN_CRC32C_X86

// A linear map on 32-bit registers, as the images of the 32 unit vectors.
using Matrix = std::array<uint32_t, 32>;

uint32_t Apply(const Matrix& m, uint32_t v) {
  uint32_t out = 0;
  for (int i = 0; v; ++i, v >>= 1) {
    if (v & 1) out ^= m[i];
  }
  return out;
}

// a after b.
Matrix Compose(const Matrix& a, const Matrix& b) {
  Matrix out{};
  for (int i = 0; i < 32; ++i) out[i] = Apply(a, b[i]);
  return out;
}

// The operator that appends `nbytes` zero bytes to a raw register,
// as byte-indexed tables: Shift(z, r) = z[0][r & 0xff] ^ ... ^ z[3][r >> 24].
using ShiftTables = std::array<std::array<uint32_t, 256>, 4>;

ShiftTables MakeShift(size_t nbytes) {
  Matrix bit{};  // one zero bit: r -> (r >> 1) ^ (r & 1 ? kPoly : 0)
  bit[0] = kPoly;
  for (int i = 1; i < 32; ++i) bit[i] = 1u << (i - 1);
  Matrix byte = bit;
  for (int i = 0; i < 3; ++i) byte = Compose(byte, byte);  // 2, 4, 8 bits
  Matrix op{};
  for (int i = 0; i < 32; ++i) op[i] = 1u << i;  // identity
  for (Matrix sq = byte; nbytes; nbytes >>= 1, sq = Compose(sq, sq)) {
    if (nbytes & 1) op = Compose(sq, op);
  }
  ShiftTables z{};
  for (uint32_t b = 0; b < 256; ++b) {
    for (int k = 0; k < 4; ++k) z[k][b] = Apply(op, b << (8 * k));
  }
  return z;
}

inline uint32_t Shift(const ShiftTables& z, uint32_t r) {
  return z[0][r & 0xff] ^ z[1][(r >> 8) & 0xff] ^ z[2][(r >> 16) & 0xff] ^ z[3][r >> 24];
}

// Three streams of kLong (then kShort) bytes at a time.
constexpr size_t kLong = 8192, kShort = 256;

struct Shifts {
  ShiftTables long_ = MakeShift(kLong), short_ = MakeShift(kShort);
};

const Shifts& GetShifts() {
  static const Shifts s;
  return s;
}

inline uint64_t Load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

template <size_t kBlock>
__attribute__((target("sse4.2"))) inline uint64_t ThreeWay(uint64_t c0, const unsigned char** pp,
                                                           size_t* nn, const ShiftTables& z) {
  const unsigned char* p = *pp;
  size_t n = *nn;
  while (n >= 3 * kBlock) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kBlock; i += 8) {
      c0 = _mm_crc32_u64(c0, Load64(p + i));
      c1 = _mm_crc32_u64(c1, Load64(p + kBlock + i));
      c2 = _mm_crc32_u64(c2, Load64(p + 2 * kBlock + i));
    }
    c0 = Shift(z, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = Shift(z, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
    p += 3 * kBlock;
    n -= 3 * kBlock;
  }
  *pp = p;
  *nn = n;
  return c0;
}

#endif  // CAIRN_CRC32C_X86

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t r = ~crc;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    r = kTables[0][(r ^ *p++) & 0xff] ^ (r >> 8);
    --n;
  }
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= r;
    r = kTables[7][w & 0xff] ^ kTables[6][(w >> 8) & 0xff] ^ kTables[5][(w >> 16) & 0xff] ^
        kTables[4][(w >> 24) & 0xff] ^ kTables[3][(w >> 32) & 0xff] ^ kTables[2][(w >> 40) & 0xff] ^
        kTables[1][(w >> 48) & 0xff] ^ kTables[0][w >> 56];
  }
#endif
  return ~Bytewise(r, p, n);
}

bool Crc32cHardwareAvailable() {
#if CAIRN_CRC32C_X86
  static const bool available = __builtin_cpu_supports("sse4.2");
  return available;
#else
  return false;
#endif
}

#if CAIRN_CRC32C_X86
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(const void* data, size_t n,
                                                          uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = static_cast<uint32_t>(~crc);
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  if (n >= 3 * kShort) {
    const Shifts& s = GetShifts();
    c = ThreeWay<kLong>(c, &p, &n, s.long_);
    c = ThreeWay<kShort>(c, &p, &n, s.short_);
  }
  for (; n >= 8; p += 8, n -= 8) c = _mm_crc32_u64(c, Load64(p));
  uint32_t r = static_cast<uint32_t>(c);
  for (; n > 0; --n) r = _mm_crc32_u8(r, *p++);
  return ~r;
}
#else
uint32_t Crc32cHardware(const void* data, size_t n, uint32_t crc) {
  return Crc32cPortable(data, n, crc);
}
#endif

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  return Crc32cHardwareAvailable() ? Crc32cHardware(data, n, crc) : Crc32cPortable(data, n, crc);
}

std::string Crc32cBase64(uint32_t crc) {
  static const char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  const unsigned char b[4] = {
      static_cast<unsigned char>(crc >> 24), static_cast<unsigned char>(crc >> 16),
      static_cast<unsigned char>(crc >> 8), static_cast<unsigned char>(crc)};
  std::string out(8, '=');
  out[0] = kAlphabet[b[0] >> 2];
  out[1] = kAlphabet[((b[0] & 3) << 4) | (b[1] >> 4)];
  out[2] = kAlphabet[((b[1] & 15) << 2) | (b[2] >> 6)];
  out[3] = kAlphabet[b[2] & 63];
  out[4] = kAlphabet[b[3] >> 2];
  out[5] = kAlphabet[(b[3] & 3) << 4];
  return out;  // out[6], out[7]: "=="
}

}  // namespace cairn::internal
