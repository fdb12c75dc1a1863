"""Cache compaction after acceptance (`jetspec_jax.verify.compact_cache`) as one Pallas kernel.

Every step moves the accepted path's keys and values (tree slots lengths + path) to the contiguous
slots lengths .. of every layer's K and V buffer. The caller names both as row indices into the buffers
seen as (rows, width), so one kernel serves the dense cache and the paged pool (kv_cache.flat_rows).
XLA does that as a gather and an in-place update per buffer: 120 small kernels a step for the embedded
model's 30 layers. Here one launch does all buffers in place (input/output aliasing), one program per
(sequence, buffer), each reading all its rows before writing any, across its warps too (a block-wide
barrier: a source row can be another row's destination). Same result as the reference, row for row. On
the H200 the accept-and-commit stage went from 0.106 to 0.056 ms at B=16 with the kernel's first form,
which stored the rows as one contiguous block (benchmarks/results/spec_step_breakdown_compaction_h200.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetspec_jax.kernels.tree_attention import default_implementation, next_power_of_two

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")


def _compact_kernel(sources_ref, targets_ref, *refs, num_rows: int, width: int, barrier: bool):
    """Program (b, j) moves rows sources[b, :] of buffer j to rows targets[b, :]."""
    buffers = len(refs) // 2
    ins, outs = refs[:buffers], refs[buffers:]  # the same memory (aliased)
    b, j = pl.program_id(0), pl.program_id(1)
    rows, cols = jnp.arange(next_power_of_two(num_rows)), jnp.arange(next_power_of_two(width))
    row_ok = rows < num_rows
    src = plgpu.load(sources_ref.at[b, rows], mask=row_ok, other=0)
    dst = plgpu.load(targets_ref.at[b, rows], mask=row_ok, other=0)
    mask = row_ok[:, None] & (cols < width)[None, :]
    for i in range(buffers):  # a ref cannot be picked by a traced index: one branch per buffer
        @pl.when(j == i)
        def _(i=i):
            moved = plgpu.load(ins[i].at[src[:, None], cols[None, :]], mask=mask, other=0)  # a gather
            # every warp's reads before any warp's writes: the rows are spread over the warps, and a warp
            # that stored first overwrote a source row another had still to read (a wrong KV row, on the
            # GPU only: interpret mode, which has no barrier, runs the load whole before the store)
            if barrier:
                plgpu.debug_barrier()
            plgpu.store(outs[i].at[dst[:, None], cols[None, :]], moved, mask=mask)


def _flat(x: jax.Array) -> jax.Array:
    """A cache buffer (B, S, ...) or pool (pages, page_size, ...) as (rows, width): a bitcast, no copy."""
    return x.reshape(x.shape[0] * x.shape[1], -1)


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact_rows_pallas(buffers: tuple[jax.Array, ...], sources: jax.Array, targets: jax.Array, *,
                        interpret: bool = False) -> tuple[jax.Array, ...]:
    """buffers: same-shaped arrays, each seen as (rows, width); row sources[b, i] of each goes to row
    targets[b, i] (all of a sequence's rows read before any is written)."""
    flat = [_flat(x) for x in buffers]
    count, width = len(flat), flat[0].shape[1]
    moved = pl.pallas_call(
        functools.partial(_compact_kernel, num_rows=sources.shape[1], width=width, barrier=not interpret),
        grid=(sources.shape[0], count),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={2 + i: i for i in range(count)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="cache_compact",
    )(sources.astype(jnp.int32), targets.astype(jnp.int32), *flat)
    return tuple(m.reshape(x.shape) for m, x in zip(moved, buffers))


def compact_rows_reference(buffers: tuple[jax.Array, ...], sources: jax.Array,
                           targets: jax.Array) -> tuple[jax.Array, ...]:
    def move(x):
        flat = _flat(x)
        return flat.at[targets.reshape(-1)].set(flat[sources.reshape(-1)]).reshape(x.shape)

    return tuple(move(x) for x in buffers)


def compact_rows(buffers: tuple[jax.Array, ...], sources: jax.Array, targets: jax.Array, *,
                 implementation: str = "auto") -> tuple[jax.Array, ...]:
    """Moves rows `sources` (B, K) of every buffer to rows `targets` (B, K), indices into each buffer
    seen as (rows, width); a sequence's targets are distinct. "auto" picks the Pallas kernel on GPU and
    the reference elsewhere; "pallas_interpret" runs the kernel's semantics anywhere (tests)."""
    if implementation == "auto":
        implementation = default_implementation()
    if implementation == "xla":
        return compact_rows_reference(buffers, sources, targets)
    if implementation in ("pallas", "pallas_interpret"):
        return compact_rows_pallas(tuple(buffers), sources, targets, interpret=implementation == "pallas_interpret")
    raise ValueError(f"unknown cache compaction {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
