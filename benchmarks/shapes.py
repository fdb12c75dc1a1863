"""Model shapes the benchmarks time with random weights (timing does not depend on weight values), and
what one pass over a shape must move and compute: the bytes and FLOPs the floor model of step_floor.py
reads."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.models.params import flatten_specs

SMOLLM2_135M = qwen3.Config(architecture="llama", vocab_size=49152, hidden_size=576, num_layers=30,
                            num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536,
                            rms_norm_eps=1e-5, rope_theta=100000.0, qk_norm=False, tie_embeddings=True,
                            max_position_embeddings=8192)
QWEN3_8B = qwen3.Config(architecture="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                        num_kv_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1e6)
# every layer's MLP is sparse: 128 experts, 8 routed a token, 3.3B of 30.5B parameters active
QWEN3_30B_A3B = qwen3.Config(architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48,
                             num_heads=32, num_kv_heads=4, head_dim=128, intermediate_size=6144, rope_theta=1e6,
                             num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                             moe_layers=tuple(range(48)), max_position_embeddings=40960)

# name -> (config, description, layers of the paper-sized head a benchmark drafts with)
SHAPES = {"smollm2-135m-shaped": (SMOLLM2_135M, "SmolLM2-135M-shaped", 3),
          "qwen3-8b-shaped": (QWEN3_8B, "Qwen3-8B-shaped", 5),
          "qwen3-30b-a3b-shaped": (QWEN3_30B_A3B, "Qwen3-30B-A3B-shaped", 5)}


def shape_config(name: str, target_layers: int | None = None) -> qwen3.Config:
    """A shape's config, or its first `target_layers` layers (a quick check)."""
    cfg = SHAPES[name][0]
    if not target_layers:
        return cfg
    return dataclasses.replace(cfg, num_layers=target_layers,
                               moe_layers=tuple(i for i in cfg.moe_layers if i < target_layers))


def distinct_experts(num_experts: int, per_token: int, tokens: int) -> float:
    """Experts of one layer that `tokens` tokens route to, in expectation under uniform routing."""
    return num_experts * (1.0 - (1.0 - per_token / num_experts) ** tokens)


def attention_flops(num_heads: int, head_dim: int, layers: int, tokens: int, seen: int) -> int:
    """FLOPs of `tokens` queries each attending to `seen` keys (scores and values) in every layer."""
    return 4 * tokens * seen * num_heads * head_dim * layers


def pass_cost(cfg: qwen3.Config, tokens_per_row: int, rows: int, context: int, itemsize: int = 2) -> tuple[int, int]:
    """(bytes, FLOPs) one target forward over `tokens_per_row` new tokens of `rows` sequences holding
    `context` cached tokens must move and compute at least: every weight it uses read once (an MoE layer's
    experts as many as its tokens reach), the cached keys and values read once, the logits of every
    token written once in fp32."""
    tokens = tokens_per_row * rows
    weight_bytes, flops = 0, 0
    for path, spec in flatten_specs(qwen3.param_specs(cfg)).items():
        size = math.prod(spec.shape)
        if path == "embed":
            weight_bytes += tokens * cfg.hidden_size * itemsize  # the embedding rows gathered
            if cfg.tie_embeddings:
                weight_bytes += size * itemsize
                flops += 2 * tokens * size
            continue
        if path.split("/")[-1].startswith("experts_"):
            used = distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, tokens) / cfg.num_experts
            weight_bytes += int(size * used) * itemsize
            flops += 2 * tokens * cfg.num_experts_per_tok * (size // cfg.num_experts)
            continue
        weight_bytes += size * itemsize
        if len(spec.shape) == 2:
            flops += 2 * tokens * size
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize * cfg.num_layers
    cache_bytes = rows * (context * kv_row + tokens_per_row * kv_row)  # read the context, write the new rows
    attention = attention_flops(cfg.num_heads, cfg.head_dim, cfg.num_layers, tokens, context + tokens_per_row)
    logits_bytes = tokens * cfg.vocab_size * 4
    return weight_bytes + cache_bytes + logits_bytes, flops + attention


def draft_pass_cost(head: draft_head.DraftConfig, target: qwen3.Config, rows: int, context: int,
                    itemsize: int = 2, draft_vocab: int | None = None) -> tuple[int, int]:
    """(bytes, FLOPs) of one head pass over a block of every row: the head's weights and the target's LM
    head (its `draft_vocab` rows, given one) read once, the head's context keys and values read once, every
    depth's logits written in fp32. The fc projection of new taps is left out (it runs on the accepted
    path's few rows)."""
    slots = rows * head.block_size
    weight_bytes, flops = 0, 0
    for path, spec in flatten_specs(draft_head.param_specs(head)).items():
        if path == "fc":
            continue
        size = math.prod(spec.shape)
        weight_bytes += size * itemsize
        if len(spec.shape) == 2:
            flops += 2 * slots * size
    vocab = draft_vocab or target.vocab_size
    lm_head = vocab * target.hidden_size
    kv_row = 2 * head.num_kv_heads * head.head_dim * itemsize * head.num_layers
    attention = attention_flops(head.num_heads, head.head_dim, head.num_layers, slots, context + head.block_size)
    nbytes = weight_bytes + lm_head * itemsize + rows * context * kv_row + slots * vocab * 4
    return nbytes, flops + 2 * slots * lm_head + attention


def floor_ms(cost: tuple[int, int], bandwidth: float, flop_rate: float) -> float:
    """The time a pass of `cost` (bytes, FLOPs) needs at least: the larger of its two terms (ms)."""
    nbytes, flops = cost
    return 1e3 * max(nbytes / bandwidth, flops / flop_rate)


def touched_experts(cfg: qwen3.Config, tokens: int) -> float | None:
    return None if not cfg.num_experts else float(np.round(distinct_experts(cfg.num_experts,
                                                                            cfg.num_experts_per_tok, tokens), 1))
