"""Top-k over the vocabulary for many rows at once (the tree's per-depth candidates), as Pallas kernels.

XLA's GPU top-k over (rows x 49,152) logits is one thread block per row; cut into short rows it
becomes a sort whose cost grows with the batch (215 us of a batch-8 step on the H200,
benchmarks/results/spec_step_profile_batch8_h200.json). Here each program takes one `chunk` of one
row and keeps its k best by k rounds of max-then-lowest-index inside the block (two block reductions
a round, nothing written in between); a second pass does the same over the chunks' winners. The tree
stage (log-softmax, top-k, build) at batch 8 / 32 went from 0.30 / 1.09 to 0.08 / 0.28 ms
(spec_step_breakdown_topk_batch*_h200.json). Same tokens and values as `lax.top_k`, ties to the lower
index; a NaN counts as -inf (callers read log-probabilities, where a NaN is a broken logit).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetspec_jax.kernels.tree_attention import default_implementation, next_power_of_two

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")
CHUNK = 2048  # entries per program of the first pass: 24 programs per row of a 49,152-entry vocabulary


def top_k_reference(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x (..., N) -> values (..., k) float32 and indices (..., k) int32, best first, ties to the lower
    index; a NaN counts as -inf."""
    x = jnp.where(jnp.isnan(x), -jnp.inf, x.astype(jnp.float32))
    values, indices = lax.top_k(x, k)
    return values, indices.astype(jnp.int32)


def _block_top_k_kernel(x_ref, values_ref, index_ref, *, k: int, length: int):
    """One block (L,) -> its k best values and their positions in the block, padded to a power of two.
    Positions at or past `length` are padding and never chosen over a real entry."""
    size = x_ref.shape[0]
    x = x_ref[...].astype(jnp.float32)
    pos = jnp.arange(size, dtype=jnp.int32)
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    # chosen entries and padding are out of the running
    taken = (pos >= length).astype(jnp.int32)
    slot = jnp.arange(values_ref.shape[0], dtype=jnp.int32)
    values = jnp.full(values_ref.shape, -jnp.inf, jnp.float32)
    index = jnp.zeros(index_ref.shape, jnp.int32)
    for r in range(k):
        best = jnp.max(jnp.where(taken == 0, x, -jnp.inf))
        at = jnp.min(jnp.where((taken == 0) & (x == best), pos, size))
        taken = jnp.where(pos == at, 1, taken)
        values = jnp.where(slot == r, best, values)
        index = jnp.where(slot == r, at, index)
    values_ref[...] = values
    index_ref[...] = index


def _blocks_top_k(x: jax.Array, k: int, length: int, interpret: bool) -> tuple[jax.Array, jax.Array]:
    """x (R, C, L) with L a power of two -> the k best of each (r, c) block: values (R, C, k), positions
    (R, C, k) in the block."""
    rows, blocks, size = x.shape
    k_pad = next_power_of_two(k)
    out_spec = pl.BlockSpec((None, None, k_pad), lambda r, c: (r, c, 0))
    values, index = pl.pallas_call(
        functools.partial(_block_top_k_kernel, k=k, length=length),
        grid=(rows, blocks),
        in_specs=[pl.BlockSpec((None, None, size), lambda r, c: (r, c, 0))],
        out_specs=[out_spec, out_spec],
        out_shape=[jax.ShapeDtypeStruct((rows, blocks, k_pad), jnp.float32),
                   jax.ShapeDtypeStruct((rows, blocks, k_pad), jnp.int32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="top_k",
    )(x)
    return values[..., :k], index[..., :k]


@functools.partial(jax.jit, static_argnames=("k", "chunk", "interpret"))
def top_k_pallas(x: jax.Array, k: int, chunk: int = CHUNK, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """x (..., N) -> (values, indices) as top_k_reference, in two kernel passes: the k best of every
    `chunk` entries of a row, then the k best of those."""
    lead, n = x.shape[:-1], x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"top-k needs 1 <= k <= {n} (the row length), got k={k}")
    chunk = min(next_power_of_two(max(chunk, k)), next_power_of_two(n))
    rows = x.reshape(-1, n)
    chunks = -(-n // chunk)
    padded = jnp.pad(rows, ((0, 0), (0, chunks * chunk - n)), constant_values=-jnp.inf)
    # the last chunk's padding is -inf after every real entry: a real -inf wins the tie, by position
    values, pos = _blocks_top_k(padded.reshape(-1, chunks, chunk), k, chunk, interpret)
    if chunks > 1:
        index = pos + (jnp.arange(chunks, dtype=jnp.int32) * chunk)[:, None]
        width = chunks * k  # winners in chunk order, each chunk's best first: ties still go to the lower index
        size = next_power_of_two(width)
        winners = jnp.pad(values.reshape(-1, 1, width), ((0, 0), (0, 0), (0, size - width)),
                          constant_values=-jnp.inf)
        values, picked = _blocks_top_k(winners, k, width, interpret)
        pos = jnp.take_along_axis(index.reshape(-1, 1, width), picked, axis=-1)
    return values.reshape(lead + (k,)), pos.reshape(lead + (k,))


def top_k(x: jax.Array, k: int, implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """The k best entries of each row of x (..., N): "auto" runs the kernel on GPU and XLA's top-k
    elsewhere; "pallas_interpret" runs the kernel's semantics anywhere (tests)."""
    if implementation == "auto":
        implementation = default_implementation()
    if implementation == "xla":
        return top_k_reference(x, k)
    if implementation in ("pallas", "pallas_interpret"):
        return top_k_pallas(x, k, interpret=implementation == "pallas_interpret")
    raise ValueError(f"unknown top-k implementation {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
