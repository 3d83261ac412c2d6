// MemStorage: a process-local Storage for tests. Files are byte strings in a
// map guarded by one mutex; directories are implied by the keys below them,
// plus an explicit set so that empty directories can exist.
#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "cairn/storage.h"

namespace cairn {
namespace {

struct MemFs {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<std::string>> files;
  std::set<std::string> dirs;

  void AddParents(const std::string& key) {
    for (size_t p = key.find('/'); p != std::string::npos; p = key.find('/', p + 1)) {
      dirs.insert(key.substr(0, p));
    }
  }
  bool IsDir(const std::string& key) {
    if (key.empty() || dirs.count(key)) return true;
    return false;
  }
  // The first proper prefix of `key` ("a", "a/b" for "a/b/c") that is a
  // file, or "" when none is: such a key cannot be created.
  std::string FileAncestor(const std::string& key) {
    for (size_t p = key.find('/'); p != std::string::npos; p = key.find('/', p + 1)) {
      std::string prefix = key.substr(0, p);
      if (files.count(prefix)) return prefix;
    }
    return {};
  }
  Status CheckCreatable(const std::string& key) {
    std::string a = FileAncestor(key);
    if (!a.empty()) return FailedPreconditionError(key + ": parent " + a + " is a file");
    return Status::OK();
  }
};

class MemWritableFile final : public WritableFile {
 public:
  MemWritableFile(std::shared_ptr<MemFs> fs, std::shared_ptr<std::string> data)
      : fs_(std::move(fs)), data_(std::move(data)) {}

  Status WriteAt(uint64_t offset, const void* src, size_t n) override {
    if (closed_) return FailedPreconditionError("write to a closed file");
    std::lock_guard<std::mutex> l(fs_->mu);
    if (data_->size() < offset + n) data_->resize(offset + n);
    if (n) std::memcpy(data_->data() + offset, src, n);
    return Status::OK();
  }
  Status Sync() override {
    return closed_ ? FailedPreconditionError("sync of a closed file") : Status::OK();
  }
  Status Close() override {
    closed_ = true;
    return Status::OK();
  }

 private:
  std::shared_ptr<MemFs> fs_;
  std::shared_ptr<std::string> data_;
  bool closed_ = false;
};

class MemReadableFile final : public ReadableFile {
 public:
  MemReadableFile(std::shared_ptr<MemFs> fs, std::shared_ptr<std::string> data)
      : fs_(std::move(fs)), data_(std::move(data)), size_(data_->size()) {}

  Status ReadAt(uint64_t offset, void* buf, size_t n) const override {
    std::lock_guard<std::mutex> l(fs_->mu);
    if (offset > data_->size() || data_->size() - offset < n) {
      return OutOfRangeError("read of " + std::to_string(n) + " bytes at offset " +
                             std::to_string(offset) + " past end of file (" +
                             std::to_string(data_->size()) + " bytes)");
    }
    if (n) std::memcpy(buf, data_->data() + offset, n);
    return Status::OK();
  }
  uint64_t Size() const override { return size_; }

 private:
  std::shared_ptr<MemFs> fs_;
  std::shared_ptr<std::string> data_;
  uint64_t size_;
};

class MemStorage final : public Storage {
 public:
  MemStorage() : fs_(std::make_shared<MemFs>()) {}

  Result<std::unique_ptr<WritableFile>> NewWritableFile(std::string_view key,
                                                        const WriteOptions&) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::string k(key);
    std::lock_guard<std::mutex> l(fs_->mu);
    if (fs_->dirs.count(k)) return InvalidArgumentError(k + ": is a directory");
    CAIRN_RETURN_IF_ERROR(fs_->CheckCreatable(k));
    auto data = std::make_shared<std::string>();
    fs_->files[k] = data;
    fs_->AddParents(k);
    return std::unique_ptr<WritableFile>(new MemWritableFile(fs_, data));
  }

  Result<std::unique_ptr<ReadableFile>> NewReadableFile(std::string_view key,
                                                        const ReadOptions&) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> l(fs_->mu);
    auto it = fs_->files.find(std::string(key));
    if (it == fs_->files.end()) return NotFoundError(std::string(key) + ": no such file");
    return std::unique_ptr<ReadableFile>(new MemReadableFile(fs_, it->second));
  }

