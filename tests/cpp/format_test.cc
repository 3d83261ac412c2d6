// Tests of the manifest encoding: round trip, damage detection, and hostile
// manifests (valid envelope, malicious body) that must be rejected cleanly.
#include "cairn/format.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <chrono>
#include <nlohmann/json.hpp>

#include "cairn/manifest.h"

namespace cairn {
namespace {

using nlohmann::json;

// A small valid manifest: one file, two tensors (one in two chunks), one
// bytes item.
Manifest SampleManifest() {
  Manifest m;
  m.world_size = 2;
  m.block_size = 4096;
  m.created_unix_ms = 1700000000000;
  m.files = {{"data/r0.bin", 3 * 4096 + 100}};
  ManifestTensor w;
  w.fqn = "model.w";
  w.dtype = "float32";
  w.shape = {4, 512};
  w.chunks.push_back({{0, 0}, {2, 512}, {0, 0, 4096, {1}}});
  w.chunks.push_back({{2, 0}, {2, 512}, {0, 4096, 4096, {2}}});
  ManifestTensor s;
  s.fqn = "step";
  s.dtype = "int64";
  s.shape = {};
  s.chunks.push_back({{}, {}, {0, 8192, 8, {3}}});
  m.tensors = {w, s};
  m.bytes.push_back({"opt.state", {0, 3 * 4096, 100, {4}}});
  m.extra = R"({"dcp":{"planner_data":null}})";
  return m;
}

std::string Envelope(const std::string& body, uint32_t version = format::kFormatVersion) {
  std::string out(format::kManifestMagic, format::kMagicSize);
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((version >> (8 * i)) & 0xff));
  for (int i = 0; i < 4; ++i) out.push_back(0);
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += body;
  uint64_t h = XXH3_64bits(out.data(), out.size());
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((h >> (8 * i)) & 0xff));
  return out;
}

json SampleBody() { return json::parse(*ManifestToJson(SampleManifest())); }

// Decodes `body` wrapped in a valid envelope.
Status DecodeBody(const json& body) { return DecodeManifest(Envelope(body.dump())).status(); }

TEST(FormatTest, ConstantsAreConsistent) {
  EXPECT_EQ(format::DtypeItemSize("float32"), 4u);
  EXPECT_EQ(format::DtypeItemSize("bfloat16"), 2u);
  EXPECT_EQ(format::DtypeItemSize("bool"), 1u);
  EXPECT_EQ(format::DtypeItemSize("object"), 0u);
  EXPECT_EQ(format::DataFileKey(3), "data/r3.bin");
}

TEST(ManifestTest, EncodeDecodeRoundTrip) {
  Manifest m = SampleManifest();
  auto bytes = EncodeManifest(m);
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto back = DecodeManifest(*bytes);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->world_size, 2u);
  EXPECT_EQ(back->block_size, 4096u);
  EXPECT_EQ(back->created_unix_ms, m.created_unix_ms);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].fqn, "model.w");
  EXPECT_EQ(back->tensors[0].chunks[1].offsets, (std::vector<uint64_t>{2, 0}));
  EXPECT_EQ(back->tensors[0].chunks[1].location.offset, 4096u);
  EXPECT_EQ(back->tensors[1].shape.size(), 0u);
  EXPECT_EQ(back->bytes[0].location.checksums, (std::vector<uint64_t>{4}));
  EXPECT_EQ(json::parse(back->extra), json::parse(m.extra));
  EXPECT_EQ(*EncodeManifest(*back), *bytes);
}

TEST(ManifestTest, ChecksumsAreFullWidth) {
  Manifest m = SampleManifest();
  m.bytes[0].location.checksums[0] = 0xfedcba9876543210ull;
  auto back = DecodeManifest(*EncodeManifest(m));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->bytes[0].location.checksums[0], 0xfedcba9876543210ull);
}

TEST(ManifestTest, FlippingAnyByteIsDataLoss) {
  std::string bytes = *EncodeManifest(SampleManifest());
  for (size_t i = 0; i < bytes.size(); ++i) {
    std::string bad = bytes;
    bad[i] ^= 0x20;
    auto r = DecodeManifest(bad);
    ASSERT_FALSE(r.ok()) << "flip at " << i;
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss)
        << "flip at " << i << ": " << r.status().ToString();
  }
}

