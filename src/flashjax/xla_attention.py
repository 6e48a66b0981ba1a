"""flashjax's attention in pure JAX (implementation="xla"): blockwise online softmax.

`attention_core(q, k, v, extras, layout, cfg)` has the contract of
`flashjax._core.attention_core` (the kernels' call): dense or packed (cfg.packed)
rows, GQA/MQA, causal and sliding windows, softcap, sinks, lse, seqused, segment ids
and positions (diagonal offsets), with the same clamping of metadata as
csrc/include/flashjax/seqlen.h. It uses jax.numpy and lax only (no FFI, no Pallas),
so it runs on any platform.

How it works:
- Every layout becomes per-row int32 metadata over one "batch" of rows (dense: the
  batch entries; packed: one entry holding every row): for query row i a visible key
  range [lo_i, hi_i] of key positions (the window around its diagonal, saturated to
  int32) and an id (segment id, or packed sequence index); for key row j its position
  (INT32_MIN for keys outside every used range: no row sees them) and id. Key j is
  visible to row i iff lo_i <= pos_j <= hi_i and id_i == id_j. Query rows outside
  every used range are zeroed at the end (out 0, lse -inf, even with sinks).
- Rows are cut into query blocks and key blocks. A pair of blocks is skipped when the
  blocks' ranges cannot meet (causal: the upper triangle; windows, packed sequences,
  segments, seqused likewise), computed without a mask when every pair of used rows is
  visible, and masked otherwise (as the kernels do).
- Forward: a scan over query blocks; for each, a loop over its key blocks carrying the
  running max, running sum and the float32 output accumulator (FlashAttention's online
  softmax; a sink starts the running max and sum). Memory is O(rows): no
  (seqlen_q, seqlen_k) array is ever built.
- Backward (jax.custom_vjp): a scan over key blocks; for each, a loop over its query
  blocks recomputing the probabilities from the saved lse, producing dK/dV of the block
  and adding into a float32 dQ. With D_i = dO_i . O_i - dlse_i:
  dS = P (dP - D), dsink_h = -sum_i exp(sink_h - lse_i) D_i.

Arithmetic is float32 (inputs cast per block, matrix products at HIGHEST precision);
out has q's dtype, lse is float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _dropout, _nonfinite
from ._autodiff import differentiable
from ._spec import Config, Extras, Layout
from ._visibility import diagonal_offset, used_rows
from ._vma import vary_over, varying_axes

__all__ = ["attention_backward", "attention_core", "no_work_attention"]

# Target block sizes (rows of queries and keys per block): the blocks of a call are at
# most this large (a length is cut into equal blocks, rounded up to a multiple of 8).
# Read at trace time (tests lower them to exercise many blocks on small shapes).
BLOCK_Q = 512
BLOCK_K = 512

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
_NO_KEY = INT32_MIN  # the position of a key that no row sees
_PRECISION = lax.Precision.HIGHEST


# ----------------------------------------------------------------------------- metadata


def _i32(x):
    return jnp.asarray(x, jnp.int32)


def _sat_add(a, b):
    """a + b for int32 arrays, saturated to [INT32_MIN, INT32_MAX] (no wrap-around)."""
    a, b = _i32(a), _i32(b)
    s = a + b  # wraps on overflow (XLA's two's-complement arithmetic)
    up = (a > 0) & (b > 0) & (s < 0)
    down = (a < 0) & (b < 0) & (s >= 0)
    return jnp.where(up, _i32(INT32_MAX), jnp.where(down, _i32(INT32_MIN), s))


def _add_static(a, c: int):
    """a + c, saturated, for an int32 array a and any Python int c."""
    a = _i32(a)
    if c >= 2**32:
        return jnp.full_like(a, INT32_MAX)
    if c <= -(2**32):
        return jnp.full_like(a, INT32_MIN)
    while c:  # same-sign chunks that fit int32: saturation composes exactly
        step = max(-INT32_MAX, min(INT32_MAX, c))
        a = _sat_add(a, np.int32(step))
        c -= step
    return a


class _Rows:
    """Per-row metadata of one call over `batch` entries of seqlen_q / seqlen_k rows.

    q_valid (batch, seqlen_q) bool: the row is used (else out 0, lse -inf);
    q_lo, q_hi (batch, seqlen_q) int32: the key positions the row sees (bounds
      included; INT32_MIN + 1 / INT32_MAX when unbounded);
    q_id, k_id (batch, seqlen) int32 or None: ids that must be equal;
    k_pos (batch, seqlen_k) int32: key positions, INT32_MIN for keys no row sees.
    q_diag (batch, seqlen_q) float32: the row's diagonal key position (ALiBi);
    q_seq (batch, seqlen_q) int32 or None: packed: the row's sequence;
    q_pos (batch, seqlen_q) int32 or None: packed: the row's index in its sequence.
    Static: use_lo / use_hi / use_id: which comparisons the element mask needs.
    """

    def __init__(self, q_valid, q_lo, q_hi, q_id, k_pos, k_id, use_lo, use_hi, q_diag=None,
                 q_seq=None, q_pos=None):
        self.q_valid, self.q_lo, self.q_hi, self.q_id = q_valid, q_lo, q_hi, q_id
        self.q_diag, self.q_seq, self.q_pos = q_diag, q_seq, q_pos
        self.k_pos, self.k_id = k_pos, k_id
        self.use_lo, self.use_hi, self.use_id = use_lo, use_hi, q_id is not None


def _window(offset, pos, valid, cfg: Config):
    """(lo, hi) of query rows at slot positions `pos` whose diagonal is key pos + offset."""
    first, last = cfg.window.bounds(offset, _add_static)
    base_lo = jnp.full_like(offset, INT32_MIN) if first is None else first
    base_hi = jnp.full_like(offset, INT32_MAX) if last is None else last
    # pos >= 0: a saturated base stays beyond every key position after adding it.
    lo = jnp.maximum(_sat_add(pos, base_lo), _i32(INT32_MIN + 1))  # > _NO_KEY always
    hi = _sat_add(pos, base_hi)
    return jnp.where(valid, lo, _i32(INT32_MAX)), jnp.where(valid, hi, _i32(INT32_MIN))


def _dense_rows(seqlen_q, seqlen_k, batch, layout: Layout, cfg: Config) -> _Rows:
    i = jnp.arange(seqlen_q, dtype=jnp.int32)[None, :]
    j = jnp.arange(seqlen_k, dtype=jnp.int32)[None, :]
    used_q = _i32(used_rows(layout.seqused_q, jnp.full((batch,), seqlen_q, jnp.int32)))
    used_k = _i32(used_rows(layout.seqused_k, jnp.full((batch,), seqlen_k, jnp.int32)))
    offset = _i32(diagonal_offset(used_q, used_k, layout.diagonal_offset))
    q_valid = jnp.broadcast_to(i < used_q[:, None], (batch, seqlen_q))
    q_lo, q_hi = _window(offset[:, None], i, q_valid, cfg)
    k_pos = jnp.where(j < used_k[:, None], j, _i32(_NO_KEY))
    q_id = k_id = None
    if layout.q_segment_ids is not None:
        q_id, k_id = _i32(layout.q_segment_ids), _i32(layout.kv_segment_ids)
    return _Rows(q_valid, q_lo, q_hi, q_id, k_pos, k_id,
                 use_lo=cfg.window.left >= 0 or layout.seqused_k is not None,
                 use_hi=cfg.window.right >= 0,
                 q_diag=(i + offset[:, None].astype(jnp.float32)).astype(jnp.float32))


def _slots(cu, total: int, max_len: int):
    """(start, slot) of each sequence, clamped as seqlen.h does."""
    cu = _i32(cu)
    start = jnp.clip(cu[:-1], 0, total)
    end = jnp.clip(cu[1:], 0, total)  # (clamping first changes no result and cannot wrap)
    slot = jnp.clip(end - start, 0, jnp.minimum(max_len, total - start))
    return start, slot


def _sequence_of_rows(start, used, total: int):
    """(sequence, position, used?) of each of `total` rows (packed layout)."""
    rows = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(start, rows, side="right").astype(jnp.int32) - 1
    seq = jnp.clip(seq, 0, start.shape[0] - 1)
    pos = rows - start[seq]
    return seq, pos, (pos >= 0) & (pos < used[seq])


def _packed_rows(total_q, total_k, layout: Layout, cfg: Config) -> _Rows:
    sequences = layout.cu_seqlens_q.shape[-1] - 1
    if sequences == 0:  # nothing is used
        zeros_q, zeros_k = (jnp.zeros((1, n), jnp.int32) for n in (total_q, total_k))
        return _Rows(zeros_q > 0, zeros_q + INT32_MAX, zeros_q + INT32_MIN, zeros_q,
                     zeros_k + _NO_KEY, zeros_k, use_lo=True, use_hi=cfg.window.right >= 0)
    start_q, slot_q = _slots(layout.cu_seqlens_q, total_q, cfg.max_seqlen_q)
    start_k, slot_k = _slots(layout.cu_seqlens_k, total_k, cfg.max_seqlen_k)
    used_q = _i32(used_rows(layout.seqused_q, slot_q))
    used_k = _i32(used_rows(layout.seqused_k, slot_k))
    offset = _i32(diagonal_offset(used_q, used_k, layout.diagonal_offset))
    q_seq, q_pos, q_valid = _sequence_of_rows(start_q, used_q, total_q)
    k_seq, k_pos, k_valid = _sequence_of_rows(start_k, used_k, total_k)
    q_lo, q_hi = _window(offset[q_seq], q_pos, q_valid, cfg)
    k_pos = jnp.where(k_valid, k_pos, _i32(_NO_KEY))
    q_diag = q_pos.astype(jnp.float32) + offset[q_seq].astype(jnp.float32)
    return _Rows(q_valid[None], q_lo[None], q_hi[None], q_seq[None], k_pos[None], k_seq[None],
                 use_lo=True, use_hi=cfg.window.right >= 0, q_diag=q_diag[None],
                 q_seq=q_seq[None], q_pos=q_pos[None])


# ----------------------------------------------------------------------------- blocks


def _block_size(n: int, target: int) -> tuple:
    """(block, count): `count` equal blocks of at most ~target rows covering n."""
    count = max(1, -(-n // target))
    block = -(-n // count)
    block = -(-block // 8) * 8
    return block, count


def _pad_rows(x, axis: int, rows: int, value=0):
    extra = rows - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


class _Plan:
    """Block layout of one call: sizes, blocked metadata and the block summaries that
    decide which block pairs are skipped, computed unmasked, or masked."""

    def __init__(self, rows: _Rows, batch, seqlen_q, seqlen_k, heads_q, heads_kv,
                 user_mask=False):
        self.batch, self.seqlen_q, self.seqlen_k = batch, seqlen_q, seqlen_k
        self.user_mask = user_mask  # a mask= array: every visited block pair is masked
        self.heads_kv, self.group = heads_kv, heads_q // heads_kv
        self.bq, self.nq = _block_size(seqlen_q, BLOCK_Q)
        self.bk, self.nk = _block_size(seqlen_k, BLOCK_K)
        self.use_lo = rows.use_lo or self.bk * self.nk != seqlen_k  # padded keys
        self.use_hi, self.use_id = rows.use_hi, rows.use_id
        pq, pk = self.bq * self.nq, self.bk * self.nk
        # Padded query rows: not used (their results are dropped).
        valid = _pad_rows(rows.q_valid, 1, pq, False)
        lo = _pad_rows(rows.q_lo, 1, pq, INT32_MAX)
        hi = _pad_rows(rows.q_hi, 1, pq, INT32_MIN)
        pos = _pad_rows(rows.k_pos, 1, pk, _NO_KEY)
        shape_q, shape_k = (batch, self.nq, self.bq), (batch, self.nk, self.bk)
        self.q_valid = valid.reshape(shape_q)
        self.q_lo, self.q_hi = lo.reshape(shape_q), hi.reshape(shape_q)
        self.k_pos = pos.reshape(shape_k)
        self.q_id = self.k_id = None
        if self.use_id:
            self.q_id = _pad_rows(rows.q_id, 1, pq).reshape(shape_q)
            self.k_id = _pad_rows(rows.k_id, 1, pk).reshape(shape_k)

        # Summaries over used rows and keys (neutral values for the others).
        v = self.q_valid
        big, small = _i32(INT32_MAX), _i32(INT32_MIN)
        self.q_any = v.any(-1)
        self.lo_min = jnp.min(jnp.where(v, self.q_lo, big), -1)
        self.lo_max = jnp.max(jnp.where(v, self.q_lo, small), -1)
        self.hi_min = jnp.min(jnp.where(v, self.q_hi, big), -1)
        self.hi_max = jnp.max(jnp.where(v, self.q_hi, small), -1)
        k_used = self.k_pos != _NO_KEY
        # Blocked rows that no result reads are zeroed (_to_blocks_*): the kernels never
        # read them, so NaN there (unread cache rows, padding) must not reach a result
        # through 0 * NaN in the block products.
        self.q_rows_used = jnp.broadcast_to(
            v[:, :, None, None, :], (batch, self.nq, 1, self.group, self.bq)
        ).reshape(batch, self.nq, 1, self.group * self.bq)
        self.k_rows_used = k_used[:, :, None, :]
        self.k_all = k_used.all(-1)
        self.pos_min = jnp.min(jnp.where(k_used, self.k_pos, big), -1)
        self.pos_max = jnp.max(self.k_pos, -1)
        if self.use_id:
            self.qid_min = jnp.min(jnp.where(v, self.q_id, big), -1)
            self.qid_max = jnp.max(jnp.where(v, self.q_id, small), -1)
            self.kid_min = jnp.min(jnp.where(k_used, self.k_id, big), -1)
            self.kid_max = jnp.max(jnp.where(k_used, self.k_id, small), -1)

    def pairs(self, b, qb=None, kb=None):
        """(meets, full) of query block(s) qb with key block(s) kb of batch entry b
        (one of qb, kb is None: all blocks on that side)."""
        qs = slice(None) if qb is None else qb
        ks = slice(None) if kb is None else kb
        q = lambda x: x[b, qs]
        k = lambda x: x[b, ks]
        meets = (q(self.q_any) & (q(self.lo_min) <= k(self.pos_max))
                 & (q(self.hi_max) >= k(self.pos_min)))
        full = k(self.k_all) & (q(self.lo_max) <= k(self.pos_min)) & (q(self.hi_min) >= k(self.pos_max))
        if self.use_id:
            meets &= (q(self.qid_min) <= k(self.kid_max)) & (k(self.kid_min) <= q(self.qid_max))
            full &= ((q(self.qid_min) == q(self.qid_max)) & (k(self.kid_min) == k(self.kid_max))
                     & (q(self.qid_min) == k(self.kid_min)))
        if self.user_mask:
            full = jnp.zeros_like(full)
        return meets, full

    def mask(self, b, qb, kb):
        """(bq, bk) bool: query row sees key, for the masked block pairs."""
        pos = self.k_pos[b, kb][None, :]
        mask = jnp.ones((self.bq, self.bk), bool)
        if self.use_lo:
            mask &= pos >= self.q_lo[b, qb][:, None]
        if self.use_hi:
            mask &= pos <= self.q_hi[b, qb][:, None]
        if self.use_id:
            mask &= self.q_id[b, qb][:, None] == self.k_id[b, kb][None, :]
        return mask

    def visible(self, b, qb, kb, terms: "_Terms"):
        """(heads_kv, group * bq, bk) bool: query row sees key, for the masked block
        pairs (the window, ids, and the mask= array)."""
        visible = jnp.broadcast_to(self.mask(b, qb, kb)[None, None],
                                   (self.heads_kv, self.group, self.bq, self.bk))
        visible = visible.reshape(self.heads_kv, self.group * self.bq, self.bk)
        return visible if terms.mask is None else visible & terms.block(terms.mask, b, qb, kb)

    @property
    def needs_mask(self) -> bool:
        return self.use_lo or self.use_hi or self.use_id or self.user_mask


def _schedule(meets, full):
    """(unmasked, masked, order): the blocks to visit, those needing no mask first (in
    order), then the masked ones; unmasked and masked count them."""
    rank = jnp.where(meets, jnp.where(full, 0, 1), 2).astype(jnp.int32)
    order = jnp.argsort(rank, stable=True).astype(jnp.int32)
    unmasked = jnp.sum(meets & full, dtype=jnp.int32)
    masked = jnp.sum(meets & ~full, dtype=jnp.int32)
    return unmasked, masked, order


def _visit(schedule, step, needs_mask: bool, init):
    """Runs step(masked, carry, block) over the scheduled blocks."""
    unmasked, masked, order = schedule
    if not needs_mask:  # every visited pair is computed unmasked
        return lax.fori_loop(0, unmasked + masked,
                             lambda i, c: step(False, c, order[i]), init)
    carry = lax.fori_loop(0, unmasked, lambda i, c: step(False, c, order[i]), init)
    return lax.fori_loop(unmasked, unmasked + masked, lambda i, c: step(True, c, order[i]),
                         carry)


def _to_blocks_q(x, plan: _Plan):
    """(batch, seqlen_q, heads_q, d) -> (batch, nq, heads_kv, group * bq, d), the rows
    not used zeroed."""
    b, _, _, d = x.shape
    x = _pad_rows(x, 1, plan.nq * plan.bq)
    x = x.reshape(b, plan.nq, plan.bq, plan.heads_kv, plan.group, d)
    x = x.transpose(0, 1, 3, 4, 2, 5)
    x = x.reshape(b, plan.nq, plan.heads_kv, plan.group * plan.bq, d)
    return jnp.where(plan.q_rows_used[..., None], x, jnp.zeros((), x.dtype))


def _from_blocks_q(x, plan: _Plan):
    """Inverse of _to_blocks_q."""
    b, d = x.shape[0], x.shape[-1]
    x = x.reshape(b, plan.nq, plan.heads_kv, plan.group, plan.bq, d)
    x = x.transpose(0, 1, 4, 2, 3, 5)
    x = x.reshape(b, plan.nq * plan.bq, plan.heads_kv * plan.group, d)
    return x[:, :plan.seqlen_q]


def _rows_to_blocks(x, plan: _Plan, value=0.0):
    """(batch, heads_q, seqlen_q) -> (batch, nq, heads_kv, group * bq); `value` in the
    rows not used."""
    b = x.shape[0]
    x = _pad_rows(x, 2, plan.nq * plan.bq, value)
    x = x.reshape(b, plan.heads_kv, plan.group, plan.nq, plan.bq)
    x = x.transpose(0, 3, 1, 2, 4).reshape(b, plan.nq, plan.heads_kv, plan.group * plan.bq)
    return jnp.where(plan.q_rows_used, x, jnp.asarray(value, x.dtype))


def _rows_from_blocks(x, plan: _Plan):
    b = x.shape[0]
    x = x.reshape(b, plan.nq, plan.heads_kv, plan.group, plan.bq)
    x = x.transpose(0, 2, 3, 1, 4).reshape(b, plan.heads_kv * plan.group, plan.nq * plan.bq)
    return x[:, :, :plan.seqlen_q]


def _to_blocks_k(x, plan: _Plan):
    """(batch, seqlen_k, heads_kv, d) -> (batch, nk, heads_kv, bk, d), the keys no row
    sees zeroed."""
    b, _, h, d = x.shape
    x = _pad_rows(x, 1, plan.nk * plan.bk)
    x = x.reshape(b, plan.nk, plan.bk, h, d).transpose(0, 1, 3, 2, 4)
    return jnp.where(plan.k_rows_used[..., None], x, jnp.zeros((), x.dtype))


def _from_blocks_k(x, plan: _Plan):
    b, _, h, _, d = x.shape
    x = x.transpose(0, 1, 3, 2, 4).reshape(b, plan.nk * plan.bk, h, d)
    return x[:, :plan.seqlen_k]


# ----------------------------------------------------------------------------- block math


def _dot(spec, a, b):
    return jnp.einsum(spec, a, b, precision=_PRECISION, preferred_element_type=jnp.float32)


def _scale_of(cfg: Config) -> float:
    """The factor q is multiplied by before q.k: scale, or scale / softcap."""
    return cfg.softmax_scale / cfg.softcap if cfg.softcap > 0 else cfg.softmax_scale


def _scores(qs, kf, cfg: Config):
    """(s, t): scores (heads_kv, group * bq, bk) and tanh of the softcap (or None)."""
    s = _dot("hmd,hkd->hmk", qs, kf)
    if cfg.softcap > 0:
        t = jnp.tanh(s)
        return jnp.float32(cfg.softcap) * t, t
    return s, None


def _masked_dot(spec, w, visible, x, signed=False):
    """_dot(spec, w, x) of a masked block, w 0 at the masked entries: the masked entries
    must not meet a non-finite x (0 * NaN); only blocks whose x has one pay for the
    exact sum (_nonfinite.masked_sum)."""
    dot = functools.partial(_dot, spec)
    return lax.cond(_nonfinite.any_nonfinite(x),
                    lambda: _nonfinite.masked_sum(w, visible, x, dot, signed=signed),
                    lambda: dot(w, x))


class _Terms:
    """The score terms of a call (bias, mask, ALiBi) per block pair, shaped like the
    scores (heads_kv, group * bq, bk): bias and mask sliced from their own broadcasting
    shape (1 or batch, 1 or heads_kv or heads_q, seqlen_q, seqlen_k), zero-/False-padded
    to whole blocks; ALiBi computed from the rows' diagonals and the keys' positions."""

    def __init__(self, bias, mask, slopes, rows: _Rows, plan: _Plan):
        self.plan = plan
        pad = lambda x, value: None if x is None else _pad_rows(
            _pad_rows(x, 2, plan.nq * plan.bq, value), 3, plan.nk * plan.bk, value)
        self.bias = pad(None if bias is None else bias.astype(jnp.float32), 0.0)
        self.mask = pad(mask, False)
        self.slopes = self.diag = None
        if slopes is not None:  # (sequences, heads_q) -> per row (batch, heads_q, rows)
            slopes = slopes.astype(jnp.float32)
            if rows.q_seq is None:
                per_row = jnp.broadcast_to(slopes[:, :, None], slopes.shape + (plan.seqlen_q,))
            else:
                per_row = jnp.swapaxes(slopes[rows.q_seq[0]], 0, 1)[None]
            self.slopes = _rows_to_blocks(per_row, plan)  # (batch, nq, heads_kv, group * bq)
            diag = _pad_rows(rows.q_diag, 1, plan.nq * plan.bq)
            self.diag = diag.reshape(plan.batch, plan.nq, plan.bq)
            self.k_pos = plan.k_pos.astype(jnp.float32)

    @property
    def active(self) -> bool:
        return self.bias is not None or self.mask is not None or self.slopes is not None

    def block(self, x, b, qb, kb):
        """Block (qb, kb) of sequence b of a bias or mask, as (heads_kv, group * bq, bk)."""
        plan = self.plan
        zero = jnp.zeros((), jnp.int32)
        entry = _i32(b) if x.shape[0] > 1 else zero
        blk = lax.dynamic_slice(x, (entry, zero, _i32(qb * plan.bq), _i32(kb * plan.bk)),
                                (1, x.shape[1], plan.bq, plan.bk))[0]
        heads = x.shape[1]
        if heads == plan.heads_kv * plan.group:  # heads_q
            blk = blk.reshape(plan.heads_kv, plan.group, plan.bq, plan.bk)
        else:  # heads_kv (each serves its group) or 1
            blk = blk.reshape(heads, 1, plan.bq, plan.bk)
        blk = jnp.broadcast_to(blk, (plan.heads_kv, plan.group, plan.bq, plan.bk))
        return blk.reshape(plan.heads_kv, plan.group * plan.bq, plan.bk)

    def add(self, s, b, qb, kb):
        """The scores of block pair (qb, kb) plus the bias and ALiBi terms."""
        plan = self.plan
        if self.bias is not None:
            s = s + self.block(self.bias, b, qb, kb)
        if self.slopes is not None:
            distance = jnp.abs(self.diag[b, qb][:, None] - self.k_pos[b, kb][None, :])
            distance = jnp.broadcast_to(distance[None, None], (plan.heads_kv, plan.group,
                                                             plan.bq, plan.bk))
            s = s - self.slopes[b, qb][..., None] * distance.reshape(s.shape)
        return s

    def bias_gradient(self, ds, dbias, b, qb, kb):
        """dbias plus block pair (qb, kb)'s dS (before the softcap derivative), summed
        over what the bias broadcasts."""
        plan = self.plan
        heads = dbias.shape[1]
        ds = ds.reshape(plan.heads_kv, plan.group, plan.bq, plan.bk)
        if heads == plan.heads_kv * plan.group:
            blk = ds.reshape(heads, plan.bq, plan.bk)
        elif heads == plan.heads_kv:
            blk = ds.sum(1)
        else:
            blk = ds.sum((0, 1))[None]
        zero = jnp.zeros((), jnp.int32)
        entry = _i32(b) if dbias.shape[0] > 1 else zero
        at = (entry, zero, _i32(qb * plan.bq), _i32(kb * plan.bk))
        old = lax.dynamic_slice(dbias, at, (1, heads, plan.bq, plan.bk))
        return lax.dynamic_update_slice(dbias, old + blk[None], at)


class _Dropout:
    """Attention dropout per block pair (dropout.h's mask, `_dropout`'s generator): the
    factors the probabilities are multiplied by, shaped like the scores (heads_kv,
    group * bq, bk): 1 / (1 - rate) where the mask keeps an element, 0 where it drops
    it. Element (b, h, i, j) from the layout's dropout operand (each sequence's key
    words and mask indices): dense, the block's rows and keys (keep_block, a Philox call
    per 8 elements); packed, each row's sequence and index in it (keep_elements)."""

    def __init__(self, words, rate: float, rows: _Rows, plan: _Plan):
        self.plan = plan
        self.active = words is not None and words.shape[0] > 0
        if not self.active:
            return
        self.words = words
        self.threshold = np.uint32(_dropout.threshold(rate))
        self.scale = np.float32(1.0 / (1.0 - rate))
        self.q_seq = self.q_pos = None
        if rows.q_seq is not None:
            blocked = lambda x: _pad_rows(x, 1, plan.nq * plan.bq).reshape(plan.batch, plan.nq,
                                                                            plan.bq)
            self.q_seq, self.q_pos = blocked(rows.q_seq), blocked(rows.q_pos)

    def factors(self, b, qb, kb):
        plan = self.plan
        heads_q = plan.heads_kv * plan.group
        if self.q_seq is None:
            w = self.words[b]  # (heads_q, 4): key words, then sequence b's mask indices
            keep = _dropout.keep_block((w[0, 0], w[0, 1]), self.threshold, 1, heads_q, plan.bq,
                                       plan.bk, batch_start=w[0, 2], head_start=w[0, 3],
                                       row_start=qb * plan.bq, col_start=kb * plan.bk)[0]
        else:
            # (heads_q, bq, 1, 4): each row's sequence's words
            w = jnp.swapaxes(self.words[self.q_seq[b, qb]], 0, 1)[:, :, None]
            keep = _dropout.keep_elements((self.words[0, 0, 0], self.words[0, 0, 1]),
                                          self.threshold, w[..., 2], w[..., 3],
                                          self.q_pos[b, qb][None, :, None],
                                          self.plan.k_pos[b, kb][None, None, :])
        keep = keep.reshape(plan.heads_kv, plan.group * plan.bq, plan.bk)
        return jnp.where(keep, self.scale, jnp.float32(0))


