"""Best-first tree growth (the rule of `jetspec_jax.tree.build_tree`) as one Pallas kernel.

XLA runs `build_tree`'s pop loop as a handful of tiny kernels per pop (about 11 us a pop on the
H200, 37 pops at B=256, so half a millisecond per step); here one program per sequence keeps the
frontier in registers through every pop. Same trees, bit for bit: the scores are the same fp32 sums
and ties go to the earlier-inserted node. `build_trees` dispatches: the Pallas kernel (Triton
lowering) on GPU, the vmapped reference elsewhere.

Checked with jax 0.10.2 on the CPU (interpret=True against the reference; the CUDA-lowered Triton
module passes MLIR's verifier) and with jax 0.11.2 on an H200: equal trees, 28 us of GPU time at
B=256 against 506 us for the reference's loop (benchmarks/results/tree_build_h200.json).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetspec_jax.kernels.tree_attention import default_implementation, next_power_of_two
from jetspec_jax.tree import Tree, ancestor_mask, build_tree

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")


def _grow_kernel(logps_ref, scores_ref, depths_ref, parents_ref, ranks_ref, valid_ref, *, budget: int, width: int,
                 max_depth: int, pops: int):
    """One sequence. logps (D', W') is the per-depth top-W log-probs padded with -inf to powers of two;
    outputs are per node (padded to a power of two): score, depth, parent, rank of its token in its
    depth's list, and 1 where the node exists."""
    size = scores_ref.shape[0]
    lp = logps_ref[...]
    idx = jnp.arange(size, dtype=jnp.int32)
    depth_ids = jnp.arange(lp.shape[0], dtype=jnp.int32)
    rank_ids = jnp.arange(lp.shape[1], dtype=jnp.int32)

    def pop_and_expand(_, state):
        n, scores, depths, parents, ranks, frontier = state
        in_frontier = frontier == 1
        best = jnp.max(jnp.where(in_frontier, scores, -jnp.inf))
        node = jnp.min(jnp.where(in_frontier & (scores == best), idx, size))  # earliest among ties
        active = (n < budget) & (node < size)
        at_node = idx == node
        # scalars are read out of vectors by a masked sum: exact, one term is nonzero
        node_depth = jnp.sum(jnp.where(at_node, depths, 0))
        node_score = jnp.sum(jnp.where(at_node, scores, 0.0))
        frontier = jnp.where(at_node & active, 0, frontier)
        count = jnp.where(active, jnp.minimum(width, budget - n), 0)
        slot = idx - n
        is_child = (slot >= 0) & (slot < count)
        row = jnp.sum(jnp.where(depth_ids[:, None] == node_depth, lp, 0.0), axis=0)  # (W',) this depth's list
        child_lp = jnp.sum(jnp.where(slot[:, None] == rank_ids[None, :], row[None, :], 0.0), axis=1)
        scores = jnp.where(is_child, node_score + child_lp, scores)
        depths = jnp.where(is_child, node_depth + 1, depths)
        parents = jnp.where(is_child, node, parents)
        ranks = jnp.where(is_child, slot, ranks)
        # as in build_tree: nodes at the depth limit never enter the frontier
        frontier = jnp.where(is_child, (node_depth + 1 < max_depth).astype(jnp.int32), frontier)
        return n + count, scores, depths, parents, ranks, frontier

    init = (jnp.int32(1), jnp.zeros((size,), jnp.float32), jnp.zeros((size,), jnp.int32),
            jnp.full((size,), -1, jnp.int32), jnp.zeros((size,), jnp.int32), (idx == 0).astype(jnp.int32))
    n, scores, depths, parents, ranks, _ = lax.fori_loop(0, pops, pop_and_expand, init)
    scores_ref[...] = scores
    depths_ref[...] = depths
    parents_ref[...] = parents
    ranks_ref[...] = ranks
    valid_ref[...] = (idx < n).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("budget", "num_warps", "interpret"))
def build_trees_pallas(root_tokens: jax.Array, cand_tokens: jax.Array, cand_logps: jax.Array, *, budget: int,
                       num_warps: int = 1, interpret: bool = False) -> Tree:
    """root_tokens (Bt,), cand_tokens / cand_logps (Bt, D, W) -> the batch's trees, equal to
    vmap(build_tree). One warp by default: every pop is a chain of block-wide reductions, which
    stay inside a warp."""
    batch, max_depth, width = cand_tokens.shape
    size, d_pad, w_pad = next_power_of_two(budget), next_power_of_two(max_depth), next_power_of_two(width)
    logps = jnp.nan_to_num(cand_logps.astype(jnp.float32), nan=-jnp.inf)
    logps = jnp.pad(logps, ((0, 0), (0, d_pad - max_depth), (0, w_pad - width)), constant_values=-jnp.inf)
    kernel = functools.partial(_grow_kernel, budget=budget, width=width, max_depth=max_depth,
                               pops=-(-(budget - 1) // width))
    node_spec = pl.BlockSpec((None, size), lambda i: (i, 0))
    scores, depths, parents, ranks, valid = pl.pallas_call(
        kernel,
        grid=(batch,),
        in_specs=[pl.BlockSpec((None, d_pad, w_pad), lambda i: (i, 0, 0))],
        out_specs=[node_spec] * 5,
        out_shape=[jax.ShapeDtypeStruct((batch, size), jnp.float32)]
        + [jax.ShapeDtypeStruct((batch, size), jnp.int32)] * 4,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="tree_build",
    )(logps)
    scores, depths, parents, ranks = (x[:, :budget] for x in (scores, depths, parents, ranks))
    valid = valid[:, :budget] == 1
    drafted = jnp.take_along_axis(cand_tokens.astype(jnp.int32).reshape(batch, -1),
                                  jnp.maximum(depths - 1, 0) * width + ranks, axis=1)
    tokens = jnp.where(depths == 0, root_tokens.astype(jnp.int32)[:, None], drafted)
    tokens = jnp.where(valid, tokens, 0)
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=scores, valid=valid,
                ancestors=ancestor_mask(parents, max_depth), num_nodes=jnp.sum(valid, axis=1, dtype=jnp.int32))


@functools.partial(jax.jit, static_argnames=("budget",))
def build_trees_xla(root_tokens: jax.Array, cand_tokens: jax.Array, cand_logps: jax.Array, *, budget: int) -> Tree:
    """The reference builder over a batch as one compiled program (called eagerly, each of vmap's ops
    would be compiled on its own: dozens of small XLA compilations for each new shape)."""
    return jax.vmap(functools.partial(build_tree, budget=budget))(root_tokens, cand_tokens, cand_logps)


def build_trees(root_tokens: jax.Array, cand_tokens: jax.Array, cand_logps: jax.Array, *, budget: int,
                implementation: str = "auto") -> Tree:
    """Trees for a batch: "auto" picks the Pallas kernel on GPU and the reference elsewhere;
    "pallas_interpret" runs the kernel's semantics anywhere (tests)."""
    if implementation == "auto":
        implementation = default_implementation()
    if implementation == "xla":
        return build_trees_xla(root_tokens, cand_tokens, cand_logps, budget=budget)
    if implementation in ("pallas", "pallas_interpret"):
        return build_trees_pallas(root_tokens, cand_tokens, cand_logps, budget=budget,
                                  interpret=implementation == "pallas_interpret")
    raise ValueError(f"unknown tree builder {implementation!r}; use one of {', '.join(IMPLEMENTATIONS)}")
