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