  Status Rename(std::string_view from, std::string_view to) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(from));
    CAIRN_RETURN_IF_ERROR(ValidateKey(to));
    std::lock_guard<std::mutex> l(fs_->mu);
    std::string f(from), t(to);
    CAIRN_RETURN_IF_ERROR(fs_->CheckCreatable(t));
    auto it = fs_->files.find(f);
    if (it != fs_->files.end()) {
      if (fs_->dirs.count(t)) return InvalidArgumentError(t + ": is a directory");
      auto data = it->second;
      fs_->files.erase(it);
      fs_->files[t] = data;
      fs_->AddParents(t);
      return Status::OK();
    }
    if (!fs_->dirs.count(f)) return NotFoundError(f + ": no such file or directory");
    // A directory: move every key below it, as rename(2) does; the target
    // may only be absent or an empty directory.
    if (f == t) return Status::OK();
    if (t.compare(0, f.size() + 1, f + "/") == 0) {
      return InvalidArgumentError("cannot move " + f + " into itself (" + t + ")");
    }
    if (fs_->files.count(t)) return FailedPreconditionError(t + ": is a file");
    std::string fp = f + "/", tp = t + "/";
    auto below = [](const auto& c, const std::string& prefix) {
      auto it = c.lower_bound(prefix);
      return it != c.end() && KeyOf(*it).compare(0, prefix.size(), prefix) == 0;
    };
    if (below(fs_->files, tp) || below(fs_->dirs, tp)) {
      return AlreadyExistsError(t + ": directory not empty");
    }
    std::vector<std::pair<std::string, std::shared_ptr<std::string>>> moved_files;
    for (auto i = fs_->files.lower_bound(fp);
         i != fs_->files.end() && i->first.compare(0, fp.size(), fp) == 0;) {
      moved_files.emplace_back(tp + i->first.substr(fp.size()), i->second);
      i = fs_->files.erase(i);
    }
    std::vector<std::string> moved_dirs;
    for (auto i = fs_->dirs.lower_bound(fp);
         i != fs_->dirs.end() && i->compare(0, fp.size(), fp) == 0;) {
      moved_dirs.push_back(tp + i->substr(fp.size()));
      i = fs_->dirs.erase(i);
    }
    fs_->dirs.erase(f);
    fs_->dirs.insert(t);
    fs_->AddParents(t);
    for (auto& [k, v] : moved_files) fs_->files[k] = std::move(v);
    for (auto& d : moved_dirs) fs_->dirs.insert(d);
    return Status::OK();
  }

  Status SyncDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    std::lock_guard<std::mutex> l(fs_->mu);
    if (!fs_->IsDir(std::string(dir)))
      return NotFoundError(std::string(dir) + ": no such directory");
    return Status::OK();
  }

  Status CreateDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    if (dir.empty()) return Status::OK();
    std::lock_guard<std::mutex> l(fs_->mu);
    std::string k(dir);
    if (fs_->files.count(k)) return AlreadyExistsError(k + ": is a file");
    CAIRN_RETURN_IF_ERROR(fs_->CheckCreatable(k));
    fs_->AddParents(k);
    fs_->dirs.insert(k);
    return Status::OK();
  }

  Status DeleteFile(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> l(fs_->mu);
    if (fs_->files.erase(std::string(key)) == 0) {
      return NotFoundError(std::string(key) + ": no such file");
    }
    return Status::OK();
  }

  Status DeleteDir(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    std::lock_guard<std::mutex> l(fs_->mu);
    std::string prefix = dir.empty() ? "" : std::string(dir) + "/";
    auto erase_prefixed = [&](auto& container) {
      for (auto it = container.lower_bound(prefix); it != container.end();) {
        const std::string& k = KeyOf(*it);
        if (k.compare(0, prefix.size(), prefix) != 0) break;
        it = container.erase(it);
      }
    };
    erase_prefixed(fs_->files);
    erase_prefixed(fs_->dirs);
    if (!dir.empty()) fs_->dirs.erase(std::string(dir));
    return Status::OK();
  }

  Result<std::vector<DirEntry>> List(std::string_view dir) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(dir, true));
    std::lock_guard<std::mutex> l(fs_->mu);
    std::string d(dir);
    if (!fs_->IsDir(d)) return NotFoundError(d + ": no such directory");
    std::string prefix = d.empty() ? "" : d + "/";
    std::map<std::string, DirEntry> out;
    for (auto it = fs_->files.lower_bound(prefix); it != fs_->files.end(); ++it) {
      if (it->first.compare(0, prefix.size(), prefix) != 0) break;
      std::string rest = it->first.substr(prefix.size());
      size_t slash = rest.find('/');
      if (slash == std::string::npos) {
        out[rest] = DirEntry{rest, false, it->second->size()};
      } else {
        std::string name = rest.substr(0, slash);
        out[name] = DirEntry{name, true, 0};
      }
    }
    for (auto it = fs_->dirs.lower_bound(prefix); it != fs_->dirs.end(); ++it) {
      if (it->compare(0, prefix.size(), prefix) != 0) break;
      std::string rest = it->substr(prefix.size());
      std::string name = rest.substr(0, rest.find('/'));
      if (!name.empty()) out[name] = DirEntry{name, true, 0};
    }
    std::vector<DirEntry> v;
    v.reserve(out.size());
    for (auto& [_, e] : out) v.push_back(std::move(e));
    return v;
  }

  Result<bool> Exists(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key, true));
    std::lock_guard<std::mutex> l(fs_->mu);
    std::string k(key);
    return fs_->files.count(k) > 0 || fs_->IsDir(k);
  }

  Result<uint64_t> FileSize(std::string_view key) override {
    CAIRN_RETURN_IF_ERROR(ValidateKey(key));
    std::lock_guard<std::mutex> l(fs_->mu);
    auto it = fs_->files.find(std::string(key));
    if (it == fs_->files.end()) return NotFoundError(std::string(key) + ": no such file");
    return static_cast<uint64_t>(it->second->size());
  }

  std::string Describe() const override { return "mem://"; }

 private:
  static const std::string& KeyOf(
      const std::pair<const std::string, std::shared_ptr<std::string>>& p) {
    return p.first;
  }
  static const std::string& KeyOf(const std::string& s) { return s; }

  std::shared_ptr<MemFs> fs_;
};

}  // namespace

std::unique_ptr<Storage> NewMemStorage() { return std::make_unique<MemStorage>(); }

}  // namespace cairn
