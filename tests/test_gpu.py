"""The CUDA kernels on the GPU against the float64 reference (skipped without a GPU).

The CPU suite's case lists (helpers.py) run here on jax.devices("gpu")[0], plus
larger shapes that cross the GPU kernels' tile boundaries. Each forward runs on
every kernel path: the default choice (Hopper TMA/wgmma on an H100), mma.sync and
SIMT, chosen with implementation="cuda" / "cuda:mma" / "cuda:simt" (helpers.use_implementation).

Output buffers cannot be NaN-poisoned from JAX; instead every output is checked
for NaN/inf and against the reference, and one test first fills the allocator's
recycled buffers with NaN results of the same shapes."""

import dataclasses

import jax
import numpy as np
import pytest

import flashjax
from helpers import (Case, case_inputs, check_empty_vmap, check_forward, check_gradients, empty_row_cases,
                     gqa_cases, head_dim_cases, ids, option_cases, position_cases, seqlen_cases,
                     use_implementation)
from nonfinite_helpers import Placement, check_nonfinite

pytestmark = pytest.mark.gpu

PATHS = ["cuda", "cuda:mma", "cuda:simt"]

LARGE_CASES = [
    Case(batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=4, heads_kv=2, head_dim=128, dtype="bfloat16", causal=True),
    Case(batch=1, seqlen_q=777, seqlen_k=1300, heads_q=4, heads_kv=1, head_dim=64, dtype="float16"),
    Case(batch=1, seqlen_q=300, seqlen_k=300, heads_q=2, heads_kv=2, head_dim=256, dtype="bfloat16", causal=True,
         sinks=True),
    Case(batch=1, seqlen_q=1000, seqlen_k=300, heads_q=2, heads_kv=2, head_dim=72, dtype="bfloat16", causal=True,
         window_size=(50, 10)),
    Case(batch=1, seqlen_q=17, seqlen_k=128, heads_q=4, heads_kv=2, head_dim=200, head_dim_v=96, dtype="float16",
         softcap=30.0, sinks=True),
    Case(batch=1, seqlen_q=128, seqlen_k=17, heads_q=4, heads_kv=2, head_dim=96, head_dim_v=64, dtype="bfloat16",
         causal=True),
    Case(batch=1, seqlen_q=1, seqlen_k=512, heads_q=8, heads_kv=1, head_dim=128, dtype="bfloat16"),
    Case(batch=1, seqlen_q=200, seqlen_k=200, heads_q=2, heads_kv=2, head_dim=128, dtype="float32", causal=True),
    Case(batch=3, seqlen_q=513, seqlen_k=511, heads_q=6, heads_kv=2, head_dim=64, dtype="bfloat16",
         window_size=(100, 0), softcap=20.0, sinks=True),
]

# GQA packing of the Hopper forward: a kv head's whole group of query heads in
# one tile when heads_q / heads_kv * seqlen_q <= 128 (decoding, short prompts).
PACKED_CASES = [
    Case(batch=2, seqlen_q=5, seqlen_k=300, heads_q=12, heads_kv=3, head_dim=64, dtype="bfloat16", causal=True),
    Case(batch=1, seqlen_q=16, seqlen_k=200, heads_q=8, heads_kv=1, head_dim=128, dtype="float16", softcap=15.0,
         sinks=True),
    Case(batch=3, seqlen_q=3, seqlen_k=140, heads_q=6, heads_kv=2, head_dim=96, dtype="bfloat16", causal=True,
         window_size=(40, 0)),
    Case(batch=1, seqlen_q=1, seqlen_k=1000, heads_q=32, heads_kv=4, head_dim=128, dtype="bfloat16", sinks=True),
]

