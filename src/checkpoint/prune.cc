// Retention of step_<N> checkpoints and removal of one checkpoint (see Prune
// and RemoveCheckpointUri in cairn/checkpoint.h).
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "cairn/checkpoint.h"
#include "cairn/format.h"
#include "checkpoint/io_util.h"

namespace cairn {

Status Prune(Storage* storage, std::string_view root, const PruneOptions& opts,
             std::vector<std::string>* removed) {
  if (opts.keep < 1) return InvalidArgumentError("prune: keep must be >= 1");
  const std::string where =
      "pruning " + storage->Describe() + (root.empty() ? "" : "/") + std::string(root);
  auto listed = ListCheckpoints(storage, root);
  if (!listed.ok()) return listed.status().WithContext(where);
  std::vector<const CheckpointInfo*> committed, partial;
  for (const auto& c : *listed) {
    if (!c.step) continue;
    (c.committed ? committed : partial).push_back(&c);
  }
  auto by_step = [](const CheckpointInfo* a, const CheckpointInfo* b) {
    return *a->step < *b->step;
  };
  std::sort(committed.begin(), committed.end(), by_step);
  std::sort(partial.begin(), partial.end(), by_step);
  std::vector<const CheckpointInfo*> doomed;
  if (committed.size() > opts.keep) {
    doomed.assign(committed.begin(), committed.end() - static_cast<ptrdiff_t>(opts.keep));
  }
  const uint64_t newest = committed.empty() ? 0 : *committed.back()->step;
  for (const auto* p : partial) {
    bool older = !committed.empty() && *p->step < newest;
    if (older || opts.remove_newer_partials) doomed.push_back(p);
  }
  std::sort(doomed.begin(), doomed.end(), by_step);
  for (const auto* c : doomed) {
    if (removed) removed->push_back(c->name);
    if (opts.dry_run) continue;
    std::string dir = internal::JoinDir(root, c->name);
    Status s = UncommitCheckpoint(storage, dir);
    if (s.ok() && opts.after_uncommit) opts.after_uncommit(c->name);
    if (s.ok()) s = storage->DeleteDir(dir);
    if (!s.ok()) return s.WithContext(where + ": removing " + c->name);
  }
  if (!opts.dry_run && opts.stale_upload_age_s >= 0) {
    Status s = storage->AbortStaleUploads(root, opts.stale_upload_age_s);
    if (!s.ok()) return s.WithContext(where + ": aborting stale uploads");
  }
  return Status::OK();
}

Status RemoveCheckpointUri(std::string_view uri) {
  CAIRN_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, OpenStorage(uri, /*create=*/false));
  Storage* st = storage.get();
  const std::string where = "removing " + st->Describe();
  // What is there: a cairn checkpoint has a manifest, or (partial) its data/
  // directory and nothing that is a checkpoint of its own.
  CAIRN_ASSIGN_OR_RETURN(bool has_manifest, st->Exists(format::kManifestName));
  CAIRN_ASSIGN_OR_RETURN(bool has_data, st->Exists(format::kDataDir));
  if (!has_manifest) {
    auto listed = ListCheckpoints(st, "");
    if (!listed.ok()) return listed.status().WithContext(where);
    for (const auto& c : *listed) {
      if (c.committed || c.step) {
        return FailedPreconditionError(where + ": a root of checkpoints (it holds " + c.name +
                                       "), not one checkpoint: name the one to remove, or "
                                       "use cairn prune");
      }
    }
    CAIRN_ASSIGN_OR_RETURN(bool stock, st->Exists(".metadata"));
    if (stock || !has_data) {
      return FailedPreconditionError(
          where + ": not a cairn checkpoint (no " + std::string(format::kManifestName) +
          (stock ? ", but a stock DCP .metadata" : " and no data/ directory") +
          "); nothing was removed");
    }
  }
  CAIRN_RETURN_IF_ERROR(UncommitCheckpoint(st, "").WithContext(where));
  CAIRN_RETURN_IF_ERROR(st->DeleteDir("").WithContext(where));
  // The storage keeps its (now empty) root: a local one is removed as well.
  if (std::string local = st->LocalPath(); !local.empty()) {
    storage.reset();
    if (::rmdir(local.c_str()) != 0 && errno != ENOENT) {
      return ErrnoToStatus(errno, where + ": rmdir " + local);
    }
  }
  return Status::OK();
}

}  // namespace cairn
