// Checks, on a Hopper GPU, the operand layouts the planned fp8 forward rests on
// (docs/architecture.md, "float8 inputs"): one warpgroup computes
//   S = Q K^T      (64 query rows x 128 keys, head dim 128, float8 e4m3, Q and K
//                   K-major in 128-byte-swizzled shared memory, as TMA leaves them),
//   P = 2^(s * kLog2Scale - max + 8), rounded to e4m3 and packed from each thread's
//       own accumulators into the 8-bit A operand (no shuffles),
//   O = P V        (B = V transposed, [head dims][keys], K-major, with each 32-key
//                   block's keys permuted into the order the packing leaves P in),
// and the host compares S and O with float64 products of the same float8 values (O
// from the P the device rounded, which it also writes out). The same O with V
// transposed but not permuted is reported too: it must disagree (the check can fail).
//
// Build and run (the device; benchmarks/device_varlen.sh step fp8check):
//   nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icsrc -Icsrc/cuda \
//     tools/fp8_wgmma_check.cu -o /tmp/fp8_wgmma_check && /tmp/fp8_wgmma_check
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90/hopper_common.cuh"
#include "sm90/wgmma_ops.cuh"

namespace {

using Fp8 = __nv_fp8_e4m3;

constexpr int kRows = 64, kKeys = 128, kDim = 128;  // one consumer's tile, head dim 128
constexpr int kKeyBlock = 32;                        // keys of an 8-bit wgmma k-step
constexpr int kTileBytes = 128 * 128;                // a 128 x 128-byte tile
constexpr float kLog2Scale = 0.125f;                 // (any: P's values only vary)
constexpr float kExponentOffset = 8.0f;              // P in (0, 256], as FA3's Max_offset

// Operand slot k of a 32-key block holds key permuted_key(k) (params.h's Float8Inputs:
// the slot a thread fills from its own accumulators, p_fragment_f8).
using flashjax::Float8Inputs;

// Byte (row, col) of a tile of 128-byte rows in the 128-byte swizzle TMA writes.
__device__ int swizzled(int row, int col) {
  return row * 128 + ((((col >> 4) ^ (row & 7))) << 4) + (col & 15);
}

__device__ float e4m3_value(uint32_t word, int byte) {
  __nv_fp8_e4m3 x;
  x.__x = static_cast<__nv_fp8_storage_t>((word >> (8 * byte)) & 0xff);
  return static_cast<float>(x);
}

// q: [64][128], k: [128 keys][128], vt: [128 head dims][128 keys] (keys permuted or
// not), bytes; s, p, o: [64][128] float32 (p: the rounded P in natural key order).
__global__ void __launch_bounds__(128) check_kernel(const uint8_t* q, const uint8_t* k,
                                                    const uint8_t* vt, float* s_out,
                                                    float* p_out, float* o_out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // (hopper_common.cuh's device part)
  using namespace flashjax::cuda;
  __shared__ __align__(1024) unsigned char smem[3 * kTileBytes];
  unsigned char *sq = smem, *sk = smem + kTileBytes, *sv = smem + 2 * kTileBytes;
  for (int i = threadIdx.x; i < kTileBytes; i += 128) {
    const int r = i / 128, c = i % 128;
    if (r < kRows) sq[swizzled(r, c)] = q[i];
    sk[swizzled(r, c)] = k[i];
    sv[swizzled(r, c)] = vt[i];
  }
  fence_proxy_async();
  __syncthreads();

  float s[64] = {};
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kDim / kKeyBlock; ++kk)
    wgmma_ss_f8_n128<Fp8>(s, k_major_desc<kRows>(sq, kk), k_major_desc<kKeys>(sk, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<0>();

  // Accumulator i of this thread: row g + 8 ((i / 2) % 2), key 8 (i / 4) + 2 t + i % 2.
  const int lane = threadIdx.x % 32, t = lane % 4;
  const int g = (threadIdx.x / 32) * 16 + lane / 4;
  const auto row_of = [&](int i) { return g + 8 * ((i / 2) % 2); };
  const auto key_of = [&](int i) { return 8 * (i / 4) + 2 * t + i % 2; };
  float row_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    s_out[row_of(i) * kKeys + key_of(i)] = s[i];
    row_max[(i / 2) % 2] = fmaxf(row_max[(i / 2) % 2], s[i] * kLog2Scale);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int m = 1; m < 4; m *= 2)
      row_max[h] = fmaxf(row_max[h], __shfl_xor_sync(0xffffffffu, row_max[h], m));
#pragma unroll
  for (int i = 0; i < 64; ++i)
    s[i] = exp2f(s[i] * kLog2Scale - row_max[(i / 2) % 2] + kExponentOffset);

  // Key block b (the kernel's packing, p_fragment_f8): register 0 row g (8-key tiles
  // 4b, 4b + 1), 1 row g + 8, 2 and 3 the same of tiles 4b + 2, 4b + 3; a tile's two
  // keys of a row are accumulators 4n + 2h and 4n + 2h + 1 (h: the row half).
  uint32_t pa[kKeys / kKeyBlock][4];
#pragma unroll
  for (int b = 0; b < kKeys / kKeyBlock; ++b) {
    p_fragment_f8<kKeys / 8>(pa[b], s, b);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int h = r % 2, n = 4 * b + 2 * (r / 2);
#pragma unroll
      for (int byte = 0; byte < 4; ++byte) {
        const int i = 4 * (n + byte / 2) + 2 * h + byte % 2;
        p_out[row_of(i) * kKeys + key_of(i)] = e4m3_value(pa[b][r], byte);
      }
    }
  }

