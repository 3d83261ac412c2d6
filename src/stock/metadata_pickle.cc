// Decoding a stock checkpoint's `.metadata` (DCP's pickled Metadata) safely.
//
// Stock FileSystemReader loads `.metadata` with pickle.load: a hostile file
// runs arbitrary code. This decoder never runs anything. It works in two steps:
//
//  1. Decode (class Unpickler). A pickle VM that knows the data opcodes of
//     protocols 2 to 5 (ints, floats, strings, bytes, tuples, lists, dicts,
//     the memo, marks, frames) and resolves only the globals a DCP metadata
//     pickle names, each into an inert value: the metadata dataclasses become
//     plain attribute bags (NEWOBJ/REDUCE without arguments, BUILD sets their
//     fields), torch.Size/_get_layout/_MEM_FORMAT_ENCODING/pathlib
//     paths/collections.OrderedDict become checked conversions, torch dtypes
//     become names. Any other global ("refusing to unpickle 'posix.system'"),
//     opcode or persistent id stops decoding. Values live in an arena and
//     refer to each other by pointer, as Python objects do (the memo shares
//     them, a list may hold itself); every length is checked against the
//     input, and the number of values, the nesting depth and the memo are
//     bounded, so no input drives an allocation or a recursion it did not pay
//     for in bytes.
//  2. Validate and convert (class Converter). The decoded tree is checked
//     field by field (types, non-negative sizes, chunks inside their tensor
//     and tiling it exactly once, data file names that are plain names inside
//     the checkpoint directory, item lengths that fit what the item can hold)
//     and converted into StockMetadata, from which the Python package builds
//     DCP's Metadata objects.
//
// The checks and messages mirror the Python stand-in unpickler this replaced.
#include <algorithm>
#include <bit>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cairn/format.h"
#include "cairn/manifest.h"
#include "cairn/stock.h"
#include "stock/dtypes.h"

