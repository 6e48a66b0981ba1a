"""A small Flax NNX transformer trained for a few steps with flashjax's attention:
`nnx.MultiHeadAttention(..., attention_fn=flashjax.flax.attention_fn)`, one line
against the model with Flax's default attention (jax.nn's). Prints both models' losses
(same initialisation, same batches). Needs flax (`pip install "flashjax[flax]"`).

The task: continue arithmetic sequences of tokens (t_i = start + i * step mod VOCAB),
right-padded to random lengths; a float key-padding mask (Flax's convention) and
causal attention (is_causal, top-left as in jax.nn).

    python examples/flax_nnx.py [--steps 20] [--batch 16]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flashjax.flax

VOCAB, LENGTH, MODEL, HEADS, KV_HEADS, LAYERS = 32, 32, 32, 4, 2, 2


class Block(nnx.Module):
    def __init__(self, attention_fn, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(MODEL, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            num_heads=HEADS, num_kv_heads=KV_HEADS, in_features=MODEL, decode=False,
            attention_fn=attention_fn, rngs=rngs)
        self.norm2 = nnx.LayerNorm(MODEL, rngs=rngs)
        self.up = nnx.Linear(MODEL, 4 * MODEL, rngs=rngs)
        self.down = nnx.Linear(4 * MODEL, MODEL, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask, is_causal=True)
        return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    def __init__(self, attention_fn, rngs: nnx.Rngs, layers: int = LAYERS):
        self.embed = nnx.Embed(VOCAB, MODEL, rngs=rngs)
        self.position = nnx.Embed(LENGTH, MODEL, rngs=rngs)
        self.blocks = nnx.List([Block(attention_fn, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(MODEL, rngs=rngs)
        self.unembed = nnx.Linear(MODEL, VOCAB, rngs=rngs)

    def __call__(self, tokens, valid):
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        mask = valid[:, None, None, :].astype(jnp.float32)  # keys that may be attended to
        for block in self.blocks:
            x = block(x, mask)
        return self.unembed(self.norm(x))


def batches(batch: int, steps: int, seed: int = 0):
    """(tokens, valid) per step: arithmetic sequences, right-padded (valid: the rows
    that are part of the sequence)."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        start = rng.integers(0, VOCAB, (batch, 1))
        step = rng.integers(1, 4, (batch, 1))
        tokens = (start + step * np.arange(LENGTH)) % VOCAB
        valid = np.arange(LENGTH) < rng.integers(LENGTH // 2, LENGTH + 1, (batch, 1))
        yield jnp.asarray(np.where(valid, tokens, 0), jnp.int32), jnp.asarray(valid)


def loss_fn(model, tokens, valid):
    """Next-token cross entropy over the valid positions."""
    logits = model(tokens, valid)[:, :-1]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    weights = valid[:, 1:]
    return (losses * weights).sum() / weights.sum()


@nnx.jit
def train_step(model, optimizer, tokens, valid):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, valid)
    optimizer.update(model, grads)
    return loss


def train(attention_fn, steps: int = 20, batch: int = 16, seed: int = 0,
          layers: int = LAYERS) -> list:
    """The losses of `steps` Adam steps of a model that uses `attention_fn`."""
    model = Transformer(attention_fn, nnx.Rngs(seed), layers)
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
    return [float(train_step(model, optimizer, tokens, valid))
            for tokens, valid in batches(batch, steps, seed)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    flash = train(flashjax.flax.attention_fn, args.steps, args.batch)
    default = train(nnx.dot_product_attention, args.steps, args.batch)
    for i, (a, b) in enumerate(zip(flash, default)):
        print(f"step {i:3d}  loss flashjax {a:.6f}  flax default {b:.6f}")
    print(f"max |difference| {max(abs(a - b) for a, b in zip(flash, default)):.2e} "
          f"({jax.default_backend()})")


if __name__ == "__main__":
    main()
