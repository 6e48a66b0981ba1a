// The C++ side of dropout's keep mask (flashjax/dropout.h), exposed for the tests that
// compare it with the pure-JAX generator (src/flashjax/_dropout.py) bit for bit:
//   flashjax_dropout_mask (CPU FFI target): (key uint32[2]) -> pred[batch, heads_q,
//     seqlen_q, seqlen_k], attributes rate (f64) and per_element (bool: each element by
//     Generator::keep, else a Philox call per 8-element group scattered to its slots,
//     as a kernel does);
//   FlashjaxPhilox4x32 (C, for ctypes): the bare generator (7 or 10 rounds), for
//   known-answer tests.
#include <cstdint>

#include "flashjax/dropout.h"
#include "handlers.h"

namespace ffi = xla::ffi;
namespace dropout = flashjax::dropout;

namespace {

ffi::Error fill_dropout_mask(ffi::Buffer<ffi::U32> key, ffi::Result<ffi::Buffer<ffi::PRED>> mask,
                             double rate, bool per_element) {
  if (key.dimensions().size() != 1 || key.dimensions()[0] != 2)
    return ffi::Error::InvalidArgument("flashjax: dropout_mask's key must be uint32[2]");
  const auto dims = mask->dimensions();
  if (dims.size() != 4)
    return ffi::Error::InvalidArgument(
        "flashjax: dropout_mask's result must be [batch, heads_q, seqlen_q, seqlen_k]");
  const int64_t batch = dims[0], heads = dims[1], rows = dims[2], cols = dims[3];
  if (rows > UINT32_MAX || cols > UINT32_MAX || heads > UINT32_MAX || batch > UINT32_MAX)
    return ffi::Error::InvalidArgument("flashjax: dropout_mask's indices must fit in uint32");
  const dropout::Generator gen{key.typed_data()[0], key.typed_data()[1],
                               dropout::threshold(rate)};
  bool* out = mask->typed_data();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      bool* plane = out + (b * heads + h) * rows * cols;
      if (per_element) {
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) plane[i * cols + j] = gen.keep(b, h, i, j);
        continue;
      }
      // Every group that meets the plane: x1 < rows / 2 rounded up to 8s, x0 likewise.
      const int64_t x1_end = (rows + 15) / 16 * 8, x0_end = (cols + 15) / 16 * 4;
      for (int64_t x1 = 0; x1 < x1_end; ++x1) {
        for (int64_t x0 = 0; x0 < x0_end; ++x0) {
          const uint32_t bits = gen.group_keep_bits(b, h, x1, x0);
          const int64_t i0 = dropout::group_row(x1), j0 = dropout::group_column(x0);
          for (int s = 0; s < dropout::kGroupSize; ++s) {
            const int64_t i = i0 + dropout::slot_row_offset(s);
            const int64_t j = j0 + dropout::slot_column_offset(s);
            if (i < rows && j < cols) plane[i * cols + j] = (bits >> s) & 1u;
          }
        }
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace

FLASHJAX_EXPORT_HANDLER(FlashjaxDropoutMaskCpu);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashjaxDropoutMaskCpu, fill_dropout_mask,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>()
                                  .Attr<double>("rate")
                                  .Attr<bool>("per_element"));

// rounds: 7 (the keep mask's, dropout::kRounds) or 10; returns false for others.
extern "C" __attribute__((visibility("default"))) bool FlashjaxPhilox4x32(
    const uint32_t counter[4], const uint32_t key[2], int rounds, uint32_t out[4]) {
  const dropout::Words4 c{{counter[0], counter[1], counter[2], counter[3]}};
  dropout::Words4 w;
  if (rounds == 7) w = dropout::philox4x32<7>(c, key[0], key[1]);
  else if (rounds == 10) w = dropout::philox4x32<10>(c, key[0], key[1]);
  else return false;
  for (int n = 0; n < 4; ++n) out[n] = w.x[n];
  return true;
}

extern "C" __attribute__((visibility("default"))) uint32_t FlashjaxDropoutThreshold(double rate) {
  return dropout::threshold(rate);
}