namespace cairn::stock {
namespace {

using internal::Dtype;
using internal::kDtypes;

constexpr size_t kMaxValues = size_t{1} << 26;  // values, stack entries and marks each
constexpr uint32_t kMaxDepth = 100;             // container nesting (DCP's is 6)
constexpr int kHighestProtocol = 5;

constexpr const char* kLayouts[] = {"strided",    "sparse_coo", "sparse_csr", "sparse_csc",
                                    "sparse_bsr", "sparse_bsc", "_mkldnn",    "jagged"};
// DCP's _MEM_FORMAT_ENCODING values 0, 1, 2.
constexpr const char* kMemoryFormats[] = {"contiguous_format", "channels_last", "preserve_format"};
enum Dataclass {
  kMetadata,
  kTensorStorageMetadata,
  kBytesStorageMetadata,
  kChunkStorageMetadata,
  kTensorProperties,
  kStorageMeta,
  kMetadataIndex,
  kStorageInfo
};
constexpr const char* kDataclasses[] = {
    "Metadata",         "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "StorageMeta",           "MetadataIndex",        "_StorageInfo"};
// Where each class has lived across torch releases.
constexpr const char* kClassModules[] = {
    "torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
    "torch.distributed._shard.sharded_tensor.metadata", "torch.distributed._shard.metadata"};

// The callables a metadata pickle may name, each a checked conversion.
enum Function { kSizeFn, kLayoutFn, kEnumFn, kPathFn, kOrderedDictFn };

// A decoded value (see step 1 at the top).
struct Value {
  enum Kind : uint8_t {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kBytes,
    kTuple,
    kList,
    kDict,
    kSize,
    kDtype,
    kLayout,
    kEnum,
    kObject,
    kClass,
    kFunction
  };
  Kind kind = kNone;
  uint32_t depth = 1;
  // kBool, kInt: the value; kFloat: its bits; kDtype: index into kDtypes;
  // kLayout: into kLayouts; kObject, kClass: a Dataclass; kFunction: a Function.
  int64_t i = 0;
  std::string_view s;  // kStr, kBytes (into the input or the decoder's strings)
  // kTuple, kList, kSize (kInt values); kDict: key, value, key, value, ...
  std::vector<Value*> items;
  Value* fields = nullptr;  // kObject: its attributes (a kDict); kEnum: its value
  Value* state = nullptr;   // kObject: a BUILD state that is not a dict
};

Value Scalar(Value::Kind kind, int64_t i = 0, Value* fields = nullptr) {
  Value v;
  v.kind = kind;
  v.i = i;
  v.fields = fields;
  return v;
}

bool IsObject(const Value* v, Dataclass c) { return v && v->kind == Value::kObject && v->i == c; }
bool IsNone(const Value* v) { return v == nullptr || v->kind == Value::kNone; }
bool IsInt(const Value* v) {
  return v && v->kind == Value::kInt;
}  // not a bool, as `type(x) is int`

// Python's bool(v).
bool Truthy(const Value* v) {
  switch (v->kind) {
    case Value::kNone:
      return false;
    case Value::kBool:
    case Value::kInt:
      return v->i != 0;
    case Value::kFloat:
      return std::bit_cast<double>(v->i) != 0;
    case Value::kStr:
    case Value::kBytes:
      return !v->s.empty();
    case Value::kTuple:
    case Value::kList:
    case Value::kDict:
    case Value::kSize:
      return !v->items.empty();
    default:
      return true;
  }
}

// list(v) for the iterable values (each character of a str, each byte of a
// bytes as an int, a dict's keys); nullopt when `v` is not iterable. New
// values (characters, bytes) are kept in `temps`.
std::optional<std::vector<const Value*>> Elements(const Value* v, std::deque<Value>* temps) {
  std::vector<const Value*> out;
  switch (v->kind) {
    case Value::kList:
    case Value::kTuple:
    case Value::kSize:
      out.assign(v->items.begin(), v->items.end());
      return out;
    case Value::kDict:
      for (size_t k = 0; k < v->items.size(); k += 2) out.push_back(v->items[k]);
      return out;
    case Value::kStr:
      for (size_t k = 0; k < v->s.size();) {  // valid UTF-8: step over continuation bytes
        size_t n = 1;
        while (k + n < v->s.size() && (static_cast<unsigned char>(v->s[k + n]) & 0xc0) == 0x80) ++n;
        Value& c = temps->emplace_back(Scalar(Value::kStr));
        c.s = v->s.substr(k, n);
        out.push_back(&c);
        k += n;
      }
      return out;
    case Value::kBytes:
      for (char b : v->s)
        out.push_back(&temps->emplace_back(Scalar(Value::kInt, static_cast<uint8_t>(b))));
      return out;
    default:
      return std::nullopt;
  }
}

// Python's repr(v), roughly, for error messages (depth-bounded).
std::string Repr(const Value* v, int depth = 0) {
  if (v == nullptr) return "None";
  auto seq = [&](const char* open, const char* close) {
    std::string out = open;
    const size_t step = v->kind == Value::kDict ? 2 : 1;
    for (size_t k = 0; k < v->items.size(); k += step) {
      if (k > 0) out += ", ";
      if (k >= 16 || depth > 3) return out + "..." + close;
      out += Repr(v->items[k], depth + 1);
      if (step == 2) out += ": " + Repr(v->items[k + 1], depth + 1);
    }
    if (v->kind == Value::kTuple && v->items.size() == 1) out += ",";
    return out + close;
  };
  switch (v->kind) {
    case Value::kNone:
      return "None";
    case Value::kBool:
      return v->i ? "True" : "False";
    case Value::kInt:
      return std::to_string(v->i);
    case Value::kFloat:
      return std::to_string(std::bit_cast<double>(v->i));
    case Value::kStr:
      return PyRepr(v->s);
    case Value::kBytes: {  // every byte outside printable ASCII escaped
      static constexpr char kDigits[] = "0123456789abcdef";
      std::string out = "b'";
      for (char c : v->s) {
        const auto u = static_cast<unsigned char>(c);
        if (u >= 0x20 && u < 0x7f && c != '\'' && c != '\\') {
          out += c;
        } else {
          out += {'\\', 'x', kDigits[u >> 4], kDigits[u & 15]};
        }
      }
      return out + "'";
    }
    case Value::kTuple:
      return seq("(", ")");
    case Value::kList:
      return seq("[", "]");
    case Value::kDict:
      return seq("{", "}");
    case Value::kSize:
      return seq("torch.Size([", "])");
    case Value::kDtype:
      return std::string("torch.") + kDtypes[v->i].canonical;
    case Value::kLayout:
      return std::string("torch.") + kLayouts[v->i];
    case Value::kEnum:
      return "<_MEM_FORMAT_ENCODING " + Repr(v->fields, depth + 1) + ">";
    case Value::kObject:
      return std::string("<") + kDataclasses[v->i] + " object>";
    default:
      return "<callable>";
  }
}

// Strict UTF-8 (no surrogates, no overlong forms): what Python can hold as str.
bool IsUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t k = 0; k < n;) {
    const unsigned char c = p[k];
    size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || len > n - k) return false;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t j = 1; j < len; ++j) {
      if ((p[k + j] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[k + j] & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
    k += len;
  }
  return true;
}

// str(pathlib.PurePosixPath(*parts)): the last absolute part restarts the
// path; empty and "." components drop out; exactly two leading slashes stay.
std::string JoinPosixPath(const std::vector<std::string_view>& parts) {
  std::string root;
  std::vector<std::string_view> components;
  for (size_t k = parts.size(); k-- > 0;) {
    std::string_view part = parts[k];
    std::vector<std::string_view> mine;
    size_t at = 0;
    while (at <= part.size()) {
      size_t slash = part.find('/', at);
      if (slash == std::string_view::npos) slash = part.size();
      std::string_view c = part.substr(at, slash - at);
      if (!c.empty() && c != ".") mine.push_back(c);
      at = slash + 1;
    }
    components.insert(components.begin(), mine.begin(), mine.end());
    if (part.starts_with('/')) {
      root = part.starts_with("//") && !part.starts_with("///") ? "//" : "/";
      break;
    }
  }
  std::string out = root;
  for (size_t k = 0; k < components.size(); ++k) {
    if (k > 0) out += '/';
    out += components[k];
  }
  return out.empty() ? "." : out;
}

// Step 1: the restricted pickle VM.
class Unpickler {
 public:
  Unpickler(std::string_view pickle, const std::string& source) : p_(pickle), source_(source) {}

  Result<Value*> Run() {
    while (true) {
      if (at_ >= p_.size()) return Bad("pickle data was truncated");
      const size_t op_at = at_;
      const uint8_t op = static_cast<uint8_t>(p_[at_++]);
      switch (op) {
        case 0x80: {  // PROTO
          CAIRN_ASSIGN_OR_RETURN(uint64_t v, Uint(1));
          if (v > kHighestProtocol) return Bad("unsupported pickle protocol " + std::to_string(v));
          break;
        }
        case 0x95: {  // FRAME: a buffering hint, but it must lie inside the data
          CAIRN_ASSIGN_OR_RETURN(uint64_t n, Uint(8));
          if (n > p_.size() - at_) return Bad("pickle data was truncated");
          break;
        }
        case '.': {  // STOP
          CAIRN_ASSIGN_OR_RETURN(Value * root, Pop());
          return root;
        }
        case '(':  // MARK
          if (marks_.size() >= kMaxValues) return Bad("too many marks");
          marks_.push_back(stack_.size());
          break;
        case '0':  // POP
          if (stack_.size() > Fence()) {
            stack_.pop_back();
          } else if (!marks_.empty()) {
            marks_.pop_back();
          } else {
            return Bad("unpickling stack underflow");
          }
          break;
        case '1': {  // POP_MARK
          CAIRN_ASSIGN_OR_RETURN(std::vector<Value*> dropped, PopMark());
          break;
        }
        case '2': {  // DUP
          if (stack_.size() <= Fence()) return Bad("unpickling stack underflow");
          CAIRN_RETURN_IF_ERROR(Push(stack_.back()));
          break;
        }
        case 'N':
          CAIRN_RETURN_IF_ERROR(Push(&none_));
          break;
        case 0x88:
          CAIRN_RETURN_IF_ERROR(Push(&true_));
          break;
        case 0x89:
          CAIRN_RETURN_IF_ERROR(Push(&false_));
          break;
        case 'K':
        case 'M': {  // BININT1, BININT2
          CAIRN_ASSIGN_OR_RETURN(uint64_t v, Uint(op == 'K' ? 1 : 2));
          CAIRN_RETURN_IF_ERROR(PushInt(static_cast<int64_t>(v)));
          break;
        }
        case 'J': {  // BININT
          CAIRN_ASSIGN_OR_RETURN(uint64_t v, Uint(4));
          CAIRN_RETURN_IF_ERROR(PushInt(static_cast<int32_t>(static_cast<uint32_t>(v))));
          break;
        }
        case 0x8a:
        case 0x8b: {  // LONG1, LONG4: little-endian two's complement
          CAIRN_ASSIGN_OR_RETURN(uint64_t n, Uint(op == 0x8a ? 1 : 4));
          if (n > 8) return Bad("integer does not fit in 64 bits");
          CAIRN_ASSIGN_OR_RETURN(std::string_view b, Take(n));
          uint64_t u = 0;
          for (uint64_t k = 0; k < n; ++k) u |= uint64_t{static_cast<uint8_t>(b[k])} << (8 * k);
          if (n > 0 && n < 8 && (b[n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);
          CAIRN_RETURN_IF_ERROR(PushInt(static_cast<int64_t>(u)));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian IEEE 754
          CAIRN_ASSIGN_OR_RETURN(std::string_view b, Take(8));
          uint64_t u = 0;
          for (char c : b) u = (u << 8) | static_cast<uint8_t>(c);
          CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kFloat));
          v->i = static_cast<int64_t>(u);
          CAIRN_RETURN_IF_ERROR(Push(v));
          break;
        }
        case 0x8c:
        case 'X':
        case 0x8d:  // SHORT_BINUNICODE, BINUNICODE, BINUNICODE8
        case 'C':
        case 'B':
        case 0x8e:
        case 0x96: {  // SHORT_BINBYTES, BINBYTES, BINBYTES8, BYTEARRAY8
          const bool str = op == 0x8c || op == 'X' || op == 0x8d;
          const size_t width = op == 0x8c || op == 'C' ? 1 : op == 'X' || op == 'B' ? 4 : 8;
          CAIRN_ASSIGN_OR_RETURN(uint64_t n, Uint(width));
          CAIRN_ASSIGN_OR_RETURN(std::string_view b, Take(n));
          if (str && !IsUtf8(b)) return Bad("a string is not valid UTF-8");
          CAIRN_ASSIGN_OR_RETURN(Value * v, New(str ? Value::kStr : Value::kBytes));
          v->s = b;
          CAIRN_RETURN_IF_ERROR(Push(v));
          break;
        }
        case ')':
        case 0x85:
        case 0x86:
        case 0x87: {  // EMPTY_TUPLE, TUPLE1, TUPLE2, TUPLE3
          const size_t n = op == ')' ? 0 : op - 0x84;
          if (stack_.size() < Fence() + n) return Bad("unpickling stack underflow");
          std::vector<Value*> items(stack_.end() - n, stack_.end());
          stack_.resize(stack_.size() - n);
          CAIRN_RETURN_IF_ERROR(PushContainer(Value::kTuple, std::move(items)));
          break;
        }
        case 't':
        case 'l':
        case 'd': {  // TUPLE, LIST, DICT (of the items above the mark)
          CAIRN_ASSIGN_OR_RETURN(std::vector<Value*> items, PopMark());
          if (op != 'd') {
            CAIRN_RETURN_IF_ERROR(
                PushContainer(op == 't' ? Value::kTuple : Value::kList, std::move(items)));
            break;
          }
          CAIRN_ASSIGN_OR_RETURN(Value * d, New(Value::kDict));
          CAIRN_RETURN_IF_ERROR(SetItems(d, items));
          CAIRN_RETURN_IF_ERROR(Push(d));
          break;
        }
        case ']':
        case '}': {  // EMPTY_LIST, EMPTY_DICT
          CAIRN_ASSIGN_OR_RETURN(Value * v, New(op == ']' ? Value::kList : Value::kDict));
          CAIRN_RETURN_IF_ERROR(Push(v));
          break;
        }
        case 'a':
        case 'e': {  // APPEND, APPENDS
          std::vector<Value*> items;
          if (op == 'a') {
            CAIRN_ASSIGN_OR_RETURN(Value * v, Pop());
            items.push_back(v);
          } else {
            CAIRN_ASSIGN_OR_RETURN(items, PopMark());
          }
          CAIRN_ASSIGN_OR_RETURN(Value * list, Top());
          if (list->kind != Value::kList) return Bad("APPEND to a value that is not a list");
          for (Value* v : items) {
            CAIRN_RETURN_IF_ERROR(Nest(list, v));
            list->items.push_back(v);
          }
          break;
        }
        case 's':
        case 'u': {  // SETITEM, SETITEMS
          std::vector<Value*> items;
          if (op == 's') {
            CAIRN_ASSIGN_OR_RETURN(Value * v, Pop());
            CAIRN_ASSIGN_OR_RETURN(Value * k, Pop());
            items = {k, v};
          } else {
            CAIRN_ASSIGN_OR_RETURN(items, PopMark());
          }
          CAIRN_ASSIGN_OR_RETURN(Value * d, Top());
          if (d->kind != Value::kDict) return Bad("SETITEM on a value that is not a dict");
          CAIRN_RETURN_IF_ERROR(SetItems(d, items));
          break;
        }
        case 'q':
        case 'r':
        case 0x94: {  // BINPUT, LONG_BINPUT, MEMOIZE
          uint64_t index = memo_.size();
          if (op != 0x94) {
            CAIRN_ASSIGN_OR_RETURN(index, Uint(op == 'q' ? 1 : 4));
          }
          if (stack_.size() <= Fence()) return Bad("unpickling stack underflow");
          memo_[index] = stack_.back();
          break;
        }
        case 'h':
        case 'j': {  // BINGET, LONG_BINGET
          CAIRN_ASSIGN_OR_RETURN(uint64_t index, Uint(op == 'h' ? 1 : 4));
          auto it = memo_.find(index);
          if (it == memo_.end())
            return Bad("memo value not found at index " + std::to_string(index));
          CAIRN_RETURN_IF_ERROR(Push(it->second));
          break;
        }
        case 'c': {  // GLOBAL module\nname\n
          CAIRN_ASSIGN_OR_RETURN(std::string_view module, Line());
          CAIRN_ASSIGN_OR_RETURN(std::string_view name, Line());
          if (!IsUtf8(module) || !IsUtf8(name)) return Bad("a global name is not valid UTF-8");
          CAIRN_RETURN_IF_ERROR(PushGlobal(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          CAIRN_ASSIGN_OR_RETURN(Value * name, Pop());
          CAIRN_ASSIGN_OR_RETURN(Value * module, Pop());
          if (name->kind != Value::kStr || module->kind != Value::kStr) {
            return Bad("STACK_GLOBAL requires str");
          }
          CAIRN_RETURN_IF_ERROR(PushGlobal(module->s, name->s));
          break;
        }
        case 'R': {  // REDUCE
          CAIRN_ASSIGN_OR_RETURN(Value * args, Pop());
          CAIRN_ASSIGN_OR_RETURN(Value * fn, Pop());
          CAIRN_ASSIGN_OR_RETURN(Value * v, Call(fn, args));
          CAIRN_RETURN_IF_ERROR(Push(v));
          break;
        }
        case 0x81:
        case 0x92: {  // NEWOBJ, NEWOBJ_EX: only a dataclass, without arguments
          Value* kwargs = nullptr;
          if (op == 0x92) {
            CAIRN_ASSIGN_OR_RETURN(kwargs, Pop());
          }
          CAIRN_ASSIGN_OR_RETURN(Value * args, Pop());
          CAIRN_ASSIGN_OR_RETURN(Value * cls, Pop());
          if (cls->kind != Value::kClass) return Bad("NEWOBJ class argument isn't a type object");
          if (args->kind != Value::kTuple || (kwargs && kwargs->kind != Value::kDict)) {
            return Bad("NEWOBJ expected an argument tuple");
          }
          if (!args->items.empty() || (kwargs && !kwargs->items.empty())) {
            return Bad("unexpected constructor arguments");
          }
          CAIRN_ASSIGN_OR_RETURN(Value * v, NewObject(cls->i));
          CAIRN_RETURN_IF_ERROR(Push(v));
          break;
        }
        case 'b': {  // BUILD: only on a dataclass
          CAIRN_ASSIGN_OR_RETURN(Value * state, Pop());
          CAIRN_ASSIGN_OR_RETURN(Value * inst, Top());
          if (inst->kind != Value::kObject) return Bad("BUILD on a value that is not a dataclass");
          CAIRN_RETURN_IF_ERROR(Build(inst, state));
          break;
        }
        case 'P':
        case 'Q':
          return DataLossError(source_ + ": unexpected persistent id in .metadata");
        default:
          return Bad("unsupported pickle opcode 0x" + Hex(op) + " at byte " +
                     std::to_string(op_at));
      }
    }
  }

 private:
  static std::string Hex(uint8_t op) {
    static constexpr char kDigits[] = "0123456789abcdef";
    return {kDigits[op >> 4], kDigits[op & 15]};
  }
  Status Bad(const std::string& what) const {
    return DataLossError(source_ + ": unreadable DCP metadata: " + what);
  }
  Result<std::string_view> Take(uint64_t n) {
    if (n > p_.size() - at_) return Bad("pickle data was truncated");
    std::string_view b = p_.substr(at_, n);
    at_ += n;
    return b;
  }
  Result<uint64_t> Uint(size_t n) {
    CAIRN_ASSIGN_OR_RETURN(std::string_view b, Take(n));
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(b[k])} << (8 * k);
    return v;
  }
  Result<std::string_view> Line() {
    size_t nl = p_.find('\n', at_);
    if (nl == std::string_view::npos) return Bad("pickle data was truncated");
    std::string_view line = p_.substr(at_, nl - at_);
    at_ = nl + 1;
    return line;
  }
  size_t Fence() const { return marks_.empty() ? 0 : marks_.back(); }

  Result<Value*> New(Value::Kind kind) {
    if (values_.size() >= kMaxValues) return Bad("more than 2^26 values");
    values_.emplace_back();
    values_.back().kind = kind;
    return &values_.back();
  }
  Status Push(Value* v) {
    if (stack_.size() >= kMaxValues) return Bad("stack deeper than 2^26 values");
    stack_.push_back(v);
    return Status::OK();
  }
  Status PushInt(int64_t i) {
    CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kInt));
    v->i = i;
    return Push(v);
  }
  Result<Value*> Pop() {
    if (stack_.size() <= Fence()) return Bad("unpickling stack underflow");
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Result<Value*> Top() {
    if (stack_.size() <= Fence()) return Bad("unpickling stack underflow");
    return stack_.back();
  }
  Result<std::vector<Value*>> PopMark() {
    if (marks_.empty()) return Bad("could not find MARK");
    std::vector<Value*> items(stack_.begin() + marks_.back(), stack_.end());
    stack_.resize(marks_.back());
    marks_.pop_back();
    return items;
  }
  // Records that `child` is now inside `parent`: bounds the nesting depth.
  Status Nest(Value* parent, const Value* child) {
    parent->depth = std::max(parent->depth, child->depth + 1);
    if (parent->depth > kMaxDepth) {
      return Bad("values nested deeper than " + std::to_string(kMaxDepth) + " levels");
    }
    return Status::OK();
  }
  Status PushContainer(Value::Kind kind, std::vector<Value*> items) {
    CAIRN_ASSIGN_OR_RETURN(Value * v, New(kind));
    for (const Value* item : items) CAIRN_RETURN_IF_ERROR(Nest(v, item));
    v->items = std::move(items);
    return Push(v);
  }
  Result<Value*> NewObject(int64_t dataclass) {
    CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kObject));
    v->i = dataclass;
    CAIRN_ASSIGN_OR_RETURN(v->fields, New(Value::kDict));
    return v;
  }

