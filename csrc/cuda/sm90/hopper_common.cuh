// Hopper (sm_90a) building blocks shared by the TMA/wgmma kernels: mbarriers,
// TMA tile loads, wgmma descriptors and issue/wait helpers, named barriers,
// and the host-side tensor maps.
//
// Shared-memory tiles use the 128-byte swizzle that TMA writes and wgmma reads:
// a [rows][d] tile is column blocks of rows x 128 B (64 16-bit elements per
// row; kElementBytes says the element size where it matters), 1024-byte aligned.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cstdint>

#include "flashjax/params.h"
#include "wgmma_ops.cuh"

namespace flashjax::cuda {

constexpr int kSmemLimit = 227 * 1024;  // the opt-in shared memory of an sm_90 CTA
constexpr int kRegisterFile = 64 * 1024;  // 32-bit registers of an sm_90 SM
constexpr int kSwizzleBytes = 128;      // a swizzle row (of one column block)
// Elements per swizzle row: the columns of one column block.
template <int kElementBytes>
constexpr int kSwizzleCols = kSwizzleBytes / kElementBytes;
// The column blocks of a tile of kCols elements (a partial last one included).
template <int kCols, int kElementBytes>
constexpr int kColumnBlocks =
    (kCols + kSwizzleCols<kElementBytes> - 1) / kSwizzleCols<kElementBytes>;
// Bytes of A and B that one wgmma k-step reads per row (16 16-bit elements).
constexpr int kMmaKBytes = 32;

// Shared memory is planned as regions appended in order, each at the next
// offset its use allows (a plan runs in a constexpr function: its offsets are
// constants).
constexpr int kSmemBaseAlign = 1024;    // align_smem rounds the kernel's base up to this
constexpr int kTileAlign = 1024;        // a swizzled tile (8 rows of 128 B)
constexpr int kBulkAlign = 16;          // a bulk copy's or bulk reduction's buffer
constexpr int kBarrierAlign = 8;        // an mbarrier
constexpr int kBarrierBytes = 8;

struct SmemPlan {
  int end = 0;
  // Appends `bytes` at the first multiple of `align` not before the end; returns its offset.
  constexpr int append(int bytes, int align) {
    const int offset = (end + align - 1) / align * align;
    end = offset + bytes;
    return offset;
  }
  constexpr int barriers(int count) { return append(count * kBarrierBytes, kBarrierAlign); }
  // What a kernel asks for: the regions and room to align their base.
  constexpr int smem_bytes() const { return end + kSmemBaseAlign; }
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The dynamic shared memory's first 1024-byte-aligned address (the 128-byte
// swizzle's period). (Aligning by pointer arithmetic instead, which lets the
// compiler see every access as a shared one, measured mixed: -2% at d64, +2%
// at d128 in the backward.)
__device__ __forceinline__ unsigned char* align_smem(unsigned char* raw) {
  constexpr uintptr_t kMask = kSmemBaseAlign - 1;
  return reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(raw) + kMask) & ~kMask);
}

// Shared-memory stores by 32-bit shared address: through a generic pointer
// each store needs a 64-bit address, which the compiler hoists out of tile
// loops into registers that the consumers do not have.
__device__ __forceinline__ void st_shared(uint32_t addr, uint32_t x) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(x) : "memory");
}
__device__ __forceinline__ void st_shared(uint32_t addr, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(x), "f"(y) : "memory");
}
// Four 8x8 16-bit matrices, each thread's 32-bit register of matrix i holding
// row lane / 4, columns 2 (lane % 4) and the next (the accumulator fragment's
// layout); lanes 8i..8i+7 give the addresses of matrix i's rows (16 bytes each).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                            uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ void ld_shared(uint32_t addr, float& x, float& y) {
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
}
// 64-bit shared-memory words between threads, ordered by the mbarriers around
// them (volatile asm: the compiler keeps them in place among the barrier ops).
__device__ __forceinline__ void st_shared_u64(uint32_t addr, uint64_t x) {
  asm volatile("st.shared.u64 [%0], %1;\n" ::"r"(addr), "l"(x) : "memory");
}
__device__ __forceinline__ uint64_t ld_shared_u64(uint32_t addr) {
  uint64_t x;
  asm volatile("ld.shared.u64 %0, [%1];\n" : "=l"(x) : "r"(addr) : "memory");
  return x;
}
__device__ __forceinline__ float ld_shared(uint32_t addr) {
  float x;
  asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr) : "memory");
  return x;
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)),
               "r"(bytes));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_u32(bar)));
}
// One arrival on `bar` for the calling warp, after its lanes' earlier writes.
__device__ __forceinline__ void warp_arrive(uint64_t* bar) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) mbar_arrive(bar);
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity));
}
// The same for a thread with nothing else to do until the phase completes (a
// producer, a writer): each try_wait may suspend it up to kIdleWaitNs (it
// resumes when the phase completes). Without the hint try_wait returns after
// ~60 cycles, and the backward's producer and dQ writer spun ~20M times per
// 2k causal call, taking issue slots from consumer warps of their schedulers.
constexpr uint32_t kIdleWaitNs = 1000000;
__device__ __forceinline__ void mbar_wait_idle(uint64_t* bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@!done bra wait_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity), "n"(kIdleWaitNs));
}

