"""Attention dropout's keep mask in pure JAX, bit for bit the one of
csrc/include/flashjax/dropout.h (every C++/CUDA path uses that header), and the public
`dropout_mask`.

The definition (the header has the reasoning behind the grouping):
- generator: Philox4x32-7 (Salmon et al., SC'11; Random123's constants; 7 rounds as
  FlashAttention 2's dropout), in uint32
  arithmetic only (the high half of a 32x32-bit product from 16-bit halves), so that it
  runs the same with jax_enable_x64 on or off;
- key (k0, k1): the PRNG key's data words (`key_words`);
- element (b, h, i, j) = (sequence, query head, query row, key column):
  counter (x0, x1, x2, x3) = ((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, h, b),
  slot = ((i % 16) // 8) * 4 + ((j % 16) // 8) * 2 + j % 2, value = the 16 bits
  (slot % 2) of word slot // 2 of Philox(counter, key), kept when value >= threshold(rate).

`keep_block` makes a (batch, heads, rows, cols) block of the mask, a Philox call per 8
elements; `keep_elements` any broadcast set of (b, h, i, j) (a call per element: for
packed rows and scalar checks).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import static_int, static_real

__all__ = ["ROUNDS", "VALUE_RANGE", "MAX_THRESHOLD", "philox4x32", "threshold", "check_rate",
           "check_dropout", "key_words", "key_rows", "keep_block", "keep_elements",
           "dropout_mask"]

# Random123's Philox4x32 multipliers and Weyl key increments.
_MULTIPLIERS = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))
_WEYL = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))
ROUNDS = 7  # (dropout.h's kRounds: why seven)
VALUE_RANGE = 65536  # values are 16-bit: uniform in [0, VALUE_RANGE)
MAX_THRESHOLD = VALUE_RANGE - 1  # a rate in [0, 1) always keeps something
_MAX_INDEX = 2 ** 32  # counters are uint32


def _mul_hi_lo(a, m: np.uint32):
    """(high, low) 32-bit halves of uint32 a times the constant m, without uint64."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    m_lo, m_hi = m & np.uint32(0xFFFF), m >> np.uint32(16)
    ll, lh, hl = a_lo * m_lo, a_lo * m_hi, a_hi * m_lo
    carry = ((ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)) >> 16
    return a_hi * m_hi + (lh >> 16) + (hl >> 16) + carry, a * m


def philox4x32(counter, k0, k1, rounds=ROUNDS):
    """Philox4x32 with `rounds` rounds of `counter` (four uint32 arrays that broadcast
    together) under key (k0, k1) (uint32 scalars): its four uint32 output words, of the
    broadcast shape."""
    shape = jnp.broadcast_shapes(*(jnp.shape(c) for c in counter))
    words = tuple(jnp.broadcast_to(jnp.asarray(c).astype(jnp.uint32), shape) for c in counter)

    def round_(_, state):
        (c0, c1, c2, c3), (k0, k1) = state
        hi0, lo0 = _mul_hi_lo(c0, _MULTIPLIERS[0])
        hi1, lo1 = _mul_hi_lo(c2, _MULTIPLIERS[1])
        return (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0), (k0 + _WEYL[0], k1 + _WEYL[1])
    # A loop, not unrolled rounds: on the CPU (10 rounds) it compiled 2.5x faster and
    # ran 8x faster ((2, 8, 512, 512) mask: 0.4 s vs 1.0 s, 19 ms vs 159 ms).
    key = (jnp.asarray(k0, jnp.uint32), jnp.asarray(k1, jnp.uint32))
    return jax.lax.fori_loop(0, rounds, round_, (words, key))[0]


def threshold(rate: float) -> int:
    """The static rate's threshold T (keep when value >= T): round(rate * 65536), halves
    up, clamped to [0, MAX_THRESHOLD] (the header's `threshold`, same double arithmetic).
    Rates below 2^-17 keep everything; rates from 1 - 1.5 / 65536 keep 1 value in 65536."""
    t = rate * VALUE_RANGE + 0.5
    return 0 if not t >= 1.0 else min(math.floor(t), MAX_THRESHOLD)


def check_rate(rate, name: str = "rate") -> float:
    """A static dropout rate in [0, 1) as a float; TypeError/ValueError naming `name`."""
    value = static_real(name, rate)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1) (the probability of dropping), got {rate!r}")
    return value


def check_dropout(dropout_rate, dropout_key) -> float:
    """An attention call's dropout arguments: the static rate as a float (0: no dropout,
    the key unused); ValueError/TypeError naming dropout_rate or dropout_key."""
    rate = check_rate(dropout_rate, "dropout_rate")
    if rate > 0:
        if dropout_key is None:
            raise ValueError(f"dropout_rate={rate!r} needs dropout_key (a JAX PRNG key, e.g. "
                             "jax.random.key(seed)); dropout_rate=0 turns dropout off")
        key_words(dropout_key)  # (checked here: the error names the argument)
    return rate


