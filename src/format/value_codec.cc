// The native value encoding (include/cairn/value_codec.h).
//
// Decoding parses with nlohmann's SAX interface into a small JSON tree of our
// own, for two reasons: the parser's nesting is bounded before any recursion
// (a hostile "[[[[..." is refused at kMaxValueDepth, never overflows a
// stack), and an integer too large for 64 bits arrives with its text, so it
// decodes exactly, as Python's json module would read it. The tree is then
// interpreted (tags, base64, array bodies) into a StoredValue.
#include "cairn/value_codec.h"

#include <array>
#include <charconv>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>
#include <utility>

namespace cairn {
namespace {

using Kind = StoredValue::Kind;

constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

// The value of each base64 character, -1 for others.
constexpr std::array<int8_t, 256> DecodeTable() {
  std::array<int8_t, 256> t{};
  for (auto& v : t) v = -1;
  for (int i = 0; i < 64; ++i) t[static_cast<unsigned char>(kAlphabet[i])] = static_cast<int8_t>(i);
  return t;
}
constexpr std::array<int8_t, 256> kDecode = DecodeTable();

bool IsDecimalInt(std::string_view s) {
  if (!s.empty() && s.front() == '-') s.remove_prefix(1);
  if (s.empty() || (s.size() > 1 && s.front() == '0')) return false;
  return s.find_first_not_of("0123456789") == std::string_view::npos;
}

// ---- encoding ------------------------------------------------------------

Status BadValue(const std::string& what) {
  return InvalidArgumentError("cannot encode value: " + what);
}

void AppendString(std::string* out, std::string_view s) {
  // nlohmann escapes (ensure_ascii, as Python's json.dumps) and checks UTF-8.
  *out +=
      nlohmann::json(std::string(s)).dump(-1, ' ', true, nlohmann::json::error_handler_t::strict);
}

void AppendFloat(std::string* out, double d) {
  char buf[64];
  auto [end, ec] = std::to_chars(buf, buf + sizeof(buf), d);  // shortest round trip
  std::string_view text(buf, static_cast<size_t>(end - buf));
  *out += text;
  // "2" would read back as an int.
  if (text.find_first_of(".e") == std::string_view::npos) *out += ".0";
}

Status Emit(const StoredValue& v, size_t depth, std::string* out);

Status EmitItems(const std::vector<StoredValue>& items, size_t depth, std::string* out) {
  if (depth > kMaxValueDepth)
    return BadValue("nested deeper than " + std::to_string(kMaxValueDepth));
  *out += '[';
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) *out += ',';
    CAIRN_RETURN_IF_ERROR(Emit(items[i], depth, out));
  }
  *out += ']';
  return Status::OK();
}

// {"<tag>": — the caller closes the brace.
Status OpenTag(std::string_view tag, size_t depth, std::string* out) {
  if (depth > kMaxValueDepth)
    return BadValue("nested deeper than " + std::to_string(kMaxValueDepth));
  *out += "{\"";
  *out += tag;
  *out += "\":";
  return Status::OK();
}

