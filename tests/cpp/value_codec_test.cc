// Tests of the native value encoding: round trips of every kind, and hostile
// encodings (bad JSON, bad tags, bad base64, deep nesting) refused as DataLoss.
#include "cairn/value_codec.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

namespace cairn {
namespace {

using Kind = StoredValue::Kind;

StoredValue Of(Kind kind) {
  StoredValue v;
  v.kind = kind;
  return v;
}
StoredValue Int(std::string digits) {
  StoredValue v = Of(Kind::kInt);
  v.text = std::move(digits);
  return v;
}
StoredValue Str(std::string s, Kind kind = Kind::kString) {
  StoredValue v = Of(kind);
  v.text = std::move(s);
  return v;
}
StoredValue Float(double d) {
  StoredValue v = Of(Kind::kFloat);
  v.number = d;
  return v;
}
StoredValue Seq(Kind kind, std::vector<StoredValue> items) {
  StoredValue v = Of(kind);
  v.items = std::move(items);
  return v;
}

std::string Body(std::string_view json) { return std::string(kValueMagic) + std::string(json); }

void ExpectSame(const StoredValue& a, const StoredValue& b) {
  ASSERT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.boolean, b.boolean);
  if (std::isnan(a.number)) {
    EXPECT_TRUE(std::isnan(b.number));
  } else {
    EXPECT_EQ(a.number, b.number);
  }
  EXPECT_EQ(a.text, b.text);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.shape, b.shape);
  ASSERT_EQ(a.items.size(), b.items.size());
  for (size_t i = 0; i < a.items.size(); ++i) ExpectSame(a.items[i], b.items[i]);
}

StoredValue RoundTrip(const StoredValue& v) {
  Result<std::string> data = EncodeValue(v);
  EXPECT_TRUE(data.ok()) << data.status().ToString();
  EXPECT_TRUE(IsEncodedValue(*data));
  Result<StoredValue> back = DecodeValue(*data);
  EXPECT_TRUE(back.ok()) << back.status().ToString();
  return back.ok() ? *back : StoredValue{};
}

TEST(ValueCodec, EveryKindRoundTrips) {
  StoredValue bytes = Str(std::string("\0\xff\x01", 3), Kind::kBytes);
  StoredValue array = Str(std::string(24, '\x07'), Kind::kArray);
  array.dtype = "<u4";
  array.shape = {2, 3};
  StoredValue scalar = Str(std::string(8, '\x01'), Kind::kScalar);
  scalar.dtype = "<f8";
  StoredValue t = Of(Kind::kBool);
  t.boolean = true;
  StoredValue v = Seq(
      Kind::kList,
      {Of(Kind::kNone), t, Int("-12"), Int("123456789012345678901234567890"), Float(1.5),
       Float(2.0), Float(-0.0), Float(1e300), Str("h\xc3\xa9\"\\\n"), bytes,
       Seq(Kind::kTuple, {Int("1"), Seq(Kind::kList, {})}),
       Seq(Kind::kDict, {Int("4"), Str("four"), Seq(Kind::kTuple, {Str("k")}), Of(Kind::kNone)}),
       array, scalar});
  ExpectSame(v, RoundTrip(v));
}

TEST(ValueCodec, FloatsStayFloatsAndNonFiniteAreTagged) {
  for (double d : {2.0, -3.0, 0.0, 1e16, 1e-7, 0.1}) {
    StoredValue back = RoundTrip(Float(d));
    EXPECT_EQ(back.kind, Kind::kFloat) << d;
    EXPECT_EQ(back.number, d);
  }
  EXPECT_EQ(*EncodeValue(Float(std::numeric_limits<double>::infinity())),
            Body(R"({"__float__":"inf"})"));
  EXPECT_EQ(RoundTrip(Float(-std::numeric_limits<double>::infinity())).number,
            -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(RoundTrip(Float(std::nan(""))).number));
}

TEST(ValueCodec, ReadsWhatPythonsJsonModuleWrote) {
  // json.dumps(..., separators=(",", ":")) of the RNG-dict shape, as the
  // Python encoder wrote it before the codec moved to C++.
  Result<StoredValue> v = DecodeValue(
      Body(R"({"__dict__":[["python",{"__tuple__":[3,[1,2],null]}],)"
           R"(["numpy",{"__ndarray__":{"dtype":"<u4","shape":[2],"data":"AQAAAAIAAAA="}}],)"
           R"(["big",340282366920938463463374607431768211456],["s","\u00e9"]]})"));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  ASSERT_EQ(v->kind, Kind::kDict);
  ASSERT_EQ(v->items.size(), 8u);
  EXPECT_EQ(v->items[1].kind, Kind::kTuple);
  EXPECT_EQ(v->items[3].kind, Kind::kArray);
  EXPECT_EQ(v->items[3].text, std::string("\1\0\0\0\2\0\0\0", 8));
  EXPECT_EQ(v->items[5].kind, Kind::kInt);
  EXPECT_EQ(v->items[5].text, "340282366920938463463374607431768211456");
  EXPECT_EQ(v->items[7].text, "\xc3\xa9");
}

