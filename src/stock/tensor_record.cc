// Decoding the data.pkl of torch.save(tensor) without a pickle VM.
//
// torch.save pickles one tensor as
//
//     GLOBAL torch._utils._rebuild_tensor_v2
//     ( ( 'storage', GLOBAL torch.<X>Storage, '<key>', '<location>', numel ) BINPERSID
//       storage_offset, (sizes...), (strides...), requires_grad,
//       GLOBAL collections.OrderedDict () REDUCE  [, metadata] ) REDUCE STOP
//
// (with BINPUT/BINGET memo traffic). The reader below knows exactly the
// opcodes that shape needs and three globals, and builds nothing: values are
// small tagged structs. Any other opcode, global or argument shape makes the
// archive "not simple" (kUnimplemented): it may still be a valid tensor, and
// the caller decodes it with torch.load(weights_only=True). Only geometry that
// is wrong for the storage it names is corruption (kDataLoss).
#include <cstring>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "cairn/stock.h"
#include "stock/dtypes.h"

namespace cairn::stock {
namespace {

using internal::Dtype;
using internal::kDtypes;
constexpr size_t kMaxPickle = 1 << 20;  // a one-tensor data.pkl is ~200 bytes
constexpr size_t kMaxStack = 4096;
constexpr size_t kMaxMemo = 4096;

struct Value {
  enum Kind {
    kMark,
    kNone,
    kBool,
    kInt,
    kStr,
    kTuple,
    kRebuild,
    kOrderedDict,
    kStorageClass,
    kStorage,
    kEmptyDict,
    kTensor
  };
  explicit Value(Kind k = kNone) : kind(k) {}
  Kind kind;
  int64_t i = 0;               // kInt, kBool; kStorage: numel
  std::string s;               // kStr; kStorage: key
  const Dtype* cls = nullptr;  // kStorageClass, kStorage: its storage class
  std::vector<Value> items;    // kTuple; kTensor: (offset, size, stride) as ints
};

Status NotSimple(std::string_view why) {
  return UnimplementedError("not torch.save's plain tensor form (" + std::string(why) + ")");
}

class TensorPickle {
 public:
  explicit TensorPickle(std::string_view p) : p_(p) {}