TEST(ManifestTest, EveryTruncationIsDataLoss) {
  std::string bytes = *EncodeManifest(SampleManifest());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = DecodeManifest(std::string_view(bytes).substr(0, n));
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  }
  auto r = DecodeManifest(bytes + "x");
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
}

TEST(ManifestTest, UnknownVersionIsFailedPrecondition) {
  json body = SampleBody();
  auto r = DecodeManifest(Envelope(body.dump(), 2));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("version 2"), std::string::npos);
  body["format_version"] = 7;
  r = DecodeManifest(Envelope(body.dump()));
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
}

// Each hostile edit must give DataLoss whose message contains `what`.
struct Hostile {
  const char* name;
  std::function<void(json&)> edit;
  const char* what;
};

class HostileManifestTest : public ::testing::TestWithParam<Hostile> {};

TEST_P(HostileManifestTest, IsRejectedWithAClearError) {
  json body = SampleBody();
  GetParam().edit(body);
  Status s = DecodeBody(body);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find(GetParam().what), std::string::npos) << s.ToString();
}

const Hostile kHostile[] = {
    {"DotDotKey", [](json& b) { b["files"][0]["key"] = "../../etc/passwd"; }, "'..'"},
    {"AbsoluteKey", [](json& b) { b["files"][0]["key"] = "/etc/passwd"; }, "absolute"},
    {"ManifestAsDataFile", [](json& b) { b["files"][0]["key"] = "cairn.manifest"; },
     "names the manifest"},
    {"DuplicateFile", [](json& b) { b["files"].push_back(b["files"][0]); }, "listed twice"},
    {"OffsetPastEof", [](json& b) { b["tensors"][0]["chunks"][0]["offset"] = 1 << 20; }, "outside"},
    {"LengthOverflow",
     [](json& b) {
       b["tensors"][0]["chunks"][0]["offset"] = 18446744073709547520ull;  // 2^64 - 4096
       b["tensors"][0]["chunks"][0]["length"] = 4096;
     },
     "outside"},
    {"UnalignedOffset", [](json& b) { b["bytes"][0]["offset"] = 1; }, "aligned"},
    {"LengthDoesNotMatchShape", [](json& b) { b["tensors"][1]["chunks"][0]["length"] = 4; },
     "does not match"},
    {"ShapeOverflow",
     [](json& b) {
       b["tensors"][0]["shape"] = {4294967296ull, 4294967296ull};
       b["tensors"][0]["chunks"][0]["sizes"] = {4294967296ull, 4294967296ull};
     },
     "overflow"},
    {"ChunkOutsideShape", [](json& b) { b["tensors"][0]["chunks"][1]["offsets"][0] = 3; },
     "outside the tensor"},
    {"RankMismatch", [](json& b) { b["tensors"][0]["chunks"][0]["sizes"] = {2048}; }, "rank"},
    {"TooManyDims", [](json& b) { b["tensors"][1]["shape"] = std::vector<int>(100, 1); },
     "too many"},
    {"UnknownDtype", [](json& b) { b["tensors"][0]["dtype"] = "object"; }, "unknown dtype"},
    {"WrongChecksumCount",
     [](json& b) { b["tensors"][0]["chunks"][0]["checksums"].push_back("0000000000000000"); },
     "checksums"},
    {"BadChecksumText", [](json& b) { b["tensors"][0]["chunks"][0]["checksums"][0] = "xyz"; },
     "hex"},
    {"FileIndexOutOfRange", [](json& b) { b["bytes"][0]["file"] = 5; }, "file index"},
    {"OverlappingItems", [](json& b) { b["tensors"][0]["chunks"][1]["offset"] = 0; }, "overlap"},
    {"FileShorterThanItems", [](json& b) { b["files"][0]["size"] = 100; }, "lie outside"},
    {"NegativeSize", [](json& b) { b["files"][0]["size"] = -1; }, "non-negative"},
    {"SizeIsAString", [](json& b) { b["files"][0]["size"] = "12"; }, "non-negative"},
    {"MissingField", [](json& b) { b["tensors"][0].erase("shape"); }, "missing"},
    {"DuplicateName", [](json& b) { b["bytes"][0]["fqn"] = "step"; }, "listed twice"},
    {"ZeroWorldSize", [](json& b) { b["world_size"] = 0; }, "world_size"},
    {"TinyBlockSize", [](json& b) { b["block_size"] = 1; }, "block_size"},
    {"ExtraNotObject", [](json& b) { b["extra"] = 5; }, "extra"},
    {"BodyNotObject",
     [](json& b) {
       b = json::array({1, 2});
     },
     "not a JSON object"},
    // Chunk coverage: the chunks must tile the tensor exactly once.
    {"MissingChunk", [](json& b) { b["tensors"][0]["chunks"].erase(1); }, "1024 of its 2048"},
    {"TensorWithoutChunks", [](json& b) { b["tensors"][0]["chunks"] = json::array(); },
     "has no chunks"},
    {"ScalarWithoutChunks", [](json& b) { b["tensors"][1]["chunks"] = json::array(); },
     "has no chunks"},
    {"OverlappingChunks", [](json& b) { b["tensors"][0]["chunks"][1]["offsets"][0] = 1; },
     "overlap at element [1, 0]"},
    {"RepeatedChunk",
     [](json& b) {
       // The same box again, stored in bytes of its own.
       json c = b["tensors"][0]["chunks"][0];
       c["offset"] = 4 * 4096;
       b["files"][0]["size"] = 5 * 4096;
       b["tensors"][0]["chunks"].push_back(c);
     },
     "both start at [0, 0]"},
    {"EmptyChunkSharingAnOffset",
     [](json& b) {
       json c = b["tensors"][0]["chunks"][0];
       c["sizes"] = {0, 512};
       c["length"] = 0;
       c["offset"] = 0;
       c["checksums"] = json::array();
       b["tensors"][0]["chunks"].push_back(c);
     },
     "both start at [0, 0]"},
    // Huge allocations: a non-tensor item is bounded whatever its file says.
    {"HugeBytesItem",
     [](json& b) {
       b["files"][0]["size"] = uint64_t{1} << 41;
       b["bytes"][0]["length"] = uint64_t{1} << 40;
     },
     "limit for a non-tensor item"},
    // The parts of `extra` that the Python layer reads back and trusts.
    {"DcpExtraNotObject", [](json& b) { b["extra"]["dcp"] = json::array({1}); }, "extra.dcp"},
    {"PlannerDataDictAsKey",
     [](json& b) {
       b["extra"]["dcp"]["planner_data"] = {
           {"__dict__", json::array({json::array({{{"__dict__", json::array()}}, 1})})}};
     },
     "planner_data"},
    {"PlannerDataListAsKey",
     [](json& b) {
       b["extra"]["dcp"]["planner_data"] = {
           {"__dict__", json::array({json::array({json::array({1}), 1})})}};
     },
     "planner_data"},
    {"PlannerDataIntWhereAListBelongs",
     [](json& b) {
       b["extra"]["dcp"]["planner_data"] = {{"__dict__", 5}};
     },
     "planner_data"},
    {"PlannerDataUnknownTag",
     [](json& b) {
       b["extra"]["dcp"]["planner_data"] = {{"__set__", json::array()}};
     },
     "planner_data"},
    {"ModulesNotAList",
     [](json& b) {
       b["extra"]["dcp"]["storage_meta"] = {{"modules", 5}};
     },
     "modules"},
    {"VersionNotAString", [](json& b) { b["extra"]["dcp"]["version"] = 1; }, "version"},
    {"ManagerNotObject", [](json& b) { b["extra"]["manager"] = "x"; }, "extra.manager"},
    {"ManagerStepNegative",
     [](json& b) {
       b["extra"]["manager"] = {{"step", -1}, {"run_id", "r"}};
     },
     "step"},
    {"UserNotObject", [](json& b) { b["extra"]["user"] = json::array(); }, "extra.user"},
    {"HugeFileCount",
     [](json& b) {
       b["files"] = json::array();
       for (int i = 0; i < (1 << 20) + 1; ++i) b["files"].push_back(0);
     },
     "too many"},
};

