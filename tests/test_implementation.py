"""implementation= on every public entry point, and flashjax.info() / __version__."""

import importlib.metadata

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import check_close, counting_jit, has_gpu, rand


def _qkv():
    return rand(1, (2, 40, 4, 16)), rand(2, (2, 56, 2, 16)), rand(3, (2, 56, 2, 16))


@pytest.mark.parametrize("implementation", [None, "cpu", "xla"])
def test_each_cpu_implementation_gives_the_same_result(implementation):
    q, k, v = _qkv()
    want = flashjax.reference.attention(q, k, v, causal=True, window_size=(9, -1))
    got = flashjax.flash_attention(q, k, v, causal=True, window_size=(9, -1),
                                   implementation=implementation)
    check_close(np.asarray(got), np.asarray(want), name=str(implementation))


def test_implementation_is_part_of_the_jit_cache_key():
    q, k, v = _qkv()
    f, traces = counting_jit(flashjax.flash_attention, static_argnames=("implementation",))
    for implementation in ("cpu", "xla", "cpu"):
        f(q, k, v, implementation=implementation)
    assert len(traces) == 2


@pytest.mark.parametrize("bad", ["tpu", "cuda:hopper", 3, "XLA"])
def test_unknown_implementation_is_a_value_error(bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="implementation must be one of"):
        flashjax.flash_attention(q, k, v, implementation=bad)


@pytest.mark.skipif(has_gpu(), reason="checks the error on a machine without a CUDA GPU")
@pytest.mark.parametrize("entry", ["dense", "varlen", "kvcache"])
def test_forced_cuda_on_the_cpu_names_the_platform(entry):
    q, k, v = _qkv()
    cu = jnp.array([0, 40], jnp.int32)
    call = {
        "dense": lambda: flashjax.flash_attention(q, k, v, implementation="cuda:mma"),
        "varlen": lambda: flashjax.flash_attention_varlen(q[0], k[0], v[0], cu, cu, 40, 40,
                                                          implementation="cuda"),
        "kvcache": lambda: flashjax.flash_attention_with_kvcache(
            q, k, v, cache_seqlens=jnp.array([3, 9], jnp.int32), implementation="cuda"),
    }[entry]
    with pytest.raises(ValueError, match=r"implementation='cuda.*arrays are on \['cpu'\]"):
        call()


@pytest.mark.parametrize("implementation", [None, "cpu", "xla"])
def test_kvcache_implementations_agree(implementation):
    q = rand(4, (2, 3, 4, 16))
    k_cache, v_cache = rand(5, (2, 24, 2, 16)), rand(6, (2, 24, 2, 16))
    k_new, v_new = rand(7, (2, 3, 2, 16)), rand(8, (2, 3, 2, 16))
    seqlens = jnp.array([5, 20], jnp.int32)
    run = lambda impl: flashjax.flash_attention_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True,
        return_lse=True, implementation=impl)
    want = run("cpu")
    for name, g, w in zip(("out", "lse", "k_cache", "v_cache"), run(implementation), want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5,
                                   err_msg=name)


def test_version_is_the_installed_distributions():
    assert flashjax.__version__ == importlib.metadata.version("flashjax")


def test_info_describes_the_build_devices_and_kernels():
    report = flashjax.info()
    assert report["version"] == flashjax.__version__
    assert "cpu" in report["platforms"]
    assert any(d.startswith("cpu:") for d in report["devices"])
    if flashjax.has_cuda_kernels():
        assert report["cuda_targets"] and report["head_dim_buckets"]
    q, k, v = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in
               ((1, 128, 8, 128), (1, 128, 2, 128), (1, 128, 2, 128)))
    kernels = flashjax.info(q, k, v, causal=True)["kernels"]
    cpu = next(name for name in kernels if name.startswith("cpu:"))
    assert kernels[cpu] == {"forward": "cpu", "backward": "cpu"}
    assert flashjax.info(q, k, v, implementation="xla")["kernels"][cpu]["forward"] == "xla"
    assert flashjax.info(q, k, v, score_terms=True)["kernels"][cpu] == kernels[cpu]
    assert flashjax.info(q, k, v, implementation="cuda")["kernels"][cpu]["forward"] == \
        "unavailable"


@pytest.mark.gpu
def test_info_names_the_kernel_dispatch_picks_on_the_gpu():
    if not has_gpu():
        pytest.skip("no GPU")
    gpu = f"gpu:{jax.devices('gpu')[0].id}"
    shape = lambda *s, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(s, dtype)
    q, k = shape(1, 1024, 8, 128), shape(1, 1024, 2, 128)
    hopper = jax.devices("gpu")[0].device_kind.startswith("NVIDIA H")
    kernels = flashjax.info(q, k, k, causal=True)["kernels"][gpu]
    assert kernels == ({"forward": "hopper", "backward": "hopper"} if hopper else
                       {"forward": "mma", "backward": "mma"})
    assert flashjax.info(q, k, k, implementation="cuda:mma")["kernels"][gpu]["forward"] == "mma"
    q32, k32 = shape(1, 64, 8, 128, dtype=jnp.float32), shape(1, 64, 2, 128, dtype=jnp.float32)
    assert flashjax.info(q32, k32, k32)["kernels"][gpu]["forward"] == "simt"
    assert flashjax.info(q, k, k, kv_cache=True)["kernels"][gpu]["forward"] == "split-kv"
    if hopper:  # score terms: not with segment ids on Hopper, nor its backward above d128
        terms = lambda *a, **o: flashjax.info(*a, score_terms=True, **o)["kernels"][gpu]
        assert terms(q, k, k) == {"forward": "hopper", "backward": "hopper"}
        assert terms(q, k, k, segment_ids=True) == {"forward": "mma", "backward": "mma"}
        q256, k256 = shape(1, 1024, 8, 256), shape(1, 1024, 2, 256)
        assert terms(q256, k256, k256) == {"forward": "hopper", "backward": "mma"}
