"""Static-size KV cache: one (batch, max_len, kv_heads, head_dim) buffer per layer, per-sequence lengths.

`lengths[b]` counts the committed tokens of sequence b. A forward over a block writes the block's keys
and values at slots lengths[b] .. lengths[b]+T-1 but does not advance `lengths`: the caller commits
what it keeps (all prompt tokens, one decoded token, or an accepted tree path after compaction).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class KVCache(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer: (batch, max_len, kv_heads, head_dim)
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # (batch,) int32

    @staticmethod
    def create(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> "KVCache":
        shape = (batch, max_len, num_kv_heads, head_dim)
        return KVCache(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
            lengths=jnp.zeros((batch,), jnp.int32),
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    def advance(self, n: jax.Array) -> "KVCache":
        return self._replace(lengths=self.lengths + n.astype(jnp.int32))


def write_block(buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes block[b] (T, ...) into buffer[b] at row starts[b]; callers guarantee starts+T <= max_len."""
    def write_one(buf, blk, start):
        return lax.dynamic_update_slice(buf, blk, (start,) + (0,) * (buf.ndim - 1))

    return jax.vmap(write_one)(buffer, block.astype(buffer.dtype), starts)


def gather_rows(buffer: jax.Array, rows: jax.Array) -> jax.Array:
    """buffer (B, S, ...), rows (B, K) -> (B, K, ...)."""
    return jax.vmap(lambda buf, idx: buf[idx])(buffer, rows)
