// FaultInjectionStorage and its FaultInjector (see
// include/cairn/fault_injection.h for what each rule does).
//
// Every call goes: count it, sleep its latency, ask the rules; if a rule
// fires, fail before touching the base (a short write first forwards the
// leading bytes), otherwise forward and, for reads and writes, throttle by
// the bandwidth cap afterwards.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <thread>

#include "cairn/fault_injection.h"

namespace cairn {
namespace {

// FaultOp's names, in enum order: what FaultOpName returns and ParseFaultOp
// accepts.
constexpr std::string_view kFaultOpNames[] = {
    "create",  "open",      "write",  "allocate",  "sync", "close",  "read",    "rename",
    "syncdir", "createdir", "delete", "deletedir", "list", "exists", "filesize"};
static_assert(std::size(kFaultOpNames) == kNumFaultOps, "one name per FaultOp");

}  // namespace

std::string_view FaultOpName(FaultOp op) {
  const auto i = static_cast<size_t>(op);
  return i < std::size(kFaultOpNames) ? kFaultOpNames[i] : "unknown";
}

Result<FaultOp> ParseFaultOp(std::string_view name) {
  std::string expected;
  for (int i = 0; i < kNumFaultOps; ++i) {
    if (kFaultOpNames[i] == name) return static_cast<FaultOp>(i);
    if (i > 0) expected += i + 1 < kNumFaultOps ? ", " : " or ";
    expected += kFaultOpNames[i];
  }
  return InvalidArgumentError("unknown storage operation '" + std::string(name) + "' (expected " +
                              expected + ")");
}

// ---- FaultInjector -----------------------------------------------------------

int FaultInjector::AddRule(FaultRule rule) {
  std::lock_guard<std::mutex> l(mu_);
  if (rule.nth == 0) rule.nth = 1;
  rules_.push_back(ActiveRule{next_id_, std::move(rule), 0});
  return next_id_++;
}

bool FaultInjector::RemoveRule(int id) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = std::find_if(rules_.begin(), rules_.end(), [&](const auto& r) { return r.id == id; });
  if (it == rules_.end()) return false;
  rules_.erase(it);
  return true;
}

void FaultInjector::ClearRules() {
  std::lock_guard<std::mutex> l(mu_);
  rules_.clear();
}

void FaultInjector::SetLatency(FaultOp op, std::chrono::microseconds delay) {
  std::lock_guard<std::mutex> l(mu_);
  latency_[static_cast<int>(op)] = std::max(delay, std::chrono::microseconds(0));
}

void FaultInjector::SetBandwidth(uint64_t bytes_per_second) {
  std::lock_guard<std::mutex> l(mu_);
  bandwidth_ = bytes_per_second;
  pipe_free_ = std::chrono::steady_clock::time_point{};
}

uint64_t FaultInjector::Calls(FaultOp op) const { return calls_[static_cast<int>(op)].load(); }

uint64_t FaultInjector::Injected() const { return injected_.load(); }

void FaultInjector::ResetCounters() {
  for (auto& c : calls_) c.store(0);
  injected_.store(0);
}

FaultInjector::Decision FaultInjector::OnCall(FaultOp op, std::string_view key,
                                              std::string_view key2) {
  calls_[static_cast<int>(op)].fetch_add(1);
  std::chrono::microseconds delay{0};
  Decision d;
  bool crash = false;
  {
    std::lock_guard<std::mutex> l(mu_);
    delay = latency_[static_cast<int>(op)];
    // Every matching rule counts the call; the first that fires decides.
    bool fired = false;
    for (auto& r : rules_) {
      const FaultRule& rule = r.rule;
      if (rule.op != op) continue;
      if (!rule.key_contains.empty() && key.find(rule.key_contains) == std::string_view::npos &&
          key2.find(rule.key_contains) == std::string_view::npos) {
        continue;
      }
      uint64_t n = ++r.matched;
      bool fires = n >= rule.nth && (rule.count == 0 || n < rule.nth + rule.count);
      if (!fires || fired) continue;
      fired = true;
      if (rule.crash) {
        crash = true;
        continue;
      }
      std::string what = "injected fault: " + std::string(FaultOpName(op)) + " " +
                         std::string(key.empty() ? std::string_view("<root>") : key);
      d.status = ErrnoToStatus(rule.error, what);
      d.partial_bytes = rule.partial_bytes;
      injected_.fetch_add(1);
    }
  }
  if (crash) {
    // A crash is a crash: no destructors, no flushing, like kill -9.
    ::kill(::getpid(), SIGKILL);
    ::_exit(137);
  }
  if (delay.count() > 0) std::this_thread::sleep_for(delay);
  return d;
}