# ----------------------------------------------------------------------------- forward


def _forward_blocks(qb_, kb_, vb_, sinks, plan: _Plan, cfg: Config, axes: frozenset,
                    terms: _Terms, dropout: _Dropout):
    """Blocked forward: q (batch, nq, heads_kv, group*bq, d), k/v (batch, nk, heads_kv, bk, d)
    -> out (batch, nq, heads_kv, group*bq, dv) float32, lse (batch, nq, heads_kv, group*bq)."""
    batch, nq = plan.batch, plan.nq
    h, m = plan.heads_kv, plan.group * plan.bq
    dv = vb_.shape[-1]
    scale = _scale_of(cfg)
    if sinks is not None:
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(h, plan.group, 1),
                              (h, plan.group, plan.bq)).reshape(h, m)
        l0 = jnp.ones((h, m), jnp.float32)
    else:
        m0 = jnp.full((h, m), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((h, m), jnp.float32)

    def query_block(_, x):
        b, qb, qblk = x
        qs = qblk.astype(jnp.float32) * jnp.float32(scale)
        schedule = _schedule(*plan.pairs(b, qb=qb))

        def step(masked, carry, kb):
            mx, l, acc, seen = carry
            kf = kb_[b, kb].astype(jnp.float32)
            vf = vb_[b, kb].astype(jnp.float32)
            s, _ = _scores(qs, kf, cfg)
            if terms.active:
                s = terms.add(s, b, qb, kb)
            if masked:
                visible = plan.visible(b, qb, kb, terms)
                s = jnp.where(visible, s, -jnp.inf)
                seen = seen | jnp.any(visible, axis=-1)
            else:
                seen = jnp.ones_like(seen)
            m_new = jnp.maximum(mx, jnp.max(s, axis=-1))  # NaN-propagating
            shift = m_new
            if masked and sinks is None:  # rows with nothing yet: shift by 0, not -inf
                shift = jnp.where(m_new == -jnp.inf, jnp.float32(0), m_new)
            p = jnp.exp(s - shift[..., None])
            alpha = jnp.exp(mx - shift)
            l = l * alpha + jnp.sum(p, axis=-1)  # (undropped: the lse is)
            if dropout.active:
                p = p * dropout.factors(b, qb, kb)
            if masked:  # NaN rows give NaN p at masked entries: zero them, and keep them
                p = jnp.where(visible, p, jnp.float32(0))  # from a non-finite v
                pv = _masked_dot("hmk,hkd->hmd", p, visible, vf)
            else:
                pv = _dot("hmk,hkd->hmd", p, vf)
            acc = acc * alpha[..., None] + pv
            return m_new, l, acc, seen

        init = tuple(vary_over(x, axes) for x in (m0, l0, jnp.zeros((h, m, dv), jnp.float32),
                                               jnp.zeros((h, m), bool)))
        mx, l, acc, seen = _visit(schedule, step, plan.needs_mask, init)
        valid = jnp.broadcast_to(plan.q_valid[b, qb], (h, plan.group, plan.bq)).reshape(h, m)
        # Rows that see no key (and no sink) are told apart by the mask, never by the
        # values: a NaN row stays NaN (docs/api.md, "Non-finite values").
        used = valid & (seen | (sinks is not None))
        out = jnp.where(used[..., None], acc / l[..., None], jnp.float32(0))
        # l == 0 on a used row: every visible score is -inf (exp(-inf - -inf) is NaN).
        lse = jnp.where(used, jnp.where(l == 0, jnp.nan, mx + jnp.log(l)), -jnp.inf)
        return None, (out, lse)

    bs = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), nq)
    qbs = jnp.tile(jnp.arange(nq, dtype=jnp.int32), batch)
    xs = (bs, qbs, qb_.reshape((batch * nq,) + qb_.shape[2:]))
    _, (out, lse) = lax.scan(query_block, None, xs)
    return out.reshape(batch, nq, h, m, dv), lse.reshape(batch, nq, h, m)