  static bool Hashable(const Value* v) {
    if (v->kind == Value::kList || v->kind == Value::kDict) return false;
    if (v->kind != Value::kTuple) return true;
    for (const Value* item : v->items) {
      if (!Hashable(item)) return false;  // depth-bounded: tuples nest at most kMaxDepth
    }
    return true;
  }
  // d[key] = value for each pair of `items`, as Python's dict does for the
  // keys that matter here: equal strings and the same object are one key.
  Status SetItems(Value* d, const std::vector<Value*>& items) {
    if (items.size() % 2 != 0) return Bad("odd number of items for SETITEMS");
    for (size_t k = 0; k < items.size(); k += 2) {
      Value* key = items[k];
      Value* value = items[k + 1];
      if (!Hashable(key)) return Bad("unhashable dict key");
      CAIRN_RETURN_IF_ERROR(Nest(d, key));
      CAIRN_RETURN_IF_ERROR(Nest(d, value));
      const size_t at = Find(d, key);
      if (at != kAbsent) {
        d->items[at + 1] = value;
        continue;
      }
      auto it = dict_index_.find(d);
      if (it != dict_index_.end()) it->second.Add(key, d->items.size());
      d->items.push_back(key);
      d->items.push_back(value);
    }
    return Status::OK();
  }
  // Where `key` is among the keys of `d` (an index into its items), or
  // kAbsent. Small dicts (every object's fields) are scanned; large ones get
  // an index on first use.
  size_t Find(Value* d, const Value* key) {
    if (key->kind != Value::kStr && key->kind != Value::kObject) return kAbsent;
    auto it = dict_index_.find(d);
    if (it == dict_index_.end()) {
      if (d->items.size() < 2 * kScannedDictSize) {
        for (size_t k = 0; k < d->items.size(); k += 2) {
          if (DictIndex::Same(d->items[k], key)) return k;
        }
        return kAbsent;
      }
      it = dict_index_.try_emplace(d).first;
      for (size_t k = 0; k < d->items.size(); k += 2) it->second.Add(d->items[k], k);
    }
    return it->second.Find(key);
  }
  // Like the stand-ins' __setstate__: a dict (or a (dict|None, dict) pair) updates
  // the fields; any other state is kept whole.
  Status Build(Value* inst, Value* state) {
    if (state->kind == Value::kDict) return SetItems(inst->fields, state->items);
    if (state->kind == Value::kTuple && state->items.size() == 2 &&
        (state->items[0]->kind == Value::kNone || state->items[0]->kind == Value::kDict) &&
        state->items[1]->kind == Value::kDict) {
      if (state->items[0]->kind == Value::kDict) {
        CAIRN_RETURN_IF_ERROR(SetItems(inst->fields, state->items[0]->items));
      }
      return SetItems(inst->fields, state->items[1]->items);
    }
    CAIRN_RETURN_IF_ERROR(Nest(inst, state));
    inst->state = state;
    return Status::OK();
  }

