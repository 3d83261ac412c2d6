#include "cairn/status.h"

#include <gtest/gtest.h>

namespace cairn {
namespace {

TEST(StatusTest, DefaultIsOk) {
  Status s;
  EXPECT_TRUE(s.ok());
  EXPECT_EQ(s.ToString(), "OK");
}

TEST(StatusTest, WithContextPrependsAndKeepsCode) {
  Status s = DataLossError("checksum mismatch").WithContext("data/r0.bin");
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "data/r0.bin: checksum mismatch");
}

TEST(StatusTest, ErrnoMapsToCodes) {
  EXPECT_EQ(ErrnoToStatus(ENOSPC, "w").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatus(ENOENT, "w").code(), StatusCode::kNotFound);
  EXPECT_EQ(ErrnoToStatus(EACCES, "w").code(), StatusCode::kPermissionDenied);
  EXPECT_EQ(ErrnoToStatus(EIO, "w").code(), StatusCode::kIOError);
  EXPECT_EQ(ErrnoToStatus(EIO, "w").sys_errno(), EIO);
}

Result<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd");
  return x / 2;
}

Status UseHalf(int x, int* out) {
  CAIRN_ASSIGN_OR_RETURN(*out, Half(x));
  return Status::OK();
}

TEST(StatusTest, AssignOrReturnPropagates) {
  int v = 0;
  EXPECT_TRUE(UseHalf(4, &v).ok());
  EXPECT_EQ(v, 2);
  EXPECT_EQ(UseHalf(3, &v).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn
