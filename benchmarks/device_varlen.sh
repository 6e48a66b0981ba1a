#!/usr/bin/env bash
# One device call (H100): build this tree (and optionally the baseline snapshot in
# .baseline/), run the GPU tests, the varlen benchmark and the dense A/B.
# Usage: benchmarks/device_varlen.sh STEP...   (steps: build base tests kvtests sanitize
#   kvsanitize varlen decode dense)
# `base` needs the baseline sources in .baseline/, made here (not on the device) with
#   mkdir .baseline && git archive REV | tar -x -C .baseline && echo /.baseline/ >> .git/info/exclude
# and passed to the device call with carry: [".baseline"]. REV: the commit to compare with
# (e.g. 0184a42, the last commit before the varlen restructure).
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=python3
for step in "$@"; do
  case $step in
    build)
      start=$(date +%s)
      # FJ_HEAD_DIMS (e.g. "64;128;256") narrows the compiled buckets for a faster build.
      $PY -m pip install -q --no-build-isolation --no-deps -C build-dir=/tmp/fjb \
        -C cmake.define.FLASHJAX_CUDA_ARCHS=90a ${FJ_HEAD_DIMS:+-C "cmake.define.FLASHJAX_HEAD_DIMS=$FJ_HEAD_DIMS"} . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
      echo "build: $(( $(date +%s) - start )) s" ;;
    base)
      $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/base -C build-dir=/tmp/fjb_base ${FJ_HEAD_DIMS:+-C "cmake.define.FLASHJAX_HEAD_DIMS=$FJ_HEAD_DIMS"} \
        -C cmake.define.FLASHJAX_CUDA_ARCHS=90a ./.baseline > "$OUT/build_base.log" 2>&1 || { tail -30 "$OUT/build_base.log"; exit 1; }
      cp src/flashjax/bench.py src/flashjax/bench_varlen.py /tmp/base/flashjax/  # same timing code
      echo "baseline built" ;;
    tests)
      $PY -m pytest -q -n 8 -m gpu -x tests/test_gpu_varlen.py tests/test_gpu.py 2>&1 | tail -25 ;;
    kvtests)
      $PY -m pytest -q -n 8 -m gpu tests/test_gpu_kvcache.py > "$OUT/kvtests.log" 2>&1
      tail -30 "$OUT/kvtests.log" ;;
    sanitize)
      compute-sanitizer --tool memcheck $PY tools/sanitize_varlen.py 2>&1 | tail -8 ;;
    kvsanitize)
      compute-sanitizer --tool memcheck $PY tools/sanitize_kvcache.py > "$OUT/kvsanitize.log" 2>&1
      tail -8 "$OUT/kvsanitize.log" ;;
    decode)
      # The decode table: every implementation, one process (DECODE_ARGS narrows it).
      $PY -m flashjax.bench --decode ${DECODE_ARGS:-} --json "$OUT/decode.jsonl" \
        > "$OUT/decode.log" 2>&1; tail -60 "$OUT/decode.log" ;;
    varlen)
      $PY -m flashjax.bench --varlen both --iters 5 --loop 5 --json "$OUT/varlen.jsonl" \
        > "$OUT/varlen.log" 2>&1; tail -20 "$OUT/varlen.log" ;;
    dense)
      # Dense FA3 shapes, new vs baseline, jitted loops of 10 dependent calls, one process each.
      for who in new base; do
        pp=""; [ "$who" = base ] && pp=/tmp/base
        PYTHONPATH=$pp $PY -m flashjax.bench --fa3-shapes --seqlen 2k 16k --impl flashjax \
          --mode fwd fwdbwd --loop 10 --iters 10 --json "$OUT/dense_$who.jsonl" > "$OUT/dense_$who.log" 2>&1
      done
      $PY - "$OUT" <<'PYEOF'
import json, sys
rows = {}
for who in ("new", "base"):
    for line in open(f"{sys.argv[1]}/dense_{who}.jsonl"):
        r = json.loads(line)
        rows.setdefault((r["mode"], r["head_dim"], r["seqlen_q"], r["causal"]), {})[who] = r["tflops"]
print("mode    d    s causal   new  base  new/base")
for (mode, d, s, c), v in sorted(rows.items()):
    n, b = v.get("new"), v.get("base")
    print(f"{mode:6s} {d:3d} {s:5d} {int(c)}  {n or 0:6.1f} {b or 0:6.1f}  {(n or 0) / (b or 1):.3f}")
PYEOF
      ;;
  esac
done
