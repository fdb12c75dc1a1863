"""Draft trees: best-first growth from per-depth top-W lists, and the ancestor mask ("tree mask").

Nodes live in fixed arrays padded to the budget B, in insertion order (a parent always precedes its
children); node 0 is the root (the anchor, depth 0, score 0). Growth follows the published
`accum_logp` rule: pop the frontier node with the highest cumulative log-probability (ties go to the
earlier-inserted node), and if it is above the depth limit add all its children at once (up to the
remaining budget). Nodes at the depth limit never enter the frontier (popping one changes nothing),
so the loop has a static trip count. Every node at depth d draws its candidates from the same depth-d
distribution. A width of 1 gives a chain (the DFlash baseline).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Tree(NamedTuple):
    tokens: jax.Array  # (..., B) int32; padding nodes hold 0
    parents: jax.Array  # (..., B) int32; -1 for the root and padding
    depths: jax.Array  # (..., B) int32
    scores: jax.Array  # (..., B) float32 cumulative log-probability
    valid: jax.Array  # (..., B) bool; False for padding past num_nodes
    ancestors: jax.Array  # (..., B, B) bool; row i: the ancestors of i and i itself
    num_nodes: jax.Array  # (...,) int32


def validate_tree_settings(budget: int, width: int, max_depth: int, depth_limit: int | None = None) -> None:
    problems = []
    if budget < 1:
        problems.append(f"budget must be >= 1 (the root counts), got {budget}")
    if width < 1:
        problems.append(f"width must be >= 1, got {width}")
    if max_depth < 1:
        problems.append(f"max depth must be >= 1, got {max_depth}")
    if depth_limit is not None and max_depth > depth_limit:
        problems.append(f"max depth {max_depth} exceeds what the draft head predicts ({depth_limit} = "
                        "block_size - 1); lower the depth or use a head with a larger block")
    if problems:
        raise ValueError("invalid tree settings: " + "; ".join(problems))


TOP_K_CHUNK = 512  # vocabulary entries per first-stage row of `top_candidates`


def top_candidates(log_probs: jax.Array, width: int, chunk: int | None = TOP_K_CHUNK) -> tuple[jax.Array, jax.Array]:
    """log_probs (..., D, V) -> top-W tokens (..., D, W) int32 and their log-probs, best first, ties to
    the lower token id (as lax.top_k).

    A long vocabulary is cut into `chunk`-entry rows, the top W of each row taken, then the top W of
    those: XLA's GPU top-k gives each row one thread block, so 16 rows of 49k entries kept the H200
    waiting 67 us a step, while thousands of short rows spread over every multiprocessor. The result
    is the same: both stages keep ties in index order (chunk-major, then rank), and the -inf padding
    of the last chunk sits after every real entry."""
    v = log_probs.shape[-1]
    if chunk is None or width > chunk or v <= 2 * chunk:
        values, tokens = lax.top_k(log_probs, width)
        return tokens.astype(jnp.int32), values.astype(jnp.float32)
    lead = log_probs.shape[:-1]
    chunks = -(-v // chunk)
    padded = jnp.pad(log_probs, [(0, 0)] * len(lead) + [(0, chunks * chunk - v)], constant_values=-jnp.inf)
    chunk_values, chunk_tokens = lax.top_k(padded.reshape(lead + (chunks, chunk)), width)
    chunk_tokens = chunk_tokens + (jnp.arange(chunks, dtype=chunk_tokens.dtype) * chunk)[:, None]
    values, picked = lax.top_k(chunk_values.reshape(lead + (chunks * width,)), width)
    tokens = jnp.take_along_axis(chunk_tokens.reshape(lead + (chunks * width,)), picked, axis=-1)
    return tokens.astype(jnp.int32), values.astype(jnp.float32)


def build_tree(root_token: jax.Array, cand_tokens: jax.Array, cand_logps: jax.Array, budget: int) -> Tree:
    """Best-first tree for one sequence.

    root_token: () int; cand_tokens / cand_logps: (D, W) top-W per depth, best first, where D is the
    depth limit. Returns a Tree padded to `budget` nodes. vmap over the batch.
    """
    max_depth, width = cand_tokens.shape
    idx = jnp.arange(budget, dtype=jnp.int32)
    tokens = jnp.zeros((budget,), jnp.int32).at[0].set(root_token.astype(jnp.int32))
    parents = jnp.full((budget,), -1, jnp.int32)
    depths = jnp.zeros((budget,), jnp.int32)
    scores = jnp.zeros((budget,), jnp.float32)
    in_frontier = idx == 0
    cand_logps = jnp.nan_to_num(cand_logps.astype(jnp.float32), nan=-jnp.inf)

    def pop_and_expand(_, state):
        n, tokens, parents, depths, scores, frontier = state
        active = (n < budget) & jnp.any(frontier)
        best = jnp.max(jnp.where(frontier, scores, -jnp.inf))
        node = jnp.argmax(frontier & (scores == best))  # first = earliest inserted among ties
        frontier = frontier.at[node].set(frontier[node] & ~active)
        depth = depths[node]
        count = jnp.where(active, jnp.minimum(width, budget - n), 0)
        slot = jnp.arange(width, dtype=jnp.int32)
        target = jnp.where(slot < count, n + slot, budget)  # out of range: dropped
        tokens = tokens.at[target].set(cand_tokens[depth], mode="drop")
        parents = parents.at[target].set(node, mode="drop")
        depths = depths.at[target].set(depth + 1, mode="drop")
        scores = scores.at[target].set(scores[node] + cand_logps[depth], mode="drop")
        # a node at the depth limit has no children: popping it would change nothing, so it never
        # enters the frontier, and every pop adds nodes
        frontier = frontier.at[target].set(depth + 1 < max_depth, mode="drop")
        return n + count, tokens, parents, depths, scores, frontier

    # every pop adds min(width, room) nodes, so this many pops fill the budget; a static trip count
    # lets XLA run the loop without reading a condition back to the host each iteration
    pops = -(-(budget - 1) // width)
    n, tokens, parents, depths, scores, _ = lax.fori_loop(
        0, pops, pop_and_expand, (jnp.int32(1), tokens, parents, depths, scores, in_frontier))
    valid = idx < n
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=scores, valid=valid,
                ancestors=ancestor_mask(parents, max_depth), num_nodes=n)


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
    """(..., B) parent indices -> (..., B, B) bool: row i marks i and all its ancestors.
    Walks up max_depth levels at once for every node (no sequential loop over nodes)."""
    budget = parents.shape[-1]
    idx = jnp.arange(budget, dtype=jnp.int32)
    mask = jnp.broadcast_to(idx[:, None] == idx[None, :], parents.shape + (budget,))
    current = parents
    for _ in range(max_depth):
        mask = mask | (current[..., :, None] == idx)
        current = jnp.where(current >= 0, jnp.take_along_axis(parents, jnp.maximum(current, 0), axis=-1), -1)
    return mask