Status Emit(const StoredValue& v, size_t depth, std::string* out) {
  switch (v.kind) {
    case Kind::kNone:
      *out += "null";
      return Status::OK();
    case Kind::kBool:
      *out += v.boolean ? "true" : "false";
      return Status::OK();
    case Kind::kInt:
      if (!IsDecimalInt(v.text)) return BadValue("int '" + v.text + "' is not decimal");
      *out += v.text;
      return Status::OK();
    case Kind::kFloat:
      if (std::isfinite(v.number)) {
        AppendFloat(out, v.number);
        return Status::OK();
      }
      CAIRN_RETURN_IF_ERROR(OpenTag("__float__", depth + 1, out));
      *out += std::isnan(v.number) ? "\"nan\"}" : v.number > 0 ? "\"inf\"}" : "\"-inf\"}";
      return Status::OK();
    case Kind::kString:
      try {
        AppendString(out, v.text);
      } catch (const nlohmann::json::exception&) {
        return BadValue("a string that is not UTF-8");
      }
      return Status::OK();
    case Kind::kBytes:
      CAIRN_RETURN_IF_ERROR(OpenTag("__bytes__", depth + 1, out));
      *out += '"' + Base64Encode(v.text) + "\"}";
      return Status::OK();
    case Kind::kList:
      return EmitItems(v.items, depth + 1, out);
    case Kind::kTuple:
      CAIRN_RETURN_IF_ERROR(OpenTag("__tuple__", depth + 1, out));
      CAIRN_RETURN_IF_ERROR(EmitItems(v.items, depth + 2, out));
      *out += '}';
      return Status::OK();
    case Kind::kDict: {
      if (v.items.size() % 2) return BadValue("a dict with an odd number of items");
      CAIRN_RETURN_IF_ERROR(OpenTag("__dict__", depth + 1, out));
      if (depth + 3 > kMaxValueDepth) return BadValue("nested too deeply");
      *out += '[';
      for (size_t i = 0; i < v.items.size(); i += 2) {
        if (i) *out += ',';
        *out += '[';
        CAIRN_RETURN_IF_ERROR(Emit(v.items[i], depth + 3, out));
        *out += ',';
        CAIRN_RETURN_IF_ERROR(Emit(v.items[i + 1], depth + 3, out));
        *out += ']';
      }
      *out += "]}";
      return Status::OK();
    }
    case Kind::kArray:
    case Kind::kScalar: {
      CAIRN_RETURN_IF_ERROR(
          OpenTag(v.kind == Kind::kArray ? "__ndarray__" : "__npscalar__", depth + 1, out));
      if (depth + 3 > kMaxValueDepth) return BadValue("nested too deeply");
      *out += "{\"dtype\":";
      try {
        AppendString(out, v.dtype);
      } catch (const nlohmann::json::exception&) {
        return BadValue("a dtype name that is not UTF-8");
      }
      *out += ",\"shape\":[";
      for (size_t i = 0; i < v.shape.size(); ++i) {
        if (i) *out += ',';
        *out += std::to_string(v.shape[i]);
      }
      *out += "],\"data\":\"" + Base64Encode(v.text) + "\"}}";
      return Status::OK();
    }
  }
  return BadValue("unknown kind");
}

// ---- decoding: JSON text -> JsonNode -------------------------------------

struct JsonNode {
  enum class Type : uint8_t { kNull, kBool, kInt, kFloat, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  std::string text;  // kInt: decimal digits; kString
  std::vector<JsonNode> elements;
  std::vector<std::pair<std::string, JsonNode>> members;  // in order, duplicates kept
};

// Builds a JsonNode tree. Open containers are a stack of pointers: a child is
// the last element of its parent, and the parent's vector only grows after
// the child is closed, so the pointers stay valid.
class TreeBuilder : public nlohmann::json_sax<nlohmann::json> {
 public:
  JsonNode root;
  std::string error;

  bool null() override { return Add(JsonNode{}); }
  bool boolean(bool b) override {
    JsonNode n;
    n.type = JsonNode::Type::kBool;
    n.boolean = b;
    return Add(std::move(n));
  }
  bool number_integer(number_integer_t v) override { return AddInt(std::to_string(v)); }
  bool number_unsigned(number_unsigned_t v) override { return AddInt(std::to_string(v)); }
  bool number_float(number_float_t v, const string_t& raw) override {
    // An integer beyond 64 bits: keep its digits (Python reads it exactly).
    if (IsDecimalInt(raw)) return AddInt(raw);
    JsonNode n;
    n.type = JsonNode::Type::kFloat;
    n.number = v;
    return Add(std::move(n));
  }
  bool string(string_t& s) override {
    JsonNode n;
    n.type = JsonNode::Type::kString;
    n.text = std::move(s);
    return Add(std::move(n));
  }
  bool binary(binary_t&) override { return Fail("binary data"); }
  bool start_object(std::size_t) override { return Open(JsonNode::Type::kObject); }
  bool key(string_t& k) override {
    pending_key_ = std::move(k);
    return true;
  }
  bool end_object() override { return Close(); }
  bool start_array(std::size_t) override { return Open(JsonNode::Type::kArray); }
  bool end_array() override { return Close(); }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    return Fail(e.what());
  }

 private:
  bool Fail(std::string what) {
    if (error.empty()) error = std::move(what);
    return false;
  }
  bool AddInt(std::string digits) {
    JsonNode n;
    n.type = JsonNode::Type::kInt;
    n.text = std::move(digits);
    return Add(std::move(n));
  }
  // Places `n` in the open container (or as the root); returns it.
  JsonNode* Place(JsonNode&& n) {
    if (open_.empty()) {
      root = std::move(n);
      return &root;
    }
    JsonNode* parent = open_.back();
    if (parent->type == JsonNode::Type::kArray) {
      parent->elements.push_back(std::move(n));
      return &parent->elements.back();
    }
    parent->members.emplace_back(std::move(pending_key_), std::move(n));
    return &parent->members.back().second;
  }
  bool Add(JsonNode&& n) {
    Place(std::move(n));
    return true;
  }
  bool Open(JsonNode::Type type) {
    if (open_.size() >= kMaxValueDepth) {
      return Fail("nested deeper than " + std::to_string(kMaxValueDepth));
    }
    JsonNode n;
    n.type = type;
    open_.push_back(Place(std::move(n)));
    return true;
  }
  bool Close() {
    open_.pop_back();
    return true;
  }

