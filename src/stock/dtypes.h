// torch's dtypes as stock checkpoints name them, for the .metadata decoder
// (metadata_pickle.cc) and the tensor-record reader (tensor_record.cc).
#pragma once

#include <cstdint>

namespace cairn::stock::internal {

struct Dtype {
  const char* name;           // as torch 2.x exposes it (aliases too): torch.<name>
  const char* canonical;      // the dtype's own name
  const char* storage_class;  // torch.save's legacy torch.<Name>Storage of it, or ""
  uint32_t itemsize;
};

inline constexpr Dtype kDtypes[] = {
    {"float32", "float32", "FloatStorage", 4},
    {"float", "float32", "", 4},
    {"float64", "float64", "DoubleStorage", 8},
    {"double", "float64", "", 8},
    {"float16", "float16", "HalfStorage", 2},
    {"half", "float16", "", 2},
    {"bfloat16", "bfloat16", "BFloat16Storage", 2},
    {"complex32", "complex32", "", 4},
    {"chalf", "complex32", "", 4},
    {"complex64", "complex64", "ComplexFloatStorage", 8},
    {"cfloat", "complex64", "", 8},
    {"complex128", "complex128", "ComplexDoubleStorage", 16},
    {"cdouble", "complex128", "", 16},
    {"uint8", "uint8", "ByteStorage", 1},
    {"uint16", "uint16", "", 2},
    {"uint32", "uint32", "", 4},
    {"uint64", "uint64", "", 8},
    {"int8", "int8", "CharStorage", 1},
    {"int16", "int16", "ShortStorage", 2},
    {"short", "int16", "", 2},
    {"int32", "int32", "IntStorage", 4},
    {"int", "int32", "", 4},
    {"int64", "int64", "LongStorage", 8},
    {"long", "int64", "", 8},
    {"bool", "bool", "BoolStorage", 1},
    {"quint8", "quint8", "", 1},
    {"qint8", "qint8", "", 1},
    {"qint32", "qint32", "", 4},
    {"quint4x2", "quint4x2", "", 1},
    {"quint2x4", "quint2x4", "", 1},
    {"float8_e4m3fn", "float8_e4m3fn", "", 1},
    {"float8_e5m2", "float8_e5m2", "", 1},
    {"float8_e4m3fnuz", "float8_e4m3fnuz", "", 1},
    {"float8_e5m2fnuz", "float8_e5m2fnuz", "", 1},
    {"float8_e8m0fnu", "float8_e8m0fnu", "", 1},
    {"float4_e2m1fn_x2", "float4_e2m1fn_x2", "", 1},
    {"bits1x8", "bits1x8", "", 1},
    {"bits2x4", "bits2x4", "", 1},
    {"bits4x2", "bits4x2", "", 1},
    {"bits8", "bits8", "", 1},
    {"bits16", "bits16", "", 2},
    {"bit", "uint1", "", 1},
    {"uint1", "uint1", "", 1},
    {"uint2", "uint2", "", 1},
    {"uint3", "uint3", "", 1},
    {"uint4", "uint4", "", 1},
    {"uint5", "uint5", "", 1},
    {"uint6", "uint6", "", 1},
    {"uint7", "uint7", "", 1},
    {"int1", "int1", "", 1},
    {"int2", "int2", "", 1},
    {"int3", "int3", "", 1},
    {"int4", "int4", "", 1},
    {"int5", "int5", "", 1},
    {"int6", "int6", "", 1},
    {"int7", "int7", "", 1},
};

}  // namespace cairn::stock::internal
