// Status and Result<T>: how every function of the cairn core reports failure.
//
// The core never throws. A function that can fail returns a Status (or a
// Result<T> carrying either a value or a non-OK Status). Codes form a small,
// fixed vocabulary modelled on absl::StatusCode; each has one documented
// meaning, so callers (and the Python layer, which maps codes to exception
// classes in one place) can decide what to do without parsing messages.
//
// Messages are meant for humans. Each layer adds context in front of the
// message it received, e.g.
//   "writing shard 3 of step_1000: data/r3.bin: No space left on device".
#pragma once

#include <cassert>
#include <cerrno>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace cairn {

enum class StatusCode : int {
  kOk = 0,
  // The caller passed something malformed: a bad path, a negative size, a
  // manifest field of the wrong type. Retrying will not help.
  kInvalidArgument = 1,
  // A file, directory or checkpoint that was asked for does not exist.
  kNotFound = 2,
  // Something to be created already exists.
  kAlreadyExists = 3,
  // The operating system refused access (EACCES, EPERM, EROFS).
  kPermissionDenied = 4,
  // Out of space or another bounded resource (ENOSPC, EDQUOT, ENOMEM, a cache
  // limit smaller than one file).
  kResourceExhausted = 5,
  // The system is not in a state where the call can work (e.g. writing to a
  // closed file, a format version this build does not know).
  kFailedPrecondition = 6,
  // An offset or length points outside the valid range of a file or buffer.
  kOutOfRange = 7,
  // Transient failure; the same call may succeed if retried with backoff
  // (EAGAIN, EINTR storms, a throttled remote store).
  kUnavailable = 8,
  // A deadline or timeout expired.
  kDeadlineExceeded = 9,
  // Stored data is corrupt or incomplete: checksum mismatch, truncated file,
  // malformed manifest. Never retried; the checkpoint must not be used.
  kDataLoss = 10,
  // A non-transient I/O failure reported by the OS (EIO and friends).
  kIOError = 11,
  // The operation was cancelled (e.g. the owner is shutting down).
  kCancelled = 12,
  // The feature is not available in this build or backend.
  kUnimplemented = 13,
  // A bug: an invariant of cairn itself was broken.
  kInternal = 14,
};

// Returns a stable, human-readable name for `code` ("DataLoss", ...).
std::string_view StatusCodeName(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message, int sys_errno = 0)
      : code_(code), message_(std::move(message)), errno_(sys_errno) {}

  static Status OK() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // The errno behind this status, or 0 when it did not come from a syscall.
  int sys_errno() const { return errno_; }

  // Returns a copy whose message is "context: message". OK stays OK.
  Status WithContext(std::string_view context) const;

  // "DataLoss: data/r0.bin: checksum mismatch in tensor 'w'".
  std::string ToString() const;

  // Marks the status as deliberately ignored.
  void IgnoreError() const {}

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
  int errno_ = 0;
};

// Status constructors, one per code.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status PermissionDeniedError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status OutOfRangeError(std::string message);
Status UnavailableError(std::string message);
Status DeadlineExceededError(std::string message);
Status DataLossError(std::string message);
Status IOError(std::string message);
Status CancelledError(std::string message);
Status UnimplementedError(std::string message);
Status InternalError(std::string message);

// Translates an errno from a failed syscall into a Status with the matching
// code: "what: strerror(err)". Every backend funnels errno through here.
Status ErrnoToStatus(int err, std::string_view what);

// Result<T> holds either a T or a non-OK Status.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT: implicit by design
    assert(!std::get<Status>(v_).ok() && "Result constructed from an OK Status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  Status status() const { return ok() ? Status::OK() : std::get<Status>(v_); }

  T& value() & {
    assert(ok());
    return std::get<T>(v_);
  }
  const T& value() const& {
    assert(ok());
    return std::get<T>(v_);
  }
  T&& value() && {
    assert(ok());
    return std::get<T>(std::move(v_));
  }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace cairn

#define CAIRN_CONCAT_INNER_(a, b) a##b
#define CAIRN_CONCAT_(a, b) CAIRN_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define CAIRN_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::cairn::Status cairn_status_ = (expr);        \
    if (!cairn_status_.ok()) return cairn_status_; \
  } while (0)

// `CAIRN_ASSIGN_OR_RETURN(auto x, MakeX());` declares x from a Result or
// returns its Status from the enclosing function.
#define CAIRN_ASSIGN_OR_RETURN(lhs, rexpr) \
  CAIRN_ASSIGN_OR_RETURN_IMPL_(CAIRN_CONCAT_(cairn_result_, __LINE__), lhs, rexpr)
#define CAIRN_ASSIGN_OR_RETURN_IMPL_(result, lhs, rexpr) \
  auto result = (rexpr);                                 \
  if (!result.ok()) return result.status();              \
  lhs = std::move(result).value()