# The Hopper forward's persistent schedule over more than one round of work items
# (more items than an H100's or H200's 132 SMs): odd query-tile counts (head dim
# 64's 192-row tiles: 5 of them; 9 of 128 rows) and an odd number of heads.
# Windows too, bounded on the right (causal) or on the left only (their tiles' costs
# grow or shrink along the rows: the order a longest-first schedule takes them in).
MULTI_ROUND_CASES = [
    Case(batch=3, seqlen_q=900, seqlen_k=900, heads_q=15, heads_kv=5, head_dim=64, dtype="bfloat16", causal=True),
    Case(batch=2, seqlen_q=1100, seqlen_k=1100, heads_q=36, heads_kv=12, head_dim=128, dtype="float16"),
    Case(batch=2, seqlen_q=1100, seqlen_k=1100, heads_q=36, heads_kv=12, head_dim=128, dtype="bfloat16",
         window_size=(300, 0), softcap=20.0),
    Case(batch=1, seqlen_q=1000, seqlen_k=1200, heads_q=40, heads_kv=40, head_dim=96, dtype="float16",
         window_size=(200, -1), sinks=True),
]
# The Hopper forward's native 96 and 192 buckets (and head dims padded into them).
NATIVE_DIM_CASES = [
    Case(batch=1, seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=192, dtype="bfloat16", causal=True),
    Case(batch=2, seqlen_q=200, seqlen_k=333, heads_q=2, heads_kv=2, head_dim=160, head_dim_v=176, dtype="float16",
         window_size=(50, 20), sinks=True),
    Case(batch=1, seqlen_q=1000, seqlen_k=1000, heads_q=2, heads_kv=1, head_dim=96, dtype="bfloat16", softcap=20.0),
    Case(batch=2, seqlen_q=130, seqlen_k=257, heads_q=4, heads_kv=4, head_dim=80, head_dim_v=96, dtype="float16",
         causal=True),
]

# The Hopper forward's 80-key tiles at head dim 256 (fwd_launch_bucket.cuh's
# wide_keys_pay: full attention, or causal rows that see 2048 keys or more on
# average): key counts not a multiple of 80, causal with a long cache, softcap,
# sinks, GQA; and a causal call that keeps 64 keys beside it.
WIDE_KEY_CASES = [
    Case(batch=2, seqlen_q=200, seqlen_k=333, heads_q=4, heads_kv=2, head_dim=256, dtype="bfloat16", sinks=True),
    Case(batch=1, seqlen_q=100, seqlen_k=2300, heads_q=4, heads_kv=1, head_dim=256, dtype="float16", causal=True,
         softcap=15.0),
    Case(batch=1, seqlen_q=4100, seqlen_k=4100, heads_q=2, heads_kv=2, head_dim=256, dtype="bfloat16", causal=True),
    Case(batch=1, seqlen_q=2000, seqlen_k=2000, heads_q=2, heads_kv=1, head_dim=256, dtype="bfloat16", causal=True),
    # head dims padded into the 256 bucket
    Case(batch=1, seqlen_q=150, seqlen_k=411, heads_q=4, heads_kv=2, head_dim=224, head_dim_v=200, dtype="bfloat16"),
]

# The Hopper wide backward (head dims 129-256, 64 keys per CTA): GQA, windows,
# softcap, sinks, head_dim_v != head_dim, ragged lengths.
WIDE_GRADIENT_CASES = [
    Case(batch=2, seqlen_q=333, seqlen_k=270, heads_q=4, heads_kv=1, head_dim=256, dtype="float16",
         window_size=(60, 20), softcap=10.0),
    Case(batch=1, seqlen_q=64, seqlen_k=640, heads_q=6, heads_kv=2, head_dim=256, head_dim_v=136,
         dtype="bfloat16", causal=True, sinks=True),
    NATIVE_DIM_CASES[0],
    # NATIVE_DIM_CASES[1] in bfloat16: in float16 its dsinks (with an lse
    # cotangent) miss the bound on every GPU path, mma.sync included (see
    # benchmarks/NOTES.md, "Open GPU correctness item").
    dataclasses.replace(NATIVE_DIM_CASES[1], dtype="bfloat16"),
]

