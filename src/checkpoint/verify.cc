// Verifying a checkpoint: every data file's size, every block checksum and
// every padding byte, in parallel on the pool given (Verify, VerifyData).
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

using internal::kIoPiece;
using internal::OpenDataFile;
using internal::Where;

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

namespace {

// Whether `dir` holds what stock dcp.save commits: ".metadata" (or rank 0's
// "__0.metadata") starting like a pickle (stock::IsStockCheckpoint's test).
bool HoldsStockMetadata(Storage* storage, std::string_view dir) {
  for (const char* name : {".metadata", "__0.metadata"}) {
    auto f = storage->NewReadableFile(internal::JoinDir(dir, name));
    char first = 0;
    if (f.ok() && (*f)->Size() > 0 && (*f)->ReadAt(0, &first, 1).ok() &&
        static_cast<uint8_t>(first) == 0x80) {
      return true;
    }
  }
  return false;
}

// What a directory without a manifest is, for Verify's error: a stock DCP
// checkpoint, a root of checkpoints, or a partial checkpoint.
Status NotACheckpointError(Storage* storage, std::string_view dir) {
  const std::string where = Where(storage, dir);
  if (HoldsStockMetadata(storage, dir)) {
    return InvalidArgumentError(
        where +
        " is a checkpoint written by stock torch.distributed.checkpoint (it has "
        ".metadata, no " +
        std::string(format::kManifestName) +
        "): cairn.Reader loads it (checking the CRC32 of every tensor record it reads), "
        "but verify checks cairn checkpoints only, whose blocks carry checksums; to get "
        "one, dcp.load it and dcp.save it with cairn.Writer");
  }
  auto list = ListCheckpoints(storage, dir);
  if (list.ok()) {
    std::vector<const CheckpointInfo*> held;
    const CheckpointInfo* newest = nullptr;
    for (const auto& c : *list) {
      if (!c.committed && !c.step) continue;
      held.push_back(&c);
      if (c.committed) newest = &c;  // ListCheckpoints: newest last
    }
    if (!held.empty()) {
      std::string names;
      constexpr size_t kShown = 6;
      size_t first = held.size() > kShown ? held.size() - kShown : 0;
      if (first > 0) names = std::to_string(first) + " older, ";
      for (size_t i = first; i < held.size(); ++i) {
        names += (i > first ? ", " : "") + held[i]->name + (held[i]->committed ? "" : " (partial)");
      }
      std::string msg = where + " is a root of checkpoints, not a checkpoint: it holds " +
                        std::to_string(held.size()) + " (" + names + "); ";
      msg += newest != nullptr ? "verify one of them, e.g. the newest committed: " +
                                     internal::JoinDir(where, newest->name)
                               : "none of them is committed";
      return InvalidArgumentError(msg);
    }
  }
  return DataLossError("verifying " + where + ": no " + std::string(format::kManifestName) +
                       ": the checkpoint is partial (never committed, or its manifest "
                       "was deleted)");
}

}  // namespace

Status Verify(Storage* storage, std::string_view dir, ThreadPool* pool,
              const ProgressFn& progress) {
  auto m = ReadManifest(storage, dir);
  if (!m.ok() && m.status().code() == StatusCode::kNotFound) {
    // A directory without a manifest is not an intact checkpoint: it never
    // committed, or its manifest was deleted; or it is no cairn checkpoint at
    // all (a stock one, a root of them). Only a missing directory is "not found".
    auto exists = storage->Exists(dir);
    if (exists.ok() && *exists) return NotACheckpointError(storage, dir);
  }
  if (!m.ok()) return m.status();
  return VerifyData(storage, dir, *m, pool, progress);
}

}  // namespace cairn
