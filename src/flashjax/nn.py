"""flashjax.nn: a drop-in for jax.nn.dot_product_attention that runs flashjax.

    out = flashjax.nn.dot_product_attention(query, key, value, bias, mask, is_causal=True)

takes jax.nn's arguments with jax.nn's meaning (docs/migration.md).
"""

from __future__ import annotations

from . import _dropin

__all__ = ["dot_product_attention"]


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None,
                          is_causal=False, query_seq_lengths=None,
                          key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
    """jax.nn.dot_product_attention's signature and semantics, computed by flashjax.

    Shapes: B batch, T query rows, S key rows, N query heads, K key/value heads
    (N % K == 0: MHA, GQA, MQA), H head dim.

    Args:
      query: (B, T, N, H) or (T, N, H); float16, bfloat16 or float32.
      key, value: (B, S, K, H) or (S, K, H), query's dtype and head dim.
      bias: optional array broadcastable to (B, N, T, S) (rank <= 4, ones prepended),
        added to the scaled scores. Differentiable (its gradient is summed over the
        broadcast dims); an integer bias is converted to float32.
      mask: optional bool array broadcastable to (B, N, T, S): True = may attend.
      scale: scores are scale * q.k; default 1/sqrt(H). A static number.
      is_causal: query row i sees keys j <= i (aligned top-left, as jax.nn; flashjax's
        own `causal=` aligns bottom-right).
      query_seq_lengths, key_value_seq_lengths: optional int32 (B,): rows at or past
        a query length give 0, keys at or past a key length are hidden.
      local_window_size: int w (= (w, w)) or (left, right): row i sees keys
        i - left <= j <= i + right (positions from 0 in both sequences).
      implementation: None (flashjax's default: its kernels on CUDA GPUs and the CPU,
        pure JAX elsewhere), jax.nn's "xla" (flashjax's pure-JAX path, any platform)
        and "cudnn" (flashjax's CUDA kernels, as "cuda"), or any of flash_attention's
        ("cuda", "cuda:mma", "cuda:simt", "cpu", "xla").
      return_residual: also return the log-sum-exp of each row's scores, shape
        (B, T, N) or (T, N), in key's dtype, not differentiated (as jax.nn).

    Returns:
      The output, query's shape and dtype (and the residual if asked).

    Differences from jax.nn: a row that sees no key (all masked, an empty window, a key
    length of 0) gives 0 where jax.nn's "xla" path averages every value (its masked
    scores are a large finite negative); its residual is -inf. Bad input raises before
    anything runs, jax.nn's ValueError where jax.nn raises one, and ValueError for a
    bias or mask with K heads (K not 1 or N), which jax.nn rejects by an assertion.
    Float64 inputs and a traced `scale` raise TypeError (flashjax's kernels take
    neither).
    """
    return _dropin.attention(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                             query_seq_lengths=query_seq_lengths,
                             key_value_seq_lengths=key_value_seq_lengths,
                             local_window_size=local_window_size,
                             implementation=implementation, return_residual=return_residual)
