#!/usr/bin/env bash
# One device call (H100): build this tree (and optionally the baseline snapshot in
# .baseline/), then the steps named, in order: the GPU tests, sanitizers, benchmarks,
# the dense A/B, the peers side by side, profiles.
# Usage: benchmarks/device_varlen.sh STEP...   (steps: build base alt patched builds variant ptx tests kvtests fuzz sanitize terms
#   kvsanitize varlen decode decodebase trace ncu dense window ring peers traintrace bwdncu termsncu
#   fp8check)
# `base` needs the baseline sources in .baseline/, made here (not on the device) with
#   mkdir .baseline && git archive REV | tar -x -C .baseline && echo /.baseline/ >> .git/info/exclude
# and passed to the device call with carry: [".baseline"]. REV: the commit to compare with
# (e.g. 0184a42, the last commit before the varlen restructure).
# `peers` and `bwdncu` need the peers' wheels in .peers/ (../shared/peers/README.md), carried.
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=python3
if [ -d .peers ] && [ -z "${FJ_NO_PEERS:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .peers/*.whl > "$OUT/peers_install.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# The PYTHONPATH entry of build NAME: none for `new` (this tree, the `build` step),
# else /tmp/NAME (base, alt, variant, patched builds).
build_path() { [ "$1" = new ] || echo "/tmp/$1"; }
# The source tree build NAME was built from (its tests go with it: a patched build's
# new test cases are in its own copy): this tree for `new` and the FLAGGED builds.
build_source() {
  [ "$1" = new ] || [ ! -f "/tmp/$1/.fj_built" ] && { echo .; return; }
  cut -d, -f1 "/tmp/$1/.fj_built"
}
# PYTHONPATH with build NAME's entry first (the peers' wheels, if installed, kept).
with_build_path() {
  local pp; pp=$(build_path "$1")
  echo "$pp${pp:+${PYTHONPATH:+:}}${PYTHONPATH:-}"
}
# The package from this tree into the environment (the `build` step).
build_main() {
  # FJ_HEAD_DIMS (e.g. "64;128;256") narrows the compiled buckets for a faster build;
  # FJ_ARCHS (default 90a) the targets (e.g. "90a;80-virtual" to test the PTX JIT).
  $PY -m pip install -q --no-build-isolation --no-deps -C build-dir=/tmp/fjb \
    -C "cmake.define.FLASHJAX_CUDA_ARCHS=${FJ_ARCHS:-90a}" ${FJ_HEAD_DIMS:+-C "cmake.define.FLASHJAX_HEAD_DIMS=$FJ_HEAD_DIMS"} . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; return 1; }
}
# Source tree $2 built into /tmp/$1 (DIMS_NAME, else BASE_DIMS, else FJ_HEAD_DIMS, narrows
# its head dims; $3: CUDA flags, e.g. a knob's -D), with this tree's timing code: NAME then
# serves TERMS_WHO / DENSE_WHO / TESTS_WHO.
build_into() {
  local own="DIMS_$1" dims
  dims=${!own:-${BASE_DIMS:-${FJ_HEAD_DIMS:-}}}
  # (--upgrade: without it pip keeps an earlier call's install in /tmp/NAME, with its
  # head dims, on a warm machine)
  $PY -m pip install -q --no-build-isolation --no-deps --upgrade --target "/tmp/$1" -C "build-dir=/tmp/fjb_$1" \
    ${dims:+-C "cmake.define.FLASHJAX_HEAD_DIMS=$dims"} -C cmake.define.FLASHJAX_CUDA_ARCHS=90a \
    ${3:+-C "cmake.define.CMAKE_CUDA_FLAGS=$3"} "$2" \
    > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; return 1; }
  cp src/flashjax/bench*.py "/tmp/$1/flashjax/"
  echo "$2, built $(date -u +%FT%TZ)" > "/tmp/$1/.fj_built"
}
# The builds that DENSE_WHO / TERMS_WHO / TESTS_WHO name: each must exist, and a
# machine kept warm between calls may hold one from an earlier call (its source
# printed: a `base` named without .baseline carried would otherwise time a stale one).
check_builds() {
  local who b
  for who in ${DENSE_WHO:-} ${TERMS_WHO:-} ${TESTS_WHO:-}; do
    b=${who%%.*}; b=${b%_det}
    [ "$b" = new ] || [ "$b" = variant ] && continue
    [ -f "/tmp/$b/.fj_built" ] || { echo "build $b missing (base: carry .baseline)" >&2; return 1; }
    echo "build $b: $(cat "/tmp/$b/.fj_built")"
  done | sort -u
}
# This tree again, built with VARIANT_FLAGS (e.g. "-DFLASHJAX_BWD_STAGGER=1") into
# /tmp/variant (FJ_VARIANT_DIMS narrows its head dims): DENSE_WHO's and traintrace's
# "variant".
build_variant() {
  $PY -m pip install -q --no-build-isolation --no-deps --upgrade --target /tmp/variant -C build-dir=/tmp/fjb_variant \
    -C cmake.define.FLASHJAX_CUDA_ARCHS=90a ${FJ_VARIANT_DIMS:+-C "cmake.define.FLASHJAX_HEAD_DIMS=$FJ_VARIANT_DIMS"} \
    -C "cmake.define.CMAKE_CUDA_FLAGS=${VARIANT_FLAGS:-}" . > "$OUT/build_variant.log" 2>&1 || { tail -30 "$OUT/build_variant.log"; return 1; }
}
# This tree with the patches of spec NAME=PATCH[,PATCH...] (benchmarks/patches/, in
# order) copied to /tmp/src_NAME; prints NAME.
patched_tree() {
  local name=${1%%=*} src=/tmp/src_${1%%=*} pt pts
  rm -rf "$src" && mkdir -p "$src"
  tar --exclude=./.git --exclude=./.baseline --exclude=./.alt --exclude=./.peers -cf - . | tar -xf - -C "$src"
  IFS=, read -ra pts <<< "${1#*=}"
  for pt in "${pts[@]}"; do
    if command -v patch > /dev/null; then patch -s -p1 -d "$src" < "benchmarks/patches/$pt.patch"
    else (cd "$src" && git apply "$OLDPWD/benchmarks/patches/$pt.patch"); fi \
      || { echo "$pt does not apply" >&2; return 1; }
  done
  echo "$name"
}
for step in "$@"; do
  case $step in
    build)
      start=$(date +%s)
      build_main || exit 1
      echo "build: $(( $(date +%s) - start )) s" ;;
    base|alt)
      # base: the snapshot in .baseline/ into /tmp/base; alt: another source tree in
      # .alt/ (e.g. main with an alternative patch) into /tmp/alt.
      src=./.baseline; [ "$step" = alt ] && src=./.alt
      build_into "$step" "$src" || exit 1
      echo "$step built" ;;
    patched)
      # PATCHED="NAME=PATCH[,PATCH...] ...": this tree with benchmarks/patches/PATCH.patch
      # applied in order (patch -p1, in a copy), built into /tmp/NAME.
      for spec in ${PATCHED:-}; do
        name=$(patched_tree "$spec") && build_into "$name" "/tmp/src_$name" || exit 1
        echo "$name built (${spec#*=})"
      done ;;
    builds)
      # build, base (with .baseline/), alt (with .alt/), variant (with VARIANT_FLAGS),
      # every FLAGGED build ("NAME:FLAGS;NAME:FLAGS", this tree with those CUDA flags into
      # /tmp/NAME, e.g. "k224:-DFLASHJAX_FP8_D128_KEYS=224;d64c2:-DFLASHJAX_FWD_D64_CONSUMERS=2")
      # and every PATCHED build at once:
      # a narrowed build has fewer units than the cores, so together they take about
      # the longest one's time (four d128 builds in a row took 367 s).
      start=$(date +%s); pids=(); names=()
      build_main & pids+=($!); names+=(build)
      [ -d .baseline ] && { build_into base ./.baseline & pids+=($!); names+=(base); }
      [ -d .baseline ] || rm -rf /tmp/base  # (not carried: no stale base from an earlier call)
      [ -d .alt ] && { build_into alt ./.alt & pids+=($!); names+=(alt); }
      [ -n "${VARIANT_FLAGS:-}" ] && { build_variant & pids+=($!); names+=(variant); }
      IFS=';' read -ra flagged <<< "${FLAGGED:-}"
      for spec in "${flagged[@]}"; do
        [ -n "$spec" ] || continue
        build_into "${spec%%:*}" . "${spec#*:}" & pids+=($!); names+=("${spec%%:*}")
      done
      for spec in ${PATCHED:-}; do
        name=$(patched_tree "$spec") || exit 1
        build_into "$name" "/tmp/src_$name" & pids+=($!); names+=("$name")
      done
      failed=0
      for i in "${!pids[@]}"; do wait "${pids[$i]}" || { echo "${names[$i]} failed"; failed=1; }; done
      [ $failed = 0 ] || exit 1
      echo "builds (${names[*]}): $(( $(date +%s) - start )) s" ;;
    variant)
      build_variant || exit 1
      echo "variant built ($VARIANT_FLAGS)" ;;
    tests)
      # GPU_TESTS=tests runs every GPU test (1363, ~5 min with GPU_WORKERS=12); GPU_K picks;
      # GPU_MARK="gpu or not gpu" also runs unmarked tests (on the GPU, jax's default device).
      # TESTS_WHO (default new) names the builds to test, one after the other (a patched
      # build: gpu_tests_NAME.log), each with the test files of its own source tree
      # (build_source: a patch's new cases run; the thirty-third session lost them).
      for who in ${TESTS_WHO:-new}; do
        log="$OUT/gpu_tests.log"; [ "$who" = new ] || log="$OUT/gpu_tests_$who.log"
        pp=$(with_build_path "$who")
        (cd "$(build_source "$who")" && PYTHONPATH=$pp $PY -m pytest -q -n ${GPU_WORKERS:-8} \
          -m "${GPU_MARK:-gpu}" -x ${GPU_TESTS:-tests/test_gpu_varlen.py tests/test_gpu.py} \
          ${GPU_K:+-k "$GPU_K"}) > "$log" 2>&1
        echo "tests ($who, $(build_source "$who")/tests):"; tail -${TESTS_TAIL:-25} "$log"
      done ;;
    kvtests)
      $PY -m pytest -q -n 8 -m gpu tests/test_gpu_kvcache.py > "$OUT/kvtests.log" 2>&1
      tail -30 "$OUT/kvtests.log" ;;
    fuzz)
      # tools/fuzz_attention.py on the GPU (bf16, --large): FUZZ_MODES (default every mode)
      # in parallel processes (~12 s a seed, mostly compilation), FUZZ_S seconds each,
      # from seed FUZZ_START; a failure line names its seed.
      for mode in ${FUZZ_MODES:-dense varlen kvcache nn}; do
        timeout "${FUZZ_S:-150}" $PY tools/fuzz_attention.py --impl cuda --dtype bfloat16 --large \
          --mode "$mode" --start "${FUZZ_START:-0}" --count 1000 > "$OUT/fuzz_$mode.log" 2>&1 &
      done
      wait
      for mode in ${FUZZ_MODES:-dense varlen kvcache nn}; do
        echo "fuzz $mode:"; grep -v "^WARNING\|^I0000\|^W0000\|^E0000" "$OUT/fuzz_$mode.log" | tail -4
      done ;;
    ptx)
      # The build's PTX (FJ_ARCHS with NN-virtual), flashjax.info(), then the non-Hopper
      # GPU tests with the driver forced to JIT every kernel from PTX.
      lib=$($PY -c "import flashjax._ffi as f; print(f.library()._name)")
      echo "PTX in $lib (per target):"; cuobjdump --list-ptx "$lib" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c
      echo "machine code (per target):"; cuobjdump --list-elf "$lib" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c
      $PY -c "import flashjax, pprint; pprint.pprint(flashjax.info())" 2>&1 | head -40
      CUDA_FORCE_PTX_JIT=1 CUDA_CACHE_MAXSIZE=4294967296 timeout ${PTX_TIMEOUT:-420} $PY -m pytest -q -n 8 -m gpu \
        ${PTX_TESTS:-tests/test_gpu.py tests/test_gpu_varlen.py tests/test_gpu_kvcache.py} \
        -k "${PTX_K:-cuda:mma or cuda:simt}" > "$OUT/ptx_tests.log" 2>&1
      tail -15 "$OUT/ptx_tests.log" ;;
    sanitize)
      # SANITIZE_WHO (default new): the builds to check, one after the other.
      for who in ${SANITIZE_WHO:-new}; do
        for script in ${SANITIZE_SCRIPTS:-tools/sanitize_dense.py tools/sanitize_varlen.py}; do
          # SANITIZE_ARGS: the scripts' arguments (e.g. tools/sanitize_terms.py's case indices)
          log="$OUT/sanitize_$(basename $script .py)$([ "$who" = new ] || echo "_$who").log"
          PYTHONPATH=$(with_build_path "$who") compute-sanitizer --tool memcheck $PY $script ${SANITIZE_ARGS:-} > "$log" 2>&1
          echo "$script ($who): $(grep -E 'ERROR SUMMARY' "$log")"
        done
      done ;;
    terms)
      # Issue 27's table (flashjax.bench_terms): masks, bias, ALiBi, dropout, flashjax.nn;
      # TERMS_ARGS adds options (e.g. "--seqlen 8k"); TERMS_WHO="new base alt" runs each
      # build in a process of its own and prints their times side by side.
      # A build named twice runs twice: NAME.2 is NAME's second process (noise).
      for who in ${TERMS_WHO:-new}; do
        pp=$(build_path "${who%%.*}")
        PYTHONPATH=$pp${PYTHONPATH:+:$PYTHONPATH} $PY -m flashjax.bench --terms ${TERMS:-all} ${TERMS_ARGS:-} \
          --json "$OUT/terms_$who.jsonl" > "$OUT/terms_$who.log" 2>&1
        tail -${TERMS_TAIL:-40} "$OUT/terms_$who.log"
      done
      $PY - "$OUT" ${TERMS_WHO:-new} <<'PYEOF'
