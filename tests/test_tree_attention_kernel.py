"""The Pallas tree-attention kernel (interpret mode on the CPU) against its jnp reference, and the
reference against the model's dense-mask attention."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.kernels.attention import attention_scores_softmax, block_attention_mask
from jetspec_jax.kernels.tree_attention import (TreeAttentionTuning, ancestors_from_parents, block_rows_for,
                                                combine_partials, head_blocked, pack_tree_mask, random_tree_parents,
                                                tree_attention, tree_attention_reference, tree_attention_with_lse,
                                                unpack_tree_mask)
from triton_lowering import lowered_triton_modules, tf32_dots

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def make_inputs(rng, batch, n, heads, kv_heads, d, s, lengths, kinds, dtype):
    parents = [random_tree_parents(rng, n, kinds[i % len(kinds)]) for i in range(batch)]
    words = pack_tree_mask(jnp.asarray(np.stack([ancestors_from_parents(p) for p in parents])))
    q = jnp.asarray(rng.standard_normal((batch, n, heads, d)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    return q, k, v, jnp.asarray(lengths, jnp.int32), words


CASES = [  # batch, N, heads, kv heads, head dim, cache rows, lengths, tree kinds
    (1, 16, 4, 4, 64, 64, [20], ["chain"]),
    (2, 13, 8, 2, 64, 100, [37, 80], ["star", "random"]),
    (2, 40, 8, 1, 128, 130, [1, 77], ["deep", "wide"]),
    (3, 7, 9, 3, 64, 48, [0, 41, 5], ["random", "chain", "star"]),
    (2, 100, 2, 2, 64, 160, [50, 33], ["wide", "chain"]),  # rows 0-63 see no node >= 64: chunks skipped
    (2, 64, 8, 2, 64, 200, [50, 120], ["wide", "deep"]),  # head-blocked: a block is one head's 64 nodes
    (1, 128, 4, 2, 64, 300, [150], ["random"]),  # head-blocked, two node blocks per head
]


VARIANTS = [{}, {"tree_in_last_split": True}, {"low_precision_partials": False},  # tuning options that change
            {"merge_in_kernel": True}, {"merge_in_kernel": True, "tree_in_last_split": True},  # what the
            {"tree_block_k": 64}, {"split_by_length": True, "tree_in_last_split": True}]  # kernel computes
# where, not only how fast (N=7 and 13: one mask word, so a 64-node step reads it twice)


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v) or "default")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, dtype, variant):
    rng = np.random.default_rng(len(case[6]) * 7 + case[1])
    q, k, v, lengths, words = make_inputs(rng, *case, dtype)
    ref = tree_attention_reference(q, k, v, lengths, words).astype(jnp.float32)
    got = tree_attention(q, k, v, lengths, words, implementation="pallas_interpret",
                         tuning=TreeAttentionTuning(block_k=16, prefix_splits=3, **variant)).astype(jnp.float32)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("implementation", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[5]])
def test_attention_split_between_two_caches_merges_by_lse(case, implementation):
    """Keys split over a shared cache (seen by every node, no tree: all-zero mask words) and a cache
    holding the rest plus the tree, each attended with its log-sum-exp and merged, equal attention
    over all keys at once; a row that sees nothing gives zeros and -inf."""
    rng = np.random.default_rng(case[1])
    q, k, v, lengths, words = make_inputs(rng, *case, jnp.float32)
    want = tree_attention_reference(q, k, v, lengths, words)
    shared = jnp.asarray(lengths) // 2  # rows [0, shared) in the first cache, the rest (and the tree) in the second
    rows = k.shape[1]
    index = jnp.arange(rows)[None, :] + shared[:, None]  # the second cache's rows, shifted down by `shared`
    take = lambda x, idx: jnp.take_along_axis(x, jnp.clip(idx, 0, rows - 1)[:, :, None, None], axis=1)  # noqa: E731
    tuning = TreeAttentionTuning(block_k=16, prefix_splits=2)
    first = tree_attention_with_lse(q, k, v, shared, jnp.zeros_like(words), implementation=implementation,
                                    tuning=tuning)
    second = tree_attention_with_lse(q, take(k, index), take(v, index), jnp.asarray(lengths) - shared, words,
                                     implementation=implementation, tuning=tuning)
    got = combine_partials([first[0], second[0]], [first[1], second[1]])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    _, ref_lse = tree_attention_with_lse(q, k, v, lengths, words, implementation="xla")
    np.testing.assert_allclose(np.asarray(jnp.logaddexp(first[1], second[1])), np.asarray(ref_lse), atol=1e-5,
                               rtol=1e-5)
    empty_out, empty_lse = first[0][shared == 0], first[1][shared == 0]  # no shared rows, no tree
    assert np.all(np.asarray(empty_out) == 0) and np.all(np.asarray(empty_lse) == -np.inf)


def test_default_splitting_and_single_split_agree():
    rng = np.random.default_rng(3)
    q, k, v, lengths, words = make_inputs(rng, 2, 9, 4, 2, 64, 2100, [2000, 700], ["random"], jnp.float32)
    ref = tree_attention_reference(q, k, v, lengths, words)
    for tuning in (TreeAttentionTuning(), TreeAttentionTuning(prefix_splits=1, block_k=128),
                   TreeAttentionTuning(min_blocks_per_split=1, block_k=32),  # 64 one-block splits
                   TreeAttentionTuning(tree_in_last_split=True),
                   TreeAttentionTuning(tree_in_last_split=True, prefix_splits=1, block_k=128),
                   TreeAttentionTuning(split_by_length=True),  # 700 of 2100 rows: every split a share
                   TreeAttentionTuning(split_by_length=True, min_blocks_per_split=1, block_k=32, tree_block_k=64)):
        got = tree_attention(q, k, v, lengths, words, implementation="pallas_interpret", tuning=tuning)
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_tree_block_k_is_one_or_two_mask_words():
    with pytest.raises(ValueError, match="tree_block_k must be 32 or 64"):
        TreeAttentionTuning(tree_block_k=48)


def test_head_blocked_layout_agrees_for_every_partial_count():
    """N a multiple of the row block: q and the output stay in (B, N, H, D), one partial is written
    final in q's dtype, several are merged."""
    rng = np.random.default_rng(11)
    q, k, v, lengths, words = make_inputs(rng, 2, 64, 8, 2, 64, 1100, [1000, 300], ["random", "wide"],
                                          jnp.float32)
    assert head_blocked(64, block_rows_for(TreeAttentionTuning(), 4 * 64))
    ref = tree_attention_reference(q, k, v, lengths, words)
    for tuning in (TreeAttentionTuning(), TreeAttentionTuning(tree_in_last_split=True, prefix_splits=1),
                   TreeAttentionTuning(tree_in_last_split=True, prefix_splits=4, block_k=32),
                   TreeAttentionTuning(low_precision_partials=False, block_k=32),
                   TreeAttentionTuning(block_rows=16, tree_in_last_split=True, prefix_splits=1)):
        got = tree_attention(q, k, v, lengths, words, implementation="pallas_interpret", tuning=tuning)
        assert got.dtype == q.dtype
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_reference_equals_model_dense_mask_attention():
    rng = np.random.default_rng(5)
    q, k, v, lengths, words = make_inputs(rng, 2, 11, 6, 2, 64, 64, [9, 30], ["random", "wide"], jnp.float32)
    dense = block_attention_mask(lengths, 11, 64, unpack_tree_mask(words, 11))
    np.testing.assert_allclose(np.asarray(attention_scores_softmax(q, k, v, dense)),
                               np.asarray(tree_attention_reference(q, k, v, lengths, words)), atol=1e-5, rtol=1e-5)


