// Reading and verifying a checkpoint.
//
// Every byte read from a data file is checked against the manifest's block
// checksums before the caller sees success. A file whose size differs from
// the manifest's record, a missing file and a checksum mismatch are all
// DataLoss, and the message names the checkpoint, the file and the item, so a
// user knows what to delete or restore.
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>

#include "cairn/checkpoint.h"
#include "checkpoint/io_util.h"

namespace cairn {
namespace {

using internal::kIoPiece;

std::string Where(Storage* storage, std::string_view dir) {
  return storage->Describe() + (dir.empty() ? "" : "/") + std::string(dir);
}

// Opens data file `f` of a checkpoint and checks its size. `needed_by` names
// an item stored in it, for the error message.
Result<std::unique_ptr<ReadableFile>> OpenDataFile(Storage* storage, std::string_view dir,
                                                   const ManifestFile& f,
                                                   const std::string& needed_by,
                                                   const ReadOptions& opts = {}) {
  auto file = storage->NewReadableFile(internal::JoinDir(dir, f.key), opts);
  if (!file.ok()) {
    if (file.status().code() == StatusCode::kNotFound) {
      return DataLossError(f.key + ": data file missing (holds " + needed_by + ")");
    }
    if (file.status().code() == StatusCode::kFailedPrecondition ||
        file.status().code() == StatusCode::kInvalidArgument) {
      // Not a regular file (a FIFO, a device, a directory): never read it.
      return DataLossError(f.key + ": " + file.status().message() + " (holds " + needed_by + ")");
    }
    return file.status().WithContext(f.key + " (holds " + needed_by + ")");
  }
  uint64_t size = (*file)->Size();
  if (size != f.size) {
    return DataLossError(f.key + ": " + (size < f.size ? "truncated" : "has extra bytes") + ": " +
                         std::to_string(size) + " bytes, the manifest records " +
                         std::to_string(f.size) + " (holds " + needed_by + ")");
  }
  return file;
}

// Reads block `b` of an item into dest (len bytes) and checks its checksum.
Status ReadBlock(const ReadableFile* file, const ManifestFile& f, const ItemLocation& loc,
                 uint64_t b, uint64_t block_size, char* dest, const std::string& name) {
  uint64_t start = b * block_size;
  uint64_t len = std::min(block_size, loc.length - start);
  internal::Hasher h;
  if (!h.ok()) return ResourceExhaustedError("cannot allocate a hash state");
  for (uint64_t done = 0; done < len;) {
    uint64_t n = std::min(kIoPiece, len - done);
    Status s = file->ReadAt(loc.offset + start + done, dest + done, n);
    if (!s.ok()) {
      if (s.code() == StatusCode::kOutOfRange) {
        return DataLossError(f.key + ": truncated while reading block " + std::to_string(b) +
                             " of " + name);
      }
      return s.WithContext(f.key + ": reading " + name);
    }
    h.Update(dest + done, n);
    done += n;
  }
  if (h.Digest() != loc.checksums[b]) {
    return DataLossError(f.key + ": checksum mismatch in block " + std::to_string(b) + " of " +
                         name);
  }
  return Status::OK();
}

// One whole block of an item, to be read into `dest` (CheckpointReader::Read).
struct BlockRead {
  const ReadableFile* file;
  const ManifestFile* mf;
  const ItemLocation* loc;
  uint64_t block;
  char* dest;
  uint64_t file_off;  // where the block starts in the file
  uint64_t len;
  const std::string* name;
};

// Padding between items that a coalesced read may fetch and drop.
constexpr uint64_t kMaxReadGap = uint64_t{64} << 10;

// Reads neighbouring blocks of one file (sorted, not overlapping) with one
// ReadV, skipping the gaps, then verifies each block's checksum.
Status ReadBlocks(const std::vector<BlockRead>& run) {
  std::vector<ReadableFile::Segment> segs;
  segs.reserve(2 * run.size());
  uint64_t at = run.front().file_off;
  for (const BlockRead& r : run) {
    if (r.file_off > at) segs.push_back({nullptr, static_cast<size_t>(r.file_off - at)});
    segs.push_back({r.dest, static_cast<size_t>(r.len)});
    at = r.file_off + r.len;
  }
  const BlockRead& first = run.front();
  Status s = first.file->ReadV(first.file_off, segs);
  if (!s.ok()) {
    if (s.code() == StatusCode::kOutOfRange) {
      return DataLossError(first.mf->key + ": truncated while reading block " +
                           std::to_string(first.block) + " of " + *first.name);
    }
    return s.WithContext(first.mf->key + ": reading " + *first.name);
  }
  for (const BlockRead& r : run) {
    if (XXH3_64bits(r.dest, r.len) != r.loc->checksums[r.block]) {
      return DataLossError(r.mf->key + ": checksum mismatch in block " + std::to_string(r.block) +
                           " of " + *r.name);
    }
  }
  return Status::OK();
}

}  // namespace

Result<std::unique_ptr<CheckpointReader>> CheckpointReader::Open(Storage* storage, std::string dir,
                                                                 const ReadOptions& opts) {
  CAIRN_ASSIGN_OR_RETURN(Manifest m, ReadManifest(storage, dir));
  return std::unique_ptr<CheckpointReader>(
      new CheckpointReader(storage, std::move(dir), std::move(m), opts));
}

Result<const ItemLocation*> CheckpointReader::Locate(const ItemRef& item) const {
  if (item.kind == ItemRef::Kind::kBytes) {
    if (item.index >= manifest_.bytes.size()) {
      return InvalidArgumentError("bytes item " + std::to_string(item.index) + " out of range");
    }
    return &manifest_.bytes[item.index].location;
  }
  if (item.index >= manifest_.tensors.size() ||
      item.chunk >= manifest_.tensors[item.index].chunks.size()) {
    return InvalidArgumentError("tensor chunk " + std::to_string(item.index) + "/" +
                                std::to_string(item.chunk) + " out of range");
  }
  return &manifest_.tensors[item.index].chunks[item.chunk].location;
}

std::string CheckpointReader::ItemName(const ItemRef& item) const {
  if (item.kind == ItemRef::Kind::kBytes) {
    return item.index < manifest_.bytes.size() ? "item '" + manifest_.bytes[item.index].fqn + "'"
                                               : "?";
  }
  if (item.index >= manifest_.tensors.size()) return "?";
  return internal::ChunkName(manifest_.tensors[item.index], item.chunk);
}

Result<const ReadableFile*> CheckpointReader::File(uint32_t index, const std::string& needed_by) {
  std::lock_guard<std::mutex> l(mu_);
  auto it = files_.find(index);
  if (it != files_.end()) return it->second.get();
  CAIRN_ASSIGN_OR_RETURN(auto f,
                         OpenDataFile(storage_, dir_, manifest_.files[index], needed_by, opts_));
  const ReadableFile* raw = f.get();
  files_.emplace(index, std::move(f));
  return raw;
}

Status CheckpointReader::CheckFiles() {
  std::vector<std::string> holder(manifest_.files.size());
  for (size_t t = 0; t < manifest_.tensors.size(); ++t) {
    for (size_t c = 0; c < manifest_.tensors[t].chunks.size(); ++c) {
      auto& h = holder[manifest_.tensors[t].chunks[c].location.file];
      if (h.empty()) h = internal::ChunkName(manifest_.tensors[t], c);
    }
  }
  for (const auto& b : manifest_.bytes) {
    auto& h = holder[b.location.file];
    if (h.empty()) h = "item '" + b.fqn + "'";
  }
  for (size_t f = 0; f < manifest_.files.size(); ++f) {
    auto r = File(static_cast<uint32_t>(f), holder[f].empty() ? "no items" : holder[f]);
    if (!r.ok()) return r.status().WithContext("opening " + Where(storage_, dir_));
  }
  return Status::OK();
}

Status CheckpointReader::Read(const std::vector<ReadRequest>& requests, ThreadPool* pool) {
  const std::string where = "reading " + Where(storage_, dir_);
  // Validate every request and open the files first (serially: cheap), so
  // the parallel part only reads.
  std::vector<const ReadableFile*> files(requests.size());
  std::vector<const ItemLocation*> locs(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const ReadRequest& r = requests[i];
    auto loc = Locate(r.item);
    if (!loc.ok()) return loc.status().WithContext(where);
    if (r.offset > (*loc)->length || (*loc)->length - r.offset < r.size) {
      return InvalidArgumentError(where + ": bytes [" + std::to_string(r.offset) + ", +" +
                                  std::to_string(r.size) + ") requested from " + ItemName(r.item) +
                                  ", which has " + std::to_string((*loc)->length));
    }
    if (r.size > 0 && r.dest == nullptr) {
      return InvalidArgumentError(where + ": null destination for " + ItemName(r.item));
    }
    locs[i] = *loc;
    if (r.size == 0) continue;
    auto f = File((*loc)->file, ItemName(r.item));
    if (!f.ok()) return f.status().WithContext(where);
    files[i] = *f;
  }
  std::vector<std::string> names(requests.size());
  std::vector<BlockRead> coalesce;  // whole blocks from files that prefer few requests
  TaskGroup group(pool);
  const uint64_t bs = manifest_.block_size;
  for (size_t i = 0; i < requests.size(); ++i) {
    const ItemLocation* loc = locs[i];
    const ManifestFile* mf = &manifest_.files[loc->file];
    const ReadableFile* f = files[i];
    char* dest = static_cast<char*>(requests[i].dest);
    const uint64_t begin = requests[i].offset, end = begin + requests[i].size;
    if (begin == end) continue;
    names[i] = ItemName(requests[i].item);
    const std::string& name = names[i];
    for (uint64_t b = begin / bs; b * bs < end; ++b) {
      const uint64_t bstart = b * bs, bend = std::min(bstart + bs, loc->length);
      if (bstart >= begin && bend <= end) {
        if (f->PreferredReadSize() > 0) {
          coalesce.push_back(
              {f, mf, loc, b, dest + (bstart - begin), loc->offset + bstart, bend - bstart, &name});
          continue;
        }
        group.Run([=] { return ReadBlock(f, *mf, *loc, b, bs, dest + (bstart - begin), name); });
        continue;
      }
      // An edge block: verify it whole in scratch memory, keep the overlap.
      group.Run([=]() -> Status {
        std::unique_ptr<char[]> scratch(new (std::nothrow) char[bend - bstart]);
        if (!scratch) return ResourceExhaustedError("cannot allocate a read buffer");
        CAIRN_RETURN_IF_ERROR(ReadBlock(f, *mf, *loc, b, bs, scratch.get(), name));
        const uint64_t lo = std::max(bstart, begin), hi = std::min(bend, end);
        std::memcpy(dest + (lo - begin), scratch.get() + (lo - bstart), hi - lo);
        return Status::OK();
      });
    }
  }
  // Neighbouring blocks of one file (items separated by padding only) go
  // into one vectored read of up to two preferred reads (on s3: one ranged
  // GET straight into the destinations), then each block is verified.
  std::sort(coalesce.begin(), coalesce.end(), [](const BlockRead& a, const BlockRead& b) {
    return a.file != b.file ? a.file < b.file : a.file_off < b.file_off;
  });
  for (size_t i = 0; i < coalesce.size();) {
    const uint64_t limit = 2 * coalesce[i].file->PreferredReadSize();
    size_t j = i + 1;
    uint64_t span_end = coalesce[i].file_off + coalesce[i].len;
    while (j < coalesce.size() && coalesce[j].file == coalesce[i].file &&
           coalesce[j].file_off >= span_end && coalesce[j].file_off - span_end <= kMaxReadGap &&
           coalesce[j].file_off + coalesce[j].len - coalesce[i].file_off <= limit) {
      span_end = coalesce[j].file_off + coalesce[j].len;
      ++j;
    }
    std::vector<BlockRead> run(coalesce.begin() + i, coalesce.begin() + j);
    group.Run([run = std::move(run)] { return ReadBlocks(run); });
    i = j;
  }
  return group.Wait().WithContext(where);
}

// ---- Verify ----------------------------------------------------------------

namespace {

// One unit of verification work: a block of an item, or a padding gap.
struct VerifyTask {
  uint32_t file;
  uint64_t offset;
  uint64_t length;
  bool is_gap;
  uint64_t checksum;  // items only
  std::string name;   // "block 3 of tensor 'w'" / "padding at offset 4000"
};

Status RunVerifyTask(const ReadableFile* file, const ManifestFile& mf, const VerifyTask& t,
                     std::atomic<uint64_t>* done, uint64_t total, const ProgressFn& progress) {
  char* buf = internal::ThreadPieceBuffer();
  if (!buf) return ResourceExhaustedError("cannot allocate an I/O buffer");
  internal::Hasher h;
  if (!h.ok()) return ResourceExhaustedError("cannot allocate a hash state");
  for (uint64_t off = 0; off < t.length;) {
    uint64_t n = std::min(kIoPiece, t.length - off);
    Status s = file->ReadAt(t.offset + off, buf, n);
    if (!s.ok()) {
      if (s.code() == StatusCode::kOutOfRange) {
        return DataLossError(mf.key + ": truncated while reading " + t.name);
      }
      return s.WithContext(mf.key + ": reading " + t.name);
    }
    if (t.is_gap) {
      for (uint64_t i = 0; i < n; ++i) {
        if (buf[i] != 0) {
          return DataLossError(mf.key + ": non-zero " + t.name + " (byte " +
                               std::to_string(t.offset + off + i) + ")");
        }
      }
    } else {
      h.Update(buf, n);
    }
    off += n;
    uint64_t d = done->fetch_add(n) + n;
    if (progress) progress(d, total);
  }
  if (!t.is_gap && h.Digest() != t.checksum) {
    return DataLossError(mf.key + ": checksum mismatch in " + t.name);
  }
  return Status::OK();
}

}  // namespace

Status VerifyData(Storage* storage, std::string_view dir, const Manifest& m, ThreadPool* pool,
                  const ProgressFn& progress) {
  const std::string where = "verifying " + Where(storage, dir);
  // Every byte of every file is covered by exactly one task: item blocks are
  // checked against their checksums, and the alignment padding between items
  // and after the last item must be zero (ValidateManifest guarantees the
  // items do not overlap and end within their file).
  std::vector<std::vector<VerifyTask>> per_file(m.files.size());
  std::vector<std::string> first_item(m.files.size());
  auto add_item = [&](const ItemLocation& loc, const std::string& name) {
    if (first_item[loc.file].empty()) first_item[loc.file] = name;
    for (uint64_t b = 0; b < loc.checksums.size(); ++b) {
      uint64_t start = b * m.block_size;
      per_file[loc.file].push_back(
          {loc.file, loc.offset + start, std::min(m.block_size, loc.length - start), false,
           loc.checksums[b], "block " + std::to_string(b) + " of " + name});
    }
  };
  for (const auto& t : m.tensors) {
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      add_item(t.chunks[c].location, internal::ChunkName(t, c));
    }
  }
  for (const auto& b : m.bytes) add_item(b.location, "item '" + b.fqn + "'");
  uint64_t total = m.TotalBytes();
  for (size_t f = 0; f < per_file.size(); ++f) {
    auto& tasks = per_file[f];
    std::sort(tasks.begin(), tasks.end(),
              [](const VerifyTask& a, const VerifyTask& b) { return a.offset < b.offset; });
    std::vector<VerifyTask> gaps;
    uint64_t pos = 0;
    for (const auto& t : tasks) {
      if (t.offset > pos) {
        gaps.push_back({static_cast<uint32_t>(f), pos, t.offset - pos, true, 0,
                        "padding at offset " + std::to_string(pos)});
      }
      pos = t.offset + t.length;
    }
    if (pos < m.files[f].size) {
      gaps.push_back({static_cast<uint32_t>(f), pos, m.files[f].size - pos, true, 0,
                      "padding at offset " + std::to_string(pos)});
    }
    tasks.insert(tasks.end(), gaps.begin(), gaps.end());
  }

