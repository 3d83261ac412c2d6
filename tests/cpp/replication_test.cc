// Replication's engine half: ring placement, offers and refusals, the
// replica files and their commit, holdings and restore plans, the view, and
// hostile messages and paths. Every "node" is a private directory standing in
// for its /dev/shm; the bytes that gloo would move are copied with memcpy.
#include "cairn/replication.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cairn/checkpoint.h"
#include "cairn/checksum.h"
#include "cairn/format.h"
#include "cairn/storage.h"
#include "cairn/thread_pool.h"
#include "scratch_dir.h"

namespace cairn {
namespace {

namespace fs = std::filesystem;
using Pair = ReplicaPlacement::Pair;

std::vector<Pair> P(std::initializer_list<std::pair<int64_t, int64_t>> ps) {
  std::vector<Pair> out;
  for (auto [s, r] : ps) out.push_back({s, r});
  return out;
}

// ---- Placement --------------------------------------------------------------

TEST(ReplicaPlacementTest, TwoNodesOfOneRankReplicateToEachOther) {
  ReplicaPlacement p({"a", "b"}, 1);
  EXPECT_TRUE(p.multi());
  EXPECT_EQ(p.nodes(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(p.Peers("a"), std::vector<std::string>{"b"});
  EXPECT_EQ(p.pairs(), P({{0, 1}, {1, 0}}));
  EXPECT_EQ(p.Incoming(0), std::vector<int64_t>{1});
}

TEST(ReplicaPlacementTest, RingOfThreeNodesWithTwoRanksEachAndTwoReplicas) {
  ReplicaPlacement p({"a", "a", "b", "b", "c", "c"}, 2);
  EXPECT_EQ(p.Peers("a"), (std::vector<std::string>{"b", "c"}));
  EXPECT_EQ(p.Peers("b"), (std::vector<std::string>{"c", "a"}));
  EXPECT_EQ(p.Peers("c"), (std::vector<std::string>{"a", "b"}));
  // Local index j sends to local index j of every peer.
  EXPECT_EQ(p.pairs(), P({{0, 2},
                          {0, 4},
                          {1, 3},
                          {1, 5},
                          {2, 4},
                          {2, 0},
                          {3, 5},
                          {3, 1},
                          {4, 0},
                          {4, 2},
                          {5, 1},
                          {5, 3}}));
  EXPECT_EQ(p.Incoming(0), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(p.leader_of(3), 2);
}

TEST(ReplicaPlacementTest, UnevenNodesWrapLocalIndices) {
  // Node a has three ranks, node b one: every rank of a sends to b's only rank,
  // and b's rank sends to a's first.
  ReplicaPlacement p({"a", "a", "a", "b"}, 1);
  EXPECT_EQ(p.pairs(), P({{0, 3}, {1, 3}, {2, 3}, {3, 0}}));
  EXPECT_EQ(p.Incoming(3), (std::vector<int64_t>{0, 1, 2}));
}

TEST(ReplicaPlacementTest, NodesAreOrderedByTheirLowestRankAndReplicasAreClamped) {
  ReplicaPlacement p({"y", "x", "y", "x"}, 5);  // interleaved; K > nodes - 1
  EXPECT_EQ(p.nodes(), (std::vector<std::string>{"y", "x"}));
  EXPECT_EQ(p.ranks_of("y"), (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(p.Peers("y"), std::vector<std::string>{"x"});
  EXPECT_EQ(p.pairs(), P({{0, 1}, {1, 0}, {2, 3}, {3, 2}}));
}

TEST(ReplicaPlacementTest, OneNodeOrNoReplicasPlaceNothing) {
  ReplicaPlacement one({"a", "a"}, 1);
  EXPECT_FALSE(one.multi());
  EXPECT_TRUE(one.pairs().empty());
  ReplicaPlacement none({"a", "b"}, 0);
  EXPECT_TRUE(none.multi());
  EXPECT_TRUE(none.pairs().empty());
  EXPECT_TRUE(none.Peers("zzz").empty());
  EXPECT_TRUE(none.ranks_of("zzz").empty());
}

TEST(SafeNodeNameTest, NamesBecomeOneSafeComponent) {
  EXPECT_EQ(SafeNodeName("node-a.example_1"), "node-a.example_1");
  EXPECT_EQ(SafeNodeName("a b/c"), "a_b_c");
  EXPECT_EQ(SafeNodeName("../../etc"), ".._.._etc");
  EXPECT_EQ(SafeNodeName(".."), "_");
  EXPECT_EQ(SafeNodeName("."), "_");
  EXPECT_EQ(SafeNodeName(""), "_");
  EXPECT_EQ(SafeNodeName(std::string("a\0b", 3)), "a_b");
  EXPECT_EQ(SafeNodeName("view"), "view_");  // the replica tier's own names
  EXPECT_EQ(SafeNodeName("owners"), "owners_");
}

// ---- Offers and refusals ----------------------------------------------------

TEST(ReplicaOfferTest, RoundTripsAndRefusesMalformedOffers) {
  ReplicaOffer o{{{1, 4096}}, 1 << 20, -5};
  auto back = DecodeReplicaOffer(EncodeReplicaOffer(o), 2);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->have, o.have);
  EXPECT_EQ(back->free, o.free);
  EXPECT_EQ(back->left, o.left);
  EXPECT_EQ(DecodeReplicaOffer("nope", 2).status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(DecodeReplicaOffer(R"({"have":[],"free":-1,"left":null})", 2).status().code(),
            StatusCode::kDataLoss);
  // Ranks outside the group and negative sizes are dropped.
  auto d = DecodeReplicaOffer(R"({"have":[[7,1],[-1,1],[1,-3],[0,10]],"free":1,"left":null})", 2);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->have, (std::map<int64_t, uint64_t>{{0, 10}}));
}

TEST(RefusedReceiversTest, RoomAndLimitDecideAndHeldBytesCount) {
  ReplicaPlacement p({"a", "b"}, 1);
  std::vector<uint64_t> sizes = {1000, 1000};
  std::vector<std::optional<ReplicaOffer>> offers(2);
  offers[0] = ReplicaOffer{{}, 999, std::nullopt};   // needs 1000, 999 free
  offers[1] = ReplicaOffer{{{0, 600}}, 10000, 300};  // grows 400, 300 left
  auto refused = RefusedReceivers(p, offers, sizes);
  ASSERT_EQ(refused.size(), 2u);
  EXPECT_EQ(refused[0], "1000 bytes needed, 999 free in shared memory");
  EXPECT_NE(refused[1].find("memory_limit"), std::string::npos) << refused[1];
  offers[1]->left = 400;
  offers[0]->have[1] = 1000;  // already holds it all: grows by 0
  EXPECT_TRUE(RefusedReceivers(p, offers, sizes).empty());
}

// ---- Holdings and plans -----------------------------------------------------

TEST(ReplicaHoldingsTest, HostileHoldingsAreDroppedEntryByEntry) {
  EXPECT_EQ(DecodeHoldings("{", 2, 2).status().code(), StatusCode::kDataLoss);
  const char* text = R"([
    {"step": 6, "memory_slot": 1, "memory": [[0, 8192], [5, 1], [1, -1]],
     "replicas": [{"source": "../../etc", "slot": 0, "files": [[1, 10]]},
                  {"source": "b", "slot": 99, "files": [[1, 10]]},
                  {"source": "b", "slot": 1, "files": [[1, 1152921504606846976], [1, 10]]},
                  {"source": 3}]},
    {"step": "7"}, 12, {"step": 8, "memory_slot": -1, "memory": [[0, 1]]}])";
  auto h = DecodeHoldings(text, 2, 2);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_EQ(h->size(), 2u);
  const StepHolding& s6 = h->at(6);
  EXPECT_EQ(s6.memory_slot, 1);
  EXPECT_EQ(s6.memory, (std::map<int64_t, uint64_t>{{0, 8192}}));
  ASSERT_EQ(s6.replicas.size(), 1u);
  EXPECT_EQ(s6.replicas[0].source, "b");
  EXPECT_EQ(s6.replicas[0].files, (std::map<int64_t, uint64_t>{{1, 10}}));
  EXPECT_EQ(h->at(8).memory_slot, -1);  // no slot: its memory files do not count
  EXPECT_TRUE(h->at(8).memory.empty());
}

TEST(PlanStepTest, OwnNodesMemoryFirstThenAnyReplicaElseNothing) {
  ReplicaPlacement p({"a", "b"}, 1);
  NodeHoldings a, b;
  a[6].memory_slot = 0;
  a[6].memory = {{0, 100}};
  a[6].replicas = {{"b", 0, {{1, 200}}}};
  b[6].memory_slot = 0;
  b[6].memory = {{1, 200}};
  b[6].replicas = {{"a", 0, {{0, 100}}}};
  auto plan = PlanStep(6, {a, b}, p);
  ASSERT_TRUE(plan);
  EXPECT_EQ(*plan, (std::vector<FileSource>{{0, "", 0, 100}, {1, "", 0, 200}}));
  // Node b lost: rank 1's file comes from a's replica.
  plan = PlanStep(6, {a, NodeHoldings{}}, p);
  ASSERT_TRUE(plan);
  EXPECT_EQ((*plan)[1], (FileSource{0, "b", 0, 200}));
  // A memory tier of another node never serves a rank (it is not its file).
  NodeHoldings claims;
  claims[6].memory_slot = 0;
  claims[6].memory = {{0, 100}, {1, 200}};
  EXPECT_FALSE(PlanStep(6, {claims, NodeHoldings{}}, p));
  EXPECT_FALSE(PlanStep(7, {a, b}, p));
}

// ---- The store, end to end ------------------------------------------------

constexpr uint64_t kSlot = 8192;

// One simulated node: its shared memory directory with the run's memory tier
// and replica tier.
struct FakeNode {
  explicit FakeNode(const std::string& root)
      : shm(root), mem(root + "/cairn-t"), reps(root + "/cairn-t-replicas") {
    fs::create_directories(mem);
  }
  std::string shm, mem, reps;
};

std::string Pattern(int seed) {
  std::string s(kSlot, '\0');
  for (size_t i = 0; i < s.size(); ++i) s[i] = static_cast<char>(i * 7 + seed);
  return s;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class ReplicaStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(base_ + "/a");
    fs::create_directories(base_ + "/b");
    manifest_.world_size = 2;
    manifest_.files = {{format::DataFileKey(0), kSlot}, {format::DataFileKey(1), kSlot}};
    manifest_.extra = R"({"manager": {"step": 6, "run_id": "run-1"}})";
    for (uint64_t off : {uint64_t{0}, uint64_t{4096}}) {
      offsets_.push_back(off);
      lengths_.push_back(4096);
    }
    // Each rank's file holds two 4 KiB items (so Verify checks every byte).
    for (uint32_t q = 0; q < 2; ++q) {
      const std::string data = Pattern(static_cast<int>(q) + 1);
      for (size_t i = 0; i < offsets_.size(); ++i) {
        ItemLocation loc{q, offsets_[i], lengths_[i], Sums(data)[i]};
        manifest_.bytes.push_back({"r" + std::to_string(q) + "." + std::to_string(i), loc});
      }
    }
  }

  std::unique_ptr<ReplicaStore> Open(const FakeNode& n, int64_t rank, int64_t k = 1) {
    ReplicaStoreOptions o{n.reps, n.mem, {"node-a", "node-b"}, rank, k, 2, base_, "run-1"};
    auto s = ReplicaStore::Open(std::move(o));
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Stages rank q's slot 0 in node n's memory tier and commits it.
  // Node a's rank 0 and node b's rank 1 staged with patterns 1 and 2 (returned).
  std::pair<std::string, std::string> StageBoth() {
    std::string da = Pattern(1), db = Pattern(2);
    Stage(a_, 0, da);
    Stage(b_, 1, db);
    return {da, db};
  }

  void Stage(const FakeNode& n, int64_t q, const std::string& bytes) {
    fs::create_directories(n.mem + "/slot0/data");
    std::ofstream(n.mem + "/slot0/" + format::DataFileKey(q), std::ios::binary) << bytes;
    auto st = NewPosixStorage(n.mem, false);
    ASSERT_TRUE(st.ok());
    ASSERT_TRUE(CommitManifest(st->get(), "slot0", manifest_).ok());
  }

  std::vector<std::vector<uint64_t>> Sums(const std::string& bytes) {
    std::vector<std::vector<uint64_t>> out;
    for (size_t i = 0; i < offsets_.size(); ++i) {
      out.push_back(*BlockChecksums(bytes.data() + offsets_[i], lengths_[i]));
    }
    return out;
  }

  // Replicates slot 0 of both ranks (a -> b, b -> a) as the Python layer
  // would, with memcpy standing in for gloo.
  void Replicate(ReplicaStore& a, ReplicaStore& b, const std::string& da, const std::string& db) {
    std::vector<std::optional<std::string>> offers = {*a.Offer(0, std::nullopt),
                                                      *b.Offer(0, std::nullopt)};
    ASSERT_TRUE(offers[0] && offers[1]);
    for (ReplicaStore* s : {&a, &b}) {
      auto refused = s->Begin(0, offers, {kSlot, kSlot});
      ASSERT_TRUE(refused.ok()) << refused.status().ToString();
      EXPECT_TRUE(refused->empty());
      EXPECT_EQ(s->live_pairs(), P({{0, 1}, {1, 0}}));
    }
    auto into_b = b.ReceiveBuffer(0);
    auto into_a = a.ReceiveBuffer(1);
    ASSERT_TRUE(into_a.ok() && into_b.ok()) << into_a.status().ToString();
    ASSERT_EQ(into_b->size, kSlot);
    std::memcpy(into_b->data, da.data(), kSlot);
    std::memcpy(into_a->data, db.data(), kSlot);
    EXPECT_EQ(*b.Verify(0, offsets_, lengths_, Sums(da)), "");
    EXPECT_EQ(*a.Verify(1, offsets_, lengths_, Sums(db)), "");
    for (ReplicaStore* s : {&a, &b}) {
      auto done = s->Commit(6, manifest_, {});
      ASSERT_TRUE(done.ok()) << done.status().ToString();
      EXPECT_TRUE(*done);
    }
  }

  test_util::ScratchDir scratch_{"replication_test"};
  const std::string base_ = scratch_.path();
  FakeNode a_{base_ + "/a"}, b_{base_ + "/b"};
  Manifest manifest_;
  std::vector<uint64_t> offsets_, lengths_;
};

TEST_F(ReplicaStoreTest, ReplicationVerifiesThenCommitsOnThePeer) {
  const auto [da, db] = StageBoth();
  auto a = Open(a_, 0), b = Open(b_, 1);
  ASSERT_TRUE(a && b);
  EXPECT_TRUE(a->leased());
  Replicate(*a, *b, da, db);
  const std::string sd = b_.reps + "/node-a/slot0";
  EXPECT_EQ(ReadFile(sd + "/data/r0.bin"), da);
  EXPECT_TRUE(fs::exists(sd + "/cairn.manifest"));
  EXPECT_NE(ReadFile(sd + "/cairn.replica.json").find("\"step\":6"), std::string::npos);
  // The next save's Begin uncommits the replica slot before any byte moves,
  // and the replica file stays mapped (same buffer).
  auto first = b->ReceiveBuffer(0);
  std::vector<std::optional<std::string>> offers = {*a->Offer(0, std::nullopt),
                                                    *b->Offer(0, std::nullopt)};
  ASSERT_TRUE(b->Begin(0, offers, {kSlot, kSlot}).ok());
  EXPECT_FALSE(fs::exists(sd + "/cairn.manifest"));
  EXPECT_FALSE(fs::exists(sd + "/cairn.replica.json"));
  EXPECT_EQ(b->ReceiveBuffer(0)->data, first->data);
}

TEST_F(ReplicaStoreTest, ACorruptArrivalIsNotTrustedAndNotCommitted) {
  const std::string da = Pattern(1);
  auto a = Open(a_, 0), b = Open(b_, 1);
  std::vector<std::optional<std::string>> offers = {*a->Offer(0, std::nullopt),
                                                    *b->Offer(0, std::nullopt)};
  ASSERT_TRUE(b->Begin(0, offers, {kSlot, kSlot}).ok());
  auto buf = b->ReceiveBuffer(0);
  ASSERT_TRUE(buf.ok());
  std::memcpy(buf->data, da.data(), kSlot);
  buf->data[5000] ^= 1;
  auto why = b->Verify(0, offsets_, lengths_, Sums(da));
  ASSERT_TRUE(why.ok());
  EXPECT_EQ(*why, "rank 0's item at offset 4096 arrived with a wrong checksum");
  // An item said to lie past the slot is refused, not read.
  why = b->Verify(0, {4096}, {kSlot}, {{1}});
  EXPECT_NE(why->find("lies outside"), std::string::npos) << *why;
  auto done = b->Commit(6, manifest_, {0});
  ASSERT_TRUE(done.ok());
  EXPECT_FALSE(*done);
  EXPECT_FALSE(fs::exists(b_.reps + "/node-a/slot0/cairn.manifest"));
  // Rank 1 receives nothing from itself.
  EXPECT_EQ(b->ReceiveBuffer(1).status().code(), StatusCode::kFailedPrecondition);
}

TEST_F(ReplicaStoreTest, ANodeWithoutRoomIsRefusedAlikeOnEveryRank) {
  auto a = Open(a_, 0), b = Open(b_, 1);
  std::vector<std::optional<std::string>> offers = {EncodeReplicaOffer({{}, 10, std::nullopt}),
                                                    *b->Offer(0, std::nullopt)};
  for (ReplicaStore* s : {a.get(), b.get()}) {
    auto refused = s->Begin(0, offers, {kSlot, kSlot});
    ASSERT_TRUE(refused.ok());
    ASSERT_EQ(refused->count(0), 1u);
    EXPECT_EQ(s->live_pairs(), P({{0, 1}}));
  }
  // A malformed offer refuses its rank too.
  offers[0] = "{}";
  EXPECT_EQ(b->Begin(0, offers, {kSlot, kSlot})->count(0), 1u);
}

TEST_F(ReplicaStoreTest, ALostNodeIsRestoredFromItsPeersReplica) {
  const auto [da, db] = StageBoth();
  {
    auto a = Open(a_, 0), b = Open(b_, 1);
    Replicate(*a, *b, da, db);
    ASSERT_TRUE(a->ReleaseLease().ok());
    ASSERT_TRUE(b->ReleaseLease().ok());
  }
  // Node b is lost: a replacement starts with an empty shared memory.
  fs::remove_all(b_.shm);
  FakeNode b2(b_.shm);
  auto a = Open(a_, 0), b = Open(b2, 1);
  std::vector<std::string> holdings = {*a->Holdings(), *b->Holdings()};
  auto ca = a->Candidates(holdings), cb = b->Candidates(holdings);
  ASSERT_TRUE(ca.ok() && cb.ok()) << ca.status().ToString();
  EXPECT_EQ(*ca, (std::vector<std::pair<int64_t, std::string>>{{6, "memory"}}));
  EXPECT_EQ(*cb, (std::vector<std::pair<int64_t, std::string>>{{6, "peer"}}));
  std::vector<std::vector<int64_t>> lacks = {*a->PrepareView(6), *b->PrepareView(6)};
  EXPECT_TRUE(lacks[0].empty());
  EXPECT_EQ(lacks[1], (std::vector<int64_t>{0, 1, -1}));
  int64_t from_a = -2, from_b = -2;
  auto sends = a->ViewTransfers(6, lacks, &from_a);
  auto recvs = b->ViewTransfers(6, lacks, &from_b);
  ASSERT_TRUE(sends.ok() && recvs.ok()) << sends.status().ToString() << recvs.status().ToString();
  EXPECT_EQ(from_a, 0);
  EXPECT_EQ(from_b, 0);
  ASSERT_EQ(sends->size(), 2u);
  ASSERT_EQ(recvs->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE((*sends)[i].send);
    EXPECT_EQ((*sends)[i].peer, 1);
    EXPECT_FALSE((*recvs)[i].send);
    EXPECT_EQ((*recvs)[i].peer, 0);
    std::memcpy((*recvs)[i].data, (*sends)[i].data, (*sends)[i].size);
  }
  a->EndViewTransfers();
  b->EndViewTransfers();
  auto raw = a->ManifestBytes(6);
  ASSERT_TRUE(raw.ok());
  ASSERT_TRUE(a->CommitView(6, raw.value()).ok());
  ASSERT_TRUE(b->CommitView(6, raw.value()).ok());
  for (const std::string& view : {a_.reps + "/view", b2.reps + "/view"}) {
    EXPECT_EQ(ReadFile(view + "/data/r0.bin"), da) << view;
    EXPECT_EQ(ReadFile(view + "/data/r1.bin"), db) << view;
    auto st = NewPosixStorage(view, false);
    ASSERT_TRUE(st.ok());
    ThreadPool pool(1);
    Status ok = Verify(st->get(), "", &pool);
    EXPECT_TRUE(ok.ok()) << view << ": " << ok.ToString();
  }
  ASSERT_TRUE(b->DropView().ok());
  EXPECT_FALSE(fs::exists(b2.reps + "/view"));
  ASSERT_TRUE(a->Close().ok());
  EXPECT_FALSE(fs::exists(a_.reps));  // the node leader removes its replica tier
}

TEST_F(ReplicaStoreTest, HoldingsTrustOnlyWhatTheSidecarAndManifestVouchFor) {
  const auto [da, db] = StageBoth();
  auto a = Open(a_, 0), b = Open(b_, 1);
  Replicate(*a, *b, da, db);
  // A replica file whose size differs from the sidecar's is not held, and a
  // replica of another run is not either.
  fs::resize_file(b_.reps + "/node-a/slot0/data/r0.bin", kSlot - 1);
  auto h = DecodeHoldings(*b->Holdings(), 2, 2);
  ASSERT_TRUE(h.ok());
  ASSERT_EQ(h->at(6).replicas.size(), 1u);
  EXPECT_TRUE(h->at(6).replicas[0].files.empty());
  ReplicaStoreOptions other{b_.reps, b_.mem, {"node-a", "node-b"}, 1, 1, 2, base_, "run-2"};
  auto c = ReplicaStore::Open(std::move(other));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*(*c)->Holdings(), "[]");
  // A FIFO planted as a manifest neither blocks nor counts.
  ASSERT_EQ(::unlink((b_.mem + "/slot0/cairn.manifest").c_str()), 0);
  ASSERT_EQ(::mkfifo((b_.mem + "/slot0/cairn.manifest").c_str(), 0600), 0);
  h = DecodeHoldings(*b->Holdings(), 2, 2);
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->at(6).memory_slot, -1);
}

TEST_F(ReplicaStoreTest, APlantedSymlinkIsNeverWrittenThrough) {
  auto a = Open(a_, 0), b = Open(b_, 1);
  std::vector<std::optional<std::string>> offers = {*a->Offer(0, std::nullopt),
                                                    *b->Offer(0, std::nullopt)};
  ASSERT_TRUE(b->Begin(0, offers, {kSlot, kSlot}).ok());
  const std::string outside = base_ + "/outside";
  std::ofstream(outside) << "keep";
  fs::create_symlink(outside, b_.reps + "/node-a/slot0/data/r0.bin");
  EXPECT_FALSE(b->ReceiveBuffer(0).ok());
  EXPECT_EQ(ReadFile(outside), "keep");
}

TEST_F(ReplicaStoreTest, ViewTransfersIgnoreHostileReports) {
  const auto [da, db] = StageBoth();
  auto a = Open(a_, 0), b = Open(b_, 1);
  std::vector<std::string> holdings = {*a->Holdings(), *b->Holdings()};
  ASSERT_TRUE(a->Candidates(holdings).ok());
  int64_t from = -2;
  // Ranks outside the group and unknown markers are ignored; nothing is
  // lacking, so nothing moves and no manifest is shared.
  auto t = a->ViewTransfers(6, {{}, {7, -9, 1 << 30}}, &from);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_TRUE(t->empty());
  EXPECT_EQ(from, -1);
  EXPECT_EQ(a->ViewTransfers(6, {{}}, &from).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(a->ViewTransfers(99, {{}, {}}, &from).status().code(), StatusCode::kInvalidArgument);
  // A holder whose file shrank below the planned size refuses to map it
  // (reading past its end would be SIGBUS).
  fs::resize_file(a_.mem + "/slot0/data/r0.bin", 100);
  EXPECT_EQ(a->ViewTransfers(6, {{}, {0}}, &from).status().code(), StatusCode::kDataLoss);
}

}  // namespace
}  // namespace cairn