_KEY_KINDS = ("a JAX PRNG key (jax.random.key(seed)) or a legacy uint32 key "
              "(jax.random.PRNGKey(seed))")


def key_words(dropout_key, name: str = "dropout_key"):
    """The generator's key (k0, k1), uint32 scalars, from one PRNG key: its data words
    (`jax.random.key_data` of a typed key; a legacy key's uint32 words as they are).
    Two words (threefry, JAX's default) are (k0, k1); 2n words (rbg: 4) fold as
    k0 = XOR of the even-numbered words, k1 = XOR of the odd-numbered ones. Works on
    traced keys (under jit and vmap: a vmapped key is one key per instance)."""
    if not isinstance(dropout_key, (jax.Array, np.ndarray)):
        raise TypeError(f"{name} must be {_KEY_KINDS}, got {type(dropout_key).__name__}")
    dtype = dropout_key.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if dropout_key.shape != ():
            raise ValueError(f"{name} must be a single key (shape ()), got a key array of "
                             f"shape {dropout_key.shape} (vmap over keys instead)")
        data = jax.random.key_data(dropout_key).reshape(-1)
    elif dtype == np.uint32:
        if dropout_key.ndim != 1:
            raise ValueError(f"{name}: a legacy uint32 key must have shape (2,) (or (2n,)), "
                             f"got shape {dropout_key.shape} (vmap over keys instead)")
        data = jnp.asarray(dropout_key)
    else:
        raise TypeError(f"{name} must be {_KEY_KINDS}, got an array of dtype {dtype}")
    if data.shape[0] == 0 or data.shape[0] % 2:
        raise ValueError(f"{name} must hold an even, nonzero number of uint32 words, got "
                         f"{data.shape[0]}")
    data = data.astype(jnp.uint32)
    k0, k1 = data[0], data[1]
    for n in range(2, data.shape[0], 2):
        k0, k1 = k0 ^ data[n], k1 ^ data[n + 1]
    return k0, k1


def key_rows(dropout_key, sequences: int, heads: int):
    """The kernels' dropout operand: uint32 (sequences, heads, 4), for sequence b and
    head h the key words (k0, k1) and the mask indices (b, h) it uses. Folding a vmapped
    axis into the sequences, or sharding them or the heads, keeps each entry's key and
    indices: every instance draws the mask of its own unbatched, unsharded call."""
    k0, k1 = key_words(dropout_key)
    shape = (sequences, heads)
    b = jnp.arange(sequences, dtype=jnp.uint32)[:, None]
    h = jnp.arange(heads, dtype=jnp.uint32)[None, :]
    return jnp.stack([jnp.broadcast_to(x, shape) for x in (k0, k1, b, h)], axis=-1)


def _values(words):
    """A Philox call's 8 16-bit values, in slot order, stacked on a new last axis."""
    return jnp.stack([(w >> shift) & 0xFFFF for w in words for shift in (0, 16)], axis=-1)