void FaultInjector::Throttle(uint64_t bytes) {
  std::chrono::steady_clock::time_point until;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (bandwidth_ == 0 || bytes == 0) return;
    auto now = std::chrono::steady_clock::now();
    auto start = std::max(now, pipe_free_);
    auto cost = std::chrono::nanoseconds(
        static_cast<int64_t>(static_cast<double>(bytes) * 1e9 / static_cast<double>(bandwidth_)));
    pipe_free_ = start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(cost);
    until = pipe_free_;
  }
  std::this_thread::sleep_until(until);
}

// ---- files -------------------------------------------------------------------

namespace {

class FaultWritableFile final : public WritableFile {
 public:
  FaultWritableFile(std::unique_ptr<WritableFile> base, std::string key,
                    std::shared_ptr<FaultInjector> inj)
      : base_(std::move(base)), key_(std::move(key)), inj_(std::move(inj)) {}

  Status WriteAt(uint64_t offset, const void* data, size_t n) override {
    auto d = inj_->OnCall(FaultOp::kWrite, key_);
    if (!d.status.ok()) {
      if (d.partial_bytes > 0 && n > 0) {
        size_t part = std::min<uint64_t>(static_cast<uint64_t>(d.partial_bytes), n - 1);
        if (part > 0) base_->WriteAt(offset, data, part).IgnoreError();
      }
      return d.status;
    }
    Status s = base_->WriteAt(offset, data, n);
    inj_->Throttle(n);
    return s;
  }
  Status Allocate(uint64_t size) override {
    auto d = inj_->OnCall(FaultOp::kAllocate, key_);
    return d.status.ok() ? base_->Allocate(size) : d.status;
  }
  Status Sync() override {
    auto d = inj_->OnCall(FaultOp::kSync, key_);
    return d.status.ok() ? base_->Sync() : d.status;
  }
  Status Close() override {
    auto d = inj_->OnCall(FaultOp::kClose, key_);
    if (!d.status.ok()) {
      // The descriptor is released anyway, as close(2) does on error.
      base_->Close().IgnoreError();
      return d.status;
    }
    return base_->Close();
  }
  Status Hole(uint64_t offset, uint64_t n) override { return base_->Hole(offset, n); }
  Status Abort() override { return base_->Abort(); }

 private:
  std::unique_ptr<WritableFile> base_;
  std::string key_;
  std::shared_ptr<FaultInjector> inj_;
};

class FaultReadableFile final : public ReadableFile {
 public:
  FaultReadableFile(std::unique_ptr<ReadableFile> base, std::string key,
                    std::shared_ptr<FaultInjector> inj)
      : base_(std::move(base)), key_(std::move(key)), inj_(std::move(inj)) {}

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    auto d = inj_->OnCall(FaultOp::kRead, key_);
    if (!d.status.ok()) return d.status;
    Status s = base_->ReadAt(offset, buf, n);
    inj_->Throttle(n);
    return s;
  }
  uint64_t Size() const override { return base_->Size(); }

 private:
  std::unique_ptr<ReadableFile> base_;
  std::string key_;
  std::shared_ptr<FaultInjector> inj_;
};

}  // namespace

// ---- FaultInjectionStorage ---------------------------------------------------

FaultInjectionStorage::FaultInjectionStorage(std::unique_ptr<Storage> base,
                                             std::shared_ptr<FaultInjector> injector)
    : StorageWrapper(std::move(base)),
      base_(target()),
      injector_(injector ? std::move(injector) : std::make_shared<FaultInjector>()) {}