# Query/key positions (q_offset / kv_offset): the uniform kernels route as non-uniform.
POSITION_CASES = (position_cases(dtypes=("bfloat16",), head_dim=64)
                  + position_cases(dtypes=("float16",), head_dim=128)[::3]
                  + [Case(batch=2, seqlen_q=700, seqlen_k=1000, heads_q=8, heads_kv=2, head_dim=128,
                          dtype="bfloat16", causal=True, q_offset=1000, kv_offset=500),
                     Case(batch=1, seqlen_q=600, seqlen_k=600, heads_q=4, heads_kv=4, head_dim=256,
                          dtype="bfloat16", window_size=(130, 0), sinks=True, q_offset=333),
                     Case(batch=1, seqlen_q=513, seqlen_k=257, heads_q=4, heads_kv=1, head_dim=96,
                          dtype="float16", window_size=(64, 64), kv_offset=300)])

# Scales that are not positive: the kernels scale scores before masking them
# (score_mod.cuh, scores_prescaled), as a masked -inf times such a scale is not -inf.
NONPOSITIVE_SCALE_CASES = [
    Case(batch=1, seqlen_q=200, seqlen_k=300, heads_q=4, heads_kv=2, head_dim=d, dtype="bfloat16", causal=True,
         window_size=window, softmax_scale=scale, sinks=sinks)
    for d, scale, window, sinks in ((64, -0.125, (-1, -1), False), (128, -0.1, (50, 0), True),
                                    (128, 0.0, (-1, -1), False), (256, -0.07, (-1, -1), False))]

FORWARD_CASES = (head_dim_cases() + seqlen_cases() + gqa_cases() + option_cases()
                 + option_cases(dtypes=("bfloat16", "float16"), seqlens=((130, 90),), windows=[(-1, -1), (10, 5)],
                                head_dim=64)
                 + empty_row_cases() + LARGE_CASES + MULTI_ROUND_CASES + PACKED_CASES + NATIVE_DIM_CASES
                 + WIDE_KEY_CASES + POSITION_CASES
                 + NONPOSITIVE_SCALE_CASES)

GRADIENT_CASES = (head_dim_cases(dtypes=("float32", "bfloat16"), seqlen=70)
                  + seqlen_cases(seqlens=[(1, 1), (1, 33), (17, 128), (128, 17)], head_dim=16)
                  + gqa_cases(dtypes=("float32", "bfloat16"))
                  + option_cases(seqlens=((70, 90),), windows=[(-1, -1), (7, 3)])
                  + option_cases(dtypes=("bfloat16", "float16"), seqlens=((90, 70),), windows=[(-1, -1), (7, 3)],
                                 head_dim=64)
                  + empty_row_cases() + LARGE_CASES[:6] + WIDE_GRADIENT_CASES + WIDE_KEY_CASES[:2]
                  + POSITION_CASES[::2]
                  + NONPOSITIVE_SCALE_CASES)

DETERMINISTIC_CASES = [
    LARGE_CASES[0],
    Case(batch=2, seqlen_q=130, seqlen_k=700, heads_q=8, heads_kv=1, head_dim=64, dtype="bfloat16", sinks=True,
         causal=True),
    Case(batch=1, seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=1, head_dim=72, dtype="float16", softcap=5.0),
    Case(batch=1, seqlen_q=200, seqlen_k=250, heads_q=2, heads_kv=1, head_dim=32, dtype="float32", sinks=True),
    # causal with many key blocks a dQ tile: the Hopper key kernel adds them in a fixed order
    Case(batch=2, seqlen_q=2048, seqlen_k=2048, heads_q=8, heads_kv=2, head_dim=128, dtype="bfloat16",
         causal=True),
    Case(batch=1, seqlen_q=1500, seqlen_k=1100, heads_q=4, heads_kv=4, head_dim=96, dtype="float16", causal=True,
         window_size=(300, 0)),
]


@pytest.fixture(params=PATHS)
def kernel_path(request, monkeypatch):
    use_implementation(monkeypatch, request.param)
    return request.param


def test_build_has_cuda_kernels():
    assert flashjax.has_cuda_kernels()


@pytest.mark.parametrize("case", FORWARD_CASES, ids=ids(FORWARD_CASES))
def test_forward(case, kernel_path, gpu_device):
    check_forward(case, device=gpu_device)


@pytest.mark.parametrize("case", GRADIENT_CASES, ids=ids(GRADIENT_CASES))
@pytest.mark.parametrize("deterministic", [False, True])
def test_gradients(case, deterministic, gpu_device):
    check_gradients(case, device=gpu_device, deterministic=deterministic)


