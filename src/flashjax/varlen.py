"""flashjax.flash_attention_varlen: packed batches of variable-length sequences
(FlashAttention's varlen interface: concatenated rows plus cumulative lengths)."""

from __future__ import annotations

import jax.numpy as jnp

from . import _checks, _ffi
from ._calls import Layout, attention_core


def _check_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks):
    _checks.check_qkv(q, k, v, 3, ("(total_q, heads_q, head_dim)",
                                   "(total_k, heads_kv, head_dim)",
                                   "(total_k, heads_kv, head_dim_v)"), "total_k")
    cu_shape = _checks.shape_of("cu_seqlens_q", cu_seqlens_q)
    if len(cu_shape) != 1 or cu_shape[0] < 1:
        raise ValueError(f"cu_seqlens_q must have shape (num_seqs + 1,), got {cu_shape}")
    sequences = cu_shape[0] - 1
    _checks.check_int_array("cu_seqlens_q", cu_seqlens_q, cu_shape, "(num_seqs + 1,)")
    _checks.check_int_array("cu_seqlens_k", cu_seqlens_k, cu_shape,
                            "(num_seqs + 1,) like cu_seqlens_q")
    _checks.check_int_array("seqused_q", seqused_q, (sequences,), "(num_seqs,)")
    _checks.check_int_array("seqused_k", seqused_k, (sequences,), "(num_seqs,)")
    _checks.check_sinks(sinks, q.shape[1])


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, sinks=None, return_lse=False,
                           deterministic=False):
    """Attention over a packed batch of sequences of different lengths.

    Args:
      q: (total_q, heads_q, head_dim); k: (total_k, heads_kv, head_dim);
        v: (total_k, heads_kv, head_dim_v): the sequences' rows concatenated.
      cu_seqlens_q, cu_seqlens_k: int32 (num_seqs + 1,): sequence i is rows
        [cu[i], cu[i + 1]) of q (of k and v). Traced: no recompilation when
        the values change.
      max_seqlen_q, max_seqlen_k: static Python ints, upper bounds of the
        sequences' lengths (they size the launch; longer sequences are cut).
      seqused_q, seqused_k: optional int32 (num_seqs,): only the first n rows of
        each sequence take part.
      softmax_scale, causal, window_size, softcap, sinks, deterministic: as in
        `flash_attention`; causal and windows are aligned bottom-right within
        each sequence, on its used lengths.
      return_lse: also return the float32 lse, shape (heads_q, total_q).

    Returns:
      out (total_q, heads_q, head_dim_v) [, lse (heads_q, total_q)]. Rows that
      belong to no sequence or lie past seqused_q get out 0 and lse -inf.

    Inconsistent metadata is clamped, never trusted: cu_seqlens entries to
    [0, total], a sequence's end to at least its start, lengths to max_seqlen,
    seqused to the sequence's length. Rows outside every sequence are zero when
    cu_seqlens is non-decreasing (unspecified otherwise); nothing is read or
    written out of bounds.
    """
    _check_arrays(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, sinks)
    max_q = _checks.check_static_length("max_seqlen_q", max_seqlen_q)
    max_k = _checks.check_static_length("max_seqlen_k", max_seqlen_k)
    cfg = _checks.make_config(q.shape[-1], softmax_scale, causal, window_size, softcap,
                              sinks is not None, deterministic, packed=True,
                              max_seqlen_q=max_q, max_seqlen_k=max_k)
    layout = Layout(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q,
                    seqused_k=seqused_k)
    _ffi.load()
    if sinks is None:
        sinks = jnp.zeros((q.shape[1],), jnp.float32)  # ignored: has_sinks is False
    out, lse = attention_core(q, k, v, sinks, layout, cfg)
    return (out, lse) if return_lse else out