  // Open every file first: a missing or wrongly sized file is reported before
  // any byte is read.
  std::vector<std::unique_ptr<ReadableFile>> files(m.files.size());
  for (size_t f = 0; f < m.files.size(); ++f) {
    std::string holder = first_item[f].empty() ? "no items" : first_item[f];
    auto rf = OpenDataFile(storage, dir, m.files[f], holder, ReadOptions{true});
    if (!rf.ok()) return rf.status().WithContext(where);
    files[f] = std::move(*rf);
  }
  std::atomic<uint64_t> done{0};
  TaskGroup group(pool);
  for (size_t f = 0; f < per_file.size(); ++f) {
    for (const auto& t : per_file[f]) {
      const ReadableFile* rf = files[f].get();
      const ManifestFile* mf = &m.files[f];
      const VerifyTask* task = &t;
      group.Run(
          [=, &done, &progress] { return RunVerifyTask(rf, *mf, *task, &done, total, progress); });
    }
  }
  return group.Wait().WithContext(where);
}

Status Verify(Storage* storage, std::string_view dir, ThreadPool* pool,
              const ProgressFn& progress) {
  auto m = ReadManifest(storage, dir);
  if (!m.ok() && m.status().code() == StatusCode::kNotFound) {
    // A directory without a manifest is not an intact checkpoint: it never
    // committed, or its manifest was deleted. Only a missing directory is
    // "not found".
    auto exists = storage->Exists(dir);
    if (exists.ok() && *exists) {
      return DataLossError("verifying " + Where(storage, dir) + ": no " +
                           std::string(format::kManifestName) +
                           ": the checkpoint is partial (never committed, or its manifest "
                           "was deleted)");
    }
  }
  if (!m.ok()) return m.status();
  return VerifyData(storage, dir, *m, pool, progress);
}

