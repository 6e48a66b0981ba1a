// The float8 storage types of KV caches on the CPU path (float8_e4m3fn and
// float8_e5m2, params.h CacheElement): their exact float values (a table of the
// 256 codes) and the rounding of a float into them as XLA's conversion does it:
// to nearest, ties to the even code; past the largest finite value e4m3fn's
// NaN and e5m2's inf.
#pragma once

#include <cmath>
#include <cstdint>

#include "flashjax/params.h"

namespace flashjax::cpu {

inline constexpr int kFloat8Codes = 256;

// A float8 format of 1 sign, kExponent, kMantissa bits; e4m3fn has no inf and one
// NaN code a sign (all exponent and mantissa bits set), e5m2 IEEE-like inf / NaN.
template <int kExponentBits, int kMantissaBits, bool kIeeeSpecials>
struct Float8 {
  static constexpr int kExponent = kExponentBits, kMantissa = kMantissaBits;
  // (the tile kernels' name of the format: TileKernels::float8_to_float)
  static constexpr CacheElement kElement =
      kIeeeSpecials ? CacheElement::kFloat8E5M2 : CacheElement::kFloat8E4M3;
  static constexpr int kBias = (1 << (kExponent - 1)) - 1;
  static constexpr int kSign = 0x80;
  static constexpr int kMaxExponent = (1 << kExponent) - 1;
  // The largest finite code, and the code an overflow takes (NaN for e4m3fn, inf).
  static constexpr int kMaxFinite = kIeeeSpecials ? (kMaxExponent << kMantissa) - 1 : 0x7e;
  static constexpr int kOverflow = kIeeeSpecials ? kMaxExponent << kMantissa : 0x7f;
  static constexpr int kNan = 0x7f;  // (e5m2: a NaN too)
  uint8_t bits;

  static float value_of(int code) {
    const int e = (code >> kMantissa) & kMaxExponent, m = code & ((1 << kMantissa) - 1);
    float v;
    if (kIeeeSpecials && e == kMaxExponent)
      v = m ? NAN : INFINITY;
    else if (!kIeeeSpecials && (code & 0x7f) == 0x7f)
      v = NAN;
    else if (e == 0)  // subnormal
      v = std::ldexp(static_cast<float>(m), 1 - kBias - kMantissa);
    else
      v = std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -kMantissa), e - kBias);
    return (code & kSign) ? -v : v;
  }
  static float overflow_value() {
    const float mantissa = kIeeeSpecials ? 1.0f : 2.0f - std::ldexp(1.0f, -kMantissa);
    return std::ldexp(mantissa, kMaxExponent - kBias);
  }
  // The codes' values.
  static const float* table() {
    static const auto values = [] {
      struct Table { float v[kFloat8Codes]; } t;
      for (int code = 0; code < kFloat8Codes; ++code) t.v[code] = value_of(code);
      return t;
    }();
    return values.v;
  }
  // x rounded to the nearest code, ties to the even one.
  static Float8 from(float x) {
    if (std::isnan(x)) return {static_cast<uint8_t>(kNan)};
    const int sign = std::signbit(x) ? kSign : 0;
    const float a = std::fabs(x), *v = table();
    int lo = 0, hi = kMaxFinite;  // the largest code whose value is <= a, by bisection
    if (a >= v[kMaxFinite]) {
      lo = kMaxFinite;
    } else {
      while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        (v[mid] <= a ? lo : hi) = mid;
      }
    }
    // The next value up; past the largest finite one, the value the overflow code
    // would have (e5m2: 2^16 where inf is; e4m3fn: 480 where NaN is). The codes are
    // few bits: the sum and the doubling below are exact.
    const float next = lo < kMaxFinite ? v[lo + 1] : overflow_value();
    const int up = lo < kMaxFinite ? lo + 1 : kOverflow;
    const float twice = 2.0f * a, midpoint = v[lo] + next;
    const int code = twice < midpoint ? lo : twice > midpoint ? up : (lo % 2 == 0 ? lo : up);
    if (code == kOverflow && !kIeeeSpecials) return {static_cast<uint8_t>(kNan | sign)};
    return {static_cast<uint8_t>(code | sign)};
  }
};
using Float8E4M3 = Float8<4, 3, false>;
using Float8E5M2 = Float8<5, 2, true>;

template <class T>
inline constexpr bool kIsFloat8 = false;
template <int kE, int kM, bool kI>
inline constexpr bool kIsFloat8<Float8<kE, kM, kI>> = true;

// Calls fn(C{}) with the cache's storage type: T (q's), or its float8 type.
template <class T, class Fn>
auto dispatch_cache_element(CacheElement element, Fn&& fn) {
  switch (element) {
    case CacheElement::kFloat8E4M3:
      return fn(Float8E4M3{});
    case CacheElement::kFloat8E5M2:
      return fn(Float8E5M2{});
    case CacheElement::kAsQuery:
    default:
      return fn(T{});
  }
}

}  // namespace flashjax::cpu
