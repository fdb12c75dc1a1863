"""Tree verification: one target forward over the tree, acceptance, and KV-cache compaction.

Acceptance walks from the root into the child whose token equals the target's choice at the current
node; the first node with no such child yields the bonus token. At temperature 0 the target's choice is
its argmax. At temperature > 0 it is one sample per node from the target's (filtered) distribution, drawn with the
key of the output index the node's token would take (sampling.select_tokens), so every committed token
is the very sample autoregressive decoding draws after the same prefix: the output follows the
target's distribution exactly, whatever the draft proposed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jetspec_jax.kernels.cache_compact import compact_rows
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import qwen3
from jetspec_jax.tree import Tree


class Acceptance(NamedTuple):
    path: jax.Array  # (B, D+1) tree indices of root, accepted nodes; padded with the last accepted
    accept_len: jax.Array  # (B,) accepted draft tokens (root excluded)
    bonus: jax.Array  # (B,) the target's token after the accepted path
    tokens: jax.Array  # (B, D+1) accepted draft tokens then the bonus; padded past accept_len + 1


def verify_tree(params: Any, tree: Tree, cache: KVCache, cfg: qwen3.Config, tap_layers: tuple[int, ...],
                attention_impl: str = "auto"):
    """Runs the target on the tree nodes (positions = cache length + depth, ancestor mask).
    Returns (logits (B, N, V), taps (B, N, n_taps, D) or None, cache with the nodes written)."""
    positions = cache.lengths[:, None] + tree.depths
    return qwen3.forward(params, tree.tokens, positions, cache, cfg, mask=tree.ancestors,
                         tap_layers=tap_layers, attention_impl=attention_impl)


def accept(tree: Tree, choices: jax.Array, max_depth: int) -> Acceptance:
    """Longest root path whose every token equals the target's choice at its parent.

    choices (B, N): the target's token at each node. Sibling tokens are distinct, so at most one
    child matches per node and the accepted path is unique.
    """
    parent_choice = jnp.take_along_axis(choices, jnp.maximum(tree.parents, 0), axis=-1)
    is_root = tree.parents < 0
    matched = tree.valid & (is_root | (tree.tokens == parent_choice))
    # a node is reached when it and all its ancestors matched
    reached = ~jnp.any(tree.ancestors & ~matched[..., None, :], axis=-1) & tree.valid
    depth_if_reached = jnp.where(reached, tree.depths, -1)
    deepest = jnp.argmax(depth_if_reached, axis=-1)  # (B,)
    accept_len = jnp.take_along_axis(tree.depths, deepest[:, None], axis=-1)[:, 0]
    bonus = jnp.take_along_axis(choices, deepest[:, None], axis=-1)[:, 0]
    # path[k] = the ancestor of `deepest` at depth k (k <= accept_len), else `deepest`
    on_path = jnp.take_along_axis(tree.ancestors, deepest[:, None, None], axis=1)[:, 0]  # (B, N)
    depth_ids = jnp.arange(max_depth + 1, dtype=jnp.int32)
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == depth_ids[None, :, None])  # (B, D+1, N)
    path = jnp.where(jnp.any(at_depth, axis=-1), jnp.argmax(at_depth, axis=-1), deepest[:, None])
    path = path.astype(jnp.int32)
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=-1)
    # committed tokens: path tokens after the root, then the bonus
    shifted = jnp.concatenate([path_tokens[:, 1:], path_tokens[:, -1:]], axis=1)
    slot = depth_ids[None, :]
    tokens = jnp.where(slot < accept_len[:, None], shifted, bonus[:, None])
    return Acceptance(path=path, accept_len=accept_len.astype(jnp.int32), bonus=bonus, tokens=tokens)


def compact_cache(cache: KVCache, path: jax.Array, keep: jax.Array, implementation: str = "auto") -> KVCache:
    """Moves the accepted nodes' keys/values (tree slots cache.lengths + path) to the contiguous
    slots cache.lengths .. and commits `keep` (B,) of them (root + accepted drafts).
    implementation: kernels.cache_compact.IMPLEMENTATIONS (auto: one Pallas kernel on GPU)."""
    layers = len(cache.k)
    sources = cache.flat_rows(cache.lengths[:, None] + path)
    targets = cache.flat_rows(cache.lengths[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)[None])
    moved = compact_rows(cache.k + cache.v, sources, targets, implementation=implementation)
    return cache._replace(k=moved[:layers], v=moved[layers:], lengths=cache.lengths + keep.astype(jnp.int32))