# ----------------------------------------------------------------------------- backward


def _backward_blocks(qb_, kb_, vb_, dob_, lseb_, deltab_, plan: _Plan, cfg: Config,
                     axes: frozenset, terms: _Terms, dropout: _Dropout, dbias):
    """Blocked backward: (dq (batch, nq, heads_kv, group*bq, d), dk, dv (batch, nk, heads_kv,
    bk, d[v])) float32, before the softmax scale (dq, dk) is applied, and dbias (padded,
    when `dbias` is its zero start, else None)."""
    batch, nk = plan.batch, plan.nk
    h, bk = plan.heads_kv, plan.bk
    d, dv = kb_.shape[-1], vb_.shape[-1]
    scale = _scale_of(cfg)

    def key_block(carry, x):
        dq, dbias = carry
        b, kb, kblk, vblk = x
        kf, vf = kblk.astype(jnp.float32), vblk.astype(jnp.float32)
        schedule = _schedule(*plan.pairs(b, kb=kb))

        def step(masked, carry, qb):
            dk, dvv, dq, dbias = carry
            qf = qb_[b, qb].astype(jnp.float32)
            qs = qf * jnp.float32(scale)
            do = dob_[b, qb].astype(jnp.float32)
            s, t = _scores(qs, kf, cfg)
            if terms.active:
                s = terms.add(s, b, qb, kb)
            p = jnp.exp(s - lseb_[b, qb][..., None])  # lse +inf for rows without keys: 0
            dp = _dot("hmd,hkd->hmk", do, vf)
            if dropout.active:
                # out = (P Z) V with Z the factors: dV = (P Z)^T dO, dP = Z dO V^T, and
                # D = rowsum(dO O) is still sum_j P_ij dP_ij.
                z = dropout.factors(b, qb, kb)
                dp = dp * z
            ds = p * (dp - deltab_[b, qb][..., None])
            if terms.active:
                # A -inf score (a -inf bias; the key stays visible) adds nothing, as on
                # the kernels: a row whose scores all are -inf is NaN, its gradients 0.
                live = s != -jnp.inf
                p = jnp.where(live, p, jnp.float32(0))
                ds = jnp.where(live, ds, jnp.float32(0))
            if dropout.active:
                p = p * z
            if masked:
                # Masked (i, j) get P = dS = 0 (with a where: a NaN there stays out), and
                # the products over i and j must not meet a non-finite row they mask.
                visible = plan.visible(b, qb, kb, terms)
                p = jnp.where(visible, p, jnp.float32(0))
                ds = jnp.where(visible, ds, jnp.float32(0))
            if dbias is not None:  # d score = dS before the softcap derivative
                dbias = terms.bias_gradient(ds, dbias, b, qb, kb)
            if t is not None:
                ds = ds * (1 - t * t)
            if masked:
                t_visible = jnp.swapaxes(visible, -1, -2)
                dvv = dvv + _masked_dot("hkm,hmd->hkd", jnp.swapaxes(p, -1, -2), t_visible, do)
                dk = dk + _masked_dot("hkm,hmd->hkd", jnp.swapaxes(ds, -1, -2), t_visible, qf,
                                      signed=True)
                dq_add = _masked_dot("hmk,hkd->hmd", ds, visible, kf, signed=True)
            else:
                dvv = dvv + _dot("hmk,hmd->hkd", p, do)
                dk = dk + _dot("hmk,hmd->hkd", ds, qf)
                dq_add = _dot("hmk,hkd->hmd", ds, kf)
            zero = jnp.zeros((), jnp.int32)
            at = (b, qb, zero, zero, zero)
            dq_blk = lax.dynamic_slice(dq, at, (1, 1) + dq.shape[2:])
            dq_blk = dq_blk + dq_add[None, None]
            return dk, dvv, lax.dynamic_update_slice(dq, dq_blk, at), dbias

        init = (vary_over(jnp.zeros((h, bk, d), jnp.float32), axes),
                vary_over(jnp.zeros((h, bk, dv), jnp.float32), axes), dq, dbias)
        dk, dvv, dq, dbias = _visit(schedule, step, plan.needs_mask, init)
        return (dq, dbias), (dk, dvv)

    bs = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), nk)
    kbs = jnp.tile(jnp.arange(nk, dtype=jnp.int32), batch)
    flat = lambda x: x.reshape((batch * nk,) + x.shape[2:])
    dq0 = vary_over(jnp.zeros(qb_.shape, jnp.float32), axes)
    if dbias is not None:
        dbias = vary_over(dbias, axes)
    (dq, dbias), (dk, dvv) = lax.scan(key_block, (dq0, dbias), (bs, kbs, flat(kb_), flat(vb_)))
    return dq, dk.reshape(kb_.shape[:-1] + (d,)), dvv.reshape(vb_.shape[:-1] + (dv,)), dbias