// ---- Discovery -------------------------------------------------------------

std::optional<uint64_t> ParseStep(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() || digits.size() > 19) return std::nullopt;
  uint64_t v = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  return v;
}

Result<std::vector<CheckpointInfo>> ListCheckpoints(Storage* storage, std::string_view root) {
  CAIRN_ASSIGN_OR_RETURN(bool exists, storage->Exists(root));
  if (!exists) return NotFoundError("no such directory: " + Where(storage, root));
  CAIRN_ASSIGN_OR_RETURN(auto entries, storage->List(root));
  std::vector<CheckpointInfo> out;
  for (const auto& e : entries) {
    if (!e.is_dir) continue;
    CheckpointInfo info;
    info.name = e.name;
    info.step = ParseStep(e.name);
    std::string dir = internal::JoinDir(root, e.name);
    auto m = ReadManifest(storage, dir);
    if (m.ok()) {
      info.committed = true;
      info.bytes = m->TotalBytes();
      info.created_unix_ms = m->created_unix_ms;
      info.world_size = m->world_size;
    } else {
      info.status = m.status();
      // A partial checkpoint's size: whatever files it already has.
      for (std::string_view sub : {std::string_view(), format::kDataDir}) {
        auto list = storage->List(internal::JoinDir(dir, sub));
        if (!list.ok()) continue;
        for (const auto& f : *list) info.bytes += f.is_dir ? 0 : f.size;
      }
    }
    out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) {
    if (a.step.has_value() != b.step.has_value()) return !a.step.has_value();
    if (a.step != b.step) return *a.step < *b.step;
    if (a.created_unix_ms != b.created_unix_ms) return a.created_unix_ms < b.created_unix_ms;
    return a.name < b.name;
  });
  return out;
}

