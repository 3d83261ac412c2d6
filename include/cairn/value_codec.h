// The native encoding of non-tensor values (docs/format.md, "Data files").
//
// A checkpoint's bytes items hold the non-tensor values of a state dict (DCP's
// BYTE_IO). A value made only of None, bool, int, float, str, bytes, lists,
// tuples, dicts and NumPy arrays or scalars (e.g. the RNG dict of a training
// loop) is stored as kValueMagic followed by UTF-8 JSON:
//
//   null, true/false, 12, 1.5, "text", [ ... ]    themselves
//   {"__tuple__": [ ... ]}                        a tuple
//   {"__dict__": [[key, value], ...]}             a dict (any hashable key)
//   {"__bytes__": "<base64>"}                     bytes
//   {"__float__": "nan" | "inf" | "-inf"}         a non-finite float
//   {"__ndarray__": {"dtype": "<u4", "shape": [624], "data": "<base64>"}}
//   {"__npscalar__": { same }}                    a NumPy scalar
//
// so that loading one never unpickles. StoredValue is that tree; the Python
// binding converts it to and from Python objects (src/python/ext_values.cc),
// and interprets a dtype string (NumPy's dtype.str) there: this layer treats
// it as an opaque name and an array's data as opaque bytes.
//
// Plain functions on values: thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cairn/status.h"

namespace cairn {

// The first 16 bytes of an encoded value.
inline constexpr std::string_view kValueMagic{"\0cairn-value-v1\n", 16};
static_assert(kValueMagic.size() == 16);

// JSON arrays and objects may nest this deep at most (a tuple is two levels:
// an object holding an array). Deeper values are not encoded (the layer above
// pickles them) and, read from a checkpoint, are DataLoss. Python's own JSON
// codec stops below this depth, so every value it encoded decodes.
inline constexpr size_t kMaxValueDepth = 1000;

struct StoredValue {
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,     // any size: `text` holds its decimal digits, with a leading '-' if negative
    kFloat,   // `number`; NaN and infinities included
    kString,  // `text`, UTF-8
    kBytes,   // `text`, raw bytes
    kList,    // `items`
    kTuple,   // `items`
    kDict,    // `items`: key0, value0, key1, value1, ...
    kArray,   // a NumPy array: `dtype`, `shape`, C-order bytes in `text`
    kScalar,  // a NumPy scalar: as kArray (its shape is normally empty)
  };
  Kind kind = Kind::kNone;
  bool boolean = false;
  double number = 0;
  std::string text;
  std::string dtype;
  std::vector<uint64_t> shape;
  std::vector<StoredValue> items;
};

// Whether `data` starts with kValueMagic (else it is the layer above's
// pickle bytes).
bool IsEncodedValue(std::string_view data);

// kValueMagic + the JSON of `v`. InvalidArgument when `v` cannot be encoded:
// nesting deeper than kMaxValueDepth, an int whose text is not decimal
// digits, a string that is not UTF-8, a dict with an odd number of items.
Result<std::string> EncodeValue(const StoredValue& v);

// The value EncodeValue encoded into `data`. Anything else is DataLoss
// "malformed stored value (...)": no magic, bytes that are not UTF-8 JSON,
// nesting deeper than kMaxValueDepth, an unknown tag or an object that is not
// exactly one tag, a tag whose body has the wrong type, base64 that is not
// padded standard base64, a dict pair that is not [key, value], a dict key
// that would not be hashable (a list, a dict, an array, or a tuple holding
// one), an array without dtype, shape (non-negative integers) and data.
Result<StoredValue> DecodeValue(std::string_view data);

// DCP planner data, stored in a manifest's extra.dcp.planner_data
// (docs/format.md): the same tagged JSON, without the magic, of None, bool,
// int, finite float, str, lists, tuples and dicts only. InvalidArgument for a
// value holding any other kind.
Result<std::string> EncodePlannerData(const StoredValue& v);

// The planner data EncodePlannerData encoded in `json`; DataLoss for JSON
// that is not such an encoding (as DecodeValue, and any other tag).
Result<StoredValue> DecodePlannerData(std::string_view json);

// DCP's Metadata fields that a manifest keeps in its extra.dcp section
// (docs/format.md, "extra"): validated by the engine, interpreted above it.
struct DcpSection {
  std::optional<std::string> version;
  StoredValue planner_data;  // kNone when absent
  struct StorageMeta {
    std::optional<std::string> checkpoint_id;
    std::optional<std::string> save_id;
    std::vector<std::string> modules;
  };
  std::optional<StorageMeta> storage_meta;
};

// The JSON object `extra` with its "dcp" member set to `dcp`. InvalidArgument
// when `extra` is not a JSON object or the planner data cannot be encoded.
Result<std::string> ExtraWithDcpSection(std::string_view extra, const DcpSection& dcp);

// The DCP section of a manifest's `extra` JSON (empty when absent or null);
// DataLoss when it is not an object or its planner data is malformed.
Result<DcpSection> ReadDcpSection(std::string_view extra);

// Standard base64 with '=' padding, and its strict inverse (only the
// alphabet, a length that is a multiple of 4, at most two '=' at the end;
// false otherwise). Exposed for tests.
std::string Base64Encode(std::string_view bytes);
bool Base64Decode(std::string_view text, std::string* out);

}  // namespace cairn