INSTANTIATE_TEST_SUITE_P(Cases, HostileManifestTest, ::testing::ValuesIn(kHostile),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(ManifestTest, WellFormedPlannerDataAndManagerSectionsPass) {
  json body = SampleBody();
  body["extra"]["dcp"] = {
      {"version", "1.0.0"},
      {"planner_data",
       {{"__dict__",
         json::array({json::array({"a", {{"__tuple__", json::array({"a", 0})}}}),
                      json::array({{{"__tuple__", json::array({1, "x"})}}, json::array({1, 2})}),
                      json::array({nullptr, {{"__dict__", json::array()}}})})}}},
      {"storage_meta", {{"checkpoint_id", "/c"}, {"save_id", nullptr}, {"modules", {"m"}}}}};
  body["extra"]["manager"] = {{"step", 7}, {"run_id", "abc"}};
  body["extra"]["user"] = {{"anything", json::array({1, {{"goes", true}}})}};
  Status s = DecodeBody(body);
  EXPECT_TRUE(s.ok()) << s.ToString();
}

// Builds a tensor of `shape` from (offsets, sizes) boxes (locations unused).
ManifestTensor Boxes(std::vector<uint64_t> shape,
                     std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> boxes) {
  ManifestTensor t;
  t.fqn = "t";
  t.dtype = "uint8";
  t.shape = std::move(shape);
  for (auto& [o, z] : boxes) {
    uint64_t n = 1;
    for (uint64_t v : z) n *= v;
    t.chunks.push_back({o, z, {0, 0, n, {}}});
  }
  return t;
}

TEST(ChunkCoverageTest, ExactTilingsPass) {
  // Rows, columns, an irregular 2D layout, a 3D grid, a scalar, empty chunks.
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({6}, {{{4}, {2}}, {{0}, {4}}})).ok());
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({2, 6}, {{{0, 0}, {2, 3}}, {{0, 3}, {2, 3}}})).ok());
  // +---+-----+
  // | 0 |  1  |   row 0..2: [0,1) [1,4)
  // +---+-+---+   row 2..3: [0,2) [2,4)
  // |  2  | 3 |
  // +-----+---+
  EXPECT_TRUE(
      ValidateChunkCoverage(
          Boxes({3, 4}, {{{0, 0}, {2, 1}}, {{0, 1}, {2, 3}}, {{2, 0}, {1, 2}}, {{2, 2}, {1, 2}}}))
          .ok());
  std::vector<std::pair<std::vector<uint64_t>, std::vector<uint64_t>>> grid;
  for (uint64_t i = 0; i < 3; ++i) {
    for (uint64_t j = 0; j < 2; ++j) {
      for (uint64_t k = 0; k < 2; ++k) grid.push_back({{i, 2 * j, 3 * k}, {1, 2, 3}});
    }
  }
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({3, 4, 6}, grid)).ok());
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({}, {{{}, {}}})).ok());
  // Uneven sharding leaves some ranks an empty chunk (at the end, twice).
  EXPECT_TRUE(
      ValidateChunkCoverage(Boxes({2}, {{{0}, {1}}, {{1}, {1}}, {{2}, {0}}, {{2}, {0}}})).ok());
  // An empty tensor needs no chunk at all, or has empty ones.
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({0, 3}, {})).ok());
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({0, 4}, {{{0, 0}, {0, 2}}, {{0, 2}, {0, 2}}})).ok());
}

