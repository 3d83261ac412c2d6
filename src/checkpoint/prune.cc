// Retention of step_<N> checkpoints (see Prune in cairn/checkpoint.h).
#include <algorithm>

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

}  // namespace cairn