TEST(ValueCodec, RefusesWhatItCannotEncode) {
  EXPECT_EQ(EncodeValue(Int("12a")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeValue(Str("\xff")).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(EncodeValue(Seq(Kind::kDict, {Int("1")})).status().code(),
            StatusCode::kInvalidArgument);
  StoredValue deep = Of(Kind::kNone);
  for (size_t i = 0; i < kMaxValueDepth; ++i) deep = Seq(Kind::kList, {std::move(deep)});
  EXPECT_TRUE(EncodeValue(deep).ok());
  deep = Seq(Kind::kList, {std::move(deep)});
  EXPECT_EQ(EncodeValue(deep).status().code(), StatusCode::kInvalidArgument);
}

TEST(ValueCodec, HostileEncodingsAreDataLoss) {
  for (std::string_view json : {
           R"({)",
           R"([1,2)",
           R"(1 2)",
           "\"\xff\"",
           R"({"__nope__":1})",
           R"({})",
           R"({"__tuple__":[1],"__dict__":[]})",
           R"({"__tuple__":1})",
           R"({"__dict__":[[1]]})",
           R"({"__dict__":[[[1],2]]})",
           R"({"__dict__":[[{"__tuple__":[[1]]},2]]})",
           R"({"__dict__":[[{"__ndarray__":{"dtype":"<u1","shape":[],"data":"AA=="}},2]]})",
           R"({"__float__":"big"})",
           R"({"__bytes__":"AAA"})",
           R"({"__bytes__":"A==="})",
           R"({"__bytes__":"AA=A"})",
           R"({"__bytes__":"A!AA"})",
           R"({"__ndarray__":{"dtype":"<u4","shape":[5]}})",
           R"({"__ndarray__":{"dtype":4,"shape":[5],"data":""}})",
           R"({"__ndarray__":{"dtype":"<u4","shape":[-1],"data":""}})",
           R"({"__ndarray__":{"dtype":"<u4","shape":[1.5],"data":""}})",
           R"({"__ndarray__":{"dtype":"<u4","shape":"12","data":""}})",
       }) {
    Result<StoredValue> v = DecodeValue(Body(json));
    EXPECT_EQ(v.status().code(), StatusCode::kDataLoss) << json;
  }
  EXPECT_EQ(DecodeValue("[1]").status().code(), StatusCode::kDataLoss);  // no magic
}

TEST(ValueCodec, DeepNestingIsRefusedBeforeItIsBuilt) {
  EXPECT_EQ(DecodeValue(Body(std::string(100000, '['))).status().code(), StatusCode::kDataLoss);
  std::string ok = std::string(kMaxValueDepth, '[') + std::string(kMaxValueDepth, ']');
  EXPECT_TRUE(DecodeValue(Body(ok)).ok());
  std::string deep = "[" + ok + "]";
  Result<StoredValue> v = DecodeValue(Body(deep));
  EXPECT_EQ(v.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(v.status().message().find("nested deeper"), std::string::npos) << v.status().ToString();
}

TEST(ValueCodec, RepeatedKeyKeepsTheLastValue) {
  // As Python's json module reads an object: one key, its last value.
  Result<StoredValue> v = DecodeValue(Body(R"({"__tuple__":[1],"__tuple__":[2,3]})"));
  ASSERT_TRUE(v.ok()) << v.status().ToString();
  EXPECT_EQ(v->kind, Kind::kTuple);
  EXPECT_EQ(v->items.size(), 2u);
}

TEST(DcpSection, RoundTripsBesideTheOtherExtraMembers) {
  DcpSection dcp;
  dcp.version = "2.0.0";
  dcp.planner_data = Seq(Kind::kDict, {Str("a.b"), Seq(Kind::kTuple, {Str("a"), Str("b")})});
  dcp.storage_meta = DcpSection::StorageMeta{"/ckpt", std::nullopt, {"m"}};
  Result<std::string> extra = ExtraWithDcpSection(R"({"user":{"k":1}})", dcp);
  ASSERT_TRUE(extra.ok()) << extra.status().ToString();
  EXPECT_NE(extra->find(R"("user":{"k":1})"), std::string::npos) << *extra;
  Result<DcpSection> back = ReadDcpSection(*extra);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->version, dcp.version);
  ExpectSame(back->planner_data, dcp.planner_data);
  ASSERT_TRUE(back->storage_meta.has_value());
  EXPECT_EQ(back->storage_meta->checkpoint_id, "/ckpt");
  EXPECT_FALSE(back->storage_meta->save_id.has_value());
  EXPECT_EQ(back->storage_meta->modules, std::vector<std::string>{"m"});
  // Absent: empty. Planner data that is not its encoding, or bytes in it: refused.
  EXPECT_FALSE(ReadDcpSection("{}")->version.has_value());
  EXPECT_EQ(ReadDcpSection(R"({"dcp":3})").status().code(), StatusCode::kDataLoss);
  EXPECT_EQ(ReadDcpSection(R"({"dcp":{"planner_data":{"__bytes__":""}}})").status().code(),
            StatusCode::kDataLoss);
  dcp.planner_data = Str("x", Kind::kBytes);
  EXPECT_EQ(ExtraWithDcpSection("{}", dcp).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ExtraWithDcpSection("[]", DcpSection{}).status().code(), StatusCode::kInvalidArgument);
}

TEST(Base64, MatchesTheStandardAlphabetAndPadding) {
  EXPECT_EQ(Base64Encode(""), "");
  EXPECT_EQ(Base64Encode("f"), "Zg==");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("\xfb\xff"), "+/8=");
  std::string out;
  for (std::string s : {"", "f", "fo", "foo", "foob", "fooba", "foobar", "\xfb\xff\xfe"}) {
    ASSERT_TRUE(Base64Decode(Base64Encode(s), &out)) << s;
    EXPECT_EQ(out, s);
  }
  EXPECT_FALSE(Base64Decode("Zg=", &out));
  EXPECT_FALSE(Base64Decode("Z===", &out));
  EXPECT_FALSE(Base64Decode("Zg=a", &out));
  EXPECT_FALSE(Base64Decode("Zm 9", &out));
}

}  // namespace
}  // namespace cairn
