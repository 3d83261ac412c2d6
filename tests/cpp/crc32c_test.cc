// Tests of CRC-32C (src/io/crc32c.h), the checksum the s3 backend sends as
// x-amz-checksum-crc32c: RFC 3720's and the common check vectors, the
// hardware path (SSE4.2, three streams joined with a shift operator) equal to
// the portable table over every length class, alignment and chaining split,
// and the header encoding. (Against an independent implementation: every
// upload to moto in the Python tests, whose tests/s3/moto_md5.py checks each
// header with the `crc32c` package.)
#include "io/crc32c.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "random_bytes.h"
#include "storage/s3/sigv4.h"

namespace cairn::internal {
namespace {

using test_util::RandomBytes;

// Every implementation this machine has.
std::vector<uint32_t (*)(const void*, size_t, uint32_t)> Kernels() {
  std::vector<uint32_t (*)(const void*, size_t, uint32_t)> k = {&Crc32c, &Crc32cPortable};
  if (Crc32cHardwareAvailable()) k.push_back(&Crc32cHardware);
  return k;
}

TEST(Crc32cTest, KnownVectors) {
  std::vector<unsigned char> zeros(32, 0), ones(32, 0xff), up(32), down(32);
  std::iota(up.begin(), up.end(), 0);
  for (int i = 0; i < 32; ++i) down[i] = static_cast<unsigned char>(31 - i);
  for (auto crc : Kernels()) {
    EXPECT_EQ(crc("123456789", 9, 0), 0xE3069283u);
    EXPECT_EQ(crc("", 0, 0), 0u);
    EXPECT_EQ(crc("a", 1, 0), 0xC1D04330u);
    // RFC 3720, B.4.
    EXPECT_EQ(crc(zeros.data(), 32, 0), 0x8A9136AAu);
    EXPECT_EQ(crc(ones.data(), 32, 0), 0x62A8AB43u);
    EXPECT_EQ(crc(up.data(), 32, 0), 0x46DD794Eu);
    EXPECT_EQ(crc(down.data(), 32, 0), 0x113FDB5Cu);
  }
}

TEST(Crc32cTest, HardwareEqualsPortableAtEveryLengthAndAlignment) {
  if (!Crc32cHardwareAvailable()) GTEST_SKIP() << "no SSE4.2 on this CPU";
  const std::vector<unsigned char> data = RandomBytes((3 << 20) + 64, 11);
  std::vector<size_t> lengths;
  for (size_t n = 0; n <= 800; ++n) lengths.push_back(n);
  // Around the three-stream block sizes (3 x 256, 3 x 8192) and beyond.
  for (size_t base : {size_t{768}, size_t{1536}, size_t{24576}, size_t{49152}, size_t{73728},
                      size_t{1} << 20, size_t{3} << 20}) {
    for (size_t d = 0; d < 17; ++d) {
      lengths.push_back(base + d);
      if (base > d) lengths.push_back(base - d);
    }
  }
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t n : lengths) {
      if (offset + n > data.size()) continue;
      ASSERT_EQ(Crc32cHardware(data.data() + offset, n, 0),
                Crc32cPortable(data.data() + offset, n, 0))
          << "offset " << offset << " length " << n;
    }
  }
}

TEST(Crc32cTest, ChainingEqualsOneCall) {
  const std::vector<unsigned char> data = RandomBytes(100000, 3);
  for (auto crc : Kernels()) {
    const uint32_t whole = crc(data.data(), data.size(), 0);
    for (size_t split : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, size_t{24577},
                         size_t{99999}, data.size()}) {
      uint32_t a = crc(data.data(), split, 0);
      EXPECT_EQ(crc(data.data() + split, data.size() - split, a), whole) << split;
    }
  }
}

TEST(Crc32cTest, Base64IsTheBigEndianBytes) {
  // The header S3 wants: base64 of E3 06 92 83.
  EXPECT_EQ(Crc32cBase64(0xE3069283u), "4waSgw==");
  EXPECT_EQ(Crc32cBase64(0), "AAAAAA==");
  EXPECT_EQ(Crc32cBase64(0xFFFFFFFFu), "/////w==");
  EXPECT_EQ(Crc32cBase64(0x01020304u), "AQIDBA==");
}

// Not a timed test: prints what this machine does, with the MD5 of
// Content-MD5 for comparison (docs/storage.md quotes it).
TEST(Crc32cTest, ReportsThroughput) {
  const std::vector<unsigned char> data = RandomBytes(8 << 20, 5);
  auto time = [&](const char* name, auto fn) {
    const int reps = 8;
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) fn();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%-28s %6.2f GB/s\n", name, reps * data.size() / s / 1e9);
  };
  uint32_t sink = 0;
  time(Crc32cHardwareAvailable() ? "crc32c (sse4.2, 3 streams)" : "crc32c (no sse4.2: table)",
       [&] { sink ^= Crc32c(data.data(), data.size(), sink); });
  time("crc32c portable table", [&] { sink ^= Crc32cPortable(data.data(), data.size(), sink); });
  time("md5 (OpenSSL, Content-MD5)",
       [&] { sink ^= static_cast<uint32_t>(s3::Md5Base64(data.data(), data.size()).size()); });
  EXPECT_NE(sink, 0xFFFFFFFFu);  // keeps the loops
}

}  // namespace
}  // namespace cairn::internal
