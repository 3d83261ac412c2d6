// Manifest encoding and validation. The byte layout is in format.h and
// docs/format.md; this file is the only code that reads or writes it.
//
// Validation is written for a hostile input: every integer is range-checked
// before it is used in arithmetic, every product is checked for overflow, and
// every key goes through ValidateKey, so that nothing a manifest says can make
// a reader touch memory or files outside what it owns.
#include "cairn/manifest.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "cairn/storage.h"
#include "io/xxh3.h"

namespace cairn {
namespace format {

size_t DtypeItemSize(std::string_view dtype) {
  struct Entry {
    std::string_view name;
    size_t size;
  };
  static constexpr Entry kDtypes[] = {
      {"float64", 8},
      {"float32", 4},
      {"float16", 2},
      {"bfloat16", 2},
      {"complex128", 16},
      {"complex64", 8},
      {"complex32", 4},
      {"int64", 8},
      {"int32", 4},
      {"int16", 2},
      {"int8", 1},
      {"uint64", 8},
      {"uint32", 4},
      {"uint16", 2},
      {"uint8", 1},
      {"bool", 1},
      {"float8_e4m3fn", 1},
      {"float8_e5m2", 1},
      {"float8_e4m3fnuz", 1},
      {"float8_e5m2fnuz", 1},
      {"float8_e8m0fnu", 1},
  };
  for (const auto& e : kDtypes) {
    if (e.name == dtype) return e.size;
  }
  return 0;
}

std::string DataFileKey(uint64_t rank) {
  return std::string(kDataDir) + "/r" + std::to_string(rank) + ".bin";
}

DataFileLayout LayOutDataFile(std::span<const uint64_t> lengths) {
  DataFileLayout l;
  l.offsets.resize(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] == 0) continue;
    l.offsets[i] = AlignItemOffset(l.end);
    l.end = l.offsets[i] + lengths[i];
  }
  return l;
}

}  // namespace format