Result<std::optional<std::string>> LatestValid(Storage* storage, std::string_view root) {
  CAIRN_ASSIGN_OR_RETURN(auto list, ListCheckpoints(storage, root));
  for (auto it = list.rbegin(); it != list.rend(); ++it) {
    if (it->committed) return std::optional<std::string>(it->name);
  }
  return std::optional<std::string>();
}

// ---- Copy ------------------------------------------------------------------

namespace {

// A local path resolved as far as it exists.
struct ResolvedDir {
  std::string canon;  // realpath of the existing part, then the rest by name
  bool exists = false;
  // (st_dev, st_ino) of the existing part and of each of its ancestors up to
  // "/", the existing part first.
  std::vector<std::pair<dev_t, ino_t>> chain;
};

std::vector<std::string> Components(std::string_view path) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t slash = path.find('/', pos);
    if (slash == std::string_view::npos) slash = path.size();
    std::string c(path.substr(pos, slash - pos));
    if (!c.empty() && c != ".") out.push_back(std::move(c));
    pos = slash + 1;
  }
  return out;
}

std::string JoinComponents(const std::vector<std::string>& comps, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) out += "/" + comps[i];
  return out.empty() ? "/" : out;
}

Result<ResolvedDir> ResolveDir(const std::string& path) {
  if (path.empty()) return InvalidArgumentError("empty directory path");
  std::string abs = path;
  if (abs[0] != '/') {
    char cwd[PATH_MAX];
    if (!::getcwd(cwd, sizeof(cwd))) return ErrnoToStatus(errno, "getcwd");
    abs = std::string(cwd) + "/" + abs;
  }
  std::vector<std::string> comps = Components(abs);
  // The longest prefix that exists (symlinks in it are followed: what matters
  // is where the bytes land).
  size_t n = comps.size();
  std::string real;
  while (true) {
    std::string prefix = JoinComponents(comps, n);
    char buf[PATH_MAX];
    if (::realpath(prefix.c_str(), buf)) {
      real = buf;
      break;
    }
    if (errno != ENOENT && errno != ENOTDIR) return ErrnoToStatus(errno, "resolving " + prefix);
    if (n == 0) return NotFoundError("resolving " + path + ": no part of it exists");
    --n;
  }
  ResolvedDir r;
  r.exists = n == comps.size();
  std::vector<std::string> canon = Components(real);
  for (size_t i = n; i < comps.size(); ++i) {
    if (comps[i] == "..") {
      if (!canon.empty()) canon.pop_back();
    } else {
      canon.push_back(comps[i]);
    }
  }
  r.canon = JoinComponents(canon, canon.size());
  std::vector<std::string> rc = Components(real);
  for (size_t k = rc.size() + 1; k-- > 0;) {
    struct stat st;
    std::string p = JoinComponents(rc, k);
    if (::stat(p.c_str(), &st) != 0) return ErrnoToStatus(errno, "stat " + p);
    r.chain.emplace_back(st.st_dev, st.st_ino);
  }
  return r;
}

