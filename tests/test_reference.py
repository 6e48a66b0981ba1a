"""The reference itself against a naive float64 NumPy loop, so that it can be trusted."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from flashjax import reference
from helpers import Case, inputs


def naive(q, k, v, scale, causal, window, softcap, sinks):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    out = np.zeros((b, sq, hq, v.shape[-1]))
    lse = np.full((b, hq, sq), -np.inf)
    left, right = window
    if causal:
        right = 0
    for bi in range(b):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(sq):
                js = [j for j in range(sk)
                      if (left < 0 or j >= i + sk - sq - left) and (right < 0 or j <= i + sk - sq + right)]
                logits = [float(q[bi, i, h] @ k[bi, j, kh]) * scale for j in js]
                if softcap > 0:
                    logits = [softcap * math.tanh(x / softcap) for x in logits]
                terms = logits + ([float(sinks[h])] if sinks is not None else [])
                if not terms:
                    continue
                m = max(terms)
                z = sum(math.exp(x - m) for x in terms)
                lse[bi, h, i] = m + math.log(z)
                for x, j in zip(logits, js):
                    out[bi, i, h] += math.exp(x - m) / z * v[bi, j, kh]
    return out, lse


@pytest.mark.parametrize("case", [
    Case(seqlen_q=9, seqlen_k=13, heads_q=2, heads_kv=1, head_dim=4, causal=True),
    Case(seqlen_q=13, seqlen_k=9, heads_q=2, heads_kv=2, head_dim=4, head_dim_v=3, causal=True, sinks=True),
    Case(seqlen_q=11, seqlen_k=11, heads_q=2, heads_kv=1, head_dim=5, window_size=(2, 1), softcap=2.0),
], ids=str)
def test_reference_matches_naive_loop(case):
    q, k, v, sinks = inputs(case)
    scale = 1 / math.sqrt(case.head_dim)
    out, lse = reference.attention(q, k, v, sinks=sinks, return_lse=True, compute_dtype=jnp.float64,
                                   **case.options())
    want_out, want_lse = naive(q, k, v, scale, case.causal, case.window_size, case.softcap,
                               None if sinks is None else np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(out), want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.asarray(lse), want_lse, rtol=1e-10)
