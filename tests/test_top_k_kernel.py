"""The Pallas top-k (interpret mode on the CPU) equals lax.top_k, ties and -inf included, and the tree's
candidates are the same on every path; its CUDA lowering passes MLIR's verifier."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.kernels.top_k import top_k, top_k_pallas, top_k_reference
from jetspec_jax.tree import top_candidates
from triton_lowering import lowered_triton_modules


def hard_rows(shape, seed: int) -> jax.Array:
    """bf16-rounded values (many exact ties) with the cases a chunked top-k can get wrong: one value
    everywhere, the best entries all in the last chunk, -inf in every other entry, a NaN."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    n = shape[-1]
    flat[0] = 0.0
    if len(flat) > 1:
        flat[1, : n - n // 5] = -np.inf
    if len(flat) > 2:
        flat[2, 1::2] = -np.inf
        flat[2, 3] = np.nan
    return jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)


@pytest.mark.parametrize("shape", [(2, 5, 1500), (3, 300), (4, 4096), (1, 7), (2, 3, 49152)])
@pytest.mark.parametrize("k", [1, 7, 10])
def test_kernel_equals_lax_top_k(shape, k):
    if k > shape[-1]:
        pytest.skip("k beyond the row")
    x = hard_rows(shape, seed=shape[-1] + k)
    want_values, want_index = top_k_reference(x, k)
    for chunk in (256, 2048):
        values, index = top_k_pallas(x, k, chunk=chunk, interpret=True)
        np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index), err_msg=f"chunk {chunk}")
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values), err_msg=f"chunk {chunk}")


def test_reference_is_lax_top_k_with_nan_as_minus_inf():
    x = jnp.asarray([[1.0, jnp.nan, -jnp.inf, 0.5]])
    values, index = top_k_reference(x, 4)
    assert np.asarray(index).tolist() == [[0, 3, 1, 2]]  # NaN and -inf tie: the lower index first
    assert np.asarray(values).tolist() == [[1.0, 0.5, -np.inf, -np.inf]]


def test_bad_k_is_refused():
    with pytest.raises(ValueError, match="1 <= k <= 5"):
        top_k_pallas(jnp.zeros((2, 5)), 6, interpret=True)
    with pytest.raises(ValueError, match="unknown top-k implementation 'fast'"):
        top_k(jnp.zeros((2, 5)), 2, "fast")


@pytest.mark.parametrize("implementation", ["pallas_interpret", "xla"])
def test_tree_candidates_are_the_same_on_every_path(implementation):
    log_probs = jax.nn.log_softmax(hard_rows((2, 15, 3000), seed=3), axis=-1)
    log_probs = jnp.where(jnp.isnan(log_probs), -jnp.inf, log_probs)
    want_values, want_tokens = jax.lax.top_k(log_probs, 7)
    tokens, values = top_candidates(log_probs, 7, chunk=256, implementation=implementation)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_triton_lowering_verifies(monkeypatch):
    x = jax.ShapeDtypeStruct((8, 15, 49152), jnp.float32)
    modules = lowered_triton_modules(monkeypatch, lambda: jax.jit(functools.partial(top_k_pallas, k=7)).trace(
        x).lower(lowering_platforms=("cuda",)))
    assert len(modules) == 2  # the chunks' pass and the winners' pass
    for module in modules:
        assert module.operation.verify()
