// Copying a checkpoint: data files copied in parallel and verified in
// transit, synced, the manifest committed last at the destination; how two
// directories lie (RelateDirs) so a copy never lands on or inside its source.
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
#include "storage/local_path.h"

namespace cairn {

using internal::JoinComponents;
using internal::kIoPiece;
using internal::OpenDataFile;
using internal::Where;

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
  return internal::PathComponents(path, /*resolve_dotdot=*/false);
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

Status CopyCheckpointTo(Storage* src, std::string_view dst_uri, ThreadPool* pool,
                        const ProgressFn& progress, const CopyOptions& opts) {
  // Checked before OpenStorage creates the destination, so that a refused
  // copy (e.g. `cairn cp ck ck/sub`) does not even leave a directory behind.
  std::string dst_local = LocalDirOfUri(dst_uri);
  if (!src->LocalPath().empty() && !dst_local.empty()) {
    auto rel = RelateLocalDirs(src->LocalPath(), dst_local);
    if (!rel.ok()) return rel.status();
    CAIRN_RETURN_IF_ERROR(
        CheckCopyTargets(*rel, src->Describe(), std::string(dst_uri)).WithContext("copying"));
  }
  auto out = OpenStorage(dst_uri, /*create=*/true);
  if (!out.ok()) return out.status();
  return CopyCheckpoint(src, "", out->get(), "", pool, progress, opts);
}

Status CopyCheckpointUri(std::string_view src_uri, std::string_view dst_uri, ThreadPool* pool,
                         const ProgressFn& progress, const CopyOptions& opts) {
  auto in = OpenStorage(src_uri, /*create=*/false);
  if (!in.ok()) {
    return in.status().code() == StatusCode::kNotFound
               ? NotFoundError("no such checkpoint: " + std::string(src_uri))
               : in.status();
  }
  return CopyCheckpointTo(in->get(), dst_uri, pool, progress, opts);
}

}  // namespace cairn
