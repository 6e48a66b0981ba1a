"""FlashAttention 3's own KV-cache test grid (its hopper test of `flash_attn_with_kvcache`)
run on flash_attention_with_kvcache against the float64 reference of kvcache_helpers.py.

The grid's axes as FlashAttention 3 draws them: batch 5, 6 query heads (MHA, MQA, GQA
with 3 kv heads), head dim 128, its (seqlen_q, seqlen_k) pairs, new tokens or not
(seqlen_new = seqlen_q or drawn in [1, seqlen_q]), causal / local (a window drawn in
[0, seqlen_k)) / neither, rotary on 0, half or all of the head dim (interleaved or
not), contiguous or paged caches (page sizes 1, 4, 128: a pool three times the
sequences' pages, shuffled), cache_leftpad, and cache_batch_idx (FlashAttention 3's
grid fixes it off; here on too, contiguous and paged: twice the cache sequences), cache
lengths drawn as FlashAttention 3 draws them, num_splits 1 or automatic. Left out:
float8 (issue 28's fp8 caches) and ragged query blocks (`cu_seqlens_q`: flashjax's
route for those is flash_attention_varlen with page_table=).

CI (no GPU) runs a fixed sample of small cases on the CPU; on a GPU a larger fixed
sample runs (4 of its 160 cases with 128k-key caches), and FLASHJAX_FA3_GRID=all runs
every case of the grid.
"""

from __future__ import annotations

import itertools
import math
import os
import random

import numpy as np
import pytest

from kvcache_helpers import KVCase, check

HEAD_DIM = 128
BATCH, HEADS = 5, 6
KV_HEADS = {"mha": 6, "mqa": 1, "gqa": 3}
SEQLENS = [(1, 128), (1, 339), (3, 1024), (64, 800), (64, 256), (3, 799), (64, 2048),
           (16, 20000), (1, 128 * 1024), (16, 128 * 1024), (128, 128), (256, 512),
           (2048, 3577)]
AXES = dict(
    seqlens=SEQLENS, num_splits=[1, 0], mha=list(KV_HEADS), new_kv=[False, True],
    causal_local=[(False, False), (True, False), (False, True)],
    seqlen_new_eq_seqlen_q=[True, False], interleaved=[False, True],
    rotary_fraction=[0.0, 0.5, 1.0], page_size=[0, 1, 4, 128], leftpad=[False, True],
    batch_idx=[False, True])
CPU_SAMPLE, GPU_SAMPLE = 8, 160
CPU_MAX_SEQLEN_K = 339
# Of the GPU sample, this many with 128k-key caches (a fifth of a plain draw: each
# builds ~4 GB float64 reference caches on the host, ~40 s a case); the rest up to 20000.
GPU_LONG, GPU_MAX_SEQLEN_K = 4, 20000


def grid():
    """Every case FlashAttention 3's skips keep, as dicts of the axes."""
    names = list(AXES)
    for values in itertools.product(*AXES.values()):
        p = dict(zip(names, values))
        seqlen_q, seqlen_k = p["seqlens"]
        if p["page_size"] and seqlen_k % p["page_size"]:
            continue
        if seqlen_q > seqlen_k and p["new_kv"]:
            continue
        if not p["new_kv"] and p["rotary_fraction"] > 0:
            continue
        yield p


def sample(n: int, max_seqlen_k: int | None = None, min_seqlen_k: int = 0):
    cases = [p for p in grid() if min_seqlen_k <= p["seqlens"][1] <= (max_seqlen_k or math.inf)]
    return cases if n <= 0 else random.Random(0).sample(cases, min(n, len(cases)))


def gpu_sample():
    if os.environ.get("FLASHJAX_FA3_GRID") == "all":
        return sample(0)
    return (sample(GPU_SAMPLE - GPU_LONG, GPU_MAX_SEQLEN_K)
            + sample(GPU_LONG, min_seqlen_k=GPU_MAX_SEQLEN_K + 1))


def to_case(p: dict, index: int) -> KVCase:
    """The KVCase of grid point p, its random draws seeded by `index`, as
    FlashAttention 3's test draws them."""
    rng = np.random.default_rng(index)
    seqlen_q, seqlen_k = p["seqlens"]
    causal, local = p["causal_local"]
    rotary_dim = math.floor(int(p["rotary_fraction"] * HEAD_DIM) / 16) * 16
    window = tuple(int(w) for w in rng.integers(0, seqlen_k, 2)) if local else (-1, -1)
    seqlen_new = seqlen_q if p["seqlen_new_eq_seqlen_q"] else int(rng.integers(1, seqlen_q + 1))
    if p["new_kv"]:
        longest = seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new)
        seqlens = rng.integers(0, longest + 1, BATCH)
    else:
        seqlens = rng.integers(1, seqlen_k + 1, BATCH)
    leftpad = tuple(int(rng.integers(0, n)) if n > 0 else 0 for n in seqlens) if p["leftpad"] else ()
    sequences = 2 * BATCH if p["batch_idx"] else BATCH
    page = p["page_size"]
    return KVCase(
        batch=BATCH, seqlen_q=seqlen_q, heads_q=HEADS, heads_kv=KV_HEADS[p["mha"]],
        head_dim=HEAD_DIM, head_dim_v=HEAD_DIM, seqlens=tuple(int(n) for n in seqlens),
        capacity=seqlen_k, seqlen_new=seqlen_new if p["new_kv"] else 0, page_size=page,
        num_pages=math.ceil(seqlen_k / page) * sequences * 3 if page else 0,
        batch_cache=sequences if p["batch_idx"] else 0, leftpad=leftpad,
        rotary_dim=rotary_dim, interleaved=p["interleaved"], causal=causal,
        window_size=window, dtype="bfloat16")


def params(points):
    return [pytest.param(p, i, id=f"{i}-{to_case(p, i)}-splits{p['num_splits']}")
            for i, p in enumerate(points)]


@pytest.mark.parametrize("point,index", params(sample(CPU_SAMPLE, CPU_MAX_SEQLEN_K)))
def test_fa3_kvcache_grid_sample(point, index):
    check(to_case(point, index), num_splits=point["num_splits"])


@pytest.mark.gpu
@pytest.mark.parametrize("point,index", params(gpu_sample()))
def test_fa3_kvcache_grid_gpu(point, index):
    check(to_case(point, index), num_splits=point["num_splits"])
