"""flashjax.flax.attention_fn in Flax's modules (NNX MultiHeadAttention, Linen
MultiHeadDotProductAttention) against Flax's default attention (jax.nn's), and
examples/flax_nnx.py's training losses. Skipped without flax (`pip install .[flax]`).

Dropout: attention_fn with a dropout_rng equals flash_attention with that dropout_key
(flashjax.dropout_mask's mask), deterministic=True equals no dropout."""

import functools
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

from flashjax.flax import attention_fn  # noqa: E402
from helpers import rand  # noqa: E402

TOL = 1e-5
# The C++ CPU kernels only (None would also trace the pure-JAX branch).
CPU_ATTENTION = functools.partial(attention_fn, implementation="cpu")


def close(got, want, tol=TOL):
    np.testing.assert_allclose(got, want, atol=tol * np.abs(np.asarray(want)).max())


@pytest.fixture(scope="module")
def x():
    """(2, 3, 24, 32): two batch dims, as Flax allows."""
    return rand(0, (2, 3, 24, 32))


def test_nnx_multi_head_attention(x):
    """GQA, two batch dims, Flax's float causal mask or is_causal, dropout rate with
    deterministic=True."""
    model = nnx.MultiHeadAttention(num_heads=4, num_kv_heads=2, in_features=32, decode=False,
                                   dropout_rate=0.1, rngs=nnx.Rngs(0))
    mask = nnx.make_causal_mask(x[..., 0])
    assert mask.dtype == jnp.float32
    want = model(x, mask=mask, deterministic=True)
    np.testing.assert_array_equal(want, model(x, is_causal=True, deterministic=True))
    model.attention_fn = CPU_ATTENTION
    close(model(x, mask=mask, deterministic=True), want)
    close(model(x, is_causal=True, deterministic=True), want)
    with pytest.raises(ValueError, match="sow"):
        model(x, is_causal=True, deterministic=True, sow_weights=True)


def test_linen_multi_head_dot_product_attention(x):
    valid = np.arange(24) < np.array([[24], [20], [9]])
    mask = linen.make_attention_mask(np.ones((3, 24)), valid)  # key padding (a float mask)
    default = linen.MultiHeadDotProductAttention(num_heads=4)
    params = default.init(jax.random.key(0), x[0], mask=mask)
    flash = linen.MultiHeadDotProductAttention(num_heads=4, attention_fn=CPU_ATTENTION)
    close(flash.apply(params, x[0], mask=mask), default.apply(params, x[0], mask=mask))


def test_bias_mask_unbatched_and_gradients():
    """attention_fn called as flax.nnx.dot_product_attention: no batch dims, a bias
    and a 0/1 integer mask; gradients of query, key, value and bias."""
    q, k, v = rand(1, (24, 4, 16)), rand(2, (40, 2, 16)), rand(3, (40, 2, 16))
    bias = rand(4, (4, 24, 40))
    mask = np.random.default_rng(5).random((1, 24, 40)) < 0.8
    mask[:, :, 0] = True  # every row sees a key (flax's default averages where none)
    mask = jnp.asarray(mask, jnp.int32)

    def loss(fn, q, k, v, bias):
        return (fn(q, k, v, bias, mask) * rand(6, q.shape)).sum()
    grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), (0, 1, 2, 3)))
    want = grad(nnx.dot_product_attention)(q, k, v, bias)
    got = grad(CPU_ATTENTION)(q, k, v, bias)
    for g, w in zip(got, want):
        close(g, w)


def test_example_losses_match_flax_default():
    """examples/flax_nnx.py: a few training steps with flashjax's attention_fn give
    the losses of the same model with Flax's default attention."""
    path = pathlib.Path(__file__).parents[1] / "examples" / "flax_nnx.py"
    spec = importlib.util.spec_from_file_location("flax_nnx", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    flash = example.train(CPU_ATTENTION, steps=4, batch=8, layers=1)
    default = example.train(nnx.dot_product_attention, steps=4, batch=8, layers=1)
    assert flash[-1] < flash[0]
    np.testing.assert_allclose(flash, default, rtol=1e-5)


def test_dropout_is_flash_attentions(x):
    """Not deterministic: flash_attention's dropout with dropout_rng as its key (the
    batch dims flattened, as attention_fn folds them); deterministic: no dropout."""
    import flashjax
    q = x.reshape(6, 24, 4, 8)
    k = v = rand(1, (6, 24, 4, 8))
    key = jax.random.key(3)
    got = CPU_ATTENTION(q, k, v, dropout_rng=key, dropout_rate=0.25, deterministic=False)
    want = flashjax.flash_attention(q, k, v, dropout_rate=0.25, dropout_key=key,
                                    implementation="cpu")
    np.testing.assert_array_equal(got, want)
    assert not np.allclose(got, flashjax.flash_attention(q, k, v, implementation="cpu"))
    np.testing.assert_array_equal(
        CPU_ATTENTION(q, k, v, dropout_rng=key, dropout_rate=0.25, deterministic=True),
        flashjax.flash_attention(q, k, v, implementation="cpu"))