// Whether `inner` names a place strictly below `outer` ('/'-separated names).
bool NameInside(const std::string& inner, const std::string& outer) {
  if (inner.size() <= outer.size() || inner.compare(0, outer.size(), outer) != 0) return false;
  return outer.back() == '/' || inner[outer.size()] == '/';
}

// `name` without trailing slashes (but "/" stays).
std::string TrimSlashes(std::string name) {
  while (name.size() > 1 && name.back() == '/') name.pop_back();
  return name;
}

DirRelation RelateNames(const std::string& a, const std::string& b) {
  if (a == b) return DirRelation::kSame;
  if (NameInside(a, b)) return DirRelation::kFirstInside;
  if (NameInside(b, a)) return DirRelation::kSecondInside;
  return DirRelation::kDisjoint;
}

}  // namespace

Result<DirRelation> RelateLocalDirs(const std::string& a, const std::string& b) {
  CAIRN_ASSIGN_OR_RETURN(ResolvedDir ra, ResolveDir(a));
  CAIRN_ASSIGN_OR_RETURN(ResolvedDir rb, ResolveDir(b));
  auto holds = [](const ResolvedDir& chain_of, const ResolvedDir& dir) {
    return dir.exists && std::find(chain_of.chain.begin(), chain_of.chain.end(), dir.chain[0]) !=
                             chain_of.chain.end();
  };
  if ((ra.exists && rb.exists && ra.chain[0] == rb.chain[0]) || ra.canon == rb.canon) {
    return DirRelation::kSame;
  }
  if (holds(ra, rb) || NameInside(ra.canon, rb.canon)) return DirRelation::kFirstInside;
  if (holds(rb, ra) || NameInside(rb.canon, ra.canon)) return DirRelation::kSecondInside;
  return DirRelation::kDisjoint;
}

