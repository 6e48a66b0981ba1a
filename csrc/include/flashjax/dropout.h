// Attention dropout's keep mask: one definition for every path (CPU, every CUDA
// kernel, and the pure-JAX generator in src/flashjax/_dropout.py, bit for bit).
//
// Generator: Philox4x32-7 (Salmon, Moraes, Dror, Shaw, "Parallel random numbers:
// as easy as 1, 2, 3", SC'11; the constants of Random123's philox.h, checked
// against its kat_vectors in tests/test_dropout.py). Counter-based: an output is a
// pure function of a 128-bit counter and a 64-bit key, so any thread can make any
// element's bits, forward and backward alike, with no state. Seven rounds, as
// FlashAttention 2's dropout: the paper finds Philox4x32 with 7 rounds passing
// TestU01's BigCrush (Random123 defaults to 10, a margin); each round is ~4
// instructions of every dropout element's ~6 in the kernels.
//
// Key (k0, k1): the JAX PRNG key's data words (jax.random.key_data of a typed key, a
// legacy uint32[2] key as it is; a key of 2n words is folded: k0 = XOR of the even
// words, k1 = XOR of the odd ones; _dropout.key_words).
//
// Keep-mask element (b, h, i, j): sequence b, query head h, query row i, key column j
// (0-based, within the call's sequences):
//   counter = (x0 = (j / 16) * 4 + (j % 8) / 2,  x1 = (i / 16) * 8 + i % 8,  x2 = h,  x3 = b)
//   slot    = ((i % 16) / 8) * 4 + ((j % 16) / 8) * 2 + j % 2                 (0..7)
//   value   = (w[slot / 2] >> (16 * (slot % 2))) & 0xFFFF,  w = Philox4x32-7(counter, key)
//   keep    = value >= T,  T = threshold(rate)
// Kept probabilities are scaled by 1 / (1 - rate), dropped ones are zero.
//
// Why this grouping: one Philox call gives 8 16-bit values, for query rows {r, r+8}
// x keys {c, c+1, c+8, c+9} (r = 16 * (x1 / 8) + x1 % 8, c = 16 * (x0 / 4) + 2 * (x0 %
// 4)): exactly what one thread holds of a 16x16 block of S in the mma.sync / wgmma
// accumulator layout (lane l: rows l/4 and l/4 + 8, column pairs 2 (l % 4) and
// 2 (l % 4) + 8). The forward uses every generated bit; the backward, which holds
// S^T (keys as rows), uses half of each call.
#pragma once

#include <cstdint>

#ifndef FJ_HOST_DEVICE
#if defined(__CUDACC__)
#define FJ_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FJ_HOST_DEVICE inline
#endif
#endif

namespace flashjax::dropout {

// Philox4x32's multipliers and Weyl key increments (Random123).
constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
constexpr int kRounds = 7;

// Keep elements whose 16-bit value is >= T; values are uniform in [0, 65536).
constexpr uint32_t kValueRange = 65536;
// T's largest value: a rate in [0, 1) always keeps something (rates from
// 1 - 1.5 / 65536 up keep 1 value in 65536; dropping everything is no rate).
constexpr uint32_t kMaxThreshold = kValueRange - 1;
// Elements per Philox call (its four words, two 16-bit values each).
constexpr int kGroupSize = 8;

struct Words4 {
  uint32_t x[4];
};

// The high 32 bits of a * b.
FJ_HOST_DEVICE uint32_t mul_hi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// One Philox4x32 round with round key (k0, k1).
FJ_HOST_DEVICE Words4 philox_round(const Words4& c, uint32_t k0, uint32_t k1) {
  const uint32_t hi0 = mul_hi(kMul0, c.x[0]), lo0 = kMul0 * c.x[0];
  const uint32_t hi1 = mul_hi(kMul1, c.x[2]), lo1 = kMul1 * c.x[2];
  return Words4{{hi1 ^ c.x[1] ^ k0, lo1, hi0 ^ c.x[3] ^ k1, lo0}};
}

// Philox4x32-R: R rounds (kRounds for the keep mask; 10 too, for the known-answer
// tests), the key bumped by the Weyl increments between rounds.
template <int R = kRounds>
FJ_HOST_DEVICE Words4 philox4x32(Words4 c, uint32_t k0, uint32_t k1) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < R; ++r) {
    c = philox_round(c, k0, k1);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return c;
}

