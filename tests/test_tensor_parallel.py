"""A target split over several devices (tensor parallel over heads, KV heads and the MLP, on the 8 fake
CPU devices) generates exactly the tokens it generates on one: AR and speculative, dense and MoE, at
T=0 in fp32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_checkpoint
from drafters import TargetGreedyDrafter

from jetspec_jax import sharding
from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.speculative import SpecConfig, speculative_cache_rows, speculative_generate
from jetspec_jax.tokens import pad_prompts

PROMPTS = [[5, 12, 40], [7, 1, 2, 3, 4, 5, 6, 8, 9], [90, 3]]
GEN = GenerationConfig(max_new_tokens=20)


def inputs():
    tokens, lengths = pad_prompts(PROMPTS, 0, 16)
    return jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0)


def ar_tokens(target) -> np.ndarray:
    return np.asarray(generate_tokens(target.params, *inputs(), cfg=target.cfg, gen=GEN, cache_len=48).tokens)


def split_over(target, model_parallel: int):
    sharded = sharding.shard_target(target, sharding.make_mesh(model_parallel, jax.devices()[:model_parallel]))
    split = [leaf for leaf in jax.tree.leaves(sharded.params) if "model" in leaf.sharding.spec]
    assert split, "no weight was split over the model axis"
    return sharded


@pytest.mark.parametrize("model_parallel", [2, 4])
def test_sharded_target_generates_one_device_s_tokens(tiny_qwen3, model_parallel):
    target = tiny_qwen3[0]
    sharded = split_over(target, model_parallel)
    want = ar_tokens(target)
    np.testing.assert_array_equal(ar_tokens(sharded), want)
    spec = SpecConfig("jetspec", 12, 3)
    cache_len = 16 + GEN.max_new_tokens + speculative_cache_rows(spec.budget, 4)
    out = speculative_generate(sharded.params, None, *inputs(), cfg=target.cfg,
                               drafter=TargetGreedyDrafter(target.cfg, 4), spec=spec, gen=GEN, cache_len=cache_len)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert np.asarray(out.accept_counts)[:, 1:].sum() > 0


def test_sharded_moe_target_generates_one_device_s_tokens(tmp_path):
    from jetspec_jax.target import load_target

    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    target = load_target(str(tmp_path), dtype="float32")
    np.testing.assert_array_equal(ar_tokens(split_over(target, 2)), ar_tokens(target))
