"""Cache compaction after acceptance (`jetspec_jax.verify.compact_cache`) as one Pallas kernel.

Every step moves the accepted path's keys and values (tree slots lengths + path) to the contiguous
slots lengths .. of every layer's K and V buffer. XLA does that as a gather and an in-place update per
buffer: 120 small kernels a step for the embedded model's 30 layers. Here one launch does all buffers
in place (input/output aliasing), one program per (sequence, buffer), each reading all its rows before
writing any, across its warps too (a block-wide barrier: a source row can be another row's
destination). Same result as the reference, row for row. On the H200 the accept-and-commit stage went
from 0.106 to 0.056 ms at B=16 (benchmarks/results/spec_step_breakdown_compaction_h200.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetspec_jax.kernels.tree_attention import default_implementation, next_power_of_two
from jetspec_jax.kv_cache import gather_rows, write_block

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")


def _compact_kernel(lengths_ref, path_ref, *refs, num_rows: int, width: int, barrier: bool):
    """Program (b, j) moves rows lengths[b] + path[b, :] of buffer j to rows lengths[b] + 0.. ."""
    buffers = len(refs) // 2
    sources, targets = refs[:buffers], refs[buffers:]  # the same memory (aliased)
    b, j = pl.program_id(0), pl.program_id(1)
    rows, cols = jnp.arange(next_power_of_two(num_rows)), jnp.arange(next_power_of_two(width))
    row_ok = rows < num_rows
    start = lengths_ref[b]
    src = start + plgpu.load(path_ref.at[b, pl.ds(0, rows.shape[0])], mask=row_ok, other=0)
    mask = row_ok[:, None] & (cols < width)[None, :]
    for i in range(buffers):  # a ref cannot be picked by a traced index: one branch per buffer
        @pl.when(j == i)
        def _(i=i):
            moved = plgpu.load(sources[i].at[b, src[:, None], cols[None, :]], mask=mask, other=0)  # a gather
            # every warp's reads before any warp's writes: the rows are spread over the warps, and a warp
            # that stored first overwrote a source row another had still to read (a wrong KV row, on the
            # GPU only: interpret mode, which has no barrier, runs the load whole before the store)
            if barrier:
                plgpu.debug_barrier()
            plgpu.store(targets[i].at[b, pl.ds(start, rows.shape[0]), pl.ds(0, cols.shape[0])], moved, mask=mask)


@functools.partial(jax.jit, static_argnames=("interpret",))
def compact_rows_pallas(buffers: tuple[jax.Array, ...], lengths: jax.Array, path: jax.Array, *,
                        interpret: bool = False) -> tuple[jax.Array, ...]:
    """buffers: same-shaped (B, S, ...) arrays; row lengths[b] + path[b, i] of each goes to row
    lengths[b] + i (all rows read before any is written). Needs lengths + max(path) < S."""
    b, s = buffers[0].shape[:2]
    flat = [x.reshape(b, s, -1) for x in buffers]  # row-major: a bitcast, no copy
    width = flat[0].shape[-1]
    count = len(flat)
    moved = pl.pallas_call(
        functools.partial(_compact_kernel, num_rows=path.shape[1], width=width, barrier=not interpret),
        grid=(b, count),
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat],
        input_output_aliases={2 + i: i for i in range(count)},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="cache_compact",
    )(lengths.astype(jnp.int32), path.astype(jnp.int32), *flat)
    return tuple(m.reshape(x.shape) for m, x in zip(moved, buffers))


def compact_rows_reference(buffers: tuple[jax.Array, ...], lengths: jax.Array,
                           path: jax.Array) -> tuple[jax.Array, ...]:
    rows = lengths[:, None] + path
    return tuple(write_block(x, gather_rows(x, rows), lengths) for x in buffers)


def compact_rows(buffers: tuple[jax.Array, ...], lengths: jax.Array, path: jax.Array, *,
                 implementation: str = "auto") -> tuple[jax.Array, ...]:
    """"auto" picks the Pallas kernel on GPU and the reference elsewhere; "pallas_interpret" runs
    the kernel's semantics anywhere (tests)."""
    if implementation == "auto":
        implementation = default_implementation()
    if implementation == "xla":
        return compact_rows_reference(buffers, lengths, path)
    if implementation in ("pallas", "pallas_interpret"):
        return compact_rows_pallas(tuple(buffers), lengths, path, interpret=implementation == "pallas_interpret")
    raise ValueError(f"unknown cache compaction {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
