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

from jetspec_jax.kernels.top_k import default_implementation, top_k, top_k_reference


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


TOP_K_CHUNK = 512  # vocabulary entries per first-stage row of the XLA path of `top_candidates`


def top_candidates(log_probs: jax.Array, width: int, chunk: int | None = TOP_K_CHUNK,
                   implementation: str = "auto") -> tuple[jax.Array, jax.Array]:
    """log_probs (..., D, V) -> top-W tokens (..., D, W) int32 and their log-probs, best first, ties to
    the lower token id (as lax.top_k); a NaN counts as -inf.

    "auto" takes the Pallas top-k (jetspec_jax/kernels/top_k.py) on GPU, a quarter of the XLA path's cost at
    batch 8 and 32. The XLA path cuts a long vocabulary into `chunk`-entry rows, takes the top W of
    each, then the top W of those: XLA's GPU top-k gives each row one thread block, so 16 rows of 49k
    entries kept the H200 waiting 67 us a step, while thousands of short rows spread over every
    multiprocessor (as a sort, whose cost grows with the batch). Every path gives the same result:
    both stages keep ties in index order (chunk-major, then rank), and the -inf padding of the last
    chunk sits after every real entry."""
    if implementation == "auto":
        implementation = default_implementation()
    if implementation != "xla":
        values, tokens = top_k(log_probs, width, implementation)
        return tokens, values
    v = log_probs.shape[-1]
    if chunk is None or width > chunk or v <= 2 * chunk:
        values, tokens = top_k_reference(log_probs, width)
        return tokens, values
    log_probs = jnp.where(jnp.isnan(log_probs), -jnp.inf, log_probs)  # as top_k_reference
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



# ---- Tree-causal drafting (jetspec-tc): the head reads a candidate tree, the tree is re-selected ----

class TreeCausalBlock(NamedTuple):
    """The head's block for a tree-causal pass over N tree nodes: 2N slots, node slots then query slots.

    Node slot i holds node i's token at depth d_i and sees its ancestors' node slots and itself; query
    slot N+i holds the mask embedding at depth d_i + 1 and sees node i's path (node slots) and itself.
    So query slot N+i computes what the plain causal block [anchor, y_1 .. y_d, MASK] computes for the
    path anchor -> i: the head's distribution of node i's children, conditioned on that path."""

    tokens: jax.Array  # (..., 2N) int32; query slots hold 0
    is_query: jax.Array  # (..., 2N) bool: the slot holds the mask embedding
    depths: jax.Array  # (..., 2N) int32: position offsets from the anchor
    mask: jax.Array  # (..., 2N, 2N) bool: row = query slot, column = key slot


def tree_causal_block(tokens: jax.Array, depths: jax.Array, ancestors: jax.Array) -> TreeCausalBlock:
    """tokens/depths (..., N) and ancestors (..., N, N) (row i: i and its ancestors, as `ancestor_mask`;
    node 0 the anchor at depth 0) -> the tree-causal block. Inference passes a draft tree; training can
    pass a teacher-forced path (a chain: parents i-1) with the same layout."""
    n = tokens.shape[-1]
    ancestors = ancestors.astype(bool)
    eye = jnp.broadcast_to(jnp.eye(n, dtype=bool), ancestors.shape)
    mask = jnp.concatenate([jnp.concatenate([ancestors, jnp.zeros_like(ancestors)], axis=-1),
                            jnp.concatenate([ancestors, eye], axis=-1)], axis=-2)
    is_query = jnp.concatenate([jnp.zeros(tokens.shape, bool), jnp.ones(tokens.shape, bool)], axis=-1)
    return TreeCausalBlock(tokens=jnp.concatenate([tokens, jnp.zeros_like(tokens)], axis=-1).astype(jnp.int32),
                           is_query=is_query, depths=jnp.concatenate([depths, depths + 1], axis=-1).astype(jnp.int32),
                           mask=mask)


