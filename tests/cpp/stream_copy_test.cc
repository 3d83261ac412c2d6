// StreamCopy (src/io/stream_copy.h): the same bytes as memcpy at every
// alignment and length class, nothing written outside the destination.
#include "io/stream_copy.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace cairn::internal {
namespace {

TEST(StreamCopyTest, CopiesExactlyTheBytesAtEveryAlignmentAndLength) {
  std::mt19937 rng(7);
  std::vector<char> src(300000);
  for (char& c : src) c = static_cast<char>(rng());
  const size_t lengths[] = {0, 1, 31, 32, 127, 128, 129, 159, 160, 4095, 65536, 65537, 299000};
  for (size_t len : lengths) {
    for (size_t dst_off = 0; dst_off < 40; dst_off += 3) {
      for (size_t src_off : {size_t{0}, size_t{1}, size_t{17}}) {
        std::vector<char> dst(len + 128, '\x5a');
        StreamCopy(dst.data() + dst_off, src.data() + src_off, len);
        ASSERT_EQ(std::memcmp(dst.data() + dst_off, src.data() + src_off, len), 0)
            << "len " << len << " dst+" << dst_off << " src+" << src_off;
        for (size_t i = 0; i < dst.size(); ++i) {
          if (i < dst_off || i >= dst_off + len) {
            ASSERT_EQ(dst[i], '\x5a') << "byte " << i << " outside the copy, len " << len;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace cairn::internal
