#!/usr/bin/env bash
# One device call (H100) for the backward work of issue 26: build this tree, then the
# steps named (any order): peers (FA3 / cuDNN side by side, PEERS_ONLY shapes),
# ncu (our key kernel and FA3's backward kernel, NCU_SHAPES "D:S:causal|full ..."),
# bench (flashjax.bench bwd / fwd+bwd at the FA3 shapes of BENCH_ARGS), trace (kernels
# per fwd+bwd step, tools/profile_train.py, TRACE_CASES), tests (GPU suite, GPU_TESTS /
# GPU_K), sanitize (compute-sanitizer memcheck of tools/sanitize_*.py).
# base: the baseline snapshot in .baseline/ (made here: mkdir .baseline && git archive REV |
# tar -x -C .baseline), built into /tmp/base; benchbase: the bench on it (same timing code).
# Needs .peers/ (../shared/peers/README.md) carried for peers and ncu.
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=python3
if [ -d .peers ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .peers/*.whl > "$OUT/peers_install.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
for step in "$@"; do
  case $step in
    build)
      start=$(date +%s)
      $PY -m pip install -q --no-build-isolation --no-deps -C build-dir=/tmp/fjb \
        -C "cmake.define.FLASHJAX_CUDA_ARCHS=${FJ_ARCHS:-90a}" \
        -C "cmake.define.FLASHJAX_HEAD_DIMS=${FJ_HEAD_DIMS:-64;128;256}" . > "$OUT/build.log" 2>&1 \
        || { tail -50 "$OUT/build.log"; exit 1; }
      echo "build: $(( $(date +%s) - start )) s" ;;
    base)
      start=$(date +%s)
      $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/base -C build-dir=/tmp/fjb_base \
        -C "cmake.define.FLASHJAX_CUDA_ARCHS=${FJ_ARCHS:-90a}" \
        -C "cmake.define.FLASHJAX_HEAD_DIMS=${FJ_HEAD_DIMS:-64;128;256}" ./.baseline > "$OUT/build_base.log" 2>&1 \
        || { tail -30 "$OUT/build_base.log"; exit 1; }
      cp src/flashjax/bench*.py /tmp/base/flashjax/  # same timing code
      echo "baseline build: $(( $(date +%s) - start )) s" ;;
    benchbase)
      PYTHONPATH=/tmp/base:${PYTHONPATH:-} $PY -m flashjax.bench ${BENCH_ARGS:---fa3-shapes --head-dim 128 --mode bwd fwdbwd --impl flashjax} \
        --json "$OUT/bench_base${BENCH_TAG:-}.jsonl" > "$OUT/bench_base${BENCH_TAG:-}.log" 2>&1
      tail -${BENCH_TAIL:-30} "$OUT/bench_base${BENCH_TAG:-}.log" ;;
    peers)
      timeout ${PEERS_TIMEOUT:-300} $PY .peers/peers_gpu.py "$OUT/peers" --impls ${PEERS_IMPLS:-flashjax,fa3-jax,jax-cudnn} \
        ${PEERS_ONLY:+--only "$PEERS_ONLY"} > "$OUT/peers.log" 2>&1
      grep -v "^\s*$" "$OUT/peers.log" | tail -${PEERS_TAIL:-40} ;;
    ncu)
      for shape in ${NCU_SHAPES:-128:2048:causal}; do
        IFS=: read -r d s c <<< "$shape"
        for impl in ${NCU_IMPLS:-flashjax fa3}; do
          tag="${impl}_d${d}_s${s}_${c}"
          ncu --clock-control none --set full --kernel-name-base demangled \
            -k regex:"hopper_key_kernel|FlashAttnBwd" -c 1 --launch-skip 1 \
            -o "/tmp/ncu_$tag" $PY tools/profile_train.py --once "$d" "$s" "$c" "$impl" > "/tmp/ncu_$tag.log" 2>&1 \
            || tail -5 "/tmp/ncu_$tag.log"
          ncu -i "/tmp/ncu_$tag.ncu-rep" --page details --print-units base > "/tmp/details_$tag.txt" 2>&1
          ncu -i "/tmp/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "/tmp/sass_$tag.csv" 2>&1
          echo "== $tag: $(grep -m1 -E 'Duration' /tmp/details_$tag.txt)"
        done
      done
      tar -czf "$OUT/ncu_text.tgz" -C /tmp $(cd /tmp && ls details_*.txt sass_*.csv) ;;
    bench)
      $PY -m flashjax.bench ${BENCH_ARGS:---fa3-shapes --head-dim 128 --mode bwd fwd+bwd --impl flashjax} \
        --json "$OUT/bench${BENCH_TAG:-}.jsonl" > "$OUT/bench${BENCH_TAG:-}.log" 2>&1
      tail -${BENCH_TAIL:-30} "$OUT/bench${BENCH_TAG:-}.log" ;;
    trace)
      # Kernels per fwd+bwd step (tools/profile_train.py), TRACE_CASES "D:S:causal|full:IMPL,IMPL;..."
      # (impl "base": flashjax from the baseline build).
      IFS=';' read -ra cases <<< "${TRACE_CASES:-128:2048:causal:flashjax,fa3,cudnn}"
      for c in "${cases[@]}"; do
        IFS=: read -r d s m impls <<< "$c"
        for impl in ${impls//,/ }; do
          if [ "$impl" = base ]; then
            echo "[baseline build]"; PYTHONPATH=/tmp/base:${PYTHONPATH:-} $PY tools/profile_train.py "$d" "$s" "$m" flashjax 2>&1 | grep -v "^W\|^I0\|^E0" | head -${TRACE_LINES:-14}
          else
            $PY tools/profile_train.py "$d" "$s" "$m" "$impl" 2>&1 | grep -v "^W\|^I0\|^E0" | head -${TRACE_LINES:-14}
          fi
        done
      done ;;
    sanitize)
      for script in ${SANITIZE_SCRIPTS:-tools/sanitize_dense.py tools/sanitize_varlen.py}; do
        compute-sanitizer --tool memcheck $PY $script > "$OUT/sanitize_$(basename $script .py).log" 2>&1
        echo "$script: $(grep -E 'ERROR SUMMARY' "$OUT/sanitize_$(basename $script .py).log")"
      done ;;
    tests)
      $PY -m pytest -q -n 8 -m gpu ${GPU_TESTS:-tests} ${GPU_K:+-k "$GPU_K"} > "$OUT/gpu_tests.log" 2>&1
      tail -15 "$OUT/gpu_tests.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
