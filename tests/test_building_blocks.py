"""flash_attention_forward / flash_attention_backward, the public building blocks, against
the composed call: the backward given the call's out and lse equals jax.vjp of
flash_attention (return_lse) with the same cotangents, on the C++ CPU kernels and the
pure-JAX path, with sinks, a bias (dbias), GQA and causal; a backward given another out
and lse (ring attention's merged ones) uses them; bad shapes raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashjax
from helpers import rand

B, SQ, SK, H, HK, D = 2, 40, 70, 4, 2, 16


def inputs():
    return (rand(0, (B, SQ, H, D)), rand(1, (B, SK, HK, D)), rand(2, (B, SK, HK, D)),
            rand(3, (B, SQ, H, D)), rand(4, (B, H, SQ)))


CASES = {
    "causal_sinks_bias": dict(causal=True, sinks=rand(5, (H,)), bias=rand(6, (1, HK, SQ, SK))),
    "window_softcap": dict(window_size=(20, 5), softcap=3.0),
}


# (the pure-JAX path on one case: its compilations dominate the time)
@pytest.mark.parametrize("impl, name", [("cpu", n) for n in CASES] + [("xla", "causal_sinks_bias")])
def test_backward_is_the_calls_vjp(impl, name):
    q, k, v, dout, dlse = inputs()
    options = dict(CASES[name], implementation=impl)
    extras = {n: options.pop(n) for n in ("sinks", "bias") if n in options}

    def call(q, k, v, extras):
        return flashjax.flash_attention(q, k, v, return_lse=True, **options, **extras)
    (out, lse), pullback = jax.vjp(jax.jit(call), q, k, v, extras)
    want = pullback((dout, dlse))
    out_f, lse_f = jax.jit(lambda *a: flashjax.flash_attention_forward(*a, **options, **extras))(
        q, k, v)
    np.testing.assert_array_equal(out_f, out)
    np.testing.assert_array_equal(lse_f, lse)
    got = jax.jit(lambda *a, dlse: flashjax.flash_attention_backward(
        *a, dlse=dlse, **options, **extras))(dout, q, k, v, out, lse, dlse=dlse)
    assert len(got) == 3 + len(extras)
    for g, w, n in zip(got, want[:3] + tuple(want[3][n] for n in ("sinks", "bias") if n in extras),
                       ("dq", "dk", "dv", *(n for n in ("sinks", "bias") if n in extras))):
        np.testing.assert_allclose(g, w, atol=2e-5, rtol=2e-5, err_msg=n)


def test_backward_takes_the_given_out_and_lse():
    """Two key halves, merged by their lse (as ring attention merges blocks): the halves'
    backwards on the merged out and lse add up to the whole call's gradients."""
    q, k, v, dout, _ = inputs()
    whole = jax.grad(lambda q, k, v: jnp.sum(flashjax.flash_attention(
        q, k, v, implementation="cpu") * dout), argnums=(0, 1, 2))(q, k, v)
    halves = [(k[:, :35], v[:, :35]), (k[:, 35:], v[:, 35:])]
    parts = [flashjax.flash_attention_forward(q, kh, vh, implementation="cpu")
             for kh, vh in halves]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * jnp.exp(l - lse).transpose(0, 2, 1)[..., None] for o, l in parts)
    grads = [flashjax.flash_attention_backward(dout, q, kh, vh, out, lse, implementation="cpu")
             for kh, vh in halves]
    np.testing.assert_allclose(grads[0][0] + grads[1][0], whole[0], atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(jnp.concatenate([grads[0][1], grads[1][1]], axis=1), whole[1],
                               atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(jnp.concatenate([grads[0][2], grads[1][2]], axis=1), whole[2],
                               atol=2e-5, rtol=2e-5)


def test_bad_shapes():
    q, k, v, dout, dlse = inputs()
    out = jnp.zeros_like(dout)
    with pytest.raises(ValueError, match="out must have shape"):
        flashjax.flash_attention_backward(dout, q, k, v, out[:, :1], dlse)
    with pytest.raises(ValueError, match="lse must have shape"):
        flashjax.flash_attention_backward(dout, q, k, v, out, dlse[:, :1])
    with pytest.raises(TypeError, match="return_lse"):
        flashjax.flash_attention_forward(q, k, v, return_lse=False)
