// Storage types of the CPU path and their float32 conversions.
#pragma once

#include <cstdint>
#include <cstring>

#include "flashjax/params.h"
#include "tile_math.h"

namespace flashjax::cpu {

struct BFloat16 {
  uint16_t bits;
};
using Float16 = _Float16;

inline float to_float(float x) { return x; }
inline float to_float(Float16 x) { return static_cast<float>(x); }
inline float to_float(BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// dst[0, n) = src[0, n) as floats, vectorised (the tile kernels' conversions).
inline void to_float_row(float* dst, const float* src, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}
inline void to_float_row(float* dst, const BFloat16* src, int64_t n) {
  tile_kernels().bf16_to_float(dst, &src->bits, n);
}
inline void to_float_row(float* dst, const Float16* src, int64_t n) {
  tile_kernels().f16_to_float(dst, reinterpret_cast<const uint16_t*>(src), n);
}

template <class T>
T from_float(float x);
template <>
inline float from_float<float>(float x) { return x; }
template <>
inline Float16 from_float<Float16>(float x) { return static_cast<Float16>(x); }
template <>
inline BFloat16 from_float<BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return BFloat16{0x7fc0};  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);                           // round to nearest even
  return BFloat16{static_cast<uint16_t>(bits >> 16)};
}

// Calls fn(T{}) with the storage type of `dtype`.
template <class Fn>
auto dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat16:
      return fn(Float16{});
    case DType::kBFloat16:
      return fn(BFloat16{});
    case DType::kFloat32:
    default:
      return fn(float{});
  }
}

}  // namespace flashjax::cpu