Result<DirRelation> RelateDirs(Storage* a, std::string_view a_dir, Storage* b,
                               std::string_view b_dir) {
  const std::string la = a->LocalPath(), lb = b->LocalPath();
  if (!la.empty() && !lb.empty()) {
    return RelateLocalDirs(internal::JoinDir(la, a_dir), internal::JoinDir(lb, b_dir));
  }
  if (!la.empty() || !lb.empty()) return DirRelation::kDisjoint;
  std::string na = TrimSlashes(a->Describe()), nb = TrimSlashes(b->Describe());
  if (a == b || na == nb) {
    // One namespace: the keys decide.
    return RelateNames("/" + std::string(a_dir), "/" + std::string(b_dir));
  }
  return RelateNames(TrimSlashes(Where(a, a_dir)), TrimSlashes(Where(b, b_dir)));
}

namespace {

// InvalidArgument unless a copy from `src` to `dst` leaves the source alone.
Status CheckCopyTargets(DirRelation rel, const std::string& src, const std::string& dst) {
  switch (rel) {
    case DirRelation::kDisjoint:
      return Status::OK();
    case DirRelation::kSame:
      return InvalidArgumentError("refusing to copy a checkpoint onto itself: " + dst +
                                  " is the source " + src);
    case DirRelation::kFirstInside:
      return InvalidArgumentError("refusing to copy: the source " + src +
                                  " lies inside the destination " + dst);
    case DirRelation::kSecondInside:
      return InvalidArgumentError("refusing to copy: the destination " + dst +
                                  " lies inside the source " + src);
  }
  return Status::OK();
}

}  // namespace

