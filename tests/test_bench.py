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


def test_bench_decode_mode_writes_json(tmp_path):
    path = tmp_path / "decode.jsonl"
    status = bench.main(["--decode", "--decode-batch", "2", "--cache", "96", "--decode-heads",
                         "4/2", "--head-dim", "16", "--page-size", "0", "16", "--iters", "1",
                         "--warmup", "0", "--loop", "2", "--json", str(path)])
    assert status == 0
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert {(r["impl"], r["page_size"]) for r in records} == {
        ("flashjax", 0), ("flashjax", 16), ("xla", 0), ("xla", 16)}
    for r in records:
        if (r["impl"], r["page_size"]) == ("xla", 16):
            assert r["error"] == "contiguous caches only"
        else:
            assert r["error"] is None and r["us"] > 0 and r["kv_bytes"] == 2 * 2 * 96 * 2 * 16 * 4
