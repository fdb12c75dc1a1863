"""The Pallas prefix-attention kernels (interpret mode on the CPU) against their jnp reference: outputs,
log-sum-exps and gradients, and the CUDA lowering of forward and backward through MLIR's verifier; and the
head's training pass through them against its dense-score path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import random_head
from triton_lowering import lowered_triton_modules, tf32_dots

from jetspec_jax.kernels.prefix_attention import PrefixAttentionTuning, prefix_attention, prefix_attention_reference
from jetspec_jax.models import draft_head

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
SMALL_TILES = PrefixAttentionTuning(block_q=16, block_k=16)

CASES = [  # batch, rows, heads, kv heads, head dim, keys, how the limits are laid out
    (1, 32, 4, 4, 16, 64, "sorted"),
    (2, 45, 6, 2, 32, 150, "sorted"),  # rows and keys past whole tiles: both padded
    (2, 40, 9, 3, 64, 70, "shuffled"),  # a row block's limits in any order
    (3, 17, 2, 1, 16, 33, "with_zeros"),  # rows that see no key: zeros and -inf
]


def make_inputs(case, dtype):
    b, m, h, hkv, d, s, layout = case
    rng = np.random.default_rng(m * 7 + s)
    q = jnp.asarray(rng.standard_normal((b, m, h, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), dtype)
    limits = np.sort(rng.integers(1, s + 1, (b, m)), axis=1)
    if layout == "shuffled":
        limits = rng.permuted(limits, axis=1)
    if layout == "with_zeros":
        limits[:, -4:] = 0
        limits[0, 2] = 0
    return q, k, v, jnp.asarray(limits, jnp.int32)


def objective(implementation):
    """A scalar of both outputs with distinct weights everywhere, so every gradient path is exercised."""
    def total(q, k, v, limits):
        out, lse = prefix_attention(q, k, v, limits, implementation=implementation, tuning=SMALL_TILES)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return jnp.sum(out.astype(jnp.float32) * weights) + 0.3 * jnp.sum(jnp.where(lse == -jnp.inf, 0.0, lse))
    return total


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1] + f"-{c[1]}x{c[5]}")
def test_kernel_matches_reference(case, dtype):
    q, k, v, limits = make_inputs(case, dtype)
    want_out, want_lse = prefix_attention_reference(q, k, v, limits)
    out, lse = prefix_attention(q, k, v, limits, implementation="pallas_interpret", tuning=SMALL_TILES)
    assert out.dtype == q.dtype and lse.dtype == jnp.float32
    unseen = np.asarray(limits == 0)[:, :, None]
    np.testing.assert_array_equal(np.asarray(lse == -jnp.inf), np.broadcast_to(unseen, lse.shape))
    assert not np.asarray(out.astype(jnp.float32))[np.broadcast_to(unseen[..., None], out.shape)].any()
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out, np.float32), atol=tol, rtol=tol)
    np.testing.assert_allclose(np.where(unseen, 0, lse), np.where(unseen, 0, want_lse), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[-1] + f"-{c[1]}x{c[5]}")
def test_kernel_gradients_match_reference(case, dtype):
    q, k, v, limits = make_inputs(case, dtype)
    want = jax.grad(objective("xla"), argnums=(0, 1, 2))(q, k, v, limits)
    got = jax.grad(objective("pallas_interpret"), argnums=(0, 1, 2))(q, k, v, limits)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == w.dtype, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        # relative to the gradient's scale: bf16 sums of many rounded products
        scale = 1.0 if dtype == jnp.float32 else float(np.abs(w).max())
        np.testing.assert_allclose(g, w, atol=TOLERANCE[dtype] * scale, rtol=TOLERANCE[dtype], err_msg=f"d{name}")


def test_bad_shapes_are_refused_with_what_to_change():
    q = jnp.zeros((1, 8, 4, 24))
    k = jnp.zeros((1, 16, 2, 24))
    with pytest.raises(ValueError, match="head dim 24 must be a power of two"):
        prefix_attention(q, k, k, jnp.zeros((1, 8), jnp.int32), implementation="pallas_interpret")
    with pytest.raises(ValueError, match=r"limits \(1, 7\) must be \(B, M\)"):
        prefix_attention(q[..., :16], k[..., :16], k[..., :16], jnp.zeros((1, 7), jnp.int32),
                         implementation="pallas_interpret")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_forward_and_backward_lower_to_valid_triton_modules(dtype, monkeypatch):
    """The CUDA lowering of all three kernels passes MLIR's verifier (the embedded model's shape: 9 heads
    over 3 kv heads of 64, a tree pass's 30 slots a block), and no dot rounds fp32 inputs to TF32."""
    args = (jax.ShapeDtypeStruct((2, 19 * 30, 9, 64), dtype), jax.ShapeDtypeStruct((2, 256, 3, 64), dtype),
            jax.ShapeDtypeStruct((2, 256, 3, 64), dtype), jax.ShapeDtypeStruct((2, 19 * 30), jnp.int32))
    modules = lowered_triton_modules(monkeypatch, lambda: jax.jit(jax.grad(objective("pallas"), argnums=(0, 1, 2)))
                                     .trace(*args).lower(lowering_platforms=("cuda",)))
    assert len(modules) == 3  # forward, dQ, dK/dV
    for module in modules:
        assert module.operation.verify()
        assert "tt.dot" in str(module) and not tf32_dots(module)


@pytest.mark.parametrize("attention, pass_", [("causal", "tree"), ("bidirectional", "block")])
def test_training_pass_through_the_kernels_equals_the_dense_path(tiny_qwen3, attention, pass_):
    """The head's training logits and their gradients are the same whichever context attention runs
    (fp32): sorted anchors, two rows, padded anchors at 0 that see no context."""
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention=attention, num_layers=2)
    cfg = drafter.cfg
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 97, (2, 40)))
    taps = jnp.asarray(rng.normal(size=(2, 40, len(cfg.tap_layers), target.cfg.hidden_size)), jnp.float32)
    anchors = np.sort(rng.integers(1, 38, (2, 7)), axis=1)
    anchors[1, -2:] = 0
    logits_of = draft_head.training_logits if pass_ == "block" else draft_head.training_tree_logits

    def total(params, implementation):
        logits = logits_of(params, target.params, target.cfg, tokens, taps, jnp.asarray(anchors), cfg,
                           attention_impl=implementation)
        return jnp.sum(jnp.sin(logits)), logits

    grad = jax.jit(jax.value_and_grad(total, has_aux=True), static_argnums=1)
    (_, want), want_grads = grad(head, "xla")
    (_, got), got_grads = grad(head, "pallas_interpret")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))
