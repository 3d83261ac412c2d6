// Tests of the manifest encoding: round trip, damage detection, and hostile
// manifests (valid envelope, malicious body) that must be rejected cleanly.
#include "cairn/format.h"

#include <gtest/gtest.h>
#include <xxhash.h>

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
    {"FileLongerThanItems", [](json& b) { b["files"][0]["size"] = 4 * 4096 + 100; },
     "differs from the end"},
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
    {"HugeFileCount",
     [](json& b) {
       b["files"] = json::array();
       for (int i = 0; i < (1 << 20) + 1; ++i) b["files"].push_back(0);
     },
     "too many"},
};

INSTANTIATE_TEST_SUITE_P(Cases, HostileManifestTest, ::testing::ValuesIn(kHostile),
                         [](const auto& info) { return std::string(info.param.name); });

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
