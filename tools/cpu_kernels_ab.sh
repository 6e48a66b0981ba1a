#!/usr/bin/env bash
# Same-process A/B of the CPU decode kernels (tools/cpu_kernels_ab.cc): REV's
# csrc/cpu/tile_kernels.inc against the working tree's, at issue 28's CPU shapes.
#   tools/cpu_kernels_ab.sh [REV]   (default HEAD)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git -C "$root" show "${1:-HEAD}:csrc/cpu/tile_kernels.inc" > "$work/before.inc"
cp "$root/csrc/cpu/tile_kernels.inc" "$work/after.inc"
# (the AVX2 copies where the CPU has no AVX-512; ROW_TYPE: bf16, e4m3, e4m3-nan-free or
# e5m2 rows)
isa=; grep -q avx512f /proc/cpuinfo || isa=-DAB_AVX2
g++ -O3 -ffp-contract=fast -fno-math-errno -std=c++17 $isa -I"$work" -I"$root/csrc/cpu" \
  -I"$root/csrc/include" "$root/tools/cpu_kernels_ab.cc" -o "$work/ab"
"$work/ab" 2 64 2 "${ROW_TYPE:-bf16}"    # heads 4/2, d64
"$work/ab" 8 128 4 "${ROW_TYPE:-bf16}"   # heads 32/8, d128
