"""The benchmark CLI runs end to end on a tiny case and writes its JSON lines."""

import json

import numpy as np
import pytest

from flashjax import bench, bench_core


@pytest.fixture(autouse=True)
def small_gemm(monkeypatch):
    """The CPU GEMM rate beside each record from 256 x 256 matrices instead of 2048 x 2048:
    the same code, ~500x fewer FLOPs (the rate itself is not checked)."""
    monkeypatch.setattr(bench_core, "GEMM_SIZE", 256)


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
        (impl, page) for impl in ("flashjax", "flashjax-fp8", "xla") for page in (0, 16)}
    for r in records:
        if (r["impl"], r["page_size"]) == ("xla", 16):
            assert r["error"] == "contiguous caches only"
        else:  # (K and V of float32, or of one byte for the float8 cache)
            element_bytes = 1 if r["impl"] == "flashjax-fp8" else 4
            assert r["error"] is None and r["us"] > 0
            assert r["kv_bytes"] == 2 * 2 * 96 * 2 * 16 * element_bytes


def test_bench_terms_mode_writes_json(tmp_path):
    """--terms all on a tiny CPU shape, fwd+bwd (every variant's build, the bias
    gradient): flashjax's variants run, the GPU peers say why not; the block-sparse mask
    hides exactly half the tiles."""
    from flashjax import bench_terms
    path = tmp_path / "terms.jsonl"
    status = bench.main(["--terms", "all", "--seqlen", "64", "--head-dim", "16", "--heads", "2",
                         "--mode", "fwdbwd", "--iters", "1", "--warmup", "0", "--json", str(path)])
    assert status == 0
    records = {r["variant"]: r for r in map(json.loads, path.read_text().splitlines())}
    assert set(records) == set(bench_terms.VARIANTS)
    for name, r in records.items():
        if name.startswith(("cudnn", "torch")):
            assert r["error"] in ("needs a CUDA GPU", "needs PyTorch"), (name, r["error"])
        else:
            assert r["error"] is None and r["tflops"] > 0, (name, r["error"])
            assert r["density"] == (0.5 if "causal" in name or name == "mask-blocks" else 1.0)
    assert np.asarray(bench_terms.block_sparse_mask(256, 512)).mean() == 0.5
    mask = np.asarray(bench_terms.block_sparse_mask(300, 384))[0, 0]  # 3 x 3 tiles, one empty
    assert (mask[::128, ::128].sum(axis=1) == 2).all() and mask.mean() == 2 / 3