TEST(ChunkCoverageTest, GapsOverlapsAndRepeatsNameTheTensorAndAnElement) {
  auto fails_with = [](const ManifestTensor& t, const std::string& what) {
    Status s = ValidateChunkCoverage(t);
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what;
    EXPECT_NE(s.message().find("tensor 't'"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find(what), std::string::npos) << s.ToString();
  };
  fails_with(Boxes({6}, {{{0}, {2}}, {{3}, {3}}}), "5 of its 6");
  // Same volume, but one element twice and another never.
  fails_with(Boxes({2, 2}, {{{0, 0}, {1, 2}}, {{0, 1}, {1, 1}}, {{1, 1}, {1, 1}}}),
             "overlap at element [0, 1]");
  fails_with(
      Boxes({3, 4}, {{{0, 0}, {2, 1}}, {{0, 1}, {2, 3}}, {{2, 0}, {1, 2}}, {{1, 2}, {1, 2}}}),
      "overlap at element [1, 2]");
  fails_with(Boxes({4}, {{{0}, {2}}, {{0}, {2}}}), "both start at [0]");
  fails_with(Boxes({}, {{{}, {}}, {{}, {}}}), "both start at []");
  fails_with(Boxes({5, 5}, {}), "has no chunks");
  // Two empty chunks at one offset cover nothing twice: allowed.
  EXPECT_TRUE(ValidateChunkCoverage(Boxes({0, 4}, {{{0, 0}, {0, 2}}, {{0, 0}, {0, 2}}})).ok());
}

TEST(ChunkCoverageTest, ManyChunksAreCheckedQuicklyAndHostileLayoutsAreBounded) {
  // A million row chunks: a regular layout validates in well under a second
  // on an idle machine. The bounds below only catch a quadratic algorithm
  // (hours here), so they are generous enough for a loaded CI machine.
  const uint64_t n = 1 << 20;
  ManifestTensor rows = Boxes({n, 2}, {});
  rows.chunks.reserve(n);
  for (uint64_t i = n; i-- > 0;) rows.chunks.push_back({{i, 0}, {1, 2}, {0, 0, 2, {}}});
  auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(ValidateChunkCoverage(rows).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60));
  // A valid but quadratic tiling: thin rows on the left half, thin columns on
  // the right; every column chunk spans every row slab. Refused quickly.
  const uint64_t k = 1 << 15;
  ManifestTensor q = Boxes({k, 2 * k}, {});
  for (uint64_t i = 0; i < k; ++i) q.chunks.push_back({{i, 0}, {1, k}, {0, 0, k, {}}});
  for (uint64_t j = 0; j < k; ++j) q.chunks.push_back({{0, k + j}, {k, 1}, {0, 0, k, {}}});
  start = std::chrono::steady_clock::now();
  Status s = ValidateChunkCoverage(q);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_NE(s.message().find("too irregular"), std::string::npos) << s.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(120));
  // The same shape in a small version passes.
  ManifestTensor small = Boxes({8, 16}, {});
  for (uint64_t i = 0; i < 8; ++i) small.chunks.push_back({{i, 0}, {1, 8}, {0, 0, 8, {}}});
  for (uint64_t j = 0; j < 8; ++j) small.chunks.push_back({{0, 8 + j}, {8, 1}, {0, 0, 8, {}}});
  EXPECT_TRUE(ValidateChunkCoverage(small).ok());
}