  Status PushGlobal(std::string_view module, std::string_view name) {
    auto in = [](std::string_view s, const auto& list) {
      for (const char* x : list) {
        if (s == x) return true;
      }
      return false;
    };
    Value* v = nullptr;
    auto function = [&](Function f) -> Status {
      CAIRN_ASSIGN_OR_RETURN(v, New(Value::kFunction));
      v->i = f;
      return Status::OK();
    };
    if (in(module, kClassModules) && in(name, kDataclasses)) {
      CAIRN_ASSIGN_OR_RETURN(v, New(Value::kClass));
      while (name != kDataclasses[v->i]) ++v->i;
    } else if (in(module, kClassModules) &&
               (name == "_MEM_FORMAT_ENCODING" || name == "MEM_FORMAT_ENCODING")) {
      CAIRN_RETURN_IF_ERROR(function(kEnumFn));
    } else if (module == "torch" && name == "Size") {
      CAIRN_RETURN_IF_ERROR(function(kSizeFn));
    } else if (module == "torch.serialization" && name == "_get_layout") {
      CAIRN_RETURN_IF_ERROR(function(kLayoutFn));
    } else if (module == "pathlib" &&
               (name == "PosixPath" || name == "PurePosixPath" || name == "WindowsPath" ||
                name == "PureWindowsPath" || name == "Path")) {
      CAIRN_RETURN_IF_ERROR(function(kPathFn));
    } else if (module == "collections" && name == "OrderedDict") {
      CAIRN_RETURN_IF_ERROR(function(kOrderedDictFn));
    } else if (module == "torch") {
      for (size_t k = 0; k < std::size(kDtypes) && v == nullptr; ++k) {
        if (name != kDtypes[k].name) continue;
        CAIRN_ASSIGN_OR_RETURN(v, New(Value::kDtype));
        v->i = static_cast<int64_t>(k);
      }
    }
    if (v == nullptr) {
      return DataLossError(source_ + ": refusing to unpickle '" + std::string(module) + "." +
                           std::string(name) +
                           "': it is not part of DCP checkpoint metadata (a hostile or foreign "
                           ".metadata file)");
    }
    return Push(v);
  }

