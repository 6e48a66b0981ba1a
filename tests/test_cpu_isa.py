"""Every instruction-set copy of the CPU tile kernels (FLASHJAX_CPU_ISA, read once per
process, so each runs in a subprocess) gives the results of the default one: outputs,
lse, gradients and where non-finite values land."""

import os
import subprocess
import sys

import numpy as np
import pytest

SCRIPT = r"""
import sys
import jax, jax.numpy as jnp, numpy as np
import flashjax

rng = np.random.default_rng(0)
q = rng.standard_normal((2, 150, 4, 40)).astype(np.float32)   # head dims off the vector width
k = rng.standard_normal((2, 170, 2, 40)).astype(np.float32)
v = rng.standard_normal((2, 170, 2, 24)).astype(np.float32)
v[1, 60, 1, 3] = np.nan
dout = jnp.asarray(rng.standard_normal((2, 150, 4, 24)).astype(np.float32))
results = {}
for causal in (False, True):
    for window in ((-1, -1), (30, 5)):
        kw = dict(causal=causal, window_size=window, softcap=0.0 if causal else 5.0,
                  implementation="cpu")
        out, lse = flashjax.flash_attention(q, k, v, return_lse=True, **kw)
        loss = lambda q, k, v: jnp.sum(flashjax.flash_attention(q, k, v, **kw) * dout)
        grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k),
                                                  jnp.asarray(v))
        for name, x in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads)):
            results[f"{name}_{int(causal)}_{window[0]}"] = np.asarray(x)
# the KV-cache decode path (row_dots, gemm_b_rows), a NaN only the last query row sees
kc = rng.standard_normal((2, 300, 2, 64)).astype(np.float32)
vc = rng.standard_normal((2, 300, 2, 64)).astype(np.float32)
vc[0, 289, 1, 9] = np.nan
# (8 packed rows a kv head; 6: gemm_b_rows' last block of 2 rows)
for heads in (8, 6):
    qd = rng.standard_normal((2, 2, heads, 64)).astype(np.float32)
    # caches read in place, widened (float8 ones under float32 q: outputs compared at
    # float32's tolerance, not bfloat16's rounding of sums in another order)
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2):
        q_dtype = jnp.float32 if jnp.dtype(dtype).itemsize == 1 else dtype
        out, lse = flashjax.flash_attention_with_kvcache(
            jnp.asarray(qd, q_dtype), *(jnp.asarray(x, dtype) for x in (kc, vc)),
            cache_seqlens=jnp.asarray([290, 100], jnp.int32), causal=True, return_lse=True,
            implementation="cpu")
        name = f"{jnp.dtype(dtype).name}_{heads}"
        results[f"kvcache_out_{name}"] = np.asarray(out, np.float32)
        results[f"kvcache_lse_{name}"] = np.asarray(lse)
np.savez(sys.argv[1], **results)
"""


def run(tmp_path, isa):
    path = tmp_path / f"{isa or 'default'}.npz"
    env = dict(os.environ)
    env.pop("FLASHJAX_CPU_ISA", None)
    if isa:
        env["FLASHJAX_CPU_ISA"] = isa
    subprocess.run([sys.executable, "-c", SCRIPT, str(path)], check=True, env=env,
                   cwd=str(tmp_path))
    return dict(np.load(path))


@pytest.mark.parametrize("isa", ["avx512", "avx2", "baseline"])
def test_isa_copies_agree(tmp_path, isa):
    want = run(tmp_path, None)
    got = run(tmp_path, isa)
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, equal_nan=True,
                                   err_msg=name)
