"""A forward over a block of tree nodes under an ancestor mask gives, for every node, the logits of
running that node's root-to-node path as an ordinary sequence after the same prefix."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jetspec_jax.models import qwen3

# A tree of 9 nodes in insertion order (parents before children); node 0 is the root.
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5]
TOKENS = [11, 23, 45, 67, 8, 19, 30, 52, 74]


def ancestor_mask(parents):
    n = len(parents)
    mask = np.zeros((n, n), bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def path_to(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def prefill(target, prefix, cache_len=64):
    cache = qwen3.new_cache(target.cfg, 1, cache_len)
    _, _, cache = qwen3.forward(target.params, jnp.asarray([prefix]), jnp.arange(len(prefix))[None], cache,
                                target.cfg)
    return cache._replace(lengths=jnp.asarray([len(prefix)], jnp.int32))


def test_tree_block_equals_per_path_sequences(tiny_qwen3):
    target, _ = tiny_qwen3
    prefix = [4, 9, 81, 16, 25]
    depth = [len(path_to(i, PARENTS)) - 1 for i in range(len(PARENTS))]
    cache = prefill(target, prefix)
    positions = jnp.asarray([[len(prefix) + d for d in depth]])
    tree_logits, _, _ = qwen3.forward(target.params, jnp.asarray([TOKENS]), positions, cache, target.cfg,
                                      mask=jnp.asarray(ancestor_mask(PARENTS))[None])
    for node in range(len(PARENTS)):
        path_tokens = [TOKENS[i] for i in path_to(node, PARENTS)]
        seq = prefix + path_tokens
        cache = qwen3.new_cache(target.cfg, 1, 64)
        ref, _, _ = qwen3.forward(target.params, jnp.asarray([seq]), jnp.arange(len(seq))[None], cache,
                                  target.cfg)
        np.testing.assert_allclose(np.asarray(tree_logits[0, node]), np.asarray(ref[0, -1]),
                                   rtol=1e-5, atol=1e-5, err_msg=f"node {node}")


def test_batch_of_trees_with_different_prefix_lengths(tiny_qwen3):
    """Per-sequence cache lengths: sequence 1's tree sits after a longer prefix."""
    target, _ = tiny_qwen3
    prefixes = [[4, 9, 81], [7, 7, 2, 5, 60, 1, 33]]
    mask = ancestor_mask(PARENTS)
    depth = [len(path_to(i, PARENTS)) - 1 for i in range(len(PARENTS))]
    single = []
    for prefix in prefixes:
        cache = prefill(target, prefix)
        pos = jnp.asarray([[len(prefix) + d for d in depth]])
        logits, _, _ = qwen3.forward(target.params, jnp.asarray([TOKENS]), pos, cache, target.cfg,
                                     mask=jnp.asarray(mask)[None])
        single.append(np.asarray(logits[0]))
    width = max(map(len, prefixes))
    padded = np.zeros((2, width), np.int32)
    for i, p in enumerate(prefixes):
        padded[i, : len(p)] = p
    cache = qwen3.new_cache(target.cfg, 2, 64)
    _, _, cache = qwen3.forward(target.params, jnp.asarray(padded), jnp.broadcast_to(jnp.arange(width), (2, width)),
                                cache, target.cfg)
    lengths = jnp.asarray([len(p) for p in prefixes], jnp.int32)
    cache = cache._replace(lengths=lengths)
    pos = lengths[:, None] + jnp.asarray(depth)[None]
    logits, _, _ = qwen3.forward(target.params, jnp.asarray([TOKENS, TOKENS]), pos, cache, target.cfg,
                                 mask=jnp.asarray(np.stack([mask, mask])))
    for i in range(2):
        np.testing.assert_allclose(np.asarray(logits[i]), single[i], rtol=1e-5, atol=1e-5)
