"""The target's KV cache: per-sequence lengths over one of two layouts of every layer's K and V.

Dense: one (batch, max_len, kv_heads, head_dim) buffer per layer, a row per sequence slot.
Paged: one pool (num_pages, page_size, kv_heads, head_dim) per layer shared by every sequence, and a
page table (batch, pages_per_sequence): row r of sequence b lives in pool page pages[b, r // page_size]
at offset r % page_size. A server then holds memory for the tokens its requests can reach, not for
slots x max_len, and admits a request by writing its table row, never by copying K/V.

`lengths[b]` counts the committed tokens of sequence b. A forward over a block writes the block's keys
and values at rows lengths[b] .. lengths[b]+T-1 but does not advance `lengths`: the caller commits
what it keeps (all prompt tokens, one decoded token, or an accepted tree path after compaction).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Pool page 0 of a paged cache is scratch: table entries no request owns point there, so the rows an
# idle sequence's step writes land where no live sequence reads.
SCRATCH_PAGE = 0


class KVCache(NamedTuple):
    k: tuple[jax.Array, ...]  # per layer: dense (batch, max_len, kv_heads, head_dim), paged (pages, page_size, ...)
    v: tuple[jax.Array, ...]
    lengths: jax.Array  # (batch,) int32
    pages: jax.Array | None = None  # paged: (batch, pages_per_sequence) int32 pool page of each logical page

    @staticmethod
    def create(num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32, page_size: int | None = None, num_pages: int | None = None) -> "KVCache":
        """A dense cache, or with `page_size` a paged one: by default its pool holds exactly the batch's
        pages (sequence b owns pages b * pages_per_sequence ..), as offline generation uses it; with
        `num_pages` a pool of that many whose table the caller fills (every entry at the scratch page),
        as the server's."""
        if page_size is None:
            shape = (batch, max_len, num_kv_heads, head_dim)
            pages = None
        else:
            check_page_size(page_size)
            per_sequence = pages_for(max_len, page_size)
            if num_pages is None:
                num_pages = batch * per_sequence
                pages = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, per_sequence)
            else:
                pages = jnp.full((batch, per_sequence), SCRATCH_PAGE, jnp.int32)
            shape = (num_pages, page_size, num_kv_heads, head_dim)
        return KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                       v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
                       lengths=jnp.zeros((batch,), jnp.int32), pages=pages)

    @property
    def paged(self) -> bool:
        return self.pages is not None

    @property
    def page_size(self) -> int | None:
        return self.k[0].shape[1] if self.paged else None

    @property
    def max_len(self) -> int:
        """Rows a sequence can address."""
        return self.pages.shape[1] * self.k[0].shape[1] if self.paged else self.k[0].shape[1]

    @property
    def batch(self) -> int:
        return self.pages.shape[0] if self.paged else self.k[0].shape[0]

    def advance(self, n: jax.Array) -> "KVCache":
        return self._replace(lengths=self.lengths + n.astype(jnp.int32))

    def write(self, buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
        """Writes block[b] (T, ...) into one layer's buffer at sequence b's rows starts[b] ..; callers
        guarantee starts + T <= max_len."""
        if not self.paged:
            return write_block(buffer, block, starts)
        rows = starts[:, None] + jnp.arange(block.shape[1], dtype=jnp.int32)[None]
        page, offset = self.locate(rows)
        return buffer.at[page, offset].set(block.astype(buffer.dtype))

    def gather(self, buffer: jax.Array, rows: jax.Array) -> jax.Array:
        """Rows (B, K) of each sequence from one layer's buffer -> (B, K, ...)."""
        if not self.paged:
            return gather_rows(buffer, rows)
        page, offset = self.locate(rows)
        return buffer[page, offset]

    def locate(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Pool page and offset of rows (B, K) of each sequence (paged only). A row past the table
        reads its last page's entry clipped: callers keep rows < max_len."""
        size = self.page_size
        logical = jnp.clip(rows // size, 0, self.pages.shape[1] - 1)
        return jnp.take_along_axis(self.pages, logical, axis=1), rows % size

    def flat_rows(self, rows: jax.Array) -> jax.Array:
        """Rows (B, K) of each sequence as indices into a layer's buffer seen as (rows, ...)."""
        if not self.paged:
            return jnp.arange(self.batch, dtype=jnp.int32)[:, None] * self.max_len + rows
        page, offset = self.locate(rows)
        return page * self.page_size + offset


def sequence_rows(pool: jax.Array, pages: jax.Array) -> jax.Array:
    """A paged pool (pages, page_size, ...) read as (batch, pages_per_sequence * page_size, ...) rows."""
    return pool[pages].reshape((pages.shape[0], -1) + pool.shape[2:])


def is_page_size(page_size: int) -> bool:
    """The tree-attention kernel reads a page as whole blocks of a power-of-two size >= 16."""
    return page_size >= 16 and not page_size & (page_size - 1)


def check_page_size(page_size: int) -> None:
    if not is_page_size(page_size):
        raise ValueError(f"page_size must be a power of two >= 16 (16, 32, 64, ...), got {page_size}")


def pages_for(rows: int, page_size: int) -> int:
    return -(-rows // page_size)


def write_block(buffer: jax.Array, block: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes block[b] (T, ...) into buffer[b] at row starts[b]; callers guarantee starts+T <= max_len."""
    def write_one(buf, blk, start):
        return lax.dynamic_update_slice(buf, blk, (start,) + (0,) * (buf.ndim - 1))

    return jax.vmap(write_one)(buffer, block.astype(buffer.dtype), starts)


def gather_rows(buffer: jax.Array, rows: jax.Array) -> jax.Array:
    """buffer (B, S, ...), rows (B, K) -> (B, K, ...)."""
    return jax.vmap(lambda buf, idx: buf[idx])(buffer, rows)