SIMT_GRADIENT_CASES = GRADIENT_CASES[::7] + LARGE_CASES[:3]


@pytest.mark.parametrize("case", SIMT_GRADIENT_CASES, ids=ids(SIMT_GRADIENT_CASES))
def test_gradients_simt_path(case, gpu_device, monkeypatch):
    use_implementation(monkeypatch, "cuda:simt")
    check_gradients(case, device=gpu_device)


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=ids(DETERMINISTIC_CASES))
def test_deterministic_backward_is_bitwise_repeatable(case, gpu_device):
    a = check_gradients(case, device=gpu_device, deterministic=True)
    b = check_gradients(case, device=gpu_device, deterministic=True)
    for name, x, y in zip(("dq", "dk", "dv", "dsinks"), a, b):
        np.testing.assert_array_equal(x, y, err_msg=f"{case}: {name} differs between two runs")


# The Hopper forward stores out by TMA boxes that the tensor's extents clip (uniform
# layouts, unpacked items): ragged row counts, head dims 64, 72 / 96 (bucket 96),
# 80 / 96, 128 and 192.
FULLY_WRITTEN_CASES = [LARGE_CASES[0], LARGE_CASES[3], LARGE_CASES[5], LARGE_CASES[8],
                       NATIVE_DIM_CASES[0], NATIVE_DIM_CASES[3]]


@pytest.mark.parametrize("case", FULLY_WRITTEN_CASES, ids=str)
def test_outputs_fully_written(case, gpu_device):
    # Fill the allocator's free list with NaN results of the same shapes, then check a
    # real call writes every element (stale NaN would show) and matches the reference.
    q, k, v, s = case_inputs(case, device=gpu_device)
    f = jax.jit(lambda q, k, v, s: flashjax.flash_attention(q, k, v, sinks=s, return_lse=True, **case.options()))
    poisoned = f(q * np.nan, k, v, s)
    jax.block_until_ready(poisoned)
    del poisoned
    check_forward(case, device=gpu_device)


# The Hopper key kernels store dK / dV by TMA boxes that the tensors' extents clip
# (uniform layouts): seqlen_k below a consumer's 64 rows, head dims below the bucket
# (72, 96 / 64), GQA, the wide kernel (200 / 96, 256 / 136).
FULLY_WRITTEN_GRADIENT_CASES = [LARGE_CASES[0], LARGE_CASES[3], LARGE_CASES[4], LARGE_CASES[5],
                                WIDE_GRADIENT_CASES[1]]


@pytest.mark.parametrize("case", FULLY_WRITTEN_GRADIENT_CASES, ids=str)
def test_gradients_fully_written(case, gpu_device):
    # As test_outputs_fully_written, for dq, dk and dv: a call whose gradients are
    # NaN leaves buffers of their shapes in the allocator's free list.
    q, k, v, s = case_inputs(case, device=gpu_device)

    def poisoned_gradients(q, k, v, s):
        out, pullback = jax.vjp(
            lambda q, k, v: flashjax.flash_attention(q, k, v, sinks=s, **case.options()), q, k, v)
        return pullback(out * np.nan)

    poisoned = jax.jit(poisoned_gradients)(q, k, v, s)
    assert all(np.isnan(np.asarray(g.astype(np.float32))).any() for g in poisoned)
    del poisoned
    check_gradients(case, device=gpu_device, return_lse=False)


def test_vmap_over_an_empty_axis(gpu_device):
    check_empty_vmap(Case(batch=1, seqlen_q=70, seqlen_k=90, heads_q=4, heads_kv=2, head_dim=128,
                          dtype="bfloat16", sinks=True, causal=True), device=gpu_device)


XLA_PATH_CASES = LARGE_CASES[:4] + POSITION_CASES[:3] + PACKED_CASES[:1]