import json, sys
out, builds = sys.argv[1], sys.argv[2:]
rows = {}
for who in builds:
    for line in open(f"{out}/terms_{who}.jsonl"):
        r = json.loads(line)
        rows.setdefault((r["seqlen_q"], r["mode"], r["variant"]), {})[who] = r["ms"]
print("seq   mode   variant          " + " ".join(f"{w:>8s}" for w in builds) + "  (ms; ratios to " + builds[0] + ")")
for (s, mode, v), t in sorted(rows.items()):
    first = t.get(builds[0]) or 0
    print(f"{s:5d} {mode:6s} {v:16s} " + " ".join(f"{t.get(w) or 0:8.3f}" for w in builds)
          + "  " + " ".join(f"{(t.get(w) or 0) / first:.3f}" if first else "-" for w in builds[1:]))
PYEOF
      ;;
    kvsanitize)
      compute-sanitizer --tool memcheck $PY tools/sanitize_kvcache.py > "$OUT/kvsanitize.log" 2>&1
      tail -8 "$OUT/kvsanitize.log" ;;
    decode)
      # The decode table: every implementation, one process (DECODE_ARGS narrows it).
      $PY -m flashjax.bench --decode ${DECODE_ARGS:-} --json "$OUT/decode${DECODE_TAG:-}.jsonl" \
        > "$OUT/decode${DECODE_TAG:-}.log" 2>&1; tail -60 "$OUT/decode${DECODE_TAG:-}.log" ;;
    decodebase)
      # The same decode cases on the baseline build (flashjax only), for an A/B.
      PYTHONPATH=/tmp/base $PY -m flashjax.bench --decode ${DECODE_ARGS:-} --impl flashjax \
        --json "$OUT/decode_base${DECODE_TAG:-}.jsonl" > "$OUT/decode_base${DECODE_TAG:-}.log" 2>&1; tail -30 "$OUT/decode_base${DECODE_TAG:-}.log" ;;
    trace)
      # Where a decode step's time goes (TRACE_CASES: "BATCH CACHE PAGE IMPL... [--heads Q/KV]
      # [--head-dim D]" cases, ";"-separated; XLA_FLAGS=--xla_gpu_graph_min_graph_size=1: graphs).
      IFS=';' read -ra cases <<< "${TRACE_CASES:-1 1024 0 flashjax xla flashjax:1;1 8192 0 flashjax xla}"
      for c in "${cases[@]}"; do $PY tools/profile_decode.py $c; done > "$OUT/trace${TRACE_TAG:-}.log" 2>&1
      grep -v "profiler.py\|contextlib\|api.py:\|Pjit\|PjRt\|PJRT" "$OUT/trace${TRACE_TAG:-}.log" ;;
    ncu)
      # Nsight Compute on the split-KV kernel of one decode case (NCU_CASE: "BATCH CACHE
      # PAGE SPLITS"; NCU_IMPL: flashjax or flashjax-fp8, whose tag ends the file names):
      # every section, and the SASS with its stall samples as csv.
      read -r b n pg sp <<< "${NCU_CASE:-1 1024 0 1}"
      impl=${NCU_IMPL:-flashjax}
      ncu --clock-control none --set full --import-source no -k regex:split_kv --launch-skip 2 \
        -c 1 -f -o /tmp/split $PY - "$b" "$n" "$pg" "$sp" "$impl" > "$OUT/ncu_run.log" 2>&1 <<'PYEOF'
