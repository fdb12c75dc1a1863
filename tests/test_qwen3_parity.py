"""Parity of our Qwen3-family forward and generation against transformers on tiny random models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.models import qwen3
from jetspec_jax.target import load_target
from jetspec_jax.tokens import pad_prompts


def run_forward(target, ids, tap_layers=()):
    cache = qwen3.new_cache(target.cfg, 1, 64)
    return qwen3.forward(target.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache,
                         target.cfg, tap_layers=tap_layers)


def test_logits_and_taps_match_transformers(tiny_checkpoint):
    kind, path, model = tiny_checkpoint
    target = load_target(path, dtype="float32")
    ids = [3, 17, 42, 5, 88, 61, 2, 9, 33, 70, 14]
    taps = tuple(range(target.cfg.num_layers - 1))  # HF's last hidden state is after the final norm
    logits, tap_out, _ = run_forward(target, ids, taps)
    with torch.no_grad():
        ref = model(torch.tensor([ids]), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits[0]), ref.logits[0].numpy(), rtol=1e-4, atol=1e-4)
    for j, layer in enumerate(taps):
        np.testing.assert_allclose(np.asarray(tap_out[0, :, j]), ref.hidden_states[layer + 1][0].numpy(),
                                   rtol=1e-4, atol=1e-5)


def test_config_matches_checkpoint(tiny_checkpoint):
    kind, path, model = tiny_checkpoint
    cfg = load_target(path, dtype="float32").cfg
    assert cfg.architecture == kind
    assert cfg.qk_norm == (kind != "llama")
    if kind == "qwen3_moe":
        assert cfg.moe_layers == (0, 2)  # mlp_only_layers=[1]


def ar_greedy(target, prompts, max_new):
    tokens, lengths = pad_prompts(prompts, pad_id=0, bucket=16)
    gen = GenerationConfig(max_new_tokens=max_new)
    out = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                          cfg=target.cfg, gen=gen, cache_len=tokens.shape[1] + max_new)
    return np.asarray(out.tokens), np.asarray(out.num_tokens)


def test_greedy_generation_matches_transformers(tiny_checkpoint):
    kind, path, model = tiny_checkpoint
    target = load_target(path, dtype="float32")
    prompt = [5, 12, 40, 7, 66, 23]
    tokens, counts = ar_greedy(target, [prompt], 32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                             min_new_tokens=32, pad_token_id=0, eos_token_id=None)
    assert counts[0] == 32
    assert tokens[0].tolist() == ref[0, len(prompt):].tolist()


def test_batched_ragged_prompts_equal_single_runs(tiny_qwen3):
    target, _ = tiny_qwen3
    prompts = [[5, 12, 40], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [90], [33, 34, 35, 36, 37]]
    batch_tokens, _ = ar_greedy(target, prompts, 20)
    for i, prompt in enumerate(prompts):
        single, _ = ar_greedy(target, [prompt], 20)
        assert batch_tokens[i].tolist() == single[0].tolist(), f"prompt {i}"


def test_eos_stops_each_sequence_and_pads(tiny_qwen3):
    target, _ = tiny_qwen3
    prompts = [[5, 12, 40], [7, 1, 2, 3]]
    free, _ = ar_greedy(target, prompts, 12)
    eos = int(free[0, 3])  # make sequence 0 stop at its 4th token
    tokens, lengths = pad_prompts(prompts, pad_id=0, bucket=16)
    gen = GenerationConfig(max_new_tokens=12, eos_token_ids=(eos,), pad_token_id=-1)
    out = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                          cfg=target.cfg, gen=gen, cache_len=64)
    got, counts = np.asarray(out.tokens), np.asarray(out.num_tokens)
    first_eos = [list(row).index(eos) if eos in row else None for row in free]
    for i in range(2):
        stop = first_eos[i]
        if stop is None:
            assert counts[i] == 12 and got[i].tolist() == free[i].tolist()
        else:
            assert counts[i] == stop + 1
            assert got[i, : stop + 1].tolist() == free[i, : stop + 1].tolist()
            assert (got[i, stop + 1:] == -1).all()


def test_moe_block_matches_dense_expert_loop():
    """ragged_dot routing equals a plain per-token loop over the chosen experts."""
    cfg = qwen3.Config(architecture="qwen3_moe", vocab_size=11, hidden_size=8, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=4, intermediate_size=0, num_experts=5,
                       num_experts_per_tok=2, moe_intermediate_size=6, norm_topk_prob=False,
                       moe_layers=(0,))
    from jetspec_jax.models.params import init_params

    layer = init_params(qwen3.param_specs(cfg), jax.random.key(3), scale=0.5)["layers"][0]
    x = jax.random.normal(jax.random.key(4), (2, 7, 8))
    got = qwen3.moe_mlp(x, layer, cfg)
    tokens = np.asarray(x).reshape(-1, 8)
    probs = np.asarray(jax.nn.softmax(tokens @ np.asarray(layer["router"]), axis=-1))
    want = np.zeros_like(tokens)
    for m, tok in enumerate(tokens):
        for e in np.argsort(-probs[m])[:2]:
            g = tok @ np.asarray(layer["experts_gate"][e])
            u = tok @ np.asarray(layer["experts_up"][e])
            h = (g / (1 + np.exp(-g))) * u
            want[m] += probs[m, e] * (h @ np.asarray(layer["experts_down"][e]))
    np.testing.assert_allclose(np.asarray(got).reshape(-1, 8), want, rtol=1e-5, atol=1e-5)