# ----------------------------------------------------------------------------- the call


def _as_dense(q, k, v, layout: Layout, cfg: Config):
    """q, k, v with a batch dim and the per-row metadata."""
    if cfg.packed:
        return q[None], k[None], v[None], _packed_rows(q.shape[0], k.shape[0], layout, cfg)
    return q, k, v, _dense_rows(q.shape[1], k.shape[1], q.shape[0], layout, cfg)


def _plan(q, k, rows: _Rows, layout: Layout) -> _Plan:
    return _Plan(rows, q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                 user_mask=layout.mask is not None)


def _terms(extras: Extras, layout: Layout, rows: _Rows, plan: _Plan) -> _Terms:
    return _Terms(extras.bias, layout.mask, layout.alibi_slopes, rows, plan)


def _forward(q, k, v, extras: Extras, layout: Layout, cfg: Config):
    _check(q, k, v, cfg)
    qd, kd, vd, rows = _as_dense(q, k, v, layout, cfg)
    plan = _plan(qd, kd, rows, layout)
    out, lse = _forward_blocks(_to_blocks_q(qd, plan), _to_blocks_k(kd, plan),
                               _to_blocks_k(vd, plan), extras.sinks, plan, cfg,
                               varying_axes(q, k, v, extras, layout),
                               _terms(extras, layout, rows, plan),
                               _Dropout(layout.dropout, cfg.dropout_rate, rows, plan))
    out = _from_blocks_q(out, plan).astype(q.dtype)
    lse = _rows_from_blocks(lse, plan)
    if cfg.packed:
        return out[0], lse[0]
    return out, lse