import sys, jax
from flashjax import bench_decode
b, n, page, splits = map(int, sys.argv[1:5])
case = bench_decode.DecodeCase(b, n, 32, 8, 128, page, "bfloat16")
step, q, k, v = bench_decode.attend(sys.argv[5], case, num_splits=splits)
f = jax.jit(step)
for _ in range(4):
    q = f(q, k, v).astype(q.dtype)
jax.block_until_ready(q)
PYEOF
      tail -3 "$OUT/ncu_run.log"
      ncu -i /tmp/split.ncu-rep --page details --print-details all > "$OUT/ncu_details_$impl.txt" 2>&1
      ncu -i /tmp/split.ncu-rep --page source --print-source sass --csv > "$OUT/ncu_sass_$impl.csv" 2>&1
      grep -E "Duration|Memory Throughput|Registers|Achieved Occupancy|Warp Cycles Per Issued|Executed Ipc|Issue Slots Busy" "$OUT/ncu_details_$impl.txt" | head -14 ;;
    fp8check)
      # tools/fp8_wgmma_check.cu: the planned fp8 forward's operand layouts on the GPU
      # (docs/architecture.md, "float8 inputs"); seconds, no flashjax build needed.
      "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" -std=c++17 -O2 \
        -gencode=arch=compute_90a,code=sm_90a -Icsrc -Icsrc/include -Icsrc/cuda \
        tools/fp8_wgmma_check.cu -o /tmp/fp8_wgmma_check > "$OUT/fp8check.log" 2>&1 \
        && /tmp/fp8_wgmma_check >> "$OUT/fp8check.log" 2>&1
      tail -5 "$OUT/fp8check.log" ;;
    ring)
      # benchmarks/ring_bench.py on the GPUs there are (one GPU: a smoke test; RING_ARGS).
      timeout 300 $PY benchmarks/ring_bench.py ${RING_ARGS:---seqlen 32k} > "$OUT/ring.log" 2>&1
      tail -30 "$OUT/ring.log" ;;
    varlen)
      $PY -m flashjax.bench --varlen both --iters 5 --loop 5 --json "$OUT/varlen.jsonl" \
        > "$OUT/varlen.log" 2>&1; tail -20 "$OUT/varlen.log" ;;
    dense)
      # Dense FA3 shapes, this build vs the baseline (and the variant build with
      # DENSE_WHO="new base variant"), jitted loops of 10 dependent calls, one process each.
      # A "_det" suffix (e.g. "new_det") runs that build with --deterministic; a build
      # named twice runs twice: NAME.2 is NAME's second process (alternate them: noise).
      # DENSE_TAG (e.g. _bwd) names a second dense step's files in the same call.
      DENSE_WHO=${DENSE_WHO:-new base} check_builds || exit 1
      for who in ${DENSE_WHO:-new base}; do
        build=${who%%.*}; build=${build%_det}; det=""; [ "${who%%.*}" != "$build" ] && det=--deterministic
        pp=$(build_path "$build")
        # DENSE_ARGS narrows the shapes (e.g. "--seqlen 2k --head-dim 64 128 --mode fwd").
        PYTHONPATH=$pp $PY -m flashjax.bench --fa3-shapes ${DENSE_ARGS:---seqlen 2k 16k --mode fwd fwdbwd} \
          $det --impl flashjax --loop 10 --iters 10 --json "$OUT/dense${DENSE_TAG:-}_$who.jsonl" > "$OUT/dense${DENSE_TAG:-}_$who.log" 2>&1
      done
      $PY - "$OUT/dense${DENSE_TAG:-}" ${DENSE_WHO:-new base} <<'PYEOF'
