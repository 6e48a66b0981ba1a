"""The benchmark CLI runs end to end on a tiny case and writes its JSON lines."""

import json

from flashjax import bench


def test_bench_cli_writes_json(tmp_path):
    path = tmp_path / "out.jsonl"
    status = bench.main(["--seqlen", "64", "--head-dim", "16", "--heads", "2", "--mode", "fwd", "bwd",
                         "--impl", "flashjax", "xla", "--causal", "yes", "--iters", "1", "--warmup", "0",
                         "--deterministic", "--json", str(path)])
    assert status in (0, None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["impl"], r["mode"]) for r in records} == {
        (impl, mode) for impl in ("flashjax", "xla") for mode in ("fwd", "bwd")}
    for r in records:
        assert r["error"] is None and r["tflops"] > 0 and r["deterministic"] is True


def test_bench_varlen_mode_writes_json(tmp_path):
    path = tmp_path / "varlen.jsonl"
    status = bench.main(["--varlen", "longtail", "--tokens", "700", "--head-dim", "16",
                         "--causal", "yes", "--mode", "fwd", "--iters", "1", "--warmup", "0",
                         "--loop", "2", "--json", str(path)])
    assert status == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {r["impl"] for r in records} >= {"varlen", "segments", "padded", "dense-mean"}
    for r in records:
        if r["impl"] != "cudnn-padded":
            assert r["error"] is None and r["tflops"] > 0 and r["tokens"] == 700
