"""The batched training forward of the head equals the inference path block by block."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import random_head

from jetspec_jax.autoregressive import prefill
from jetspec_jax.models import draft_head


@pytest.mark.parametrize("attention", ["causal", "bidirectional"])
def test_training_logits_equal_inference_draft(tiny_qwen3, attention):
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention=attention, num_layers=2)
    cfg = drafter.cfg
    seq = jnp.asarray([[3, 9, 27, 81, 14, 42, 5, 6, 7, 8, 11, 12, 13, 60, 61, 62, 63, 64]])
    s = seq.shape[1]
    _, taps, _ = prefill(target.params, seq, jnp.asarray([s]), target.cfg, 64, tap_layers=cfg.tap_layers)
    anchors = jnp.asarray([[2, 7, 0, 11]])
    got = draft_head.training_logits(head, target.params, target.cfg, seq, taps, anchors, cfg)
    for j, a in enumerate(np.asarray(anchors[0])):
        ctx = draft_head.new_context(cfg, 1, 64)
        ctx = draft_head.extend_context(head, ctx, taps[:, :a], jnp.asarray([a]), cfg) if a else ctx
        want = draft_head.draft_logits(head, target.params, target.cfg, seq[:, a], ctx, cfg)
        np.testing.assert_allclose(np.asarray(got[0, j]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)


def test_training_tree_logits_equal_the_tree_pass_along_the_data(tiny_qwen3):
    """The teacher-forced tree-causal training forward (a chain of true tokens per anchor) equals the
    inference tree pass over that chain, anchor by anchor; tokens past the sequence's end are clipped."""
    from jetspec_jax.tree import ancestor_mask

    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", num_layers=2)
    cfg = drafter.cfg
    seq = jnp.asarray([[3, 9, 27, 81, 14, 42, 5, 6, 7, 8, 11, 12, 13, 60, 61, 62, 63, 64]])
    s, depth = seq.shape[1], cfg.max_depth
    _, taps, _ = prefill(target.params, seq, jnp.asarray([s]), target.cfg, 64, tap_layers=cfg.tap_layers)
    anchors = jnp.asarray([[2, 7, 0, 14]])
    got = draft_head.training_tree_logits(head, target.params, target.cfg, seq, taps, anchors, cfg)
    assert got.shape == (1, 4, depth, target.cfg.vocab_size)
    block = draft_head.training_logits(head, target.params, target.cfg, seq, taps, anchors, cfg)
    np.testing.assert_allclose(np.asarray(got[:, :, 0]), np.asarray(block[:, :, 0]), rtol=1e-4, atol=1e-4)
    chain = jnp.arange(depth)
    for j, a in enumerate(np.asarray(anchors[0])):
        ctx = draft_head.new_context(cfg, 1, 64)
        ctx = draft_head.extend_context(head, ctx, taps[:, :a], jnp.asarray([a]), cfg) if a else ctx
        tokens = seq[:, np.minimum(a + np.arange(depth), s - 1)]
        want = draft_head.tree_logits(head, target.params, target.cfg, tokens, chain[None],
                                      ancestor_mask(chain - 1, depth)[None], ctx, cfg)
        np.testing.assert_allclose(np.asarray(got[0, j]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