  std::vector<JsonNode*> open_;
  std::string pending_key_;
};

// ---- decoding: JsonNode -> StoredValue -----------------------------------

Status Malformed(const std::string& what) { return DataLossError("malformed stored " + what); }

// The last value of `key` in object `n` (JSON objects decode as Python dicts:
// a repeated key keeps its last value), or null.
const JsonNode* Member(const JsonNode& n, std::string_view key) {
  const JsonNode* found = nullptr;
  for (const auto& [k, v] : n.members) {
    if (k == key) found = &v;
  }
  return found;
}

// Whether ok(x) holds for `v` and every value nested in it.
template <typename Ok>
bool Everywhere(const StoredValue& v, const Ok& ok) {
  if (!ok(v)) return false;
  for (const StoredValue& x : v.items) {
    if (!Everywhere(x, ok)) return false;
  }
  return true;
}

// Python's hashability of the decoded value: no list, dict or array in it.
bool Hashable(const StoredValue& v) {
  return Everywhere(v, [](const StoredValue& x) {
    return x.kind != Kind::kList && x.kind != Kind::kDict && x.kind != Kind::kArray;
  });
}

Result<StoredValue> Interpret(const JsonNode& n);

Result<StoredValue> ArrayBody(Kind kind, const JsonNode& body) {
  StoredValue v;
  v.kind = kind;
  const JsonNode* dtype = Member(body, "dtype");
  const JsonNode* shape = Member(body, "shape");
  const JsonNode* data = Member(body, "data");
  if (dtype == nullptr || shape == nullptr || data == nullptr) {
    return Malformed("array (dtype, shape and data are needed)");
  }
  if (dtype->type != JsonNode::Type::kString || shape->type != JsonNode::Type::kArray ||
      data->type != JsonNode::Type::kString) {
    return Malformed("array (a field has the wrong type)");
  }
  v.dtype = dtype->text;
  for (const JsonNode& d : shape->elements) {
    uint64_t n = 0;
    const std::string& t = d.text;
    auto [end, ec] = std::from_chars(t.data(), t.data() + t.size(), n);
    if (d.type != JsonNode::Type::kInt || ec != std::errc() || end != t.data() + t.size()) {
      return Malformed("array (its shape is not non-negative integers)");
    }
    v.shape.push_back(n);
  }
  if (!Base64Decode(data->text, &v.text)) return Malformed("array (its data is not base64)");
  return v;
}

Result<StoredValue> Tagged(const JsonNode& n) {
  if (n.members.empty()) return Malformed("value");
  const std::string& tag = n.members.front().first;
  for (const auto& m : n.members) {
    if (m.first != tag) return Malformed("value");  // not exactly one tag
  }
  const JsonNode& body = *Member(n, tag);
  StoredValue v;
  if (tag == "__tuple__" && body.type == JsonNode::Type::kArray) {
    v.kind = Kind::kTuple;
    for (const JsonNode& e : body.elements) {
      CAIRN_ASSIGN_OR_RETURN(StoredValue x, Interpret(e));
      v.items.push_back(std::move(x));
    }
    return v;
  }
  if (tag == "__dict__" && body.type == JsonNode::Type::kArray) {
    v.kind = Kind::kDict;
    for (const JsonNode& pair : body.elements) {
      if (pair.type != JsonNode::Type::kArray || pair.elements.size() != 2) {
        return Malformed("dict");
      }
      CAIRN_ASSIGN_OR_RETURN(StoredValue key, Interpret(pair.elements[0]));
      if (!Hashable(key)) return DataLossError("unhashable key in a stored dict");
      CAIRN_ASSIGN_OR_RETURN(StoredValue value, Interpret(pair.elements[1]));
      v.items.push_back(std::move(key));
      v.items.push_back(std::move(value));
    }
    return v;
  }
  if (tag == "__float__" && body.type == JsonNode::Type::kString) {
    v.kind = Kind::kFloat;
    if (body.text == "nan") {
      v.number = std::numeric_limits<double>::quiet_NaN();
      return v;
    }
    if (body.text == "inf" || body.text == "-inf") {
      v.number = std::numeric_limits<double>::infinity() * (body.text == "inf" ? 1 : -1);
      return v;
    }
  }
  if (tag == "__bytes__" && body.type == JsonNode::Type::kString) {
    v.kind = Kind::kBytes;
    if (!Base64Decode(body.text, &v.text)) return Malformed("bytes (not base64)");
    return v;
  }
  if ((tag == "__ndarray__" || tag == "__npscalar__") && body.type == JsonNode::Type::kObject) {
    return ArrayBody(tag == "__ndarray__" ? Kind::kArray : Kind::kScalar, body);
  }
  return Malformed("value");
}