  // On success `*out` is the kTensor value, and `*storage` its storage.
  Status Run(Value* out) {
    while (true) {
      if (at_ >= p_.size()) return NotSimple("truncated pickle");
      const uint8_t op = static_cast<uint8_t>(p_[at_++]);
      switch (op) {
        case 0x80:
          CAIRN_RETURN_IF_ERROR(Skip(1));
          break;  // PROTO
        case 0x95:
          CAIRN_RETURN_IF_ERROR(Skip(8));
          break;     // FRAME
        case 'c': {  // GLOBAL
          std::string module, name;
          CAIRN_RETURN_IF_ERROR(Line(&module));
          CAIRN_RETURN_IF_ERROR(Line(&name));
          CAIRN_RETURN_IF_ERROR(PushGlobal(module, name));
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          Value name, module;
          CAIRN_RETURN_IF_ERROR(Pop(&name));
          CAIRN_RETURN_IF_ERROR(Pop(&module));
          if (name.kind != Value::kStr || module.kind != Value::kStr) return NotSimple("global");
          CAIRN_RETURN_IF_ERROR(PushGlobal(module.s, name.s));
          break;
        }
        case 'q':
          CAIRN_RETURN_IF_ERROR(Put(Uint(1)));
          break;  // BINPUT
        case 'r':
          CAIRN_RETURN_IF_ERROR(Put(Uint(4)));
          break;  // LONG_BINPUT
        case 0x94:
          CAIRN_RETURN_IF_ERROR(Put(memo_.size()));
          break;  // MEMOIZE
        case 'h':
          CAIRN_RETURN_IF_ERROR(Get(Uint(1)));
          break;  // BINGET
        case 'j':
          CAIRN_RETURN_IF_ERROR(Get(Uint(4)));
          break;  // LONG_BINGET
        case '(':
          CAIRN_RETURN_IF_ERROR(Push(Value{Value::kMark}));
          break;
        case 'X':     // BINUNICODE
        case 0x8c: {  // SHORT_BINUNICODE
          uint64_t n = Uint(op == 'X' ? 4 : 1);
          if (!ok_ || n > p_.size() - at_) return NotSimple("truncated string");
          Value v{Value::kStr};
          v.s.assign(p_.substr(at_, n));
          at_ += n;
          CAIRN_RETURN_IF_ERROR(Push(std::move(v)));
          break;
        }
        case 'K':
          CAIRN_RETURN_IF_ERROR(PushInt(Uint(1)));
          break;  // BININT1
        case 'M':
          CAIRN_RETURN_IF_ERROR(PushInt(Uint(2)));
          break;  // BININT2
        case 'J':
          CAIRN_RETURN_IF_ERROR(PushInt(static_cast<int32_t>(Uint(4))));
          break;
        case 0x8a: {  // LONG1: little-endian two's complement of n <= 8 bytes
          uint64_t n = Uint(1);
          if (!ok_ || n > 8 || n > p_.size() - at_) return NotSimple("long integer");
          uint64_t u = 0;
          for (uint64_t k = 0; k < n; ++k)
            u |= uint64_t{static_cast<uint8_t>(p_[at_ + k])} << (8 * k);
          if (n > 0 && n < 8 && (p_[at_ + n - 1] & 0x80)) u |= ~uint64_t{0} << (8 * n);
          at_ += n;
          CAIRN_RETURN_IF_ERROR(PushInt(static_cast<int64_t>(u)));
          break;
        }
        case 'N':
          CAIRN_RETURN_IF_ERROR(Push(Value{Value::kNone}));
          break;
        case 0x88:
        case 0x89: {  // NEWTRUE, NEWFALSE
          Value v{Value::kBool};
          v.i = op == 0x88;
          CAIRN_RETURN_IF_ERROR(Push(std::move(v)));
          break;
        }
        case '}':
          CAIRN_RETURN_IF_ERROR(Push(Value{Value::kEmptyDict}));
          break;
        case ')':
          CAIRN_RETURN_IF_ERROR(Push(Value{Value::kTuple}));
          break;
        case 0x85:
          CAIRN_RETURN_IF_ERROR(TupleN(1));
          break;
        case 0x86:
          CAIRN_RETURN_IF_ERROR(TupleN(2));
          break;
        case 0x87:
          CAIRN_RETURN_IF_ERROR(TupleN(3));
          break;
        case 't':
          CAIRN_RETURN_IF_ERROR(TupleToMark());
          break;
        case 'Q':
          CAIRN_RETURN_IF_ERROR(PersistentId());
          break;  // BINPERSID
        case 'R':
          CAIRN_RETURN_IF_ERROR(Reduce());
          break;
        case '.':  // STOP
          if (stack_.empty() || stack_.back().kind != Value::kTensor)
            return NotSimple("not a tensor");
          *out = std::move(stack_.back());
          return Status::OK();
        default:
          return NotSimple("opcode " + std::to_string(op));
      }
      if (!ok_) return NotSimple("truncated pickle");
    }
  }