Status CopyCheckpoint(Storage* src, std::string_view src_dir, Storage* dst,
                      std::string_view dst_dir, ThreadPool* pool, const ProgressFn& progress,
                      const CopyOptions& opts) {
  const std::string where = "copying " + Where(src, src_dir) + " to " + Where(dst, dst_dir);
  auto mr = ReadManifest(src, src_dir);
  if (!mr.ok()) return mr.status().WithContext(where);
  const Manifest& m = *mr;
  // Before a byte changes: a destination that is (or holds, or lies in) the
  // source would have its manifest removed and its data files truncated.
  {
    auto rel = RelateDirs(src, src_dir, dst, dst_dir);
    if (!rel.ok()) return rel.status().WithContext(where);
    CAIRN_RETURN_IF_ERROR(CheckCopyTargets(*rel, Where(src, src_dir), Where(dst, dst_dir)));
  }
  Status s = UncommitCheckpoint(dst, dst_dir);
  if (!s.ok()) return s.WithContext(where);

  struct FilePair {
    std::unique_ptr<ReadableFile> in;
    std::unique_ptr<WritableFile> out;
  };
  std::vector<FilePair> files(m.files.size());
  for (size_t f = 0; f < m.files.size(); ++f) {
    auto in = OpenDataFile(src, src_dir, m.files[f], "data of " + std::string(m.files[f].key),
                           ReadOptions{true});
    if (!in.ok()) return in.status().WithContext(where);
    files[f].in = std::move(*in);
    WriteOptions wo;
    wo.direct_io = opts.direct_io;
    auto out = dst->NewWritableFile(internal::JoinDir(dst_dir, m.files[f].key), wo);
    if (!out.ok()) return out.status().WithContext(where);
    files[f].out = std::move(*out);
    s = files[f].out->Allocate(m.files[f].size);
    if (!s.ok()) return s.WithContext(where);
  }

  // The padding between items is never written: declare it (an S3 file
  // then uploads each part as soon as its items are copied).
  {
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> items(m.files.size());
    auto add = [&](const ItemLocation& l) {
      if (l.length > 0 && l.file < items.size()) items[l.file].emplace_back(l.offset, l.length);
    };
    for (const auto& t : m.tensors) {
      for (const auto& c : t.chunks) add(c.location);
    }
    for (const auto& b : m.bytes) add(b.location);
    for (size_t f = 0; s.ok() && f < items.size(); ++f) {
      std::sort(items[f].begin(), items[f].end());
      uint64_t end = 0;
      for (const auto& [off, len] : items[f]) {
        if (off > end && s.ok()) s = files[f].out->Hole(end, off - end);
        end = std::max(end, off + len);
      }
      if (end < m.files[f].size && s.ok()) s = files[f].out->Hole(end, m.files[f].size - end);
    }
    if (!s.ok()) {
      for (auto& fp : files) fp.out->Abort().IgnoreError();
      return s.WithContext(where);
    }
  }

  // One task per item block: read it piecewise into the thread's buffer,
  // hash it, write it. Padding is never copied: fresh files read as zeros.
  std::atomic<uint64_t> done{0};
  uint64_t total = 0;  // item bytes: padding is not copied
  for (const auto& t : m.tensors) {
    for (const auto& c : t.chunks) total += c.location.length;
  }
  for (const auto& b : m.bytes) total += b.location.length;
  auto copy_block = [&](const ItemLocation& loc, uint64_t b, const std::string& name) -> Status {
    const ManifestFile& mf = m.files[loc.file];
    char* buf = internal::ThreadPieceBuffer();
    if (!buf) return ResourceExhaustedError("cannot allocate an I/O buffer");
    internal::Hasher h;
    if (!h.ok()) return ResourceExhaustedError("cannot allocate a hash state");
    uint64_t start = b * m.block_size;
    uint64_t len = std::min(m.block_size, loc.length - start);
    for (uint64_t off = 0; off < len;) {
      uint64_t n = std::min(kIoPiece, len - off);
      uint64_t at = loc.offset + start + off;
      Status rs = files[loc.file].in->ReadAt(at, buf, n);
      if (!rs.ok()) {
        if (rs.code() == StatusCode::kOutOfRange) {
          return DataLossError(mf.key + ": truncated while reading block " + std::to_string(b) +
                               " of " + name);
        }
        return rs.WithContext(mf.key + ": reading " + name);
      }
      h.Update(buf, n);
      CAIRN_RETURN_IF_ERROR(files[loc.file]
                                .out->WriteAt(at, buf, n)
                                .WithContext(dst->Describe() + ": writing " + mf.key));
      off += n;
      uint64_t d = done.fetch_add(n) + n;
      if (progress) progress(d, total);
    }
    if (h.Digest() != loc.checksums[b]) {
      return DataLossError(mf.key + ": checksum mismatch in block " + std::to_string(b) + " of " +
                           name + " (at the source)");
    }
    return Status::OK();
  };
  {
    TaskGroup group(pool);
    for (const auto& t : m.tensors) {
      for (size_t c = 0; c < t.chunks.size(); ++c) {
        const ItemLocation* loc = &t.chunks[c].location;
        std::string name = internal::ChunkName(t, c);
        for (uint64_t b = 0; b < loc->checksums.size(); ++b) {
          group.Run([=, &copy_block] { return copy_block(*loc, b, name); });
        }
      }
    }
    for (const auto& bi : m.bytes) {
      const ItemLocation* loc = &bi.location;
      std::string name = "item '" + bi.fqn + "'";
      for (uint64_t b = 0; b < loc->checksums.size(); ++b) {
        group.Run([=, &copy_block] { return copy_block(*loc, b, name); });
      }
    }
    s = group.Wait();
  }
  // Sync in parallel too: fsyncs of different files overlap on the device.
  if (s.ok()) {
    TaskGroup group(pool);
    for (auto& fp : files) {
      WritableFile* out = fp.out.get();
      bool sync = opts.sync;
      group.Run([out, sync]() -> Status {
        if (sync) CAIRN_RETURN_IF_ERROR(out->Sync());
        return out->Close();
      });
    }
    s = group.Wait();
  }
  for (auto& fp : files) (s.ok() ? fp.out->Close() : fp.out->Abort()).IgnoreError();
  if (!s.ok()) return s.WithContext(where);
  if (opts.verify_destination) {
    s = VerifyData(dst, dst_dir, m, pool);
    if (!s.ok()) return s.WithContext(where);
  }
  return CommitManifest(dst, dst_dir, m).WithContext(where);
}

