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
        ctx = draft_head.DraftContext.create(cfg, 1, 64)
        ctx = draft_head.extend_context(head, ctx, taps[:, :a], jnp.asarray([a]), cfg) if a else ctx
        want = draft_head.draft_logits(head, target.params, target.cfg, seq[:, a], ctx, cfg)
        np.testing.assert_allclose(np.asarray(got[0, j]), np.asarray(want[0]), rtol=1e-4, atol=1e-4)