 private:
  Status Skip(size_t n) {
    if (n > p_.size() - at_) return NotSimple("truncated pickle");
    at_ += n;
    return Status::OK();
  }
  uint64_t Uint(size_t n) {
    if (n > p_.size() - at_) {
      ok_ = false;
      return 0;
    }
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(p_[at_ + k])} << (8 * k);
    at_ += n;
    return v;
  }
  Status Line(std::string* out) {
    size_t nl = p_.find('\n', at_);
    if (nl == std::string_view::npos || nl - at_ > 256) return NotSimple("global name");
    out->assign(p_.substr(at_, nl - at_));
    at_ = nl + 1;
    return Status::OK();
  }
  Status Push(Value v) {
    if (stack_.size() >= kMaxStack) return NotSimple("stack too deep");
    stack_.push_back(std::move(v));
    return Status::OK();
  }
  Status PushInt(int64_t i) {
    Value v{Value::kInt};
    v.i = i;
    return Push(std::move(v));
  }
  Status Pop(Value* v) {
    if (stack_.empty() || stack_.back().kind == Value::kMark) return NotSimple("stack underflow");
    *v = std::move(stack_.back());
    stack_.pop_back();
    return Status::OK();
  }
  Status Put(uint64_t index) {
    if (!ok_ || stack_.empty() || index >= kMaxMemo) return NotSimple("memo");
    memo_[index] = stack_.back();
    return Status::OK();
  }
  Status Get(uint64_t index) {
    auto it = memo_.find(index);
    if (!ok_ || it == memo_.end()) return NotSimple("memo");
    return Push(it->second);
  }
  Status PushGlobal(const std::string& module, const std::string& name) {
    Value v;
    if (module == "torch._utils" && name == "_rebuild_tensor_v2") {
      v.kind = Value::kRebuild;
    } else if (module == "collections" && name == "OrderedDict") {
      v.kind = Value::kOrderedDict;
    } else {
      for (const Dtype& d : kDtypes) {
        if (module == "torch" && *d.storage_class != '\0' && name == d.storage_class) v.cls = &d;
      }
      if (v.cls == nullptr) return NotSimple("global " + module + "." + name);
      v.kind = Value::kStorageClass;
    }
    return Push(std::move(v));
  }
  Status TupleN(size_t n) {
    if (stack_.size() < n) return NotSimple("stack underflow");
    Value t{Value::kTuple};
    for (size_t k = stack_.size() - n; k < stack_.size(); ++k) {
      if (stack_[k].kind == Value::kMark) return NotSimple("stack underflow");
      t.items.push_back(std::move(stack_[k]));
    }
    stack_.resize(stack_.size() - n);
    return Push(std::move(t));
  }
  Status TupleToMark() {
    size_t mark = stack_.size();
    while (mark > 0 && stack_[mark - 1].kind != Value::kMark) --mark;
    if (mark == 0) return NotSimple("no mark");
    Value t{Value::kTuple};
    for (size_t k = mark; k < stack_.size(); ++k) t.items.push_back(std::move(stack_[k]));
    stack_.resize(mark - 1);
    return Push(std::move(t));
  }
  // ('storage', storage class, key, location, numel) -> a storage.
  Status PersistentId() {
    Value pid;
    CAIRN_RETURN_IF_ERROR(Pop(&pid));
    const auto& it = pid.items;
    if (pid.kind != Value::kTuple || it.size() != 5 || it[0].kind != Value::kStr ||
        it[0].s != "storage" || it[1].kind != Value::kStorageClass || it[2].kind != Value::kStr ||
        it[4].kind != Value::kInt) {
      return NotSimple("storage id");
    }
    Value v{Value::kStorage};
    v.cls = it[1].cls;
    v.s = it[2].s;
    v.i = it[4].i;
    return Push(std::move(v));
  }
  Status Reduce() {
    Value args, fn;
    CAIRN_RETURN_IF_ERROR(Pop(&args));
    CAIRN_RETURN_IF_ERROR(Pop(&fn));
    if (args.kind != Value::kTuple) return NotSimple("reduce arguments");
    if (fn.kind == Value::kOrderedDict) {
      if (!args.items.empty()) return NotSimple("hooks");
      return Push(Value{Value::kEmptyDict});
    }
    if (fn.kind != Value::kRebuild) return NotSimple("reduce");
    // (storage, offset, size, stride, requires_grad, hooks[, metadata])
    auto& a = args.items;
    auto int_tuple = [](const Value& v) {
      if (v.kind != Value::kTuple) return false;
      for (const Value& x : v.items) {
        if (x.kind != Value::kInt) return false;
      }
      return true;
    };
    if (a.size() < 6 || a.size() > 7 || a[0].kind != Value::kStorage || a[1].kind != Value::kInt ||
        !int_tuple(a[2]) || !int_tuple(a[3]) || a[2].items.size() != a[3].items.size() ||
        (a[5].kind != Value::kEmptyDict && a[5].kind != Value::kNone) ||
        (a.size() == 7 && a[6].kind != Value::kNone && a[6].kind != Value::kEmptyDict)) {
      return NotSimple("rebuild arguments");
    }
    Value t{Value::kTensor};
    t.items = {std::move(a[0]), std::move(a[1]), std::move(a[2]), std::move(a[3])};
    return Push(std::move(t));
  }