Status CopyCheckpointUri(std::string_view src_uri, std::string_view dst_uri, ThreadPool* pool,
                         const ProgressFn& progress, const CopyOptions& opts) {
  auto in = OpenStorage(src_uri, /*create=*/false);
  if (!in.ok()) {
    return in.status().code() == StatusCode::kNotFound
               ? NotFoundError("no such checkpoint: " + std::string(src_uri))
               : in.status();
  }
  // Checked before OpenStorage creates the destination, so that a refused
  // copy (e.g. `cairn cp ck ck/sub`) does not even leave a directory behind.
  std::string dst_local = LocalDirOfUri(dst_uri);
  if (!(*in)->LocalPath().empty() && !dst_local.empty()) {
    auto rel = RelateLocalDirs((*in)->LocalPath(), dst_local);
    if (!rel.ok()) return rel.status();
    CAIRN_RETURN_IF_ERROR(
        CheckCopyTargets(*rel, (*in)->Describe(), std::string(dst_uri)).WithContext("copying"));
  }
  auto out = OpenStorage(dst_uri, /*create=*/true);
  if (!out.ok()) return out.status();
  return CopyCheckpoint(in->get(), "", out->get(), "", pool, progress, opts);
}

// ---- Named buffers ---------------------------------------------------------

Result<std::vector<LoadedBuffer>> LoadBuffers(Storage* storage, std::string_view dir,
                                              ThreadPool* pool) {
  CAIRN_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(storage, std::string(dir)));
  const Manifest& m = reader->manifest();
  std::vector<LoadedBuffer> out(m.tensors.size());
  // Chunks are read into scratch buffers, then scattered into the dense
  // result (a single chunk covering the tensor is read in place).
  std::vector<std::vector<uint8_t>> scratch;
  struct Pending {
    size_t tensor, chunk, scratch;
  };
  std::vector<Pending> pending;
  std::vector<ReadRequest> reqs;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    const ManifestTensor& t = m.tensors[i];
    size_t itemsize = format::DtypeItemSize(t.dtype);
    uint64_t numel = 1;
    for (uint64_t d : t.shape) numel *= d;  // validated: no overflow
    out[i].name = t.fqn;
    out[i].dtype = t.dtype;
    out[i].shape = t.shape;
    out[i].data.resize(numel * itemsize);
    for (size_t c = 0; c < t.chunks.size(); ++c) {
      const TensorChunk& ch = t.chunks[c];
      ItemRef ref{ItemRef::Kind::kTensorChunk, static_cast<uint32_t>(i), static_cast<uint32_t>(c)};
      if (ch.sizes == t.shape) {
        reqs.push_back({ref, out[i].data.data(), ch.location.length});
      } else {
        scratch.emplace_back(ch.location.length);
        pending.push_back({i, c, scratch.size() - 1});
      }
    }
  }
  for (const auto& p : pending) {
    ItemRef ref{ItemRef::Kind::kTensorChunk, static_cast<uint32_t>(p.tensor),
                static_cast<uint32_t>(p.chunk)};
    reqs.push_back({ref, scratch[p.scratch].data(), scratch[p.scratch].size()});
  }
  CAIRN_RETURN_IF_ERROR(reader->Read(reqs, pool));
  // Scatter: copy each chunk row by row (the last dimension is contiguous in
  // both the chunk and the tensor).
  for (const auto& p : pending) {
    const ManifestTensor& t = m.tensors[p.tensor];
    const TensorChunk& ch = t.chunks[p.chunk];
    size_t itemsize = format::DtypeItemSize(t.dtype);
    size_t nd = t.shape.size();
    if (ch.location.length == 0) continue;
    uint64_t row = (nd ? ch.sizes[nd - 1] : 1) * itemsize;
    uint64_t rows = ch.location.length / row;
    std::vector<uint64_t> idx(nd, 0);  // index within the chunk, last dim fixed at 0
    const uint8_t* src = scratch[p.scratch].data();
    for (uint64_t r = 0; r < rows; ++r) {
      uint64_t lin = 0;
      for (size_t d = 0; d < nd; ++d) lin = lin * t.shape[d] + ch.offsets[d] + idx[d];
      std::memcpy(out[p.tensor].data.data() + lin * itemsize, src + r * row, row);
      for (size_t d = nd >= 1 ? nd - 1 : 0; d-- > 0;) {
        if (++idx[d] < ch.sizes[d]) break;
        idx[d] = 0;
      }
    }
  }
  return out;
}

}  // namespace cairn