def max_internal_nodes(budget: int, width: int, max_depth: int) -> int:
    """An upper bound on the nodes with children in a `build_tree` tree: every pop adds one such node
    (ceil((B-1)/W) pops), and only nodes above the depth limit have children (sum of W^d, d < D)."""
    pops = -(-(budget - 1) // width)
    above_limit, level = 0, 1
    for _ in range(max_depth):
        above_limit += level
        level *= width
        if above_limit >= pops:
            break
    return max(1, min(pops, above_limit))


def internal_nodes(parents: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """One tree's nodes that have a child: (size,) indices in index order (a parent before its
    children) and (size,) bool, which entries are real. `size` must bound their number
    (`max_internal_nodes`); the rest of the entries point at the root."""
    budget = parents.shape[-1]
    has_child = jnp.zeros((budget,), bool).at[jnp.where(parents >= 0, parents, budget)].set(True, mode="drop")
    idx = jnp.nonzero(has_child, size=size, fill_value=0)[0].astype(jnp.int32)
    return idx, jnp.arange(size) < jnp.sum(has_child)


def subtree(tree: Tree, nodes: jax.Array, real: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tokens, depths and ancestor mask (..., P), (..., P), (..., P, P) of the ancestor-closed node set
    `nodes` (..., P) of a tree; entries that are not `real` become lone nodes (token 0, depth 0, self only)."""
    tokens = jnp.where(real, jnp.take_along_axis(tree.tokens, nodes, axis=-1), 0)
    depths = jnp.where(real, jnp.take_along_axis(tree.depths, nodes, axis=-1), 0)
    rows = jnp.take_along_axis(tree.ancestors, nodes[..., :, None], axis=-2)
    ancestors = jnp.take_along_axis(rows, nodes[..., None, :], axis=-1)
    both = real[..., :, None] & real[..., None, :]
    p = nodes.shape[-1]
    ancestors = (ancestors & both) | jnp.eye(p, dtype=bool)
    return tokens, depths, ancestors


# a log-probability below this (or NaN) counts as this: path scores stay finite and ordered
LOGP_FLOOR = -1e30


def select_conditioned(tree: Tree, nodes: jax.Array, real: jax.Array, cond_logps: jax.Array, budget: int,
                       extend: int, max_depth: int, top_k_impl: str = "auto", to_draft=None, to_target=None) -> Tree:
    """Re-selects one sequence's tree by path-conditioned scores (jetspec-tc, after the tree-causal pass).

    tree: the candidate tree (C nodes); nodes / real (P,): its nodes with children (`internal_nodes`);
    cond_logps (P, V): the head's log-distribution of each such node's children given its path. Node u
    scores sum over its path of log q(y_w | ancestors of w), each term read from its parent's row. Each
    internal node also offers the top `extend` tokens of its row as new children (not already its
    children). The `budget` best of candidates and offered children become the tree, ties to the
    lower index: a child never outscores its parent (log q <= 0, and it comes later), so the set is
    ancestor-closed, and it is what best-first growth one node at a time over the same pool gives.
    `top_k_impl` is the offered children's top-k (jetspec_jax/kernels/top_k.py). With a draft vocabulary
    cond_logps' columns are its places: `to_draft` maps tree tokens to them, `to_target` back.
    Returns a Tree padded to `budget`, nodes in score order (parents before children)."""
    c = tree.tokens.shape[-1]
    p = nodes.shape[-1]
    row_of = jnp.full((c,), -1, jnp.int32).at[jnp.where(real, nodes, c)].set(jnp.arange(p, dtype=jnp.int32),
                                                                            mode="drop")
    cond_logps = cond_logps.astype(jnp.float32)
    cond_logps = jnp.where(jnp.isnan(cond_logps) | (cond_logps < LOGP_FLOOR), LOGP_FLOOR,
                           jnp.minimum(cond_logps, 0.0))
    parent_row = row_of[jnp.maximum(tree.parents, 0)]
    lp = cond_logps[jnp.maximum(parent_row, 0), tree.tokens if to_draft is None else to_draft(tree.tokens)]
    lp = jnp.where(tree.parents >= 0, lp, 0.0)
    # s[u] = s[parent] + lp[u], one depth at a time: fp addition of lp <= 0 never raises a score
    scores = jnp.zeros((c,), jnp.float32)
    for d in range(1, max_depth + 1):
        scores = jnp.where(tree.depths == d, scores[jnp.maximum(tree.parents, 0)] + lp, scores)
    scores = jnp.where(tree.valid, scores, -jnp.inf)

    pool_tokens, pool_parents, pool_depths, pool_scores = tree.tokens, tree.parents, tree.depths, scores
    if extend > 0:
        ext_tokens, ext_lp = top_candidates(cond_logps, extend, implementation=top_k_impl)  # (P, K)
        ext_tokens = ext_tokens if to_target is None else to_target(ext_tokens)
        # an offered token that is already a child of that node is dropped (siblings stay distinct)
        is_child = (tree.parents[None, :] == nodes[:, None]) & tree.valid[None, :]  # (P, C)
        dup = jnp.any(is_child[:, None, :] & (tree.tokens[None, None, :] == ext_tokens[:, :, None]), axis=-1)
        ext_depths = jnp.broadcast_to((tree.depths[nodes] + 1)[:, None], ext_tokens.shape)
        ok = real[:, None] & ~dup & (ext_depths <= max_depth)
        ext_scores = jnp.where(ok, scores[nodes][:, None] + ext_lp, -jnp.inf)
        pool_tokens = jnp.concatenate([pool_tokens, ext_tokens.reshape(-1)])
        pool_parents = jnp.concatenate([pool_parents, jnp.broadcast_to(nodes[:, None], ext_tokens.shape).reshape(-1)])
        pool_depths = jnp.concatenate([pool_depths, ext_depths.reshape(-1)])
        pool_scores = jnp.concatenate([pool_scores, ext_scores.reshape(-1)])

    size = pool_scores.shape[0]
    if size < budget:  # a pool smaller than the budget: pad (never chosen over a real node)
        pad = budget - size
        pool_tokens = jnp.pad(pool_tokens, (0, pad))
        pool_parents = jnp.pad(pool_parents, (0, pad), constant_values=-1)
        pool_depths = jnp.pad(pool_depths, (0, pad))
        pool_scores = jnp.pad(pool_scores, (0, pad), constant_values=-jnp.inf)
        size = budget
    chosen_scores, chosen = lax.top_k(pool_scores, budget)  # ties: the lower index first
    valid = chosen_scores > -jnp.inf
    position = jnp.full((size,), -1, jnp.int32).at[chosen].set(jnp.arange(budget, dtype=jnp.int32))
    old_parents = pool_parents[chosen]
    parents = jnp.where(valid & (old_parents >= 0), position[jnp.maximum(old_parents, 0)], -1)
    tokens = jnp.where(valid, pool_tokens[chosen], 0)
    depths = jnp.where(valid, pool_depths[chosen], 0)
    return Tree(tokens=tokens, parents=parents, depths=depths, scores=jnp.where(valid, chosen_scores, 0.0),
                valid=valid, ancestors=ancestor_mask(parents, max_depth),
                num_nodes=jnp.sum(valid, dtype=jnp.int32))
