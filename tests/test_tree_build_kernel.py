"""The Pallas tree builder (interpret mode on the CPU) equals the reference builder, vmapped, field
for field; and its CUDA lowering passes MLIR's verifier."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jetspec_jax.kernels.tree_build import build_trees, build_trees_pallas
from jetspec_jax.tree import top_candidates
from test_tree import tree_inputs
from triton_lowering import lowered_triton_modules


def assert_same_trees(root, tokens, logps, budget):
    want = build_trees(root, tokens, logps, budget=budget, implementation="xla")
    got = build_trees(root, tokens, logps, budget=budget, implementation="pallas_interpret")
    for field in want._fields:
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)),
                                      err_msg=field)


@settings(max_examples=60, deadline=None)
@given(st.lists(tree_inputs(), min_size=1, max_size=3))
def test_kernel_equals_reference(batch):
    """Small depths, widths and budgets (powers of two or not) with many exact ties. A batch shares
    its shapes and budget: examples of another depth or width are dropped, the first one's budget
    is used."""
    tokens, logps, budget = batch[0]
    rows = [(t, lp) for t, lp, _ in batch if t.shape == tokens.shape]
    root = jnp.arange(len(rows), dtype=jnp.int32) + 3
    assert_same_trees(root, jnp.asarray(np.stack([t for t, _ in rows])), jnp.asarray(np.stack([lp for _, lp in rows])),
                      budget)


@pytest.mark.parametrize("budget", [1, 16, 100, 256])
def test_published_sizes_with_bf16_ties(budget):
    """Depth 15, width 7, log-probs rounded to bf16 as on the GPU, a batch of 3."""
    logits = jax.random.normal(jax.random.key(budget), (3, 15, 300)) * 3
    log_probs = jax.nn.log_softmax(logits.astype(jnp.bfloat16).astype(jnp.float32), axis=-1)
    tokens, logps = top_candidates(log_probs.astype(jnp.bfloat16).astype(jnp.float32), 7)
    assert_same_trees(jnp.asarray([5, 6, 7], jnp.int32), tokens, logps, budget)


def test_non_finite_log_probs():
    """-inf candidates (a vocabulary smaller than the width after masking) and NaN behave as in the
    reference, which reads NaN as -inf."""
    logps = np.full((2, 4, 3), -1.0, np.float32)
    logps[0, :, 2] = -np.inf
    logps[1, 1, :] = np.nan
    tokens = np.arange(24, dtype=np.int32).reshape(2, 4, 3)
    assert_same_trees(jnp.asarray([1, 2], jnp.int32), jnp.asarray(tokens), jnp.asarray(logps), 40)


def test_unknown_builder_is_refused():
    with pytest.raises(ValueError, match="unknown tree builder"):
        build_trees(jnp.zeros((1,), jnp.int32), jnp.zeros((1, 2, 2), jnp.int32), jnp.zeros((1, 2, 2)), budget=4,
                    implementation="cuda")


@pytest.mark.parametrize("budget,depth,width", [(256, 15, 7), (100, 15, 7), (16, 3, 1)])
def test_kernel_lowers_to_a_valid_triton_module(budget, depth, width, monkeypatch):
    args = (jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((2, depth, width), jnp.int32),
            jax.ShapeDtypeStruct((2, depth, width), jnp.float32))
    modules = lowered_triton_modules(monkeypatch, lambda: jax.jit(functools.partial(
        build_trees_pallas, budget=budget)).trace(*args).lower(lowering_platforms=("cuda",)))
    for module in modules:
        assert module.operation.verify()