def _check(q, k, v, cfg: Config):
    rank = 3 if cfg.packed else 4
    if q.ndim != rank or k.ndim != rank or v.ndim != rank:
        raise ValueError(f"xla_attention: q, k, v must have rank {rank} "
                         f"({'packed' if cfg.packed else 'dense'}), got {q.shape}, {k.shape}, "
                         f"{v.shape} (vmap over extra leading dimensions)")


def no_work_attention(q, k, v, extras: Extras, layout: Layout, cfg: Config):
    """(out, lse) of a call with no query rows or no keys (any implementation: no kernel
    runs): out 0; lse -inf, or, with sinks, the sink logit for the used rows (a softmax
    over the sink alone). Plain JAX, so autodiff needs no rule (dsinks = the lse
    cotangent of the used rows)."""
    out = jnp.zeros(q.shape[:-1] + v.shape[-1:], q.dtype)
    *_, rows = _as_dense(q, k, v, layout, cfg)
    used = rows.q_valid[:, None, :]  # (batch, 1, seqlen_q)
    lse = jnp.full(used.shape[:1] + (q.shape[-2],) + used.shape[2:], -jnp.inf, jnp.float32)
    if extras.sinks is not None:
        lse = jnp.where(used, extras.sinks.astype(jnp.float32)[None, :, None], lse)
    return out, (lse[0] if cfg.packed else lse)