TEST(ManifestTest, InvalidJsonIsDataLoss) {
  auto r = DecodeManifest(Envelope("{not json"));
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("not valid JSON"), std::string::npos);
}

TEST(ManifestTest, DeeplyNestedBodyIsRejectedWithoutRecursing) {
  std::string body = SampleBody().dump();
  std::string deep(1 << 20, '[');
  deep += std::string(1 << 20, ']');
  body.insert(body.size() - 1, ",\"deep\":" + deep);
  auto r = DecodeManifest(Envelope(body));
  EXPECT_EQ(r.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(r.status().message().find("nested deeper"), std::string::npos) << r.status().ToString();
  json ok = SampleBody();
  ok["extra"]["user"] = {{"a", {{"b", {1, 2, {3}}}}}};
  EXPECT_TRUE(DecodeBody(ok).ok());
}

TEST(ManifestTest, AbsurdBodyLengthIsDataLoss) {
  std::string bytes = *EncodeManifest(SampleManifest());
  for (int i = 0; i < 8; ++i) bytes[16 + i] = static_cast<char>(0xff);
  EXPECT_EQ(DecodeManifest(bytes).status().code(), StatusCode::kDataLoss);
}

TEST(ManifestTest, CallerBuiltBadManifestIsInvalidArgument) {
  json body = SampleBody();
  body["files"][0]["key"] = "../x";
  auto r = ManifestFromJson(body.dump(), /*from_storage=*/false);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  Manifest m = SampleManifest();
  m.tensors[0].dtype = "nope";
  EXPECT_EQ(EncodeManifest(m).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace cairn
