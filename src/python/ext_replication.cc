// Bindings for replication (include/cairn/replication.h): the engine owns a
// node's replica state; Python only posts the gloo sends and receives over
// the buffers the store hands out, and carries its messages in all-gathers.
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/set.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cairn/replication.h"
#include "common.h"
#include "without_gil.h"

namespace nb = nanobind;

namespace cairn::python {
namespace {

// The Python object: the store until close().
struct PyReplicaStore {
  std::unique_ptr<ReplicaStore> s;
  ReplicaStore& get() {
    if (!s) RaiseStatus(FailedPreconditionError("replica store closed"));
    return *s;
  }
};

// (send, peer rank, address, size) of one transfer.
using PyTransfer = std::tuple<bool, int64_t, uintptr_t, uint64_t>;
PyTransfer ToPy(const ReplicaTransfer& t) {
  return {t.send, t.peer, reinterpret_cast<uintptr_t>(t.data), t.size};
}

}  // namespace

void RegisterReplication(nb::module_& m) {
  m.def("node_id", &NodeId, "This node's identity: $CAIRN_NODE_ID if set, else the hostname.");
  m.def("safe_node_name", &SafeNodeName, nb::arg("name"),
        "`name` as one safe path component of the replica tier.");

  nb::class_<PyReplicaStore>(m, "ReplicaStore")
      .def(
          "__init__",
          [](PyReplicaStore* self, const std::string& dir, const std::string& memory_dir,
             const std::vector<std::string>& nodes, int64_t rank, int64_t replicas, int64_t slots,
             const std::string& run_root, const std::string& run_id) {
            ReplicaStoreOptions o{dir, memory_dir, nodes, rank, replicas, slots, run_root, run_id};
            new (self) PyReplicaStore{WithoutGil([&] { return ReplicaStore::Open(std::move(o)); })};
          },
          nb::arg("dir"), nb::arg("memory_dir"), nb::arg("nodes"), nb::arg("rank"),
          nb::arg("replicas"), nb::arg("slots"), nb::arg("run_root") = "", nb::arg("run_id") = "")
      .def_prop_ro("multi", [](PyReplicaStore& p) { return p.get().placement().multi(); })
      .def_prop_ro("leased", [](PyReplicaStore& p) { return p.s && p.s->leased(); })
      .def("peers", [](PyReplicaStore& p,
                       const std::string& node) { return p.get().placement().Peers(node); })
      .def("pairs",
           [](PyReplicaStore& p) {
             std::vector<std::pair<int64_t, int64_t>> out;
             for (const auto& x : p.get().placement().pairs())
               out.emplace_back(x.source, x.receiver);
             return out;
           })
      .def(
          "offer",
          [](PyReplicaStore& p, int64_t slot, std::optional<int64_t> limit) {
            return WithoutGil([&] { return p.get().Offer(slot, limit); });
          },
          nb::arg("slot"), nb::arg("limit").none())
      .def(
          "begin",
          [](PyReplicaStore& p, int64_t slot, const std::vector<std::optional<std::string>>& offers,
             const std::vector<uint64_t>& sizes) {
            auto refused = WithoutGil([&] { return p.get().Begin(slot, offers, sizes); });
            std::vector<std::pair<int64_t, int64_t>> live;
            for (const auto& x : p.get().live_pairs()) live.emplace_back(x.source, x.receiver);
            return std::make_pair(refused, live);
          },
          nb::arg("slot"), nb::arg("offers"), nb::arg("sizes"),
          "Refusals {rank: why} and the live (source, receiver) pairs of one replication.")
      .def(
          "receive_buffer",
          [](PyReplicaStore& p, int64_t q) {
            return ToPy(WithoutGil([&] { return p.get().ReceiveBuffer(q); }));
          },
          nb::arg("source"))
      .def(
          "verify",
          [](PyReplicaStore& p, int64_t q, const std::vector<uint64_t>& offsets,
             const std::vector<uint64_t>& lengths, const std::vector<std::vector<uint64_t>>& sums) {
            return WithoutGil([&] { return p.get().Verify(q, offsets, lengths, sums); });
          },
          nb::arg("source"), nb::arg("offsets"), nb::arg("lengths"), nb::arg("sums"),
          "'' when rank `source`'s received items match their checksums, else what did not.")
      .def(
          "commit",
          [](PyReplicaStore& p, int64_t step, const Manifest& manifest,
             const std::set<int64_t>& failed) {
            return WithoutGil([&] { return p.get().Commit(step, manifest, failed); });
          },
          nb::arg("step"), nb::arg("manifest"), nb::arg("failed"))
      .def("holdings",
           [](PyReplicaStore& p) { return WithoutGil([&] { return p.get().Holdings(); }); })
      .def(
          "candidates",
          [](PyReplicaStore& p, const std::vector<std::string>& everyone) {
            return WithoutGil([&] { return p.get().Candidates(everyone); });
          },
          nb::arg("everyone"))
      .def(
          "prepare_view",
          [](PyReplicaStore& p, int64_t step) {
            return WithoutGil([&] { return p.get().PrepareView(step); });
          },
          nb::arg("step"))
      .def(
          "view_transfers",
          [](PyReplicaStore& p, int64_t step, const std::vector<std::vector<int64_t>>& lacks) {
            int64_t from = -1;
            auto ts = WithoutGil([&] { return p.get().ViewTransfers(step, lacks, &from); });
            std::vector<PyTransfer> out;
            for (const auto& t : ts) out.push_back(ToPy(t));
            return std::make_pair(out, from);
          },
          nb::arg("step"), nb::arg("lacks"),
          "The (send, peer, address, size) transfers of this rank, and the rank that shares "
          "its manifest (-1: none).")
      .def("end_view_transfers", [](PyReplicaStore& p) { p.get().EndViewTransfers(); })
      .def(
          "manifest_bytes",
          [](PyReplicaStore& p, int64_t step) {
            std::string b = WithoutGil([&] { return p.get().ManifestBytes(step); });
            return nb::bytes(b.data(), b.size());
          },
          nb::arg("step"))
      .def(
          "commit_view",
          [](PyReplicaStore& p, int64_t step, std::optional<nb::bytes> raw) {
            std::optional<std::string> r;
            if (raw) r.emplace(raw->c_str(), raw->size());
            WithoutGil([&] { return p.get().CommitView(step, r); });
          },
          nb::arg("step"), nb::arg("raw").none())
      .def("drop_view", [](PyReplicaStore& p) { WithoutGil([&] { return p.get().DropView(); }); })
      .def("release_lease",
           [](PyReplicaStore& p) { WithoutGil([&] { return p.get().ReleaseLease(); }); })
      .def("close", [](PyReplicaStore& p) {
        if (!p.s) return;
        Status s;
        {
          nb::gil_scoped_release nogil;
          s = p.s->Close();
          p.s.reset();
        }
        ThrowIfError(s);
      });
}

}  // namespace cairn::python
