"""Which keys a query row sees: the one description that the kernels' callers, the
pure-JAX path (xla_attention), the reference and the sequence-sharded calls (ring)
share (docs/api.md, "Masking"; the kernels' own is csrc/include/flashjax/seqlen.h).

Used row i of a sequence has a diagonal, key i + offset, where offset is the query
position minus the key position (q_offset - kv_offset) when positions are given, else
used_k - used_q (bottom-right alignment on the used lengths). It sees the used keys in
[diagonal - left, diagonal + right] (a `Window`; -1: unbounded; causal is right = 0)
whose segment id equals its own. Rows past the used ones see nothing.
"""

from __future__ import annotations

import dataclasses
import operator

import jax.numpy as jnp
import numpy as np

__all__ = ["Window", "used_rows", "diagonal_offset"]


@dataclasses.dataclass(frozen=True)
class Window:
    """The keys a row sees around its diagonal: [diagonal - left, diagonal + right],
    -1 meaning unbounded."""

    left: int = -1
    right: int = -1

    @classmethod
    def of(cls, causal: bool, window_size) -> "Window":
        """The window of the public arguments: causal sets right = 0 (left is kept)."""
        left, right = (int(w) for w in window_size)
        return cls(left, 0 if causal else right)

    @property
    def masked(self) -> bool:
        """Some key may be hidden from a row (causal or a window)."""
        return self.left >= 0 or self.right >= 0

    @property
    def sliding(self) -> bool:
        """A bound other than causal's: a left one, or a right one past the diagonal."""
        return self.left >= 0 or self.right > 0

    def bounds(self, diagonal, add=operator.add):
        """(first, last) key a row with this diagonal sees; None where unbounded.
        add(x, c) adds a Python int (xla_attention saturates int32 there)."""
        first = None if self.left < 0 else add(diagonal, -self.left)
        last = None if self.right < 0 else add(diagonal, self.right)
        return first, last

    def sees(self, i, j, offset):
        """Whether row i sees key j (broadcast NumPy or JAX arrays) by the window alone."""
        first, last = self.bounds(i + offset)
        mask = np.ones(np.broadcast_shapes(np.shape(i), np.shape(j), np.shape(offset)), bool)
        if first is not None:
            mask = mask & (j >= first)
        if last is not None:
            mask = mask & (j <= last)
        return mask

    def block(self, offset, rows: int):
        """(some, every): whether some row of a rows x rows block whose row 0 has
        diagonal key `offset` sees some key of it, and whether every row sees every
        key (by the window alone; offset a JAX array)."""
        some = every = jnp.ones(jnp.shape(offset), bool)
        if self.right >= 0:
            some, every = some & (offset + self.right >= 1 - rows), every & (
                offset + self.right >= rows - 1)
        if self.left >= 0:
            some, every = some & (offset - self.left <= rows - 1), every & (
                offset - self.left <= 1 - rows)
        return some, every


def used_rows(seqused, rows):
    """The rows of each sequence that take part: seqused clamped to [0, rows], or
    `rows` (an int or an array per sequence) when seqused is None."""
    return rows if seqused is None else jnp.clip(seqused, 0, rows)


def diagonal_offset(used_q, used_k, positions=None):
    """Row 0's diagonal key: the position offset when given, else bottom-right
    alignment on the used lengths."""
    return used_k - used_q if positions is None else positions
