"""benchmarks/path_gap.py's pieces against hand computations: the target's teacher-forced log p over the
whole sequence, the block pass's per-depth argmax path, and jetspec-tc's greedy chain of tree passes."""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import random_head

from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.tokens import pad_prompts
from jetspec_jax.tree import ancestor_mask

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import path_gap  # noqa: E402

BLOCK = 4  # 3 depths: few shapes (compilations) for the reference's chains of 1..3 nodes
PROMPTS = [[3, 9, 27, 81, 14], [5, 12, 40, 7, 1, 2, 3, 4, 8, 6, 11]]


def prompt_step(target, tap_layers, prompts=PROMPTS):
    tokens, lengths = pad_prompts(prompts, 0, bucket=16)
    return (*path_gap.first_step(target.params, jnp.asarray(tokens), jnp.asarray(lengths), target_cfg=target.cfg,
                                 tap_layers=tap_layers, cache_len=32), jnp.asarray(lengths))


@functools.partial(jax.jit, static_argnames="cfg")
def causal_log_softmax(params, tokens, cfg):
    logits, _, _ = qwen3.forward(params, tokens[None], jnp.arange(tokens.shape[0])[None],
                                 qwen3.new_cache(cfg, 1, tokens.shape[0], jnp.float32), cfg)
    return jax.nn.log_softmax(logits[0], axis=-1)


def full_log_softmax(target, seq, width=32):
    """The target over the whole sequence from an empty cache: fp32 log-probs (len(seq), V). Zeros pad it
    to one width (causal: they change nothing before them), one compilation."""
    tokens = jnp.asarray(np.pad(seq, (0, width - len(seq))), jnp.int32)
    return np.asarray(causal_log_softmax(target.params, tokens, target.cfg))[: len(seq)]


def alone(drafter, head, taps, lengths, b):
    """Row b's head context on its own (batch 1): its prompt's taps, the padding rows uncommitted."""
    ctx = draft_head.new_context(drafter.cfg, 1, taps.shape[1])
    return extend_context(head, ctx, taps[b: b + 1], lengths[b: b + 1], drafter.cfg)


# the references, jitted (each op run eagerly compiles once per shape: slower than one program)
extend_context = jax.jit(draft_head.extend_context, static_argnums=4)
draft_logits = jax.jit(draft_head.draft_logits, static_argnums=(2, 5))
tree_logits = jax.jit(draft_head.tree_logits, static_argnums=(2, 7))


def test_target_log_p_equals_the_full_sequence_forward(tiny_qwen3):
    target, _ = tiny_qwen3
    drafter, _ = random_head(target.cfg, jax.random.key(4), block_size=BLOCK)
    anchor, _, cache, _ = prompt_step(target, drafter.tap_layers)  # the taps of the other tests: one compilation
    d = 5
    paths = []
    for b, prompt in enumerate(PROMPTS):
        assert int(anchor[b]) == int(np.argmax(full_log_softmax(target, prompt)[-1]))
        seq = prompt + [int(anchor[b])]
        for _ in range(d):  # the target's greedy continuation, its 4th token (row 0) replaced
            seq.append(int(np.argmax(full_log_softmax(target, seq)[-1])))
        path = seq[len(prompt) + 1:]
        if b == 0:
            path[3] = (path[3] + 1) % target.cfg.vocab_size
        paths.append(path)
    log_p, is_argmax = path_gap.target_path_logprobs(target.params, cache, anchor, jnp.asarray(paths),
                                                     target_cfg=target.cfg)
    for b, (prompt, path) in enumerate(zip(PROMPTS, paths)):
        lp = full_log_softmax(target, prompt + [int(anchor[b])] + path)
        n = len(prompt)  # path token j sits at n + 1 + j, predicted from position n + j
        want = [lp[n + j, t] for j, t in enumerate(path)]
        np.testing.assert_allclose(np.asarray(log_p[b]), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(np.asarray(is_argmax[b]), [lp[n + j].argmax() == t for j, t in enumerate(path)])
    assert path_gap.leading_true(np.asarray(is_argmax)).tolist() == [3, d]


@pytest.mark.parametrize("attention, method", [("causal", "jetspec"), ("bidirectional", "ddtree")])
def test_block_path_is_the_per_depth_argmax(tiny_qwen3, attention, method):
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention=attention, block_size=BLOCK)
    anchor, taps, _, lengths = prompt_step(target, drafter.tap_layers)
    path, log_r = path_gap.rank1_path(head, target.params, taps, lengths, anchor, drafter=drafter, method=method)
    for b in range(len(PROMPTS)):
        ctx = alone(drafter, head, taps, lengths, b)
        lp = np.asarray(jax.nn.log_softmax(
            draft_logits(head, target.params, target.cfg, anchor[b: b + 1], ctx, drafter.cfg)[0], axis=-1))
        np.testing.assert_array_equal(np.asarray(path[b]), lp.argmax(-1))
        np.testing.assert_allclose(float(log_r[b].sum()), lp.max(-1).sum(), rtol=1e-4, atol=1e-4)


def test_tree_causal_path_is_greedy_over_separate_tree_passes(tiny_qwen3):
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", block_size=BLOCK)
    cfg = drafter.cfg
    anchor, taps, _, lengths = prompt_step(target, cfg.tap_layers)
    path, log_r = path_gap.rank1_path(head, target.params, taps, lengths, anchor, drafter=drafter,
                                      method="jetspec-tc")
    block, block_log_r = path_gap.rank1_path(head, target.params, taps, lengths, anchor, drafter=drafter,
                                             method="jetspec")
    for b in range(len(PROMPTS)):
        ctx = alone(drafter, head, taps, lengths, b)
        chain, want_log_r = [int(anchor[b])], []
        for k in range(1, cfg.max_depth + 1):  # the chain so far, k nodes, as its own tree
            nodes = jnp.arange(k)
            logits = tree_logits(head, target.params, target.cfg, jnp.asarray(chain)[None], nodes[None],
                                 ancestor_mask(nodes - 1, k)[None], ctx, cfg)
            lp = np.asarray(jax.nn.log_softmax(logits[0, -1], axis=-1))
            chain.append(int(lp.argmax()))
            want_log_r.append(lp.max())
        np.testing.assert_array_equal(np.asarray(path[b]), chain[1:])
        np.testing.assert_allclose(np.asarray(log_r[b]), want_log_r, rtol=1e-4, atol=1e-4)
        # depth 1 has no path to condition on: the block pass's depth 1
        assert int(path[b, 0]) == int(block[b, 0])
        np.testing.assert_allclose(float(log_r[b, 0]), float(block_log_r[b, 0]), rtol=1e-4, atol=1e-4)


def test_gap_bins_follow_the_paper():
    row = path_gap.gap_summary(np.array([-3.0, 4.99, 5.0, 19.9, 20.0, 45.0, 80.0, 100.0]))
    assert [row[k] for k in path_gap.GAP_BINS] == [25.0, 25.0, 12.5, 12.5, 25.0]
    assert row["median_gap"] == pytest.approx(20.0 / 2 + 19.9 / 2) and row["mean_gap"] == pytest.approx(33.98625)