  // fn(*args) for the callables a metadata pickle may name.
  Result<Value*> Call(Value* fn, Value* args) {
    if (args->kind != Value::kTuple) return Bad("REDUCE arguments are not a tuple");
    const std::vector<Value*>& a = args->items;
    if (fn->kind == Value::kClass) {
      if (!a.empty()) return Bad("unexpected constructor arguments");
      return NewObject(fn->i);
    }
    if (fn->kind != Value::kFunction) return Bad("REDUCE on a value that is not callable");
    switch (fn->i) {
      case kSizeFn: {
        if (a.size() > 1) return Bad("torch.Size takes at most one argument");
        CAIRN_ASSIGN_OR_RETURN(Value * size, New(Value::kSize));
        size->depth = 2;
        if (a.empty()) return size;
        const Value* dims = a[0];
        bool ok = dims->kind == Value::kTuple || dims->kind == Value::kList;
        for (Value* d : dims->items) ok = ok && IsInt(d) && d->i >= 0;
        if (!ok) return Bad("malformed torch.Size " + Repr(dims));
        size->items = dims->items;
        return size;
      }
      case kLayoutFn: {
        if (a.size() == 1 && a[0]->kind == Value::kStr && a[0]->s.starts_with("torch.")) {
          for (size_t k = 0; k < std::size(kLayouts); ++k) {
            if (a[0]->s.substr(6) != kLayouts[k]) continue;
            CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kLayout));
            v->i = static_cast<int64_t>(k);
            return v;
          }
        }
        return Bad("unknown tensor layout " + (a.size() == 1 ? Repr(a[0]) : Repr(args)));
      }
      case kEnumFn: {
        if (a.size() != 1) return Bad("_MEM_FORMAT_ENCODING takes one argument");
        CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kEnum));
        v->fields = a[0];
        CAIRN_RETURN_IF_ERROR(Nest(v, a[0]));
        return v;
      }
      case kPathFn: {
        std::vector<std::string_view> parts;
        for (const Value* part : a) {
          if (part->kind != Value::kStr) return Bad("malformed path in .metadata");
          parts.push_back(part->s);
        }
        CAIRN_ASSIGN_OR_RETURN(Value * v, New(Value::kStr));
        v->s = strings_.emplace_back(parts.empty() ? "" : JoinPosixPath(parts));
        return v;
      }
      default: {  // kOrderedDictFn: dict(*args)
        CAIRN_ASSIGN_OR_RETURN(Value * d, New(Value::kDict));
        if (a.size() > 1) return Bad("OrderedDict takes at most one argument");
        if (a.empty()) return d;
        if (a[0]->kind == Value::kDict) {
          CAIRN_RETURN_IF_ERROR(SetItems(d, a[0]->items));
          return d;
        }
        if (a[0]->kind != Value::kList && a[0]->kind != Value::kTuple) {
          return Bad("OrderedDict of a value that is not a dict or a sequence of pairs");
        }
        std::vector<Value*> pairs;
        for (const Value* pair : a[0]->items) {
          if ((pair->kind != Value::kTuple && pair->kind != Value::kList) ||
              pair->items.size() != 2) {
            return Bad("OrderedDict of a value that is not a dict or a sequence of pairs");
          }
          pairs.push_back(pair->items[0]);
          pairs.push_back(pair->items[1]);
        }
        CAIRN_RETURN_IF_ERROR(SetItems(d, pairs));
        return d;
      }
    }
  }

  // The keys of a large dict that Python's dict would find equal: equal
  // strings, and the same object.
  struct DictIndex {
    static bool Same(const Value* a, const Value* b) {
      return a == b || (a->kind == Value::kStr && b->kind == Value::kStr && a->s == b->s);
    }
    void Add(const Value* key, size_t at) {
      if (key->kind == Value::kStr) strs.try_emplace(key->s, at);
      if (key->kind == Value::kObject) objects.try_emplace(key, at);
    }
    size_t Find(const Value* key) const {
      if (key->kind == Value::kStr) {
        auto it = strs.find(key->s);
        return it == strs.end() ? kAbsent : it->second;
      }
      auto it = objects.find(key);
      return it == objects.end() ? kAbsent : it->second;
    }
    std::unordered_map<std::string_view, size_t> strs;
    std::unordered_map<const Value*, size_t> objects;
  };
  static constexpr size_t kAbsent = ~size_t{0};
  static constexpr size_t kScannedDictSize = 16;

  std::string_view p_;
  const std::string& source_;
  size_t at_ = 0;
  std::deque<Value> values_;  // the arena: a deque never moves what it holds
  std::deque<std::string> strings_;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
  std::unordered_map<const Value*, DictIndex> dict_index_;
  Value none_ = Scalar(Value::kNone), true_ = Scalar(Value::kBool, 1),
        false_ = Scalar(Value::kBool, 0);
};