def _backward(q, k, v, out, dout, lse, dlse, extras: Extras, layout: Layout, cfg: Config,
              needed: Extras):
    sinks = extras.sinks
    dout = dout.astype(jnp.float32)
    dlse = dlse.astype(jnp.float32)
    # D_i = dO_i . O_i - dlse_i: dS = P (dP - D) covers the lse cotangent too.
    delta = jnp.einsum("...qhd,...qhd->...hq", dout, out.astype(jnp.float32),
                       precision=_PRECISION) - dlse
    if cfg.packed:
        qd, kd, vd, dod, lsed, deltad = q[None], k[None], v[None], dout[None], lse[None], delta[None]
        rows = _packed_rows(q.shape[0], k.shape[0], layout, cfg)
    else:
        qd, kd, vd, dod, lsed, deltad = q, k, v, dout, lse, delta
        rows = _dense_rows(q.shape[1], k.shape[1], q.shape[0], layout, cfg)
    plan = _plan(qd, kd, rows, layout)
    terms = _terms(extras, layout, rows, plan)
    # dbias only when bias is perturbed (custom_vjp's symbolic zeros)
    dbias = None
    if extras.bias is not None and needed.bias:
        dbias = jnp.zeros(terms.bias.shape, jnp.float32)
    # lse -inf (rows not used, or without any key and sink): +inf, so that P = 0.
    lse_safe = jnp.where(lsed == -jnp.inf, jnp.inf, lsed)
    dq, dk, dvv, dbias = _backward_blocks(
        _to_blocks_q(qd, plan), _to_blocks_k(kd, plan), _to_blocks_k(vd, plan),
        _to_blocks_q(dod, plan), _rows_to_blocks(lse_safe, plan, jnp.inf),
        _rows_to_blocks(deltad, plan), plan, cfg,
        varying_axes(q, k, v, extras, layout, dout, dlse), terms,
        _Dropout(layout.dropout, cfg.dropout_rate, rows, plan), dbias)
    dq = _from_blocks_q(dq, plan) * jnp.float32(cfg.softmax_scale)
    dk = _from_blocks_k(dk, plan) * jnp.float32(cfg.softmax_scale)
    dvv = _from_blocks_k(dvv, plan)
    if cfg.packed:
        dq, dk, dvv = dq[0], dk[0], dvv[0]
    d_extras = Extras()
    if dbias is not None:
        d_extras = d_extras._replace(
            bias=dbias[:, :, :q.shape[1], :k.shape[1]].astype(extras.bias.dtype))
    if sinks is not None:
        # d lse_i / d sink = P_sink = exp(sink - lse_i); d out_i / d sink = -out_i P_sink.
        sink = sinks.astype(jnp.float32)
        sink = sink[:, None] if cfg.packed else sink[None, :, None]
        finite = jnp.isfinite(lse)
        p_sink = jnp.exp(jnp.where(finite, sink - jnp.where(finite, lse, 0), -jnp.inf))
        axes = (1,) if cfg.packed else (0, 2)
        d_extras = d_extras._replace(
            sinks=-jnp.sum(p_sink * delta, axis=axes).astype(sinks.dtype))
    return dq.astype(q.dtype), dk.astype(k.dtype), dvv.astype(v.dtype), d_extras


# The backward alone (flash_attention_backward's pure-JAX route): (dq, dk, dv, d_extras).
attention_backward = _backward
attention_core = differentiable(_forward, _backward)
attention_core.__doc__ = """(out, lse): the same contract as flashjax._core.attention_core,
computed blockwise in pure JAX; differentiable in q, k, v and the extras (custom_vjp with
a blockwise backward); layout fields get no cotangent."""