// The static rate's threshold, computed once on the host: round(rate * 65536), half
// up, clamped to [0, kMaxThreshold] (a NaN or negative rate gives 0: keep all).
// Callers validate the rate (flashjax checks 0 <= rate < 1 in Python).
inline uint32_t threshold(double rate) {
  const double t = rate * static_cast<double>(kValueRange) + 0.5;
  if (!(t >= 1.0)) return 0;
  return t >= static_cast<double>(kMaxThreshold) ? kMaxThreshold : static_cast<uint32_t>(t);
}

// The counter words of query row i / key column j (x1 / x0).
FJ_HOST_DEVICE uint32_t row_counter(uint32_t i) { return (i / 16) * 8 + i % 8; }
FJ_HOST_DEVICE uint32_t column_counter(uint32_t j) { return (j / 16) * 4 + (j % 8) / 2; }
// Element (i, j)'s slot among its call's 8 values.
FJ_HOST_DEVICE int slot(uint32_t i, uint32_t j) {
  return static_cast<int>(((i % 16) / 8) * 4 + ((j % 16) / 8) * 2 + j % 2);
}
// The inverse: the first row / column of the group with counters (x1, x0), and
// where slot s lies from there (rows +0/+8, columns +0, +1, +8, +9).
FJ_HOST_DEVICE uint32_t group_row(uint32_t x1) { return (x1 / 8) * 16 + x1 % 8; }
FJ_HOST_DEVICE uint32_t group_column(uint32_t x0) { return (x0 / 4) * 16 + (x0 % 4) * 2; }
FJ_HOST_DEVICE uint32_t slot_row_offset(int s) { return static_cast<uint32_t>(s / 4) * 8; }
FJ_HOST_DEVICE uint32_t slot_column_offset(int s) {
  return static_cast<uint32_t>((s / 2) % 2) * 8 + static_cast<uint32_t>(s % 2);
}

// The generator of one call: its key and threshold.
struct Generator {
  uint32_t k0 = 0, k1 = 0;
  uint32_t threshold = 0;  // threshold(rate); 0 keeps every element

  // The 8 values of the group (b, h, x1, x0), value of slot s in word s / 2,
  // bits 16 (s % 2) and up.
  FJ_HOST_DEVICE Words4 group_words(uint32_t b, uint32_t h, uint32_t x1, uint32_t x0) const {
    return philox4x32(Words4{{x0, x1, h, b}}, k0, k1);
  }
  // The group's keep bits: bit s set when slot s is kept.
  FJ_HOST_DEVICE uint32_t group_keep_bits(uint32_t b, uint32_t h, uint32_t x1,
                                          uint32_t x0) const {
    const Words4 w = group_words(b, h, x1, x0);
    uint32_t bits = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int s = 0; s < kGroupSize; ++s) {
      const uint32_t value = (w.x[s / 2] >> (16 * (s % 2))) & 0xFFFFu;
      bits |= static_cast<uint32_t>(value >= threshold) << s;
    }
    return bits;
  }
  // One element (a whole Philox call for one bit: for checks and scalar paths; a
  // kernel takes a group's bits once).
  FJ_HOST_DEVICE bool keep(uint32_t b, uint32_t h, uint32_t i, uint32_t j) const {
    return (group_keep_bits(b, h, row_counter(i), column_counter(j)) >> slot(i, j)) & 1u;
  }
};

}  // namespace flashjax::dropout