import json, sys
out, builds = sys.argv[1], sys.argv[2:]
rows = {}
for who in builds:
    for line in open(f"{out}_{who}.jsonl"):
        r = json.loads(line)
        rows.setdefault((r["mode"], r["head_dim"], r["seqlen_q"], r["causal"]), {})[who] = r["tflops"]
print("mode    d    s causal " + " ".join(f"{w:>8s}" for w in builds) + "  (ratios to " + builds[0] + ")")
for (mode, d, s, c), v in sorted(rows.items()):
    first = v.get(builds[0]) or 1
    print(f"{mode:6s} {d:3d} {s:5d} {int(c)}   " + " ".join(f"{v.get(w) or 0:8.1f}" for w in builds)
          + "  " + " ".join(f"{(v.get(w) or 0) / first:.3f}" for w in builds[1:]))
PYEOF
      ;;
    window)
      # The window (1024, 0) d128 16k shape of the peers harness (carried in .peers/), flashjax
      # alone, for each build of WINDOW_WHO (default "new base"; NAME.2: a second process),
      # WINDOW_MODES (default fwd; "fwd,fwd+bwd" in the harness's names: "fwdbwd" runs
      # nothing): an A/B of a shape --fa3-shapes does not cover.
      for who in ${WINDOW_WHO:-new base}; do
        pp=$(build_path "${who%%.*}")
        PYTHONPATH=$pp${pp:+:}${PYTHONPATH:-} timeout 120 $PY .peers/peers_gpu.py "$OUT/window_$who" \
          --impls flashjax --only window --modes "${WINDOW_MODES:-fwd}" > "$OUT/window_$who.log" 2>&1
        grep "TFLOP/s" "$OUT/window_$who.log" | sed "s/^/$who: /"
      done ;;
    peers)
      # ../shared/peers/peers_gpu.py (carried in .peers/): flashjax, FA3, cuDNN (PEERS_IMPLS)
      # in one process at the FA3 shapes (PEERS_ONLY picks tags).
      timeout ${PEERS_TIMEOUT:-300} $PY .peers/peers_gpu.py "$OUT/peers" --impls ${PEERS_IMPLS:-flashjax,fa3-jax,jax-cudnn} \
        ${PEERS_ONLY:+--only "$PEERS_ONLY"} > "$OUT/peers.log" 2>&1
      grep -v "^\s*$" "$OUT/peers.log" | tail -${PEERS_TAIL:-40} ;;
    traintrace)
      # Kernels per fwd+bwd step (tools/profile_train.py), TRAIN_CASES "D:S:causal|full:IMPL,IMPL;..."
      # (impl "base": flashjax from the baseline build; the name of any other build of this
      # call, e.g. a PATCHED one: flashjax from it).
      IFS=';' read -ra cases <<< "${TRAIN_CASES:-128:2048:causal:flashjax,fa3,cudnn}"
      for c in "${cases[@]}"; do
        IFS=: read -r d s m impls <<< "$c"
        for impl in ${impls//,/ }; do
          pp=${PYTHONPATH:-}; who=$impl
          [ "$impl" = base ] && { pp=/tmp/base:$pp; who=flashjax; echo "[baseline build]"; }
          [ "$impl" = variant ] && { pp=/tmp/variant:$pp; who=flashjax; echo "[variant build]"; }
          [ "$impl" != base ] && [ -f "/tmp/$impl/.fj_built" ] && {
            pp=/tmp/$impl:$pp; who=flashjax; echo "[$impl build]"; }
          PYTHONPATH=$pp $PY tools/profile_train.py "$d" "$s" "$m" "$who" 2>&1 \
            | grep -v "^W\|^I0\|^E0" | head -${TRAIN_LINES:-14}
        done
      done ;;
    bwdncu)
      # Nsight Compute on our key kernel and FA3's backward kernel, one fwd+bwd step each
      # (tools/profile_train.py --once), BWD_NCU_SHAPES "D:S:causal|full ...": details and
      # the SASS with executed counts and stall samples (csv), tarred into $OUT
      # (tools/ncu_lines.py reads the csvs; --source maps ours to source lines).
      # NCU_KERNELS picks other kernels (e.g. "hopper_forward_kernel|FlashAttnFwd"),
      # NCU_MODE=fwd profiles a forward-only step (BWD_NCU_IMPLS may name flashjax_fp8);
      # NCU_COUNT (default 1): kernels profiled, after as many skipped (those of a step that
      # NCU_KERNELS matches, e.g. 3 for "preprocess_kernel|stage_rows|convert_dq").
      for shape in ${BWD_NCU_SHAPES:-128:2048:causal}; do
        IFS=: read -r d s c <<< "$shape"
        for impl in ${BWD_NCU_IMPLS:-flashjax fa3}; do
          tag="${impl}_d${d}_s${s}_${c}"
          ncu --clock-control none --set full --kernel-name-base demangled \
            -k regex:"${NCU_KERNELS:-hopper_key_kernel|FlashAttnBwd}" -c "${NCU_COUNT:-1}" --launch-skip "${NCU_COUNT:-1}" \
            -o "/tmp/ncu_$tag" $PY tools/profile_train.py --once "$d" "$s" "$c" "$impl" ${NCU_MODE:-} > "/tmp/ncu_$tag.log" 2>&1 \
            || tail -5 "/tmp/ncu_$tag.log"
          ncu -i "/tmp/ncu_$tag.ncu-rep" --page details --print-units base > "/tmp/details_$tag.txt" 2>&1
          ncu -i "/tmp/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$tag.csv" 2>&1
          echo "== $tag: $(grep -m1 -E 'Duration' /tmp/details_$tag.txt)"
        done
      done
      tar -czf "$OUT/ncu_text.tgz" -C /tmp $(cd /tmp && ls details_*.txt sass_*.csv) ;;
    termsncu)
      # Nsight Compute on one kernel of issue 27's score-terms calls next to the plain
      # call (tools/profile_terms.py; FA3 shapes, d128 bf16): TERMS_NCU_VARIANTS (default
      # "none alibi"), TERMS_NCU_KERNEL (default hopper_forward_kernel; hopper_key_kernel
      # with TERMS_NCU_MODE=fwdbwd), TERMS_NCU_SEQLEN (8192). Details and SASS csv tarred
      # (tools/ncu_lines.py compares the csvs: samples by how often a line ran, top lines).
      # TERMS_NCU_WHO (default new): the builds profiled (names as in terms).
      for who in ${TERMS_NCU_WHO:-new}; do
      pp=$(build_path "$who")
      for v in ${TERMS_NCU_VARIANTS:-none alibi}; do
        n=${v}_$who
        PYTHONPATH=$pp${PYTHONPATH:+:$PYTHONPATH} ncu --clock-control none --set full --import-source no \
          -k regex:"${TERMS_NCU_KERNEL:-hopper_forward_kernel}" --launch-skip 1 -c 1 -f \
          -o "/tmp/tncu_$n" $PY tools/profile_terms.py "$v" ${TERMS_NCU_SEQLEN:-8192} \
          ${TERMS_NCU_MODE:-fwd} > "/tmp/tncu_$n.log" 2>&1 || tail -5 "/tmp/tncu_$n.log"
        ncu -i "/tmp/tncu_$n.ncu-rep" --page details --print-units base > "/tmp/tdetails_$n.txt" 2>&1
        ncu -i "/tmp/tncu_$n.ncu-rep" --page source --csv --print-source sass > "/tmp/tsass_$n.csv" 2>&1
        echo "== $n: $(grep -m1 -E 'Duration' "/tmp/tdetails_$n.txt")"
      done
      done
      tar -czf "$OUT/terms_ncu.tgz" -C /tmp $(cd /tmp && ls tdetails_*.txt tsass_*.csv) ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
