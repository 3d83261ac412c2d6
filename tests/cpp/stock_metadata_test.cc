// The restricted reader of stock DCP `.metadata` pickles (DecodeStockMetadata):
// real metadata decodes to the same values, hostile or damaged bytes are
// refused as corruption, never crash, and never need more than they paid for.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "cairn/stock.h"
#include "stock_metadata_fixtures.h"

namespace cairn::stock {
namespace {

using testing::kDcpMetadataV2;
using testing::kDcpMetadataV4;

const std::string kSource = "/ck/.metadata";

// `pickle` without its FRAME opcode (frames are optional), so that splices
// may change its length.
std::string Unframed(const std::string& pickle) {
  EXPECT_EQ(pickle.substr(0, 3), std::string("\x80\x04\x95", 3));
  return pickle.substr(0, 2) + pickle.substr(11);
}

// `pickle` with the first `from` replaced by `to` (which must be present).
std::string Splice(std::string pickle, const std::string& from, const std::string& to) {
  size_t at = pickle.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  if (at != std::string::npos) pickle.replace(at, from.size(), to);
  return pickle;
}

std::string Str(const std::string& s) {  // SHORT_BINUNICODE
  return std::string("\x8c", 1) + static_cast<char>(s.size()) + s;
}

// The code and message of decoding `pickle`.
Status Decode(const std::string& pickle) { return DecodeStockMetadata(pickle, kSource).status(); }

void ExpectDataLoss(const std::string& pickle, const std::string& fragment) {
  Status s = Decode(pickle);
  EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
  EXPECT_NE(s.message().find(kSource), std::string::npos) << s.ToString();
  EXPECT_NE(s.message().find(fragment), std::string::npos) << s.ToString();
}

void ExpectTheSavedState(const StockMetadata& m) {
  ASSERT_EQ(m.state.size(), 4u);
  const StockItem& w = m.state[0];
  EXPECT_EQ(w.fqn, "w");
  EXPECT_FALSE(w.is_bytes);
  EXPECT_EQ(w.dtype, "float32");
  EXPECT_EQ(w.layout, "strided");
  EXPECT_EQ(w.memory_format, "contiguous_format");
  EXPECT_FALSE(w.requires_grad);
  EXPECT_EQ(w.size, std::vector<uint64_t>{10});
  ASSERT_EQ(w.chunks.size(), 1u);
  EXPECT_EQ(w.chunks[0].offsets, std::vector<uint64_t>{0});
  EXPECT_EQ(w.chunks[0].sizes, std::vector<uint64_t>{10});
  EXPECT_EQ(m.state[1].fqn, "b");
  EXPECT_EQ(m.state[1].dtype, "bfloat16");
  EXPECT_EQ(m.state[1].size, (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(m.state[2].fqn, "step");
  EXPECT_TRUE(m.state[2].is_bytes);
  EXPECT_EQ(m.state[3].fqn, "l.0");
  EXPECT_EQ(m.state[3].dtype, "int64");

  ASSERT_EQ(m.locations.size(), 4u);
  uint64_t end = 0;
  for (const StockLocation& loc : m.locations) {
    EXPECT_EQ(loc.relative_path, "__0_0.distcp");
    EXPECT_EQ(loc.offset, end);  // one data file, items back to back
    end = loc.offset + loc.length;
  }
  EXPECT_EQ(m.locations[0].fqn, "step");  // DCP writes non-tensor items first
  EXPECT_FALSE(m.locations[0].index_offset.has_value());
  EXPECT_EQ(m.locations[1].fqn, "w");
  EXPECT_EQ(m.locations[1].index_offset, std::vector<uint64_t>{0});
  EXPECT_EQ(m.locations[1].index, 0);

  ASSERT_TRUE(m.planner_data.has_value());
  ASSERT_EQ(m.planner_data->size(), 4u);
  EXPECT_EQ((*m.planner_data)[3].first, "l.0");
  EXPECT_EQ((*m.planner_data)[3].second,
            (std::vector<StockPathPart>{std::string("l"), int64_t{0}}));
  ASSERT_TRUE(m.storage_meta.has_value());
  EXPECT_EQ(m.storage_meta->checkpoint_id, "/ck");  // a pathlib.PosixPath
  EXPECT_EQ(m.storage_meta->save_id, "save-1");
  EXPECT_EQ(m.version, "1.0.0");
}

TEST(StockMetadataDecodeTest, DecodesTheMetadataOfARealDcpSave) {
  Result<StockMetadata> m = DecodeStockMetadata(kDcpMetadataV4, kSource);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ExpectTheSavedState(*m);
}

TEST(StockMetadataDecodeTest, DecodesProtocol2AsWell) {
  Result<StockMetadata> m = DecodeStockMetadata(kDcpMetadataV2, kSource);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ExpectTheSavedState(*m);
}

TEST(StockMetadataDecodeTest, ReadsTheFileThroughTheStorage) {
  auto st = NewMemStorage();
  {
    auto f = st->NewWritableFile(".metadata").value();
    ASSERT_TRUE(f->WriteAt(0, kDcpMetadataV4.data(), kDcpMetadataV4.size()).ok());
    ASSERT_TRUE(f->Close().ok());
  }
  Result<StockMetadata> m = ReadStockMetadata(st.get(), ".metadata");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->state.size(), 4u);
  EXPECT_EQ(ReadStockMetadata(st.get(), "__0.metadata").status().code(), StatusCode::kNotFound);
}

TEST(StockMetadataDecodeTest, EveryTruncationIsDataLoss) {
  for (size_t n = 0; n < kDcpMetadataV4.size(); ++n) {
    Status s = Decode(kDcpMetadataV4.substr(0, n));
    ASSERT_EQ(s.code(), StatusCode::kDataLoss) << n << ": " << s.ToString();
  }
}

TEST(StockMetadataDecodeTest, GlobalsOutsideTheAllowlistAreRefusedByName) {
  // posix.system via STACK_GLOBAL (protocol 4) and GLOBAL (protocol 2), and
  // builtins.eval, each called with a harmless-looking argument.
  ExpectDataLoss(
      std::string("\x80\x04", 2) + Str("posix") + Str("system") + "\x93" + Str("true") + "\x85R.",
      "refusing to unpickle 'posix.system'");
  ExpectDataLoss(std::string("\x80\x02", 2) + "cbuiltins\neval\n" + Str("1") + "\x85R.",
                 "refusing to unpickle 'builtins.eval'");
  // A real metadata class from another module is not one of the allowed.
  ExpectDataLoss(Splice(Unframed(kDcpMetadataV4), Str("Metadata"), Str("MetadataX")),
                 "refusing to unpickle 'torch.distributed.checkpoint.metadata.MetadataX'");
}

TEST(StockMetadataDecodeTest, OpcodesOutsideTheDataSubsetAreRefused) {
  for (const std::string& op : {std::string("i"), std::string("o"), std::string("\x82\x01", 2),
                                std::string("S'x'\n"), std::string("\x97")}) {
    ExpectDataLoss(std::string("\x80\x04", 2) + op + ".", "unsupported pickle opcode");
  }
  ExpectDataLoss(std::string("\x80\x04", 2) + Str("id") + "Q.", "persistent id");
  ExpectDataLoss(std::string("\x80\x06N.", 4), "unsupported pickle protocol 6");
}

TEST(StockMetadataDecodeTest, CallsOnlyWhatTheAllowlistMakesCallable) {
  const std::string size = Str("torch") + Str("Size") + "\x93";
  const std::string md = Str("torch.distributed.checkpoint.metadata") + Str("Metadata") + "\x93";
  ExpectDataLoss(std::string("\x80\x04", 2) + md + Str("x") + "\x85R.",
                 "unexpected constructor arguments");
  ExpectDataLoss(std::string("\x80\x04", 2) + size + ")\x81.", "isn't a type object");
  ExpectDataLoss(std::string("\x80\x04", 2) + Str("torch") + Str("float32") + "\x93)R.",
                 "not callable");
  ExpectDataLoss(std::string("\x80\x04", 2) + size + "J\xff\xff\xff\xff\x85\x85R.",
                 "malformed torch.Size");
  ExpectDataLoss(std::string("\x80\x04", 2) + "}N}b.", "BUILD on a value");
}

TEST(StockMetadataDecodeTest, DeepNestingIsRefused) {
  ExpectDataLoss(std::string("\x80\x04N", 3) + std::string(200, '\x85') + ".",
                 "nested deeper than 100");
  ExpectDataLoss("\x80\x04" + std::string(200, ']') + std::string(199, 'a') + ".",
                 "nested deeper than 100");
  // A list that holds itself is not deep (and decodes: it is no Metadata).
  ExpectDataLoss(std::string("\x80\x04]\x94h\x00\x61.", 8), "the root object is not a Metadata");
}

TEST(StockMetadataDecodeTest, HugeLengthsAreTruncationNotAllocation) {
  ExpectDataLoss(std::string("\x80\x04X\xff\xff\xff\xff", 7), "truncated");
  ExpectDataLoss(std::string("\x80\x04\x8d\xff\xff\xff\xff\xff\xff\xff\x7f", 11), "truncated");
  ExpectDataLoss(std::string("\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff", 11), "truncated");
  ExpectDataLoss(std::string("\x80\x04\x8b\xff\xff\xff\xff", 7), "64 bits");
  // A memo index far out is just a key, not an array size.
  ExpectDataLoss(std::string("\x80\x04N\x72\xff\xff\xff\xff.", 9), "not a Metadata");
  ExpectDataLoss(std::string("\x80\x04j\xff\xff\xff\xff.", 8), "memo value not found");
}

TEST(StockMetadataDecodeTest, NegativeSizesAndOffsetsAreRefused) {
  const std::string v4 = Unframed(kDcpMetadataV4);
  // 'w' has size torch.Size((10,)): BININT1 10, TUPLE1, TUPLE1, REDUCE.
  ExpectDataLoss(Splice(v4, "K\x0a\x85\x94\x85\x94R", "J\xff\xff\xff\xff\x85\x94\x85\x94R"),
                 "malformed torch.Size");
  ExpectDataLoss(Splice(v4, Str("offset") + std::string("\x94K\x00", 3),
                        Str("offset") + "\x94J\xff\xff\xff\xff"),
                 "bad offset/length -1/");
}

TEST(StockMetadataDecodeTest, DataFileNamesOutsideTheDirectoryAreRefused) {
  const std::string v4 = Unframed(kDcpMetadataV4);
  const std::vector<std::string> names = {
      "../_0.distcp", "/etc/passwd", "a/b.distcp", "..", "", std::string("a\0b", 3), "a\\b"};
  for (const std::string& name : names) {
    ExpectDataLoss(Splice(v4, Str("__0_0.distcp"), Str(name)), "is not a plain file name");
  }
}

TEST(StockMetadataDecodeTest, AChunkOutsideItsTensorOrAMissingLocationIsRefused) {
  const std::string v4 = Unframed(kDcpMetadataV4);
  // The chunk of 'w' claims 11 of its 10 elements.
  ExpectDataLoss(Splice(v4, Str("sizes") + "\x94h!K\x0a", Str("sizes") + "\x94h!K\x0b"),
                 "'w'.chunks[0] lies outside the tensor");
  // The storage_data key of 'w' (BINGET 106 'fqn', BINGET 7 'w') names another.
  ExpectDataLoss(Splice(v4, "h\x6ah\x07", "h\x6a" + Str("v")),
                 "no data location for 'w' at torch.Size([0])");
}

// A Metadata with empty state and storage and the planner_data pairs
// (key, 1-tuple of a str) in pickle order, duplicates included.
std::string MetadataWithPlannerData(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::string p = std::string("\x80\x04", 2) + Str("torch.distributed.checkpoint.metadata") +
                  Str("Metadata") + "\x93)\x81}(" + Str("state_dict_metadata") + "}" +
                  Str("storage_data") + "}" + Str("planner_data") + "}(";
  for (const auto& [k, v] : kv) p += Str(k) + Str(v) + "\x85";
  return p + "uub.";
}

TEST(StockMetadataDecodeTest, ARepeatedDictKeyKeepsItsPlaceAndTakesTheLastValue) {
  for (size_t n : {3, 40}) {  // a scanned dict and an indexed one
    std::vector<std::pair<std::string, std::string>> kv;
    for (size_t i = 0; i < n; ++i) kv.emplace_back("k" + std::to_string(i), "a");
    kv.emplace_back("k1", "z");
    Result<StockMetadata> m = DecodeStockMetadata(MetadataWithPlannerData(kv), kSource);
    ASSERT_TRUE(m.ok()) << m.status().ToString();
    ASSERT_EQ(m->planner_data->size(), n);
    EXPECT_EQ((*m->planner_data)[1].first, "k1");
    EXPECT_EQ((*m->planner_data)[1].second, std::vector<StockPathPart>{std::string("z")});
    EXPECT_EQ((*m->planner_data)[2].second, std::vector<StockPathPart>{std::string("a")});
  }
}

TEST(StockMetadataDecodeTest, AnUnsupportedVersionIsInvalidArgument) {
  Status s = Decode(Splice(kDcpMetadataV4, Str("1.0.0"), Str("2.0.0")));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("unsupported DCP metadata version '2.0.0'"), std::string::npos);
}

TEST(StockMetadataDecodeTest, RandomDamageDecodesOrFailsCleanly) {
  std::mt19937 rng(1234);
  int corrupt = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::string damaged = kDcpMetadataV4;
    for (int k = std::uniform_int_distribution<int>(1, 4)(rng); k > 0; --k) {
      damaged[rng() % damaged.size()] ^= static_cast<char>(1 << (rng() % 8));
    }
    Status s = Decode(damaged);
    ASSERT_TRUE(s.ok() || s.code() == StatusCode::kDataLoss ||
                s.code() == StatusCode::kInvalidArgument)
        << s.ToString();
    corrupt += s.code() == StatusCode::kDataLoss;
  }
  EXPECT_GT(corrupt, 500);
}

TEST(StockMetadataDecodeTest, PyReprQuotesLikePython) {
  EXPECT_EQ(PyRepr("w"), "'w'");
  EXPECT_EQ(PyRepr("it's"), "\"it's\"");
  EXPECT_EQ(PyRepr("a'b\"c"), "'a\\'b\"c'");
  EXPECT_EQ(PyRepr("a\nb\\\x01"), "'a\\nb\\\\\\x01'");
  EXPECT_EQ(PyRepr("\xc3\xa9"), "'\xc3\xa9'");  // printable non-ASCII stays
}

}  // namespace
}  // namespace cairn::stock