FaultInjectionStorage::FaultInjectionStorage(std::shared_ptr<Storage> base,
                                             std::shared_ptr<FaultInjector> injector)
    : StorageWrapper(std::move(base)),
      base_(target()),
      injector_(injector ? std::move(injector) : std::make_shared<FaultInjector>()) {}

FaultInjectionStorage::FaultInjectionStorage(Storage* base, std::shared_ptr<FaultInjector> injector)
    : StorageWrapper(base),
      base_(base),
      injector_(injector ? std::move(injector) : std::make_shared<FaultInjector>()) {}

namespace {

// Every storage call goes through here: the key is validated first, as in
// every backend, so an invalid key is rejected the same way with or without
// the wrapper (allow_root: the call takes a directory, and "" is the root);
// then the rules for `op` may fail the call before the base sees it;
// otherwise forward() makes it on the base.
template <typename Forward>
auto Gate(FaultInjector& injector, FaultOp op, std::string_view key, bool allow_root,
          Forward forward) -> decltype(forward()) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(key, allow_root));
  auto d = injector.OnCall(op, key);
  if (!d.status.ok()) return d.status;
  return forward();
}

// Opening a file: open() opens it on the base, and the file is wrapped so
// that its own calls meet the rules too.
template <typename FaultFile, typename Open>
auto OpenFaultFile(const std::shared_ptr<FaultInjector>& injector, FaultOp op, std::string_view key,
                   Open open) -> decltype(open()) {
  return Gate(*injector, op, key, false, [&]() -> decltype(open()) {
    CAIRN_ASSIGN_OR_RETURN(auto f, open());
    return std::unique_ptr<typename decltype(f)::element_type>(
        new FaultFile(std::move(f), std::string(key), injector));
  });
}

}  // namespace

Result<std::unique_ptr<WritableFile>> FaultInjectionStorage::NewWritableFile(
    std::string_view key, const WriteOptions& opts) {
  return OpenFaultFile<FaultWritableFile>(injector_, FaultOp::kCreate, key,
                                          [&] { return base_->NewWritableFile(key, opts); });
}

Result<std::unique_ptr<ReadableFile>> FaultInjectionStorage::NewReadableFile(
    std::string_view key, const ReadOptions& opts) {
  return OpenFaultFile<FaultReadableFile>(injector_, FaultOp::kOpen, key,
                                          [&] { return base_->NewReadableFile(key, opts); });
}

// A rename matches rules on either key.
Status FaultInjectionStorage::Rename(std::string_view from, std::string_view to) {
  CAIRN_RETURN_IF_ERROR(ValidateKey(from));
  CAIRN_RETURN_IF_ERROR(ValidateKey(to));
  auto d = injector_->OnCall(FaultOp::kRename, from, to);
  return d.status.ok() ? base_->Rename(from, to) : d.status;
}

Status FaultInjectionStorage::SyncDir(std::string_view dir) {
  return Gate(*injector_, FaultOp::kSyncDir, dir, true, [&] { return base_->SyncDir(dir); });
}

Status FaultInjectionStorage::CreateDir(std::string_view dir) {
  return Gate(*injector_, FaultOp::kCreateDir, dir, true, [&] { return base_->CreateDir(dir); });
}

Status FaultInjectionStorage::DeleteFile(std::string_view key) {
  return Gate(*injector_, FaultOp::kDelete, key, false, [&] { return base_->DeleteFile(key); });
}

Status FaultInjectionStorage::DeleteDir(std::string_view dir) {
  return Gate(*injector_, FaultOp::kDeleteDir, dir, true, [&] { return base_->DeleteDir(dir); });
}

Result<std::vector<DirEntry>> FaultInjectionStorage::List(std::string_view dir) {
  return Gate(*injector_, FaultOp::kList, dir, true, [&] { return base_->List(dir); });
}

Result<bool> FaultInjectionStorage::Exists(std::string_view key) {
  return Gate(*injector_, FaultOp::kExists, key, true, [&] { return base_->Exists(key); });
}

Result<uint64_t> FaultInjectionStorage::FileSize(std::string_view key) {
  return Gate(*injector_, FaultOp::kFileSize, key, false, [&] { return base_->FileSize(key); });
}

}  // namespace cairn