// This thread's warpgroup, through a shuffle so that the compiler knows it is
// warp-uniform: addresses and wgmma descriptors derived from it then live in
// uniform registers (from threadIdx.x directly, each product re-encoded its
// descriptors in per-thread registers and moved them over: R2UR).
__device__ __forceinline__ int warpgroup_index() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

// A position in a ring of kStages shared-memory stages: the stage and the
// parity of its mbarriers' phase, stepped without divisions (a 64-bit
// `it % kStages` per tile costs ~15 instructions in a consumer's loop).
template <int kStages>
struct RingSlot {
  int stage = 0, phase = 0;
  __device__ __forceinline__ void next() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

// Loads box {64 columns, rows} at (col, row, head, batch) into `dst`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar,
                                         int col, int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(head), "r"(batch),
      "r"(smem_u32(bar))
      : "memory");
}

// Stores box {64 columns, rows} of `src` at (col, row, head, batch) (a bulk
// group: commit it, and wait for its reads before `src` is written again or
// the CTA exits). Rows and columns past the tensor's extents are not written.
__device__ __forceinline__ void tma_store(const CUtensorMap* map, const void* src, int col,
                                          int row, int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(src)), "r"(col), "r"(row), "r"(head),
      "r"(batch)
      : "memory");
}

// Plain (non-tensor) bulk copy of `bytes` (a multiple of 16, 16-byte aligned).
__device__ __forceinline__ void bulk_load(void* dst, const void* src, int bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(smem_u32(dst)), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// Closes the bulk group of the bulk stores and reductions issued since the last.
__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Adds `bytes` of float32 from shared memory to global memory (one bulk
// reduction, atomic per element); completion is tracked by bulk groups.
__device__ __forceinline__ void bulk_reduce_add(float* dst, const float* src, int bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
      ::"l"(reinterpret_cast<uint64_t>(dst)), "r"(smem_u32(src)), "r"(bytes)
      : "memory");
  bulk_commit();
}
// Waits until all but the kPending most recent bulk groups have read their
// shared-memory sources.
template <int kPending = 0>
__device__ __forceinline__ void bulk_wait_reads() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until the issued bulk groups are complete.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// All column blocks of a [rows][kHeadDim] tile; block c lands at c * rows * 128 B
// (a partial last block, e.g. at head dim 96, is zero-filled past the tensor).
template <int kHeadDim, int kRows, int kElementBytes = 2>
__device__ __forceinline__ void tma_tile(unsigned char* dst, const CUtensorMap* map,
                                         uint64_t* bar, int row, int head, int batch) {
#pragma unroll
  for (int c = 0; c < kColumnBlocks<kHeadDim, kElementBytes>; ++c)
    tma_load(dst + c * kRows * kSwizzleBytes, map, bar, c * kSwizzleCols<kElementBytes>, row,
             head, batch);
}

// Stores a warpgroup's packed [64 rows][16 kK columns] fragment (x: kK k-steps
// of A-operand registers, as pack_fragments makes them) at rows row0 + [0, 64)
// and columns 8 chunk0 + [0, 16 kK) (chunk0 even) of a 16-bit tile in the
// 128-byte-swizzled layout of TMA and wgmma: column blocks of kBlockRows rows
// x 128 bytes, 16-byte chunk c of row r at c ^ (r % 8). One stmatrix per
// k-step: its matrices are x[kk]'s registers (rows +8 for odd ones, the next
// chunk for 2 and 3), lane l addressing row l % 8 of matrix l / 8. The tile is
// 1024-byte aligned and a k-step's first chunk even, so each address is one
// XOR from one base. Used for P^T / dS^T ([keys][64 queries]: 16 32-bit
// stores a k-step before, 4x the instructions and their address arithmetic,
// between the softmax and the dS barrier) and the epilogues' dK / dV and out.
template <int kK, int kBlockRows = 0>
__device__ __forceinline__ void store_fragment(unsigned char* tile, int row0, int chunk0,
                                               const uint32_t (&x)[kK][4]) {
  constexpr int kChunks = kSwizzleBytes / 16;  // 16-byte chunks of a swizzle row
  const int lane = threadIdx.x % 32;
  const int row = row0 + ((threadIdx.x / 32) % 4) * 16 + lane % 8 + 8 * ((lane / 8) % 2);
  const uint32_t base =
      (smem_u32(tile) + row * kSwizzleBytes) | (((lane / 16) ^ (row % 8)) << 4);
#pragma unroll
  for (int kk = 0; kk < kK; ++kk) {
    const int chunk = chunk0 + 2 * kk;
    stmatrix_x4((base ^ ((chunk % kChunks) << 4)) + chunk / kChunks * kBlockRows * kSwizzleBytes,
                x[kk][0], x[kk][1], x[kk][2], x[kk][3]);
  }
}

// wgmma shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lead_bytes,
                                              uint32_t stride_bytes) {
  return static_cast<uint64_t>((smem_u32(p) & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lead_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

// Where k-step kk (kMmaKBytes: 16 16-bit elements) starts in a K-major
// [kRows][d] tile: 4 k-steps per swizzle row, then the next column block.
template <int kRows>
__host__ __device__ constexpr int k_step_offset(int kk) {
  constexpr int kStepsPerBlock = kSwizzleBytes / kMmaKBytes;
  return (kk / kStepsPerBlock) * kRows * kSwizzleBytes + (kk % kStepsPerBlock) * kMmaKBytes;
}
// Operand of k-step kk of a K-major [kRows][d] tile.
template <int kRows>
__device__ __forceinline__ uint64_t k_major_desc(const unsigned char* tile, int kk) {
  return smem_desc(tile + k_step_offset<kRows>(kk), 16, 1024);
}
// A descriptor moved `bytes` further into shared memory: an add to its
// address field (addresses / 16, 14 bits: shared memory is < 256 KB, so the
// field cannot overflow into the next). Loops build a tile's descriptor once
// and step it per k-slice; re-encoding each address costs ~6 instructions
// per product.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}
// k-step kk of a K-major [kRows][d] tile whose k-step 0 is `desc` (k_major_desc's layout).
template <int kRows>
__device__ __forceinline__ uint64_t k_major_step(uint64_t desc, int kk) {
  return desc_advance(desc, k_step_offset<kRows>(kk));
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Makes this thread's shared-memory stores visible to wgmma (the async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Orders this thread's global-memory accesses with its bulk (async proxy) ones.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// A counter other CTAs publish to: acquire load, release add (gpu scope).
__device__ __forceinline__ int ld_acquire_gpu(const int* at) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(at) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* at, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(at), "r"(v) : "memory");
}
// Named barriers among consumer threads (id 0 is __syncthreads'). The forward
// uses 1 and 2 to order its two consumer warpgroups' wgmma issues.
__device__ __forceinline__ void named_sync(int id, int threads = 256) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Zeros rows [first_row, kRows) of a [kRows][kCols] swizzled tile (whole
// 128-byte rows of each column block, so the swizzle does not matter), then
// makes the zeros visible to the warpgroup's wgmma reads (`barrier`: the
// warpgroup's 128-thread named barrier). Tiles that cross the end of a
// sequence's used rows hold whatever follows them (padding, the next
// sequence); the masks make their P and dS 0, but 0 * NaN is not 0, so a
// product that sums over those rows needs them zero. Every warpgroup that
// reads a tile may zero it: they write the same zeros.
template <int kRows, int kCols, int kElementBytes = 2>
__device__ __forceinline__ void zero_tile_rows(unsigned char* tile, int first_row, int barrier) {
  const uint32_t base = smem_u32(tile) + first_row * kSwizzleBytes;
  const int bytes = (kRows - first_row) * kSwizzleBytes;
#pragma unroll
  for (int c = 0; c < kColumnBlocks<kCols, kElementBytes>; ++c)
    for (int i = (threadIdx.x % 128) * 8; i < bytes; i += 128 * 8)
      st_shared(base + c * kRows * kSwizzleBytes + i, 0.0f, 0.0f);
  fence_proxy_async();
  named_sync(barrier, 128);
}
__device__ __forceinline__ void named_arrive(int id, int threads = 256) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// setmaxnreg: a warpgroup that needs few registers (a producer) gives them up
// to kRegs per thread, and the others (consumers) claim up to kRegs.
template <int kRegs>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Orders reads of wgmma accumulators after the wait that completes them.
template <int kN>
__device__ __forceinline__ void fence_operands(float (&regs)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}

// float8 T (k32 steps; both operands K-major: B of wgmma_rs too, e.g. V^T).
template <class T, int N>
__device__ __forceinline__ void wgmma_ss_f8(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
  if constexpr (N == 64) wgmma_ss_f8_n64<T>(d, a, b, acc);
  else if constexpr (N == 128) wgmma_ss_f8_n128<T>(d, a, b, acc);
  else if constexpr (N == 192) wgmma_ss_f8_n192<T>(d, a, b, acc);
  else if constexpr (N == 224) wgmma_ss_f8_n224<T>(d, a, b, acc);
  else wgmma_ss_f8_n256<T>(d, a, b, acc);
}
template <class T, int N>
__device__ __forceinline__ void wgmma_rs_f8(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (N == 64) wgmma_rs_f8_n64<T>(d, a, b, 1);
  else if constexpr (N == 128) wgmma_rs_f8_n128<T>(d, a, b, 1);
  else wgmma_rs_f8_n256<T>(d, a, b, 1);
}

// Four floats as e4m3 bytes of one register, k0 in the lowest byte (saturated to the
// finite range; cvt puts its first operand in the upper byte of a pair).
__device__ __forceinline__ uint32_t pack_e4m3x4(float k0, float k1, float k2, float k3) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(k1), "f"(k0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(k3), "f"(k2));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

// The 8-bit A fragment (16 rows x 32 keys) of P for key step kk, from the accumulator
// fragment s (fragment.cuh's layout) without shuffles: register r takes row g + 8 (r %
// 2)'s keys 2t, 2t + 1 of 8-key tiles n and n + 1 (n = 4 kk + 2 (r / 2)), which puts
// key 2t + (j & 1) + 8 (j >> 1) (+ 16 for r >= 2) in operand slot 4t + j: the order of
// Float8Inputs::permuted_key, in which V^T's keys come (checked on a GPU by
// tools/fp8_wgmma_check.cu).
template <int kKeyTiles>
__device__ __forceinline__ void p_fragment_f8(uint32_t (&a)[4], const float (&s)[kKeyTiles * 4],
                                              int kk) {
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const int h = r % 2, n = 4 * kk + 2 * (r / 2);
    a[r] = pack_e4m3x4(s[4 * n + 2 * h], s[4 * n + 2 * h + 1], s[4 * (n + 1) + 2 * h],
                       s[4 * (n + 1) + 2 * h + 1]);
  }
}

template <class T, int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t a, uint64_t b, int acc) {
  if constexpr (sizeof(T) == 1) wgmma_ss_f8<T, N>(d, a, b, acc);
  else if constexpr (N == 64) wgmma_ss_n64<T>(d, a, b, acc);
  else if constexpr (N == 128) wgmma_ss_n128<T>(d, a, b, acc);
  else if constexpr (N == 80) wgmma_ss_n80<T>(d, a, b, acc);
  else wgmma_ss_n256<T>(d, a, b, acc);
}
template <class T, int N>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t b) {
  if constexpr (sizeof(T) == 1) wgmma_rs_f8<T, N>(d, a, b);
  else if constexpr (N == 64) wgmma_rs_n64<T>(d, a, b, 1);
  else if constexpr (N == 96) wgmma_rs_n96<T>(d, a, b, 1);
  else if constexpr (N == 128) wgmma_rs_n128<T>(d, a, b, 1);
  else if constexpr (N == 192) wgmma_rs_n192<T>(d, a, b, 1);
  else wgmma_rs_n256<T>(d, a, b, 1);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// Layouts the Hopper kernels take: uniform, packed, seqused and segment-id
// ones; int32 TMA coordinates bound the packed rows. The schedules divide their
// work indices (tiles of 64 or more rows of a head and sequence, (sequence, head)
// pairs) in 32 bits (div_index): below 2^31 such slots (their q alone would take
// 256 GB).
inline bool hopper_layouts_supported(const AttentionParams& p) {
  static constexpr int64_t kMaxWorkSlots = int64_t{1} << 31, kSlotRows = 64;
  const int64_t rows = std::max(p.seqlen_q, p.seqlen_k);
  const int64_t slots = p.batch * p.heads_q * ((rows + kSlotRows - 1) / kSlotRows + 1);
  return slots < kMaxWorkSlots &&
         (p.uniform() || (p.total_q < (1 << 30) && p.total_k < (1 << 30)));
}

// The batch entries and rows of the query-side / key-side tensors as their
// TMA maps see them: a packed tensor is one entry of every sequence's rows.
struct MapExtent {
  int64_t batch, rows;
};
inline MapExtent query_extent(const AttentionParams& p) {
  return p.packed() ? MapExtent{1, p.total_q} : MapExtent{p.batch, p.seqlen_q};
}
inline MapExtent key_extent(const AttentionParams& p) {
  return p.packed() ? MapExtent{1, p.total_k} : MapExtent{p.batch, p.seqlen_k};
}

// Bytes per element of the tensor-core kernels' dtypes (fp16, bf16).
inline int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

// A tensor map's element: its TMA type and bytes (float8 moves as bytes).
struct MapElement {
  CUtensorMapDataType type;
  int bytes;
};
inline MapElement map_element(DType dtype) {
  return {dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                   : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
          element_bytes(dtype)};
}
inline constexpr MapElement kFloat8MapElement{CU_TENSOR_MAP_DATA_TYPE_UINT8, 1};

// 4-d map (dim, seqlen, heads, batch) of a (batch, seqlen, heads, dim) tensor t
// (packed: batch 1 and seqlen the total rows);
// a box is one swizzle row of columns (64 16-bit ones) of box_rows rows of
// box_heads heads (head-major in shared memory).
inline bool make_map(CUtensorMap* map, const TensorRef& t, MapElement element, int64_t batch,
                     int64_t seqlen, int64_t heads, int64_t dim, int box_rows, int box_heads = 1) {
  const cuuint64_t sizes[4] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(seqlen),
                               static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  // A packed tensor (one batch entry) has batch stride 0, never used to
  // address: give the encoder the entry's extent instead of a zero stride.
  const int64_t batch_stride =
      batch == 1 && t.batch_stride == 0 ? seqlen * t.row_stride : t.batch_stride;
  const int64_t bytes = element.bytes;
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(t.row_stride * bytes),
                                 static_cast<cuuint64_t>(t.head_stride * bytes),
                                 static_cast<cuuint64_t>(batch_stride * bytes)};
  const cuuint32_t box[4] = {static_cast<cuuint32_t>(kSwizzleBytes / bytes),
                             static_cast<cuuint32_t>(box_rows),
                             static_cast<cuuint32_t>(box_heads), 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  auto encode = encode_fn();
  return encode && encode(map, element.type, 4, t.data, sizes, strides, box, unit,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}
inline bool make_map(CUtensorMap* map, const TensorRef& t, DType dtype, int64_t batch,
                     int64_t seqlen, int64_t heads, int64_t dim, int box_rows, int box_heads = 1) {
  return make_map(map, t, map_element(dtype), batch, seqlen, heads, dim, box_rows, box_heads);
}

}  // namespace flashjax::cuda
