"""benchmarks/train_step_profile.py's attribution: a compiled program's instructions mapped to the named
scopes of the training step (forward and backward apart)."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from train_step_profile import op_names, part_of  # noqa: E402


def test_instructions_are_attributed_to_the_step_parts_that_made_them():
    def loss(w, x):
        with jax.named_scope("jetspec"), jax.named_scope("tree_pass"):
            with jax.named_scope("lm_head"):
                logits = jnp.tanh(x @ w)
            with jax.named_scope("loss"):
                return jnp.sum(jax.nn.log_softmax(logits))

    def step(w, x):
        grads = jax.grad(loss)(w, x)
        with jax.named_scope("optimizer"):
            return w - 0.1 * grads

    args = (jnp.ones((8, 16)), jnp.ones((4, 8)))
    names = op_names(jax.jit(step).lower(*args).compile().as_text())
    parts = {part_of(op) for op in names.values()}
    assert {"jetspec/tree_pass/lm_head", "jetspec/tree_pass/loss", "optimizer"} <= parts
    assert any(p.endswith("/bwd") for p in parts)  # the backward pass's ops carry a transpose
    assert part_of("jit(f)/jit(main)/dot_general") == "other"
    assert part_of("jit(step)/teacher/dot_general") == "teacher"
