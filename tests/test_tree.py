"""The jitted best-first tree builder against a plain-Python heapq reference, and the ancestor mask."""

from __future__ import annotations

import heapq

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetspec_jax.tree import ancestor_mask, build_tree, top_candidates, validate_tree_settings


def heapq_tree(root, tokens, logps, budget):
    """The published accum_logp loop, written plainly: (token, parent, depth, score) per node."""
    max_depth, width = tokens.shape
    nodes = [(int(root), -1, 0, 0.0)]
    heap = [(-0.0, 0, 0)]  # (-score, insertion counter, node index)
    counter = 1
    while heap and len(nodes) < budget:
        neg, _, v = heapq.heappop(heap)
        depth = nodes[v][2]
        if depth == max_depth:
            continue
        for j in range(min(width, budget - len(nodes))):
            score = np.float32(nodes[v][3]) + np.float32(logps[depth, j])
            nodes.append((int(tokens[depth, j]), v, depth + 1, float(score)))
            heapq.heappush(heap, (-float(score), counter, len(nodes) - 1))
            counter += 1
    return nodes


build = jax.jit(build_tree, static_argnames="budget")


def check_against_reference(root, tokens, logps, budget):
    tree = build(jnp.int32(root), jnp.asarray(tokens), jnp.asarray(logps), budget=budget)
    ref = heapq_tree(root, tokens, logps, budget)
    n = len(ref)
    assert int(tree.num_nodes) == n
    assert np.asarray(tree.valid).tolist() == [i < n for i in range(budget)]
    assert np.asarray(tree.tokens)[:n].tolist() == [r[0] for r in ref]
    assert np.asarray(tree.parents)[:n].tolist() == [r[1] for r in ref]
    assert np.asarray(tree.depths)[:n].tolist() == [r[2] for r in ref]
    np.testing.assert_allclose(np.asarray(tree.scores)[:n], [r[3] for r in ref], rtol=1e-6)
    anc = np.asarray(tree.ancestors)
    for i in range(n):
        want, v = set(), i
        while v >= 0:
            want.add(v)
            v = ref[v][1]
        assert set(np.flatnonzero(anc[i]).tolist()) == want, f"ancestors of node {i}"


@st.composite
def tree_inputs(draw):
    depth = draw(st.integers(1, 6))
    width = draw(st.integers(1, 5))
    budget = draw(st.integers(1, 40))
    # a small value set makes ties between nodes (also across depths) common
    values = st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -3.0]) | st.floats(-8.0, 0.0, width=32, allow_subnormal=False)  # XLA flushes subnormals
    rows = [sorted(draw(st.lists(values, min_size=width, max_size=width)), reverse=True) for _ in range(depth)]
    tokens = np.arange(depth * width, dtype=np.int32).reshape(depth, width) + 10
    return tokens, np.asarray(rows, np.float32), budget


@settings(max_examples=150, deadline=None)
@given(tree_inputs())
def test_builder_matches_heapq_reference(inputs):
    tokens, logps, budget = inputs
    check_against_reference(3, tokens, logps, budget)


@pytest.mark.parametrize("budget", [2, 16, 64, 256])
def test_published_sizes_with_bf16_ties(budget):
    """Depth 15, width 7, log-probs rounded to bf16 as the GPU path makes them: many exact ties."""
    logits = jax.random.normal(jax.random.key(budget), (15, 300)) * 3
    log_probs = jax.nn.log_softmax(logits.astype(jnp.bfloat16).astype(jnp.float32), axis=-1)
    tokens, logps = top_candidates(log_probs.astype(jnp.bfloat16).astype(jnp.float32), 7)
    check_against_reference(5, np.asarray(tokens), np.asarray(logps), budget)


def test_budget_smaller_than_one_fan_out():
    tokens = np.array([[5, 6, 7, 8], [9, 10, 11, 12]], np.int32)
    logps = np.log(np.array([[0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1]], np.float32))
    check_against_reference(1, tokens, logps, budget=3)  # root + 2 of the root's 4 children
    tree = build(jnp.int32(1), jnp.asarray(tokens), jnp.asarray(logps), budget=3)
    assert np.asarray(tree.tokens).tolist() == [1, 5, 6]


def test_width_one_is_a_chain_to_the_depth_limit():
    tokens = np.arange(6, dtype=np.int32)[:, None] + 100
    logps = np.full((6, 1), -0.1, np.float32)
    tree = build(jnp.int32(1), jnp.asarray(tokens), jnp.asarray(logps), budget=16)
    assert int(tree.num_nodes) == 7  # root + 6 depths, the rest padding
    assert np.asarray(tree.parents)[:7].tolist() == [-1, 0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("vocab", [1024, 1500, 49152])
def test_chunked_top_candidates_equal_one_top_k(vocab):
    """The two-stage top-k returns exactly lax.top_k's tokens and values, ties (bf16-rounded values,
    whole chunks of equal values, -inf entries) included."""
    rng = np.random.default_rng(vocab)
    logits = rng.standard_normal((2, 15, vocab)).astype(np.float32) * 3
    logits[0, 0] = 0.0  # one value everywhere: the lowest ids win
    logits[0, 1, : vocab // 2] = -np.inf  # the best entries all in the later chunks
    logits[1, 2, 1::2] = -np.inf
    log_probs = jax.nn.log_softmax(jnp.asarray(logits), axis=-1).astype(jnp.bfloat16).astype(jnp.float32)
    for width in (1, 7, 10):
        want_values, want_tokens = jax.lax.top_k(log_probs, width)
        tokens, values = top_candidates(log_probs, width, chunk=256)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_top_candidates_and_batching():
    log_probs = jax.nn.log_softmax(jax.random.normal(jax.random.key(0), (3, 4, 50)), axis=-1)
    tokens, logps = top_candidates(log_probs, 5)
    assert tokens.shape == (3, 4, 5) and bool(jnp.all(logps[..., :-1] >= logps[..., 1:]))
    trees = jax.vmap(lambda r, t, l: build_tree(r, t, l, 20))(jnp.arange(3), tokens, logps)
    for b in range(3):
        check_against_reference(b, np.asarray(tokens[b]), np.asarray(logps[b]), 20)
        assert int(trees.num_nodes[b]) == 20


def test_ancestor_mask_of_padding_is_self_only():
    parents = jnp.asarray([-1, 0, 0, 1, -1, -1])
    mask = np.asarray(ancestor_mask(parents, 3))
    assert mask[3].tolist() == [True, True, False, True, False, False]
    assert mask[5].tolist() == [False] * 5 + [True]


@pytest.mark.parametrize("budget,width,depth,limit", [(0, 4, 3, 15), (8, 0, 3, 15), (8, 4, 16, 15)])
def test_invalid_settings(budget, width, depth, limit):
    with pytest.raises(ValueError, match="budget|width|depth"):
        validate_tree_settings(budget, width, depth, limit)