// Step 2: validation and conversion.
class Converter {
 public:
  explicit Converter(const std::string& source) : source_(source) {}

  Result<StockMetadata> Metadata(const Value* root) {
    StockMetadata out;
    CAIRN_ASSIGN_OR_RETURN(const Value* f, Obj(root, kMetadata, "the root object"));
    const Value* sdm = Get(f, "state_dict_metadata");
    if (sdm == nullptr || sdm->kind != Value::kDict)
      return Fail("state_dict_metadata is not a dict");
    for (size_t k = 0; k < sdm->items.size(); k += 2) {
      const Value* fqn = sdm->items[k];
      const Value* v = sdm->items[k + 1];
      if (fqn->kind != Value::kStr) return Fail("key " + Repr(fqn) + " is not a string");
      StockItem item;
      item.fqn = fqn->s;
      item.is_bytes = IsObject(v, kBytesStorageMetadata);
      if (!item.is_bytes) CAIRN_RETURN_IF_ERROR(Tensor(v, PyRepr(fqn->s), &item));
      out.state.push_back(std::move(item));
    }

    const Value* planner = Get(f, "planner_data");
    if (!IsNone(planner)) {
      if (planner->kind != Value::kDict) return Fail("planner_data is not a dict");
      out.planner_data.emplace();
      for (size_t k = 0; k < planner->items.size(); k += 2) {
        const Value* key = planner->items[k];
        const Value* path = planner->items[k + 1];
        const std::string bad = "planner_data[" + Repr(key) + "] is malformed";
        if (key->kind != Value::kStr ||
            (path->kind != Value::kTuple && path->kind != Value::kSize)) {
          return Fail(bad);
        }
        std::vector<StockPathPart> parts;
        for (const Value* p : path->items) {
          if (p->kind == Value::kStr) {
            parts.emplace_back(std::string(p->s));
          } else if (p->kind == Value::kInt) {
            parts.emplace_back(p->i);
          } else if (p->kind == Value::kBool) {
            parts.emplace_back(p->i != 0);
          } else {
            return Fail(bad);
          }
        }
        out.planner_data->emplace_back(std::string(key->s), std::move(parts));
      }
    }

    const Value* sd = Get(f, "storage_data");
    if (sd == nullptr || sd->kind != Value::kDict) return Fail("storage_data is not a dict");
    // MetadataIndex equality: fqn and offset (the index is a hint).
    std::map<std::pair<std::string, std::optional<std::vector<uint64_t>>>, size_t> where;
    for (size_t k = 0; k < sd->items.size(); k += 2) {
      StockLocation loc;
      CAIRN_RETURN_IF_ERROR(
          Index(sd->items[k], "storage_data key #" + std::to_string(k / 2), &loc));
      CAIRN_RETURN_IF_ERROR(StorageInfo(sd->items[k + 1], PyRepr(loc.fqn), &loc));
      auto [it, fresh] = where.try_emplace({loc.fqn, loc.index_offset}, out.locations.size());
      if (fresh) {
        out.locations.push_back(std::move(loc));
      } else {  // a dict keeps the first key and the last value
        StockLocation& old = out.locations[it->second];
        old.relative_path = std::move(loc.relative_path);
        old.offset = loc.offset;
        old.length = loc.length;
      }
    }

    // Every item the planner may ask for must have a location, with a bound on
    // what reading it allocates (its file may be sparse, so the file's size
    // alone bounds nothing).
    for (const StockItem& item : out.state) {
      std::vector<std::pair<std::optional<std::vector<uint64_t>>, unsigned __int128>> wanted;
      if (item.is_bytes) {
        wanted.emplace_back(std::nullopt, format::kMaxBytesItemSize);
      } else {
        uint32_t itemsize = 0;
        for (const Dtype& d : kDtypes) {
          if (item.dtype == d.canonical) itemsize = d.itemsize;
        }
        for (const StockChunk& c : item.chunks) {
          unsigned __int128 bytes = itemsize;
          for (uint64_t s : c.sizes) bytes *= s;  // <= the tensor's numel: no overflow
          wanted.emplace_back(c.offsets, bytes + kStockTensorItemSlack);
        }
      }
      for (const auto& [offset, limit] : wanted) {
        const std::string at = " at " + SizeRepr(offset);
        auto it = where.find({item.fqn, offset});
        if (it == where.end()) return Fail("no data location for " + PyRepr(item.fqn) + at);
        const uint64_t length = out.locations[it->second].length;
        if (length > limit) {
          return Fail("item " + PyRepr(item.fqn) + at + " declares " + std::to_string(length) +
                      " bytes, more than it can hold (" +
                      std::to_string(static_cast<uint64_t>(limit)) + ")");
        }
      }
    }

    const Value* sm = Get(f, "storage_meta");
    if (!IsNone(sm)) {
      CAIRN_ASSIGN_OR_RETURN(const Value* smf, Obj(sm, kStorageMeta, "storage_meta"));
      StockStorageMeta meta;
      auto str = [&](const char* name) -> std::optional<std::string> {
        const Value* v = Get(smf, name);
        if (v == nullptr || v->kind != Value::kStr) return std::nullopt;
        return std::string(v->s);
      };
      meta.checkpoint_id = str("checkpoint_id");
      meta.save_id = str("save_id");
      const Value* modules = Get(smf, "modules");
      if (modules != nullptr && Truthy(modules)) {
        std::deque<Value> temps;
        auto elements = Elements(modules, &temps);
        if (!elements) return Fail("storage_meta.modules is not iterable");
        for (const Value* m : *elements) {
          if (m->kind == Value::kStr) meta.modules.emplace_back(m->s);
        }
      }
      out.storage_meta = std::move(meta);
    }
    const Value* version = Get(f, "version");
    if (!IsNone(version)) {
      if (version->kind != Value::kStr) return Fail("version is not a string");
      if (!version->s.starts_with("1.")) {
        return InvalidArgumentError(source_ + ": unsupported DCP metadata version " +
                                    PyRepr(version->s));
      }
      out.version = std::string(version->s);
    }
    return out;
  }