namespace {

using nlohmann::json;

// Deepest nesting accepted in a manifest body (the schema itself needs 5;
// the rest is for the free-form "extra" section).
constexpr int kMaxJsonDepth = 64;

// a * b, or false on overflow.
bool MulOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool AddOk(uint64_t a, uint64_t b, uint64_t* out) { return !__builtin_add_overflow(a, b, out); }

Status Invalid(const std::string& what) { return DataLossError("invalid manifest: " + what); }

std::string Hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

bool ParseHex64(const std::string& s, uint64_t* out) {
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else {
      return false;
    }
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

void PutU32(std::string* s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string* s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint32_t GetU32(const char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

// Checks one item location against the files and the block size. `what`
// names the item in the error ("tensor 'w' chunk 2").
Status ValidateLocation(const Manifest& m, const ItemLocation& loc, const std::string& what) {
  if (loc.file >= m.files.size()) {
    return Invalid(what + ": file index " + std::to_string(loc.file) + " out of range");
  }
  const ManifestFile& f = m.files[loc.file];
  uint64_t end;
  if (!AddOk(loc.offset, loc.length, &end) || end > f.size) {
    return Invalid(what + ": bytes [" + std::to_string(loc.offset) + ", +" +
                   std::to_string(loc.length) + ") lie outside " + f.key + " (" +
                   std::to_string(f.size) + " bytes)");
  }
  if (loc.offset % format::kItemAlignment != 0) {
    return Invalid(what + ": offset " + std::to_string(loc.offset) + " is not " +
                   std::to_string(format::kItemAlignment) + "-byte aligned");
  }
  uint64_t blocks = loc.length / m.block_size + (loc.length % m.block_size != 0);
  if (loc.checksums.size() != blocks) {
    return Invalid(what + ": " + std::to_string(loc.checksums.size()) + " checksums for " +
                   std::to_string(blocks) + " blocks");
  }
  return Status::OK();
}

std::string ElementName(const std::vector<uint64_t>& coord) {
  std::string s = "[";
  for (size_t i = 0; i < coord.size(); ++i) s += (i ? ", " : "") + std::to_string(coord[i]);
  return s + "]";
}

// Proves that the non-empty chunks of a tensor tile its shape exactly once.
//
// A sweep, one dimension at a time: along dimension d the chunk boundaries
// cut the tensor into slabs; the chunks that span a slab must tile it in the
// remaining dimensions, which is checked recursively. At the last level every
// cell must be covered by exactly one chunk. A regular grid of n chunks costs
// O(n log n); each (chunk, slab) visit spends one step of a budget shared by
// the whole manifest, so a hostile layout cannot make validation quadratic.
class CoverageChecker {
 public:
  CoverageChecker(const ManifestTensor& t, uint64_t* budget)
      : t_(t), budget_(budget), coord_(t.shape.size(), 0) {}

  Status Run() {
    const std::string what = "tensor '" + t_.fqn + "'";
    uint64_t numel = 1;
    for (uint64_t d : t_.shape) numel *= d;  // validated: no overflow
    // No two chunks may start at the same offsets (DCP names a chunk by its
    // offsets), unless both are empty.
    std::vector<uint32_t> order(t_.chunks.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    CAIRN_RETURN_IF_ERROR(Spend(order.size() * (std::bit_width(order.size()) + 1)));
    std::sort(order.begin(), order.end(),
              [&](uint32_t a, uint32_t b) { return t_.chunks[a].offsets < t_.chunks[b].offsets; });
    for (size_t i = 1; i < order.size(); ++i) {
      const TensorChunk& a = t_.chunks[order[i - 1]];
      const TensorChunk& b = t_.chunks[order[i]];
      if (a.offsets == b.offsets && (a.location.length != 0 || b.location.length != 0)) {
        return Invalid(what + ": chunks " + std::to_string(std::min(order[i - 1], order[i])) +
                       " and " + std::to_string(std::max(order[i - 1], order[i])) +
                       " both start at " + ElementName(a.offsets));
      }
    }
    if (numel == 0) return Status::OK();  // nothing to cover
    if (t_.chunks.empty()) {
      return Invalid(what + ": has no chunks (its " + std::to_string(numel) +
                     " elements are not stored)");
    }
    // Cheap first: the chunks' volumes must add up to the element count.
    std::vector<uint32_t> boxes;
    uint64_t volume = 0;
    for (uint32_t i = 0; i < t_.chunks.size(); ++i) {
      uint64_t n = 1;
      for (uint64_t s : t_.chunks[i].sizes) n *= s;  // validated: <= numel
      if (n == 0) continue;
      boxes.push_back(i);
      if (!AddOk(volume, n, &volume) || volume > numel) break;
    }
    if (volume != numel) {
      std::string held =
          volume > numel ? "more than " + std::to_string(numel) : std::to_string(volume);
      return Invalid(what + ": its chunks hold " + held + " of its " + std::to_string(numel) +
                     " elements (chunks are missing, overlap or repeat)");
    }
    return Tile(0, boxes);
  }

 private:
  Status Spend(uint64_t n) {
    if (*budget_ < n + 1) {
      return Invalid("tensor '" + t_.fqn + "': chunk layout too irregular to validate (more than " +
                     std::to_string(format::kMaxCoverageSteps) + " steps)");
    }
    *budget_ -= n + 1;
    return Status::OK();
  }

  std::string What() const { return "tensor '" + t_.fqn + "'"; }
  uint64_t Start(uint32_t c, size_t d) const { return t_.chunks[c].offsets[d]; }
  uint64_t End(uint32_t c, size_t d) const {
    return t_.chunks[c].offsets[d] + t_.chunks[c].sizes[d];
  }

  // `boxes` all span the current slab (coord_[0..d) .. its end) in the
  // dimensions before d; they must tile dimensions d.. exactly once.
  Status Tile(size_t d, std::vector<uint32_t> boxes) {
    CAIRN_RETURN_IF_ERROR(Spend(boxes.size()));
    if (d == t_.shape.size()) {
      if (boxes.empty())
        return Invalid(What() + ": no chunk covers element " + ElementName(coord_));
      if (boxes.size() > 1) {
        return Invalid(What() + ": chunks " + std::to_string(std::min(boxes[0], boxes[1])) +
                       " and " + std::to_string(std::max(boxes[0], boxes[1])) +
                       " overlap at element " + ElementName(coord_));
      }
      return Status::OK();
    }
    // Sorting costs n log n steps.
    CAIRN_RETURN_IF_ERROR(Spend(boxes.size() * (std::bit_width(boxes.size()) + 1)));
    std::sort(boxes.begin(), boxes.end(),
              [&](uint32_t a, uint32_t b) { return Start(a, d) < Start(b, d); });
    std::vector<uint32_t> active;
    size_t next = 0;
    uint64_t pos = 0;
    const uint64_t extent = t_.shape[d];
    while (pos < extent) {
      while (next < boxes.size() && Start(boxes[next], d) == pos) active.push_back(boxes[next++]);
      coord_[d] = pos;
      std::fill(coord_.begin() + d + 1, coord_.end(), 0);
      if (active.empty())
        return Invalid(What() + ": no chunk covers element " + ElementName(coord_));
      uint64_t slab_end = next < boxes.size() ? Start(boxes[next], d) : extent;
      for (uint32_t c : active) slab_end = std::min(slab_end, End(c, d));
      CAIRN_RETURN_IF_ERROR(Tile(d + 1, active));
      pos = slab_end;
      CAIRN_RETURN_IF_ERROR(Spend(active.size()));
      active.erase(std::remove_if(active.begin(), active.end(),
                                  [&](uint32_t c) { return End(c, d) <= pos; }),
                   active.end());
    }
    return Status::OK();
  }

  const ManifestTensor& t_;
  uint64_t* budget_;
  std::vector<uint64_t> coord_;
};

Status ValidateCoverage(const ManifestTensor& t, uint64_t* budget) {
  return CoverageChecker(t, budget).Run();
}

Status ValidateTensor(const Manifest& m, const ManifestTensor& t, uint64_t* budget) {
  std::string what = "tensor '" + t.fqn + "'";
  if (t.fqn.empty()) return Invalid("a tensor has an empty name");
  size_t itemsize = format::DtypeItemSize(t.dtype);
  if (itemsize == 0) return Invalid(what + ": unknown dtype '" + t.dtype + "'");
  if (t.shape.size() > format::kMaxDims) return Invalid(what + ": too many dimensions");
  uint64_t numel = 1;
  for (uint64_t d : t.shape) {
    if (!MulOk(numel, d, &numel)) return Invalid(what + ": shape overflows");
  }
  uint64_t nbytes;
  if (!MulOk(numel, itemsize, &nbytes) || nbytes > (uint64_t{1} << 62)) {
    return Invalid(what + ": absurd size");
  }
  if (t.layout != "strided") return Invalid(what + ": unsupported layout '" + t.layout + "'");
  if (t.chunks.size() > format::kMaxItems) return Invalid(what + ": too many chunks");
  for (size_t c = 0; c < t.chunks.size(); ++c) {
    const TensorChunk& ch = t.chunks[c];
    std::string cw = what + " chunk " + std::to_string(c);
    if (ch.offsets.size() != t.shape.size() || ch.sizes.size() != t.shape.size()) {
      return Invalid(cw + ": rank differs from the tensor's");
    }
    uint64_t cn = 1;
    for (size_t d = 0; d < t.shape.size(); ++d) {
      uint64_t end;
      if (!AddOk(ch.offsets[d], ch.sizes[d], &end) || end > t.shape[d]) {
        return Invalid(cw + ": lies outside the tensor's shape in dimension " + std::to_string(d));
      }
      if (!MulOk(cn, ch.sizes[d], &cn)) return Invalid(cw + ": size overflows");
    }
    uint64_t cb;
    if (!MulOk(cn, itemsize, &cb) || cb != ch.location.length) {
      return Invalid(cw + ": length " + std::to_string(ch.location.length) +
                     " does not match its shape and dtype");
    }
    CAIRN_RETURN_IF_ERROR(ValidateLocation(m, ch.location, cw));
  }
  return ValidateCoverage(t, budget);
}

json LocationToJson(const ItemLocation& loc) {
  json sums = json::array();
  for (uint64_t c : loc.checksums) sums.push_back(Hex64(c));
  return json{{"file", loc.file},
              {"offset", loc.offset},
              {"length", loc.length},
              {"checksums", std::move(sums)}};
}

// Typed field access that reports the path of a bad field instead of
// throwing nlohmann's generic type_error.
class Reader {
 public:
  explicit Reader(bool from_storage) : from_storage_(from_storage) {}

  Status Bad(const std::string& path, const std::string& why) const {
    std::string m = "field '" + path + "': " + why;
    return from_storage_ ? Invalid(m) : InvalidArgumentError("invalid manifest: " + m);
  }

  Result<const json*> Field(const json& obj, const char* name, const std::string& path) const {
    if (!obj.is_object()) return Bad(path, "not an object");
    auto it = obj.find(name);
    if (it == obj.end()) return Bad(path + "." + name, "missing");
    return &*it;
  }

  Result<uint64_t> U64(const json& obj, const char* name, const std::string& path) const {
    CAIRN_ASSIGN_OR_RETURN(const json* v, Field(obj, name, path));
    if (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<int64_t>() >= 0)) {
      return Bad(path + "." + name, "not a non-negative integer");
    }
    return v->get<uint64_t>();
  }

  Result<std::string> Str(const json& obj, const char* name, const std::string& path) const {
    CAIRN_ASSIGN_OR_RETURN(const json* v, Field(obj, name, path));
    if (!v->is_string()) return Bad(path + "." + name, "not a string");
    return v->get<std::string>();
  }

  Result<bool> Bool(const json& obj, const char* name, const std::string& path, bool dflt) const {
    if (!obj.is_object()) return Bad(path, "not an object");
    auto it = obj.find(name);
    if (it == obj.end()) return dflt;
    if (!it->is_boolean()) return Bad(path + "." + name, "not a boolean");
    return it->get<bool>();
  }

  Result<const json*> Array(const json& obj, const char* name, const std::string& path,
                            uint64_t max) const {
    CAIRN_ASSIGN_OR_RETURN(const json* v, Field(obj, name, path));
    if (!v->is_array()) return Bad(path + "." + name, "not an array");
    if (v->size() > max) return Bad(path + "." + name, "too many entries");
    return v;
  }

  Result<std::vector<uint64_t>> U64Array(const json& obj, const char* name, const std::string& path,
                                         uint64_t max) const {
    CAIRN_ASSIGN_OR_RETURN(const json* a, Array(obj, name, path, max));
    std::vector<uint64_t> out;
    out.reserve(a->size());
    for (const json& v : *a) {
      if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0)) {
        return Bad(path + "." + name, "contains a value that is not a non-negative integer");
      }
      out.push_back(v.get<uint64_t>());
    }
    return out;
  }

  Result<ItemLocation> Location(const json& obj, const std::string& path) const {
    ItemLocation loc;
    CAIRN_ASSIGN_OR_RETURN(uint64_t file, U64(obj, "file", path));
    if (file > format::kMaxFiles) return Bad(path + ".file", "out of range");
    loc.file = static_cast<uint32_t>(file);
    CAIRN_ASSIGN_OR_RETURN(loc.offset, U64(obj, "offset", path));
    CAIRN_ASSIGN_OR_RETURN(loc.length, U64(obj, "length", path));
    CAIRN_ASSIGN_OR_RETURN(const json* sums, Array(obj, "checksums", path, format::kMaxItems));
    loc.checksums.reserve(sums->size());
    for (const json& s : *sums) {
      uint64_t v;
      if (!s.is_string() || !ParseHex64(s.get<std::string>(), &v)) {
        return Bad(path + ".checksums", "not a 16-digit lowercase hex string");
      }
      loc.checksums.push_back(v);
    }
    return loc;
  }

 private:
  bool from_storage_;
};

// Parses `text`, discarding values nested deeper than kMaxJsonDepth (and
// setting *too_deep): a hostile body must not drive recursive code (dump,
// destroy) into a stack overflow. Never throws; a parse error is discarded().
json ParseLimited(std::string_view text, bool* too_deep) {
  json::parser_callback_t limit_depth = [too_deep](int depth, json::parse_event_t, json&) {
    if (depth > kMaxJsonDepth) *too_deep = true;
    return depth <= kMaxJsonDepth;
  };
  return json::parse(text, limit_depth, /*allow_exceptions=*/false);
}

// Whether `v` is DCP planner data as python/cairn/dcp.py encodes it: scalars
// and lists are themselves, a tuple is {"__tuple__": [...]}, a dict is
// {"__dict__": [[key, value], ...]}. A dict key must decode to a hashable
// value (a scalar, or a tuple of hashables). Depth is bounded by the parse.
bool ValidPlannerValue(const json& v, bool hashable) {
  if (v.is_array()) {
    if (hashable) return false;
    for (const json& e : v) {
      if (!ValidPlannerValue(e, false)) return false;
    }
    return true;
  }
  if (v.is_object()) {
    if (v.size() != 1) return false;
    if (auto it = v.find("__tuple__"); it != v.end()) {
      if (!it->is_array()) return false;
      for (const json& e : *it) {
        if (!ValidPlannerValue(e, hashable)) return false;
      }
      return true;
    }
    if (auto it = v.find("__dict__"); it != v.end()) {
      if (hashable || !it->is_array()) return false;
      for (const json& pair : *it) {
        if (!pair.is_array() || pair.size() != 2 || !ValidPlannerValue(pair[0], true) ||
            !ValidPlannerValue(pair[1], false)) {
          return false;
        }
      }
      return true;
    }
    return false;
  }
  return true;  // null, boolean, number, string
}

bool NullOrString(const json& obj, const char* name) {
  auto it = obj.find(name);
  return it == obj.end() || it->is_null() || it->is_string();
}

// The sections of `extra` that cairn's Python layer reads back and trusts
// (docs/format.md, "extra"); anything else in `extra` stays opaque.
Status ValidateExtra(const json& extra) {
  if (auto it = extra.find("dcp"); it != extra.end() && !it->is_null()) {
    const json& d = *it;
    if (!d.is_object()) return Invalid("extra.dcp: not an object");
    if (!NullOrString(d, "version")) return Invalid("extra.dcp.version: not a string");
    if (auto pd = d.find("planner_data"); pd != d.end() && !ValidPlannerValue(*pd, false)) {
      return Invalid(
          "extra.dcp.planner_data: malformed (not the tagged encoding of dicts, "
          "lists, tuples and scalars, or a dict key that is not hashable)");
    }
    if (auto sm = d.find("storage_meta"); sm != d.end() && !sm->is_null()) {
      if (!sm->is_object()) return Invalid("extra.dcp.storage_meta: not an object");
      if (!NullOrString(*sm, "checkpoint_id") || !NullOrString(*sm, "save_id")) {
        return Invalid("extra.dcp.storage_meta: checkpoint_id and save_id must be strings");
      }
      if (auto mods = sm->find("modules"); mods != sm->end() && !mods->is_null()) {
        if (!mods->is_array()) return Invalid("extra.dcp.storage_meta.modules: not an array");
        for (const json& e : *mods) {
          if (!e.is_string()) return Invalid("extra.dcp.storage_meta.modules: not all strings");
        }
      }
    }
  }
  if (auto it = extra.find("user"); it != extra.end() && !it->is_object()) {
    return Invalid("extra.user: not an object");
  }
  if (auto it = extra.find("manager"); it != extra.end()) {
    if (!it->is_object()) return Invalid("extra.manager: not an object");
    if (auto step = it->find("step"); step != it->end() && !step->is_number_unsigned() &&
                                      !(step->is_number_integer() && step->get<int64_t>() >= 0)) {
      return Invalid("extra.manager.step: not a non-negative integer");
    }
    if (!NullOrString(*it, "run_id")) return Invalid("extra.manager.run_id: not a string");
  }
  return Status::OK();
}

}  // namespace

uint64_t Manifest::TotalBytes() const {
  uint64_t total = 0;
  for (const auto& f : files) total += f.size;
  return total;
}

Status ValidateManifest(const Manifest& m) {
  if (m.version != format::kFormatVersion) {
    return FailedPreconditionError("unsupported checkpoint format version " +
                                   std::to_string(m.version) + " (this build reads version " +
                                   std::to_string(format::kFormatVersion) +
                                   "; upgrade cairn to read it)");
  }
  if (m.world_size == 0 || m.world_size > format::kMaxWorldSize) {
    return Invalid("world_size " + std::to_string(m.world_size) + " out of range");
  }
  if (m.block_size < format::kMinBlockSize || m.block_size > format::kMaxBlockSize ||
      m.block_size % format::kItemAlignment != 0) {
    return Invalid("block_size " + std::to_string(m.block_size) + " out of range");
  }
  if (m.files.size() > format::kMaxFiles) return Invalid("too many files");
  if (m.tensors.size() > format::kMaxItems || m.bytes.size() > format::kMaxItems) {
    return Invalid("too many items");
  }
  std::set<std::string> keys;
  for (const auto& f : m.files) {
    Status s = ValidateKey(f.key);
    if (!s.ok()) return Invalid("file " + s.message());
    if (f.key == format::kManifestName || f.key == format::kManifestTempName) {
      return Invalid("file key '" + f.key + "' names the manifest");
    }
    if (f.size > format::kMaxFileSize) return Invalid("file " + f.key + ": absurd size");
    if (!keys.insert(f.key).second) return Invalid("file " + f.key + " listed twice");
  }
  std::unordered_set<std::string> names;
  uint64_t chunk_count = 0;
  uint64_t coverage_budget = format::kMaxCoverageSteps;
  for (const auto& t : m.tensors) {
    CAIRN_RETURN_IF_ERROR(ValidateTensor(m, t, &coverage_budget));
    if (!names.insert(t.fqn).second) return Invalid("name '" + t.fqn + "' listed twice");
    chunk_count += t.chunks.size();
    if (chunk_count > format::kMaxItems) return Invalid("too many chunks");
  }
  for (const auto& b : m.bytes) {
    if (b.fqn.empty()) return Invalid("a bytes item has an empty name");
    if (!names.insert(b.fqn).second) return Invalid("name '" + b.fqn + "' listed twice");
    if (b.location.length > format::kMaxBytesItemSize) {
      return Invalid("bytes '" + b.fqn + "': length " + std::to_string(b.location.length) +
                     " exceeds the limit for a non-tensor item (" +
                     std::to_string(format::kMaxBytesItemSize) + " bytes)");
    }
    CAIRN_RETURN_IF_ERROR(ValidateLocation(m, b.location, "bytes '" + b.fqn + "'"));
  }
  // Items of one file must not overlap and must end within the file; bytes
  // after the last item are trailing padding (a reused staging slot is larger
  // than what one save puts in it). Every byte of a data file is either
  // covered by a checksum or is padding that must be zero, so Verify can check
  // them all.
  std::vector<std::vector<std::pair<uint64_t, uint64_t>>> spans(m.files.size());
  for (const auto& t : m.tensors) {
    for (const auto& c : t.chunks) {
      if (c.location.length) {
        spans[c.location.file].push_back({c.location.offset, c.location.length});
      }
    }
  }
  for (const auto& b : m.bytes) {
    if (b.location.length) spans[b.location.file].push_back({b.location.offset, b.location.length});
  }
  for (size_t i = 0; i < spans.size(); ++i) {
    auto& v = spans[i];
    std::sort(v.begin(), v.end());
    uint64_t end = 0;
    for (const auto& [off, len] : v) {
      if (off < end) {
        return Invalid(m.files[i].key + ": items overlap at offset " + std::to_string(off));
      }
      end = off + len;
    }
    if (end > m.files[i].size) {
      return Invalid(m.files[i].key + ": size " + std::to_string(m.files[i].size) +
                     " is smaller than the end of its last item (" + std::to_string(end) + ")");
    }
  }
  if (m.extra.empty()) return Invalid("extra is empty (must be a JSON object)");
  bool too_deep = false;
  json extra = ParseLimited(m.extra, &too_deep);
  if (too_deep) return Invalid("extra: nested deeper than " + std::to_string(kMaxJsonDepth));
  if (!extra.is_object()) return Invalid("extra: not a JSON object");
  return ValidateExtra(extra);
}

Status ValidateChunkCoverage(const ManifestTensor& t) {
  uint64_t budget = format::kMaxCoverageSteps;
  return ValidateCoverage(t, &budget);
}

Result<std::string> ManifestToJson(const Manifest& m) {
  Status s = ValidateManifest(m);
  if (!s.ok()) return Status(StatusCode::kInvalidArgument, s.message());
  json extra = json::parse(m.extra, nullptr, /*allow_exceptions=*/false);
  if (!extra.is_object()) return InvalidArgumentError("manifest extra is not a JSON object");
  json files = json::array();
  for (const auto& f : m.files) files.push_back({{"key", f.key}, {"size", f.size}});
  json tensors = json::array();
  for (const auto& t : m.tensors) {
    json chunks = json::array();
    for (const auto& c : t.chunks) {
      json jc = LocationToJson(c.location);
      jc["offsets"] = c.offsets;
      jc["sizes"] = c.sizes;
      chunks.push_back(std::move(jc));
    }
    tensors.push_back({{"fqn", t.fqn},
                       {"dtype", t.dtype},
                       {"shape", t.shape},
                       {"requires_grad", t.requires_grad},
                       {"layout", t.layout},
                       {"memory_format", t.memory_format},
                       {"pin_memory", t.pin_memory},
                       {"chunks", std::move(chunks)}});
  }
  json bytes = json::array();
  for (const auto& b : m.bytes) {
    json jb = LocationToJson(b.location);
    jb["fqn"] = b.fqn;
    bytes.push_back(std::move(jb));
  }
  json body = {{"format_version", m.version},
               {"checksum", std::string(format::kChecksumAlgorithm)},
               {"world_size", m.world_size},
               {"block_size", m.block_size},
               {"created_unix_ms", m.created_unix_ms},
               {"files", std::move(files)},
               {"tensors", std::move(tensors)},
               {"bytes", std::move(bytes)},
               {"extra", std::move(extra)}};
  // Invalid UTF-8 in a name would make dump() throw; replace it instead.
  return body.dump(-1, ' ', false, json::error_handler_t::replace);
}

Result<Manifest> ManifestFromJson(std::string_view text, bool from_storage) {
  Reader r(from_storage);
  // Values nested deeper than kMaxJsonDepth are discarded while parsing and
  // reported: a hostile body must not drive recursive code (dump, destroy)
  // into a stack overflow.
  bool too_deep = false;
  json body = ParseLimited(text, &too_deep);
  if (too_deep) {
    return r.Bad("<body>", "nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  if (body.is_discarded()) return r.Bad("<body>", "not valid JSON");
  if (!body.is_object()) return r.Bad("<body>", "not a JSON object");
  Manifest m;
  CAIRN_ASSIGN_OR_RETURN(uint64_t version, r.U64(body, "format_version", ""));
  if (version != format::kFormatVersion) {
    return FailedPreconditionError("unsupported checkpoint format version " +
                                   std::to_string(version) + " (this build reads version " +
                                   std::to_string(format::kFormatVersion) + ")");
  }
  m.version = static_cast<uint32_t>(version);
  CAIRN_ASSIGN_OR_RETURN(std::string algo, r.Str(body, "checksum", ""));
  if (algo != format::kChecksumAlgorithm) return r.Bad("checksum", "unknown algorithm " + algo);
  CAIRN_ASSIGN_OR_RETURN(m.world_size, r.U64(body, "world_size", ""));
  CAIRN_ASSIGN_OR_RETURN(m.block_size, r.U64(body, "block_size", ""));
  {
    CAIRN_ASSIGN_OR_RETURN(const json* created, r.Field(body, "created_unix_ms", ""));
    if (!created->is_number_integer()) return r.Bad("created_unix_ms", "not an integer");
    m.created_unix_ms = created->get<int64_t>();
  }
  CAIRN_ASSIGN_OR_RETURN(const json* files, r.Array(body, "files", "", format::kMaxFiles));
  for (size_t i = 0; i < files->size(); ++i) {
    std::string p = "files[" + std::to_string(i) + "]";
    ManifestFile f;
    CAIRN_ASSIGN_OR_RETURN(f.key, r.Str((*files)[i], "key", p));
    CAIRN_ASSIGN_OR_RETURN(f.size, r.U64((*files)[i], "size", p));
    m.files.push_back(std::move(f));
  }
  CAIRN_ASSIGN_OR_RETURN(const json* tensors, r.Array(body, "tensors", "", format::kMaxItems));
  m.tensors.reserve(tensors->size());
  for (size_t i = 0; i < tensors->size(); ++i) {
    const json& jt = (*tensors)[i];
    std::string p = "tensors[" + std::to_string(i) + "]";
    ManifestTensor t;
    CAIRN_ASSIGN_OR_RETURN(t.fqn, r.Str(jt, "fqn", p));
    CAIRN_ASSIGN_OR_RETURN(t.dtype, r.Str(jt, "dtype", p));
    CAIRN_ASSIGN_OR_RETURN(t.shape, r.U64Array(jt, "shape", p, format::kMaxDims));
    CAIRN_ASSIGN_OR_RETURN(t.requires_grad, r.Bool(jt, "requires_grad", p, false));
    CAIRN_ASSIGN_OR_RETURN(t.pin_memory, r.Bool(jt, "pin_memory", p, false));
    CAIRN_ASSIGN_OR_RETURN(t.layout, r.Str(jt, "layout", p));
    CAIRN_ASSIGN_OR_RETURN(t.memory_format, r.Str(jt, "memory_format", p));
    CAIRN_ASSIGN_OR_RETURN(const json* chunks, r.Array(jt, "chunks", p, format::kMaxItems));
    t.chunks.reserve(chunks->size());
    for (size_t c = 0; c < chunks->size(); ++c) {
      std::string cp = p + ".chunks[" + std::to_string(c) + "]";
      TensorChunk ch;
      CAIRN_ASSIGN_OR_RETURN(ch.location, r.Location((*chunks)[c], cp));
      CAIRN_ASSIGN_OR_RETURN(ch.offsets, r.U64Array((*chunks)[c], "offsets", cp, format::kMaxDims));
      CAIRN_ASSIGN_OR_RETURN(ch.sizes, r.U64Array((*chunks)[c], "sizes", cp, format::kMaxDims));
      t.chunks.push_back(std::move(ch));
    }
    m.tensors.push_back(std::move(t));
  }
  CAIRN_ASSIGN_OR_RETURN(const json* bytes, r.Array(body, "bytes", "", format::kMaxItems));
  for (size_t i = 0; i < bytes->size(); ++i) {
    std::string p = "bytes[" + std::to_string(i) + "]";
    ManifestBytes b;
    CAIRN_ASSIGN_OR_RETURN(b.fqn, r.Str((*bytes)[i], "fqn", p));
    CAIRN_ASSIGN_OR_RETURN(b.location, r.Location((*bytes)[i], p));
    m.bytes.push_back(std::move(b));
  }
  CAIRN_ASSIGN_OR_RETURN(const json* extra, r.Field(body, "extra", ""));
  if (!extra->is_object()) return r.Bad("extra", "not a JSON object");
  m.extra = extra->dump(-1, ' ', false, json::error_handler_t::replace);
  Status s = ValidateManifest(m);
  if (!s.ok() && !from_storage && s.code() == StatusCode::kDataLoss) {
    return Status(StatusCode::kInvalidArgument, s.message());
  }
  CAIRN_RETURN_IF_ERROR(s);
  return m;
}

Result<std::string> EncodeManifest(const Manifest& m) {
  CAIRN_ASSIGN_OR_RETURN(std::string body, ManifestToJson(m));
  std::string out;
  out.reserve(format::kManifestHeaderSize + body.size() + format::kManifestTrailerSize);
  out.append(format::kManifestMagic, format::kMagicSize);
  PutU32(&out, m.version);
  PutU32(&out, 0);  // flags
  PutU64(&out, body.size());
  out.append(body);
  PutU64(&out, XXH3_64bits(out.data(), out.size()));
  return out;
}

Result<Manifest> DecodeManifest(std::string_view bytes) {
  if (bytes.size() < format::kManifestHeaderSize + format::kManifestTrailerSize) {
    return DataLossError("manifest truncated: " + std::to_string(bytes.size()) + " bytes");
  }
  if (std::memcmp(bytes.data(), format::kManifestMagic, format::kMagicSize) != 0) {
    return DataLossError("not a cairn manifest (bad magic)");
  }
  const char* p = bytes.data() + format::kMagicSize;
  uint32_t version = GetU32(p);
  uint32_t flags = GetU32(p + 4);
  uint64_t body_len = GetU64(p + 8);
  uint64_t expected;
  if (body_len > format::kMaxManifestBodySize ||
      !AddOk(format::kManifestHeaderSize + format::kManifestTrailerSize, body_len, &expected) ||
      expected != bytes.size()) {
    return DataLossError("manifest truncated or damaged: header says " + std::to_string(body_len) +
                         " body bytes, file has " + std::to_string(bytes.size()) + " bytes in all");
  }
  size_t covered = bytes.size() - format::kManifestTrailerSize;
  uint64_t want = GetU64(bytes.data() + covered);
  uint64_t got = XXH3_64bits(bytes.data(), covered);
  if (want != got) {
    // A damaged version field must not masquerade as "unknown version": the
    // checksum is checked first.
    return DataLossError("manifest checksum mismatch (the manifest is damaged)");
  }
  if (version != format::kFormatVersion) {
    return FailedPreconditionError("unsupported checkpoint format version " +
                                   std::to_string(version) + " (this build reads version " +
                                   std::to_string(format::kFormatVersion) +
                                   "; upgrade cairn to read it)");
  }
  if (flags != 0) return DataLossError("manifest has unknown flags " + std::to_string(flags));
  return ManifestFromJson(bytes.substr(format::kManifestHeaderSize, body_len),
                          /*from_storage=*/true);
}

}  // namespace cairn