  std::string_view p_;
  size_t at_ = 0;
  bool ok_ = true;
  std::vector<Value> stack_;
  std::map<uint64_t, Value> memo_;
};

const ZipEntry* Find(const std::vector<ZipEntry>& entries, std::string_view name) {
  for (const ZipEntry& e : entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

Status ReadEntry(const ReadableFile& archive, const ZipEntry& e, std::string* out) {
  out->resize(e.size);
  return archive.ReadAt(e.data_begin, out->data(), e.size);
}

}  // namespace

Result<TensorRecord> DecodeTensorRecord(const ReadableFile& archive,
                                        const std::vector<ZipEntry>& entries, bool verify_crc) {
  const ZipEntry* pkl = nullptr;
  int pkl_count = 0;
  for (const ZipEntry& e : entries) {
    if (e.method != 0) return NotSimple("compressed entry");
    size_t slash = e.name.find('/');
    if (e.name.size() > 9 && e.name.ends_with("/data.pkl") && slash == e.name.size() - 9) {
      pkl = &e;
      ++pkl_count;
    }
  }
  if (pkl_count != 1) return NotSimple("layout");
  if (pkl->size > kMaxPickle) return NotSimple("large data.pkl");
  const std::string prefix = pkl->name.substr(0, pkl->name.size() - 8);
  std::string small;
  if (const ZipEntry* order = Find(entries, prefix + "byteorder")) {
    if (order->size > 16) return NotSimple("byte order");
    CAIRN_RETURN_IF_ERROR(ReadEntry(archive, *order, &small));
    if (verify_crc) CAIRN_RETURN_IF_ERROR(VerifyEntry(*order, small.data(), small.size()));
    if (small != "little") return NotSimple("byte order");
  }
  std::string pickle;
  CAIRN_RETURN_IF_ERROR(ReadEntry(archive, *pkl, &pickle));
  if (verify_crc) CAIRN_RETURN_IF_ERROR(VerifyEntry(*pkl, pickle.data(), pickle.size()));
  Value tensor;
  CAIRN_RETURN_IF_ERROR(TensorPickle(pickle).Run(&tensor));

  const Value& storage = tensor.items[0];
  TensorRecord rec;
  rec.dtype = storage.cls->canonical;
  rec.itemsize = storage.cls->itemsize;
  rec.storage_offset = tensor.items[1].i;
  for (const Value& v : tensor.items[2].items) rec.size.push_back(v.i);
  for (const Value& v : tensor.items[3].items) rec.stride.push_back(v.i);
  const ZipEntry* data = Find(entries, prefix + "data/" + storage.s);
  const uint64_t numel = static_cast<uint64_t>(storage.i);
  if (data == nullptr || storage.i < 0 ||
      numel > std::numeric_limits<uint64_t>::max() / rec.itemsize ||
      data->size != numel * rec.itemsize) {
    return DataLossError("tensor storage is missing or has the wrong size");
  }
  rec.storage = *data;
  rec.storage_numel = numel;
  if (rec.storage_offset < 0) return DataLossError("negative tensor geometry");
  bool empty = false;
  for (size_t d = 0; d < rec.size.size(); ++d) {
    if (rec.size[d] < 0 || rec.stride[d] < 0) return DataLossError("negative tensor geometry");
    empty |= rec.size[d] == 0;
  }
  if (!empty) {  // the last viewed element must lie inside the storage
    unsigned __int128 extent = static_cast<uint64_t>(rec.storage_offset) + 1;
    for (size_t d = 0; d < rec.size.size(); ++d) {
      extent +=
          static_cast<unsigned __int128>(rec.size[d] - 1) * static_cast<uint64_t>(rec.stride[d]);
      if (extent > numel) return DataLossError("tensor view exceeds its storage");
    }
  }
  if (verify_crc) {  // every other small entry (version, serialization id, ...)
    for (const ZipEntry& e : entries) {
      if (&e == data || &e == pkl || e.name == prefix + "byteorder") continue;
      if (e.size > kMaxPickle) return NotSimple("large entry " + e.name);
      CAIRN_RETURN_IF_ERROR(ReadEntry(archive, e, &small));
      CAIRN_RETURN_IF_ERROR(VerifyEntry(e, small.data(), small.size()));
    }
  }
  return rec;
}

}  // namespace cairn::stock
