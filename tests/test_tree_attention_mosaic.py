"""The Mosaic GPU tree-attention kernel in Mosaic GPU's CPU interpreter against the jnp reference, its
dispatch (the Triton kernel where it cannot take a call), and its lowering for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tree_attention_kernel import make_inputs

from jetspec_jax.kernels.tree_attention import (MosaicTreeAttentionTuning, mosaic_unsupported_reason, tree_attention,
                                                tree_attention_reference)
from jetspec_jax.kernels.tree_attention_mosaic import grid_for, tree_attention_mosaic_splits

CASES = [  # batch, N, heads, kv heads, head dim, cache rows, lengths, tree kinds, dtype, splits, stages
    # two splits, lengths off the 64-row tiles, a sequence with an empty prefix
    (2, 64, 4, 2, 64, 176, [100, 0], ["random", "wide"], jnp.bfloat16, 2, 2),
    # 3 query heads per KV head: an odd count of 64-row blocks, so one warpgroup repeats a block unwritten
    (1, 64, 6, 2, 64, 168, [100], ["deep"], jnp.bfloat16, 3, 2),
    # head dim 128, two node blocks per head, three K/V stages, the last split's share past the prefix
    (1, 128, 3, 1, 128, 200, [70], ["wide"], jnp.float16, 4, 3),
    # a prefix ending inside the last split's first tile, one split
    (1, 64, 2, 1, 64, 400, [300], ["random"], jnp.bfloat16, None, 2),
    # GQA ratios 1, 4 and 8 (the cases above have 2 and 3)
    (2, 64, 2, 2, 64, 136, [61, 5], ["chain", "star"], jnp.bfloat16, 2, 2),
    (1, 64, 4, 1, 64, 96, [29], ["deep"], jnp.bfloat16, None, 3),
    (1, 64, 8, 1, 64, 80, [16], ["wide"], jnp.bfloat16, 2, 4),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-{c[6]}")
def test_mosaic_kernel_matches_reference(case):
    *shape, dtype, splits, stages = case
    rng = np.random.default_rng(shape[1] + shape[2])
    q, k, v, lengths, words = make_inputs(rng, *shape, dtype)
    want = tree_attention_reference(q, k, v, lengths, words).astype(jnp.float32)
    tuning = MosaicTreeAttentionTuning(stages=stages, splits=splits)
    assert mosaic_unsupported_reason(q, k) is None
    got = tree_attention(q, k, v, lengths, words, implementation="mosaic_interpret",
                         mosaic_tuning=tuning).astype(jnp.float32)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)
    if splits:  # the kernel ran the splits asked for (shapes only: no second run in the interpreter)
        out, lse = jax.eval_shape(functools.partial(tree_attention_mosaic_splits, tuning=tuning, interpret=True),
                                  q, k, v, lengths, words)
        assert out.shape[1] == splits and lse.shape == (shape[0], splits, shape[2], shape[1])


@pytest.mark.parametrize("n, dtype, needle", [(13, jnp.bfloat16, "multiple of 64"), (64, jnp.float32, "bf16 or f16")])
def test_calls_it_cannot_take_go_to_the_triton_kernel(n, dtype, needle):
    """Among them every fp32 call: the Triton kernel computes it in fp32, to the reference's 1e-5."""
    rng = np.random.default_rng(3)
    q, k, v, lengths, words = make_inputs(rng, 2, n, 4, 2, 64, 100, [7, 30], ["star", "random"], dtype)
    assert needle in mosaic_unsupported_reason(q, k)
    got = tree_attention(q, k, v, lengths, words, implementation="mosaic_interpret")
    want = tree_attention(q, k, v, lengths, words, implementation="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    if dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got), np.asarray(tree_attention_reference(q, k, v, lengths, words)),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_shape, kv_shape, dtype, needle", [
    ((1, 100, 4, 64), (1, 256, 2, 64), jnp.bfloat16, "multiple of 64"),
    ((1, 64, 4, 96), (1, 256, 2, 96), jnp.bfloat16, "head dim 96"),
    ((1, 64, 4, 64), (1, 256, 2, 64), jnp.float32, "bf16 or f16"),
    ((1, 64, 4, 64), (1, 250, 2, 64), jnp.bfloat16, "multiple of 8"),
    ((1, 64, 5, 64), (1, 256, 2, 64), jnp.bfloat16, "multiple of KV heads"),
])
def test_unsupported_calls_are_named(q_shape, kv_shape, dtype, needle):
    q, k = jnp.zeros(q_shape, dtype), jnp.zeros(kv_shape, dtype)
    assert needle in mosaic_unsupported_reason(q, k)
    with pytest.raises(ValueError, match="implementation='pallas'"):
        tree_attention_mosaic_splits(q, k, k, jnp.zeros((1,), jnp.int32),
                                     jnp.zeros((1, q_shape[1], -(-q_shape[1] // 32)), jnp.uint32), interpret=True)


def test_default_splits_fill_one_wave():
    tuning = MosaicTreeAttentionTuning()
    assert grid_for((1, 256, 32, 128), (1, 4352, 8, 128), tuning) == (8, 8, 2)  # 128 of 132 CTAs
    assert grid_for((8, 256, 32, 128), (8, 4352, 8, 128), tuning) == (8, 8, 8)  # 512 CTAs: no split
    assert grid_for((1, 256, 9, 64), (1, 1280, 3, 64), tuning) == (6, 3, 7)  # 126 CTAs


LOWERING_SHAPES = [  # batch, N, heads, kv heads, head dim, cache rows, stages
    (1, 256, 32, 8, 128, 4352, 2), (8, 256, 32, 8, 128, 4352, 3), (2, 64, 9, 3, 64, 1088, 2),
    (1, 256, 9, 3, 64, 1280, 4)]


@pytest.mark.parametrize("shape", LOWERING_SHAPES)
def test_kernel_lowers_for_cuda(shape):
    """Pallas lowers the kernel to a Mosaic GPU module for CUDA (from jax 0.11 with layout inference)."""
    b, n, h, hkv, d, s, stages = shape
    args = (jax.ShapeDtypeStruct((b, n, h, d), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, n // 32), jnp.uint32))
    lowered = tree_attention_mosaic_splits.trace(*args, tuning=MosaicTreeAttentionTuning(stages=stages)).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_verify_forward_through_the_mosaic_kernel_equals_dense_mask():
    """The model's "mosaic_interpret" attention: a 64-node tree block through one bf16 layer of head
    dim 64 (a shape the Mosaic kernel takes) gives the dense-mask forward's logits."""
    from jetspec_jax.kernels.tree_attention import ancestors_from_parents, random_tree_parents
    from jetspec_jax.models import qwen3
    from jetspec_jax.models.params import init_params

    cfg = qwen3.Config.from_hf_config(dict(
        model_type="qwen3", vocab_size=97, hidden_size=128, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False))
    params = init_params(qwen3.param_specs(cfg), jax.random.key(0), jnp.bfloat16, scale=0.2)
    rng = np.random.default_rng(5)
    cache = qwen3.new_cache(cfg, 2, 192, jnp.bfloat16)
    _, _, cache = qwen3.forward(params, jnp.asarray(rng.integers(0, 97, (2, 40))), jnp.arange(40)[None].repeat(2, 0),
                                cache, cfg)
    cache = cache._replace(lengths=jnp.asarray([40, 21], jnp.int32))
    anc = jnp.asarray(np.stack([ancestors_from_parents(random_tree_parents(rng, 64, kind))
                                for kind in ("random", "wide")]))
    tokens = jnp.asarray(rng.integers(0, 97, (2, 64)))
    positions = cache.lengths[:, None] + jnp.asarray(anc.sum(-1) - 1)
    want, _, _ = qwen3.forward(params, tokens, positions, cache, cfg, mask=anc, attention_impl="xla")
    got, _, _ = qwen3.forward(params, tokens, positions, cache, cfg, mask=anc, attention_impl="mosaic_interpret")
    got, want = np.asarray(got), np.asarray(want)
    # bf16 activations: the Triton kernel differs from the dense mask by ~1% of the logits' scale here too
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95
