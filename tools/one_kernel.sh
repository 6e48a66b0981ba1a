#!/usr/bin/env bash
# One Hopper kernel instantiation compiled alone (seconds, not a bucket's minutes): its
# registers, spills and whether ptxas serialised its wgmmas (C7512), and with DIS=1 its
# line-annotated disassembly for tools/ncu_lines.py --source.
# Usage: tools/one_kernel.sh KERNEL [SRC]   (SRC: a source tree, default this one;
#   KERNEL_FLAGS: more nvcc flags, e.g. -DFLASHJAX_FP8_D128_KEYS=192)
#   KERNEL: key128 key64 (the fused uniform key kernels, bf16), wide (d256 key kernel),
#           fwd128 (the uniform forward, bf16), fp8fwd128 fp8fwd256 (its float8 kernels),
#           keybias128 fwdbias128 (the d128 key kernel and forward of calls with a bias)
# Output in /tmp/one_kernel/KERNEL.{log,cubin,dis}.
set -euo pipefail
kernel=$1 src=$(cd "${2:-$(dirname "$0")/..}" && pwd)
out=/tmp/one_kernel; mkdir -p "$out"
nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
args='const flashjax::AttentionParams, const __grid_constant__ fc::hopper_bwd::BackwardMaps,
      const fc::hopper_bwd::RowStats, float*'
fwd_args='const __grid_constant__ flashjax::AttentionParams,
      const __grid_constant__ fc::hopper_fwd::TensorMaps,
      const __grid_constant__ fc::hopper_fwd::ScheduleOf<fc::Layouts::LAYOUTS>,
      const __grid_constant__ fc::SegmentTiles, const __grid_constant__ fc::MaskTiles'
case $kernel in
  key128|key64|keybias128)
    header=sm90/bwd_kernel.cuh terms=kNone dim=${kernel#key}
    [ "$kernel" = keybias128 ] && terms=kAny dim=128
    inst="template __global__ void fc::hopper_bwd::hopper_key_kernel<__nv_bfloat16, $dim, true,
      fc::Layouts::kUniform, fc::TermSet::$terms>($args, int*, const fc::VarlenWorkList,
      const __grid_constant__ fc::SegmentTiles, const __grid_constant__ fc::MaskTiles);" ;;
  wide)
    header=sm90/bwd_kernel.cuh
    inst="template __global__ void fc::hopper_bwd::hopper_wide_key_kernel<__nv_bfloat16>($args);" ;;
  fwd128|fwdbias128)
    header=sm90/fwd_kernel.cuh layouts=kUniform terms=kNone
    [ "$kernel" = fwdbias128 ] && layouts=kVarlen terms=kAny
    inst="template __global__ void fc::hopper_fwd::hopper_forward_kernel<__nv_bfloat16, __nv_bfloat16,
      128, fc::Layouts::$layouts, fc::TermSet::$terms, false>(${fwd_args/LAYOUTS/$layouts});" ;;
  fp8fwd128|fp8fwd256)
    header=sm90/fwd_kernel.cuh
    inst="template __global__ void fc::hopper_fwd::hopper_forward_kernel<__nv_fp8_e4m3, __nv_bfloat16,
      ${kernel#fp8fwd}, fc::Layouts::kUniform, fc::TermSet::kNone, false>(${fwd_args/LAYOUTS/kUniform});" ;;
  *) echo "unknown kernel $kernel (key128 key64 keybias128 wide fwd128 fwdbias128 fp8fwd128 fp8fwd256)" >&2; exit 2 ;;
esac
printf '#include "%s"\nnamespace fc = flashjax::cuda;\n%s\n' "$header" "$inst" > "$out/$kernel.cu"
"$nvcc" -std=c++17 -O3 -lineinfo -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
  -I"$src/csrc" -I"$src/csrc/include" -I"$src/csrc/cuda" -DFLASHJAX_TC_HEAD_DIM_64=1 \
  -DFLASHJAX_TC_HEAD_DIM_128=1 -DFLASHJAX_TC_HEAD_DIM_256=1 ${KERNEL_FLAGS:-} -cubin -o "$out/$kernel.cubin" \
  "$out/$kernel.cu" -Xptxas -v > "$out/$kernel.log" 2>&1 || { tail -20 "$out/$kernel.log"; exit 1; }
echo "$kernel ($src): $(grep -o '[0-9]* bytes spill stores' "$out/$kernel.log" | head -1)," \
  "$(grep -o 'Used [0-9]* registers' "$out/$kernel.log" | head -1)," \
  "$(grep -c C7512 "$out/$kernel.log" || true) wgmma serialisation warnings"
if [ -n "${DIS:-}" ]; then
  # (NVDISASM: where the toolkit has none, e.g. from `pip download nvidia-cuda-nvdisasm`)
  nvdisasm=${NVDISASM:-$(command -v nvdisasm || echo /usr/local/cuda/bin/nvdisasm)}
  "$nvdisasm" -gi -c "$out/$kernel.cubin" > "$out/$kernel.dis" && echo "disassembly: $out/$kernel.dis"
fi