def test_packing_round_trip():
    anc = np.random.default_rng(0).random((3, 70, 70)) < 0.3
    words = pack_tree_mask(jnp.asarray(anc))
    assert words.shape == (3, 70, 3) and words.dtype == jnp.uint32
    assert (np.asarray(unpack_tree_mask(words, 70)) == anc).all()


def test_ar_and_speculative_generate_through_the_kernel_equal_ar(tiny_qwen3):
    from drafters import greedy_speculative_and_ar

    from jetspec_jax.speculative import SpecConfig

    spec = SpecConfig("jetspec", budget=8, width=2, attention_impl="pallas_interpret")
    got, ar_through_kernel = greedy_speculative_and_ar(tiny_qwen3[0], spec, max_new_tokens=10,
                                                       ar_attention="pallas_interpret")
    _, want = greedy_speculative_and_ar(tiny_qwen3[0], SpecConfig("jetspec", budget=8, width=2,
                                                                  attention_impl="xla"), max_new_tokens=10)
    np.testing.assert_array_equal(np.asarray(ar_through_kernel), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want))
    assert float(np.asarray(got.target_forwards).max()) < 10  # drafts were accepted through the kernel


LOWERING_SHAPES = [  # batch, N, heads, kv heads, head dim, cache rows, dtype, tuning
    (1, 16, 32, 8, 128, 1040, jnp.bfloat16, TreeAttentionTuning()),
    (8, 256, 32, 8, 128, 4352, jnp.bfloat16, TreeAttentionTuning(block_rows=128, block_k=128, num_warps=8)),
    (2, 64, 9, 3, 64, 1088, jnp.bfloat16, TreeAttentionTuning()),
    (3, 7, 4, 4, 64, 100, jnp.float32, TreeAttentionTuning(block_k=32)),
    (1, 256, 32, 8, 128, 4352, jnp.bfloat16, TreeAttentionTuning(tree_in_last_split=True,
                                                                 low_precision_partials=True)),
    (1, 256, 32, 8, 128, 4352, jnp.bfloat16, TreeAttentionTuning(block_rows=32, tree_in_last_split=True,
                                                                 target_programs=66)),
    (1, 256, 32, 8, 128, 4352, jnp.bfloat16, TreeAttentionTuning(tree_in_last_split=True, merge_in_kernel=True)),
    (2, 40, 8, 2, 64, 1088, jnp.bfloat16, TreeAttentionTuning(merge_in_kernel=True)),  # packed rows
    (1, 256, 32, 8, 128, 4352, jnp.bfloat16, TreeAttentionTuning(tree_in_last_split=True, split_by_length=True,
                                                                 tree_block_k=64)),
    (1, 70, 9, 3, 64, 600, jnp.bfloat16, TreeAttentionTuning(tree_block_k=64)),  # three words: one read twice
]