  float o[64] = {};
  wgmma_fence();
#pragma unroll
  for (int b = 0; b < kKeys / kKeyBlock; ++b)
    wgmma_rs_f8_n128<Fp8>(o, pa[b], k_major_desc<kDim>(sv, b), b > 0);
  wgmma_commit();
  wgmma_wait<0>();
  // (O's accumulators as S's: column key_of(i) is a head dim here)
#pragma unroll
  for (int i = 0; i < 64; ++i) o_out[row_of(i) * kDim + key_of(i)] = o[i];
#endif
}

uint8_t to_e4m3(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
double from_e4m3(uint8_t x) {
  __nv_fp8_e4m3 v;
  v.__x = x;
  return static_cast<float>(v);
}

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      std::printf("%s: %s\n", #call, cudaGetErrorString(e_));                          \
      return 2;                                                                        \
    }                                                                                  \
  } while (0)

// Hopper's float8 wgmma adds its products with fewer mantissa bits than float32 (about
// 14: DeepSeek-V3's report, section 3.3.2): on this H200, 4.3e-4 (S) and 5.5e-4 (O) of
// the largest value against float64 of the same float8 inputs (2026-11-29). A wrong
// layout pairs the wrong keys: errors of the order of the values (1.4 for plain V).
constexpr double kFp8AccumulationTolerance = 2e-3;
constexpr double kLayoutErrorFloor = 1e-1;

// Largest |got - want| over the largest |want|.
double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    err = std::fmax(err, std::fabs(got[i] - want[i]));
    scale = std::fmax(scale, std::fabs(want[i]));
  }
  return err / scale;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<uint8_t> q(kRows * kDim), k(kKeys * kDim), v(kKeys * kDim);
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = to_e4m3(2.0f * normal(rng));
  // V transposed, [head dim][key]; permuted: slot k of each 32-key block holds key perm(k).
  std::vector<uint8_t> vt_permuted(kDim * kKeys), vt_plain(kDim * kKeys);
  for (int d = 0; d < kDim; ++d)
    for (int key = 0; key < kKeys; ++key) {
      const int block = key / kKeyBlock * kKeyBlock;
      vt_permuted[d * kKeys + key] = v[(block + Float8Inputs::permuted_key(key % kKeyBlock)) * kDim + d];
      vt_plain[d * kKeys + key] = v[key * kDim + d];
    }

  uint8_t *dq, *dk, *dv;
  float *ds, *dp, *dout;
  CHECK(cudaMalloc(&dq, q.size()));
  CHECK(cudaMalloc(&dk, k.size()));
  CHECK(cudaMalloc(&dv, v.size()));
  CHECK(cudaMalloc(&ds, sizeof(float) * kRows * kKeys));
  CHECK(cudaMalloc(&dp, sizeof(float) * kRows * kKeys));
  CHECK(cudaMalloc(&dout, sizeof(float) * kRows * kDim));
  CHECK(cudaMemcpy(dq, q.data(), q.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), k.size(), cudaMemcpyHostToDevice));

  std::vector<double> s_ref(kRows * kKeys, 0.0);
  for (int r = 0; r < kRows; ++r)
    for (int key = 0; key < kKeys; ++key)
      for (int d = 0; d < kDim; ++d)
        s_ref[r * kKeys + key] += from_e4m3(q[r * kDim + d]) * from_e4m3(k[key * kDim + d]);

  int failures = 0;
  for (int permuted = 1; permuted >= 0; --permuted) {
    const auto& vt = permuted ? vt_permuted : vt_plain;
    CHECK(cudaMemcpy(dv, vt.data(), vt.size(), cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dout, 0xff, sizeof(float) * kRows * kDim));  // (poisoned: NaN)
    check_kernel<<<1, 128>>>(dq, dk, dv, ds, dp, dout);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> s(kRows * kKeys), p(kRows * kKeys), o(kRows * kDim);
    CHECK(cudaMemcpy(s.data(), ds, sizeof(float) * s.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(p.data(), dp, sizeof(float) * p.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(o.data(), dout, sizeof(float) * o.size(), cudaMemcpyDeviceToHost));
    std::vector<double> o_ref(kRows * kDim, 0.0);
    for (int r = 0; r < kRows; ++r)
      for (int d = 0; d < kDim; ++d)
        for (int key = 0; key < kKeys; ++key)
          o_ref[r * kDim + d] += double(p[r * kKeys + key]) * from_e4m3(v[key * kDim + d]);
    const double s_err = relative_error(s, s_ref), o_err = relative_error(o, o_ref);
    const bool s_ok = s_err < kFp8AccumulationTolerance,
               o_ok = permuted ? o_err < kFp8AccumulationTolerance : o_err > kLayoutErrorFloor;
    std::printf("%s V: S relative error %.2e (%s), O relative error %.2e (%s)\n",
                permuted ? "permuted" : "plain (must disagree)", s_err, s_ok ? "ok" : "FAIL",
                o_err, o_ok ? "ok" : "FAIL");
    failures += !s_ok + !o_ok;
  }
  std::printf(failures ? "fp8 wgmma layouts: FAILED\n" : "fp8 wgmma layouts: ok\n");
  return failures ? 1 : 0;
}