 private:
  Status Fail(const std::string& what) const {
    return DataLossError(source_ + ": malformed checkpoint metadata: " + what);
  }
  static const Value* Get(const Value* fields, std::string_view name) {
    for (size_t k = 0; k < fields->items.size(); k += 2) {
      const Value* key = fields->items[k];
      if (key->kind == Value::kStr && key->s == name) return fields->items[k + 1];
    }
    return nullptr;
  }
  static std::string SizeRepr(const std::optional<std::vector<uint64_t>>& size) {
    if (!size) return "None";
    std::string out = "torch.Size([";
    for (size_t k = 0; k < size->size(); ++k) out += (k ? ", " : "") + std::to_string((*size)[k]);
    return out + "])";
  }
  // The fields of `v`, a `c` dataclass.
  Result<const Value*> Obj(const Value* v, Dataclass c, const std::string& where) const {
    if (!IsObject(v, c)) return Fail(where + " is not a " + kDataclasses[c]);
    return v->fields;
  }
  // A torch.Size, or (in old pickles) a tuple or list of non-negative ints.
  Result<std::vector<uint64_t>> Size(const Value* v, const std::string& where) const {
    bool ok = v != nullptr &&
              (v->kind == Value::kSize || v->kind == Value::kTuple || v->kind == Value::kList);
    std::vector<uint64_t> out;
    for (size_t k = 0; ok && k < v->items.size(); ++k) {
      ok = IsInt(v->items[k]) && v->items[k]->i >= 0;
      out.push_back(static_cast<uint64_t>(v->items[k]->i));
    }
    if (!ok) return Fail(where + " is not a size");
    if (out.size() > format::kMaxDims) return Fail(where + " has too many dimensions");
    return out;
  }

  Status Properties(const Value* v, const std::string& where, StockItem* out) const {
    if (!IsObject(v, kTensorProperties)) return Fail(where + ".properties is not TensorProperties");
    static Value kZero = Scalar(Value::kInt);
    static const Value kStrided = Scalar(Value::kLayout), kFalse = Scalar(Value::kBool),
                       kContiguous = Scalar(Value::kEnum, 0, &kZero);
    const Value *dtype, *layout, *requires_grad, *mem, *pin;
    if (IsNone(v->state)) {  // pickled as a plain dict by some releases
      auto get = [&](const char* name, const Value* fallback) {
        const Value* x = Get(v->fields, name);
        return x ? x : fallback;
      };
      dtype = Get(v->fields, "dtype");
      layout = get("layout", &kStrided);
      requires_grad = get("requires_grad", &kFalse);
      mem = get("memory_format", &kContiguous);
      pin = get("pin_memory", &kFalse);
    } else {
      const Value* s = v->state;
      if (s->kind != Value::kTuple || s->items.size() != 5) {
        return Fail(where + ".properties has an unexpected shape");
      }
      dtype = s->items[0], layout = s->items[1], requires_grad = s->items[2];
      mem = s->items[3], pin = s->items[4];
    }
    if (dtype == nullptr || dtype->kind != Value::kDtype)
      return Fail(where + " has no valid dtype");
    if (layout->kind != Value::kLayout) return Fail(where + " has no valid layout");
    const Value* code = mem->kind == Value::kEnum ? mem->fields : nullptr;
    double c = -1;  // _MEM_FORMATS keys 0, 1, 2 (Python: True == 1.0 == 1)
    if (code && (code->kind == Value::kInt || code->kind == Value::kBool)) c = double(code->i);
    if (code && code->kind == Value::kFloat) c = std::bit_cast<double>(code->i);
    if (!(c == 0 || c == 1 || c == 2)) return Fail(where + " has an unknown memory format");
    out->dtype = kDtypes[dtype->i].canonical;
    out->layout = kLayouts[layout->i];
    out->requires_grad = Truthy(requires_grad);
    out->memory_format = kMemoryFormats[static_cast<int>(c)];
    out->pin_memory = Truthy(pin);
    return Status::OK();
  }