Result<StoredValue> Interpret(const JsonNode& n) {
  using T = JsonNode::Type;
  StoredValue v;
  switch (n.type) {
    case T::kNull:
      return v;
    case T::kArray:
      v.kind = Kind::kList;
      for (const JsonNode& e : n.elements) {
        CAIRN_ASSIGN_OR_RETURN(StoredValue x, Interpret(e));
        v.items.push_back(std::move(x));
      }
      return v;
    case T::kObject:
      return Tagged(n);
    default:  // a scalar: the parser set only the field of its type
      v.kind = n.type == T::kBool    ? Kind::kBool
               : n.type == T::kInt   ? Kind::kInt
               : n.type == T::kFloat ? Kind::kFloat
                                     : Kind::kString;
      v.boolean = n.boolean;
      v.number = n.number;
      v.text = n.text;
      return v;
  }
}

// Whether `v` is made of the planner-data kinds only.
bool PlannerKinds(const StoredValue& v) {
  return Everywhere(v, [](const StoredValue& x) {
    return x.kind != Kind::kBytes && x.kind != Kind::kArray && x.kind != Kind::kScalar &&
           (x.kind != Kind::kFloat || std::isfinite(x.number));
  });
}

// Parses `json` (no magic) into a StoredValue.
Result<StoredValue> Parse(std::string_view json) {
  TreeBuilder tree;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(json, &tree);
  } catch (const nlohmann::json::exception& e) {
    tree.error = e.what();
  }
  if (!ok) return Malformed("value (" + (tree.error.empty() ? "not JSON" : tree.error) + ")");
  return Interpret(tree.root);
}

}  // namespace

Result<std::string> EncodePlannerData(const StoredValue& v) {
  if (!PlannerKinds(v)) {
    return InvalidArgumentError(
        "planner data holds bytes, arrays or non-finite floats (only dicts, lists, tuples "
        "and scalars)");
  }
  std::string out;
  CAIRN_RETURN_IF_ERROR(Emit(v, 0, &out));
  return out;
}

Result<StoredValue> DecodePlannerData(std::string_view json) {
  CAIRN_ASSIGN_OR_RETURN(StoredValue v, Parse(json));
  if (!PlannerKinds(v)) return DataLossError("malformed planner data (a tag it never holds)");
  return v;
}

bool IsEncodedValue(std::string_view data) { return data.starts_with(kValueMagic); }

Result<std::string> EncodeValue(const StoredValue& v) {
  std::string out(kValueMagic);
  CAIRN_RETURN_IF_ERROR(Emit(v, 0, &out));
  return out;
}

Result<StoredValue> DecodeValue(std::string_view data) {
  if (!IsEncodedValue(data)) return Malformed("value (no value magic)");
  data.remove_prefix(kValueMagic.size());
  return Parse(data);
}

std::string Base64Encode(std::string_view bytes) {
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  auto at = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(bytes[k])); };
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t w = at(i) << 16 | at(i + 1) << 8 | at(i + 2);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(w >> s) & 63];
  }
  if (size_t rest = bytes.size() - i; rest) {
    uint32_t w = at(i) << 16 | (rest == 2 ? at(i + 1) << 8 : 0);
    out += kAlphabet[(w >> 18) & 63];
    out += kAlphabet[(w >> 12) & 63];
    out += rest == 2 ? kAlphabet[(w >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

bool Base64Decode(std::string_view text, std::string* out) {
  out->clear();
  if (text.size() % 4) return false;
  size_t pad = 0;
  while (pad < 2 && pad < text.size() && text[text.size() - 1 - pad] == '=') ++pad;
  std::string_view body = text.substr(0, text.size() - pad);
  out->reserve(body.size() / 4 * 3 + 2);
  uint32_t w = 0;
  int bits = 0;
  for (char c : body) {
    int8_t d = kDecode[static_cast<unsigned char>(c)];
    if (d < 0) return false;  // '=' inside, or outside the alphabet
    w = (w << 6) | static_cast<uint32_t>(d);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((w >> bits) & 0xff));
    }
  }
  // Bits left over that do not make a byte are ignored, as Python's decoder does.
  return true;
}

}  // namespace cairn