def keep_elements(key, rate_threshold, b, h, i, j):
    """keep of the elements (b, h, i, j) (integer arrays that broadcast together,
    indices >= 0; traced values are fine) under key (k0, k1) (`key_words`) and
    `rate_threshold` (`threshold(rate)`, an int or a traced uint32): a Philox call per
    element."""
    b, h, i, j = (jnp.asarray(x).astype(jnp.uint32) for x in (b, h, i, j))
    words = philox4x32(((j // 16) * 4 + (j % 8) // 2, (i // 16) * 8 + i % 8, h, b), *key)
    slot = ((i % 16) // 8) * 4 + ((j % 16) // 8) * 2 + j % 2
    word = jnp.select([slot // 2 == n for n in range(3)], list(words[:3]), words[3])
    return ((word >> (16 * (slot % 2))) & 0xFFFF) >= jnp.asarray(rate_threshold, jnp.uint32)


def _aligned(start):
    """(start // 16 as uint32, start % 16): static when start is a Python int."""
    if isinstance(start, (int, np.integer)):
        return np.uint32(start // 16), int(start % 16)
    start = jnp.asarray(start, jnp.int32)
    return (start // 16).astype(jnp.uint32), start % 16


def keep_block(key, rate_threshold, batch: int, heads: int, rows: int, cols: int, *,
               batch_start=0, head_start=0, row_start=0, col_start=0):
    """keep[b, h, i, j] of sequences batch_start + [0, batch), heads head_start + [0,
    heads), rows row_start + [0, rows), columns col_start + [0, cols): bool (batch,
    heads, rows, cols), under key (k0, k1) and `rate_threshold` as in keep_elements.
    Sizes are static; starts may be traced (>= 0). One Philox call per 8 elements (the
    16x16 blocks that meet the range, cut to it)."""
    if isinstance(rate_threshold, int) and rate_threshold == 0:
        return jnp.ones((batch, heads, rows, cols), bool)
    row_block, row_skip = _aligned(row_start)
    col_block, col_skip = _aligned(col_start)
    # 16x16 blocks covering the range from the aligned starts (one more when the skip
    # is traced: its value is unknown).
    qb = -(-(rows + (row_skip if isinstance(row_skip, int) else 15)) // 16)
    kb = -(-(cols + (col_skip if isinstance(col_skip, int) else 15)) // 16)
    u32 = jnp.uint32
    # Counters of the block grid [b, h, qb, qr, kb, kc], from the first 16x16 block's:
    # x1 = 8 (row_block + qb) + qr, x0 = 4 (col_block + kb) + kc.
    x1 = (row_block * 8 + jnp.arange(qb * 8, dtype=u32)).reshape(qb, 8, 1, 1)
    x0 = (col_block * 4 + jnp.arange(kb * 4, dtype=u32)).reshape(kb, 4)
    h = (jnp.asarray(head_start).astype(u32) + jnp.arange(heads, dtype=u32)).reshape(
        heads, 1, 1, 1, 1)
    b = (jnp.asarray(batch_start).astype(u32) + jnp.arange(batch, dtype=u32)).reshape(
        batch, 1, 1, 1, 1, 1)
    values = _values(philox4x32((x0, x1, h, b), *key))  # [b, h, qb, qr, kb, kc, slot]
    keep = values >= jnp.asarray(rate_threshold, jnp.uint32)
    # slot = 4 qh + 2 kh + kp: row 16 qb + 8 qh + qr, column 16 kb + 8 kh + 2 kc + kp.
    keep = keep.reshape(batch, heads, qb, 8, kb, 4, 2, 2, 2).transpose(0, 1, 2, 6, 3, 4, 7, 5, 8)
    keep = keep.reshape(batch, heads, qb * 16, kb * 16)
    if isinstance(row_skip, int) and isinstance(col_skip, int):
        return keep[:, :, row_skip:row_skip + rows, col_skip:col_skip + cols]
    starts = [jnp.asarray(x, jnp.int32) for x in (0, 0, row_skip, col_skip)]
    return jax.lax.dynamic_slice(keep, starts, (batch, heads, rows, cols))


def _check_size(name: str, n) -> int:
    n = static_int(name, n)
    if not 0 <= n <= _MAX_INDEX:
        raise ValueError(f"{name} must be in [0, 2^32], got {n}")
    return n


def dropout_mask(dropout_key, rate, batch, heads_q, seqlen_q, seqlen_k):
    """The keep mask of attention dropout with `dropout_key` and `rate`: bool
    (batch, heads_q, seqlen_q, seqlen_k), True where a probability is kept (and scaled by
    1 / (1 - rate)), False where it is dropped. Whatever causal, window, bias or mask a
    call sets, this is its dropout mask (same bits on every path: CUDA, CPU, pure JAX).

    dropout_key: one PRNG key, traced values fine: a typed key (`jax.random.key`) or a
    legacy uint32 key (`jax.random.PRNGKey`); both of one seed give the same mask. Keys
    of 2n data words (e.g. the "rbg" implementation's 4) are folded into 2 (see
    `flashjax._dropout.key_words`). Under `jax.vmap` over keys each instance gets the
    mask of the unbatched call with its key.
    rate: static, in [0, 1); 0 keeps everything. Element (b, h, i, j) is kept when its
    16-bit Philox4x32-7 value is >= round(rate * 65536) (at most 65535: any rate below 1
    keeps something), so the kept fraction is 1 - rate to within 2^-17.
    batch, heads_q, seqlen_q, seqlen_k: static sizes (>= 0); element (b, h, i, j) is
    sequence b, query head h, query row i, key column j.

    The mask's definition, and why its generator calls are grouped as they are, is in
    docs/architecture.md ("Dropout")."""
    rate = check_rate(rate)
    key_words(dropout_key)  # checked here, outside the jit: the error names the call
    sizes = tuple(_check_size(name, n) for name, n in (
        ("batch", batch), ("heads_q", heads_q), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)))
    rate_threshold = threshold(rate)
    if rate_threshold == 0:
        return jnp.ones(sizes, bool)
    return _mask(dropout_key, np.uint32(rate_threshold), sizes)


@functools.partial(jax.jit, static_argnums=2)
def _mask(dropout_key, rate_threshold, sizes: tuple):
    # One compiled program per shape and key type, for every rate (op by op, every
    # operation would compile on its own).
    return keep_block(key_words(dropout_key), rate_threshold, *sizes)