  Status Tensor(const Value* v, const std::string& where, StockItem* out) const {
    CAIRN_ASSIGN_OR_RETURN(const Value* f, Obj(v, kTensorStorageMetadata, where));
    CAIRN_RETURN_IF_ERROR(Properties(Get(f, "properties"), where, out));
    CAIRN_ASSIGN_OR_RETURN(out->size, Size(Get(f, "size"), where + ".size"));
    const Value* chunks = Get(f, "chunks");
    if (chunks == nullptr || chunks->kind != Value::kList)
      return Fail(where + ".chunks is not a list");
    if (chunks->items.size() > format::kMaxItems) return Fail(where + " has too many chunks");
    ManifestTensor t;  // for the coverage proof shared with cairn manifests
    t.fqn = where;
    t.shape = out->size;
    for (size_t i = 0; i < chunks->items.size(); ++i) {
      const std::string cw = where + ".chunks[" + std::to_string(i) + "]";
      CAIRN_ASSIGN_OR_RETURN(const Value* cf, Obj(chunks->items[i], kChunkStorageMetadata, cw));
      StockChunk c;
      CAIRN_ASSIGN_OR_RETURN(c.offsets, Size(Get(cf, "offsets"), cw + ".offsets"));
      CAIRN_ASSIGN_OR_RETURN(c.sizes, Size(Get(cf, "sizes"), cw + ".sizes"));
      if (c.offsets.size() != out->size.size() || c.sizes.size() != out->size.size()) {
        return Fail(cw + " has the wrong rank");
      }
      uint64_t numel = 1;
      for (size_t d = 0; d < out->size.size(); ++d) {
        if (c.offsets[d] > out->size[d] || c.sizes[d] > out->size[d] - c.offsets[d]) {
          return Fail(cw + " lies outside the tensor");
        }
        numel = c.sizes[d] == 0 ? 0 : numel;  // only whether it is empty matters below
      }
      TensorChunk tc;
      tc.offsets = c.offsets;
      tc.sizes = c.sizes;
      tc.location.length = numel;
      t.chunks.push_back(std::move(tc));
      out->chunks.push_back(std::move(c));
    }
    uint64_t numel = 1;
    for (uint64_t d : out->size) {
      if (__builtin_mul_overflow(numel, d, &numel)) {
        return Fail("tensor '" + where + "': shape overflows");
      }
    }
    Status s = ValidateChunkCoverage(t);
    if (!s.ok()) {
      std::string_view m = s.message();
      if (m.starts_with("invalid manifest: ")) m.remove_prefix(18);
      return Fail(std::string(m));
    }
    return Status::OK();
  }

  Status Index(const Value* v, const std::string& where, StockLocation* out) const {
    CAIRN_ASSIGN_OR_RETURN(const Value* f, Obj(v, kMetadataIndex, where));
    const Value* fqn = Get(f, "fqn");
    if (fqn == nullptr || fqn->kind != Value::kStr) return Fail(where + ".fqn is not a string");
    out->fqn = fqn->s;
    const Value* offset = Get(f, "offset");
    if (!IsNone(offset)) {
      CAIRN_ASSIGN_OR_RETURN(out->index_offset, Size(offset, where + ".offset"));
    }
    const Value* index = Get(f, "index");
    if (!IsNone(index)) {
      if (!IsInt(index)) return Fail(where + ".index is not an int");
      out->index = index->i;
    }
    return Status::OK();
  }

  Status StorageInfo(const Value* v, const std::string& where, StockLocation* out) const {
    CAIRN_ASSIGN_OR_RETURN(const Value* f, Obj(v, kStorageInfo, where));
    const Value* rel = Get(f, "relative_path");
    const Value* off = Get(f, "offset");
    const Value* length = Get(f, "length");
    const Value* td = Get(f, "transform_descriptors");
    const bool plain = rel != nullptr && rel->kind == Value::kStr && rel->s != "" &&
                       rel->s != "." && rel->s != ".." &&
                       rel->s.find_first_of(std::string_view("/\\\0", 3)) == std::string::npos;
    if (!plain) {
      return Fail(where + ": data file name " + Repr(rel) +
                  " is not a plain file name in the checkpoint directory");
    }
    if (!IsInt(off) || !IsInt(length) || off->i < 0 || length->i < 0) {
      return Fail(where + ": bad offset/length " + Repr(off) + "/" + Repr(length));
    }
    if (td != nullptr && Truthy(td)) {
      std::deque<Value> temps;
      auto elements = Elements(td, &temps);
      if (!elements) return Fail(where + ": transform_descriptors is not iterable");
      Value as_list = Scalar(Value::kList);
      for (const Value* e : *elements) as_list.items.push_back(const_cast<Value*>(e));
      return InvalidArgumentError(source_ + ": item " + where + " uses stream transforms " +
                                  Repr(&as_list) +
                                  " (e.g. compression), which cairn's stock reader does not "
                                  "support");
    }
    out->relative_path = rel->s;
    out->offset = static_cast<uint64_t>(off->i);
    out->length = static_cast<uint64_t>(length->i);
    return Status::OK();
  }

  const std::string& source_;
};

}  // namespace

std::string PyRepr(std::string_view s) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char quote = dq ? '"' : '\'';
  std::string out(1, quote);
  static constexpr char kDigits[] = "0123456789abcdef";
  for (size_t k = 0; k < s.size(); ++k) {
    const unsigned char c = static_cast<unsigned char>(s[k]);
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += kDigits[c >> 4];
      out += kDigits[c & 15];
    } else if (c == 0xc2 && k + 1 < s.size() &&
               (static_cast<unsigned char>(s[k + 1]) <= 0xa0 ||
                static_cast<unsigned char>(s[k + 1]) == 0xad)) {
      const unsigned char cp = static_cast<unsigned char>(s[++k]);  // U+0080..U+00A0, U+00AD
      out += "\\x";
      out += kDigits[cp >> 4];
      out += kDigits[cp & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

Result<StockMetadata> DecodeStockMetadata(std::string_view pickle, const std::string& source) {
  Unpickler unpickler(pickle, source);
  CAIRN_ASSIGN_OR_RETURN(const Value* root, unpickler.Run());
  return Converter(source).Metadata(root);
}

Result<StockMetadata> ReadStockMetadata(Storage* storage, const std::string& name) {
  CAIRN_ASSIGN_OR_RETURN(std::string raw, ReadMetadataFile(storage, name, kMaxStockMetadataSize));
  return DecodeStockMetadata(raw, JoinKey(storage->Describe(), name));
}

}  // namespace cairn::stock
