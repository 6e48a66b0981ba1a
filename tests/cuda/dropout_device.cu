// flashjax/dropout.h compiled as CUDA device code (tests/test_dropout.py compiles
// this with nvcc for sm_90a when nvcc is found; nothing runs it). The kernel takes a
// thread's share of a 16x16 block the way the tensor-core kernels will: lane l's
// group is rows l/4 (+8), column pairs 2 (l % 4) (+8).
#include <cstdint>

#include "flashjax/dropout.h"

namespace dropout = flashjax::dropout;

__global__ void keep_bits_of_block(dropout::Generator gen, uint32_t b, uint32_t h,
                                   uint32_t* bits) {
  const uint32_t lane = threadIdx.x % 32;
  const uint32_t x1 = dropout::row_counter(blockIdx.y * 16 + lane / 4);
  const uint32_t x0 = dropout::column_counter(blockIdx.x * 16 + 2 * (lane % 4));
  bits[(blockIdx.y * gridDim.x + blockIdx.x) * 32 + lane] = gen.group_keep_bits(b, h, x1, x0);
}

__global__ void keep_elements(dropout::Generator gen, uint32_t rows, uint32_t cols, bool* keep) {
  const uint32_t i = blockIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j < cols) keep[i * cols + j] = gen.keep(0, 0, i, j);
}