@pytest.mark.parametrize("case", XLA_PATH_CASES, ids=ids(XLA_PATH_CASES))
def test_pure_jax_path_on_the_gpu(case, gpu_device, monkeypatch):
    """implementation="xla" (the path for platforms without flashjax's kernels) on the GPU:
    forward and gradients against the float64 reference."""
    use_implementation(monkeypatch, "xla")
    check_forward(case, device=gpu_device)
    check_gradients(case, device=gpu_device)


# ----------------------------------------------------------------------------- non-finite inputs
# docs/api.md, "Non-finite values": NaN / +-inf placed inside masked tiles (rows 70
# and 700: inside the diagonal tiles of every kernel's tiling) reach exactly the rows
# the reference says (tests/nonfinite_helpers.py), forward and gradients, on every path.

NONFINITE_CASES = [
    Case(batch=2, seqlen_q=200, seqlen_k=200, heads_q=4, heads_kv=2, head_dim=64, dtype="bfloat16",
         causal=True),
    Case(batch=1, seqlen_q=130, seqlen_k=250, heads_q=2, heads_kv=2, head_dim=128, dtype="float16",
         window_size=(40, 8), sinks=True),
    Case(batch=1, seqlen_q=150, seqlen_k=150, heads_q=2, heads_kv=1, head_dim=64, dtype="float32",
         causal=True, softcap=20.0),
    Case(batch=1, seqlen_q=333, seqlen_k=333, heads_q=8, heads_kv=2, head_dim=128, dtype="bfloat16",
         causal=True),
]
NONFINITE_PLACEMENTS = [
    Placement("q", "nan", batch=0, row=70, head=1),
    Placement("k", "nan", batch=0, row=70, head=0),
    Placement("v", "nan", batch=0, row=70, head=0),
    Placement("v", "inf", batch=0, row=70, head=0, column=None),
    Placement("k", "inf", batch=0, row=70, head=0),
]
NONFINITE_LARGE = Case(batch=1, seqlen_q=1000, seqlen_k=1000, heads_q=2, heads_kv=2, head_dim=128,
                       dtype="bfloat16", causal=True)


@pytest.mark.parametrize("placement", NONFINITE_PLACEMENTS, ids=str)
@pytest.mark.parametrize("case", NONFINITE_CASES, ids=ids(NONFINITE_CASES))
def test_nonfinite(case, placement, kernel_path, gpu_device):
    check_nonfinite(case, placement, device=gpu_device)


@pytest.mark.parametrize("placement", [Placement(t, "nan", row=700, head=1) for t in "qkv"], ids=str)
def test_nonfinite_large(placement, kernel_path, gpu_device):
    check_nonfinite(NONFINITE_LARGE, placement, device=gpu_device, gradients=True)


@pytest.mark.parametrize("placement", NONFINITE_PLACEMENTS[:3], ids=str)
@pytest.mark.parametrize("case", NONFINITE_CASES[::2] + [NONFINITE_CASES[-1]],
                         ids=ids(NONFINITE_CASES[::2] + [NONFINITE_CASES[-1]]))
def test_nonfinite_gradients(case, placement, kernel_path, gpu_device):
    check_nonfinite(case, placement, device=gpu_device, gradients=True)


# The Hopper forward's recompute of flagged rows walks the tiles its CTA did: under the
# dynamic schedule (head dim 64 causal; windows), the ones its producer took.
NONFINITE_MULTI_ROUND_CASES = MULTI_ROUND_CASES[0:3:2]  # (d64 causal; d128 window + softcap)


@pytest.mark.parametrize("placement", [NONFINITE_PLACEMENTS[0], NONFINITE_PLACEMENTS[4]], ids=str)
@pytest.mark.parametrize("case", NONFINITE_MULTI_ROUND_CASES, ids=ids(NONFINITE_MULTI_ROUND_CASES))
def test_nonfinite_multi_round(case, placement, kernel_path, gpu_device):
    check_nonfinite(case, placement, device=gpu_device)


@pytest.mark.parametrize("placement", NONFINITE_PLACEMENTS[:3], ids=str)
def test_nonfinite_gradients_deterministic(placement, kernel_path, gpu_device):
    check_nonfinite(NONFINITE_CASES[0], placement, device=gpu_device, gradients=True,
                    deterministic=True)