@pytest.mark.parametrize("shape", LOWERING_SHAPES)
def test_kernel_lowers_to_a_valid_triton_module(shape, monkeypatch):
    """The CUDA lowering passes MLIR's verifier (a mistyped loop bound once failed only on the GPU), and
    no dot rounds fp32 inputs to TF32."""
    from jetspec_jax.kernels.tree_attention import tree_attention_pallas

    b, n, h, hkv, d, s, dtype, tuning = shape
    args = (jax.ShapeDtypeStruct((b, n, h, d), dtype), jax.ShapeDtypeStruct((b, s, hkv, d), dtype),
            jax.ShapeDtypeStruct((b, s, hkv, d), dtype), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, -(-n // 32)), jnp.uint32))
    modules = lowered_triton_modules(monkeypatch, lambda: jax.jit(
        tree_attention_pallas, static_argnames=("tuning",)).trace(*args, tuning=tuning).lower(
        lowering_platforms=("cuda",)))
    for module in modules:
        assert module.operation.verify()
        assert "tt.dot" in str(module) and not tf32_dots(module)


@pytest.mark.parametrize("attention", ["causal", "bidirectional", "tree"])
def test_draft_head_through_the_kernel_equals_dense_mask(tiny_qwen3, attention):
    """The head's attention as tree attention (block written past each context, any block mask)
    gives the dense-mask head's logits, on a batch of two context lengths."""
    from drafters import random_head

    from jetspec_jax.autoregressive import prefill
    from jetspec_jax.models import draft_head

    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", num_layers=2)
    cfg = drafter.cfg
    block_mask = None
    if attention == "bidirectional":
        block_mask = jnp.ones((cfg.block_size, cfg.block_size), bool)
    elif attention == "tree":  # slots 1-3 a chain off the anchor, 4-7 a second chain: a tree-causal mask
        parents = np.array([-1, 0, 1, 2, 0, 4, 5, 6])[:cfg.block_size]
        block_mask = jnp.asarray(ancestors_from_parents(parents))
    seq = jnp.asarray([[3, 9, 27, 81, 14, 42, 5, 6, 7, 8, 11], [4, 8, 15, 16, 23, 42, 0, 0, 0, 0, 0]])
    lengths = jnp.asarray([11, 6])
    _, taps, _ = prefill(target.params, seq, lengths, target.cfg, 32, tap_layers=cfg.tap_layers)
    kernel_drafter = dataclasses.replace(drafter, attention_impl="pallas_interpret")
    ctx = kernel_drafter.init_state(head, 2, 11, jnp.float32)  # room for the context; the drafter adds the block's
    ctx = draft_head.extend_context(head, ctx, taps, lengths - 1, cfg)
    anchor = jnp.asarray([11, 42])
    want = draft_head.draft_logits(head, target.params, target.cfg, anchor, ctx, cfg, block_mask=block_mask)
    got = draft_head.draft_logits(head, target.params, target.cfg, anchor, ctx, cfg, block_mask=block_mask,
                                  attention_impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
