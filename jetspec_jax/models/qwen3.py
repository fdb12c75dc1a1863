"""Qwen3-family decoder (Qwen3 dense, Qwen3-MoE, Llama/SmolLM layout) as pure JAX functions.

One forward serves prefill, decode and tree verification: it takes a block of query tokens with
explicit positions and an explicit block mask, attends to the cached prefix plus the block, and
returns logits, the hidden states of requested layers ("taps") and the cache with the block written.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from jetspec_jax.kernels import precision
from jetspec_jax.kernels.attention import cache_attention, cache_visibility
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models.params import ParamSpec

SUPPORTED_HF_ARCHITECTURES = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "llama": "llama",
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


# What a config value must be; the checks below collect every key that is not.
VALUE_KINDS = {
    "positive integer": lambda v: _is_int(v) and v > 0,
    "non-negative integer": lambda v: _is_int(v) and v >= 0,
    "positive number": lambda v: _is_number(v) and v > 0,
    "boolean": lambda v: isinstance(v, bool),
    "token id": lambda v: _is_int(v) and v >= 0,
    "token id or list of token ids": lambda v: (_is_int(v) and v >= 0) or (
        isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)),
    "object": lambda v: isinstance(v, dict),
    "list of layer indices": lambda v: isinstance(v, list) and all(_is_int(i) and i >= 0 for i in v),
}
# config.json keys read by from_hf_config: key -> kind; null counts as absent.
HF_CONFIG_KEYS = {
    "vocab_size": "positive integer", "hidden_size": "positive integer", "num_hidden_layers": "positive integer",
    "num_attention_heads": "positive integer", "intermediate_size": "non-negative integer",
    "num_key_value_heads": "positive integer", "head_dim": "positive integer",
    "max_position_embeddings": "positive integer", "rms_norm_eps": "positive number", "rope_theta": "positive number",
    "rope_parameters": "object", "rope_scaling": "object", "attention_bias": "boolean", "mlp_bias": "boolean",
    "tie_word_embeddings": "boolean", "num_experts": "non-negative integer",
    "num_local_experts": "non-negative integer", "num_experts_per_tok": "non-negative integer",
    "moe_intermediate_size": "non-negative integer", "decoder_sparse_step": "non-negative integer",
    "mlp_only_layers": "list of layer indices", "norm_topk_prob": "boolean",
    "bos_token_id": "token id", "eos_token_id": "token id or list of token ids",
}
HF_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
# GGUF metadata keys, after the "<architecture>." prefix.
GGUF_KEYS = {
    "embedding_length": "positive integer", "attention.head_count": "positive integer",
    "block_count": "positive integer", "vocab_size": "positive integer",
    "attention.head_count_kv": "positive integer", "attention.key_length": "positive integer",
    "feed_forward_length": "non-negative integer", "attention.layer_norm_rms_epsilon": "positive number",
    "rope.freq_base": "positive number", "context_length": "positive integer",
    "expert_count": "non-negative integer", "expert_used_count": "non-negative integer",
    "expert_feed_forward_length": "non-negative integer",
}
GGUF_REQUIRED = ("embedding_length", "attention.head_count", "block_count")


def key_problems(values: Mapping[str, Any], kinds: Mapping[str, str], required: tuple[str, ...],
                 prefix: str = "") -> list[str]:
    """Every required key that is absent and every present key whose value is not of its kind."""
    problems = [f"missing required key {prefix + key!r} ({kinds[key]})" for key in required
                if values.get(prefix + key) is None]
    for key, kind in kinds.items():
        value = values.get(prefix + key)
        if value is not None and not VALUE_KINDS[kind](value):
            problems.append(f"{prefix + key} must be a {kind}, got {value!r}")
    return problems


@dataclasses.dataclass(frozen=True)
class Config:
    """Static model description; hashable so it can be a jit static argument."""

    architecture: str  # "qwen3" | "qwen3_moe" | "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # sorted items of an HF rope dict
    qk_norm: bool = True
    attention_bias: bool = False
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    # Mixture of experts (Qwen3-MoE); moe_layers lists the layers whose MLP is sparse.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        problems = []
        if self.architecture not in SUPPORTED_HF_ARCHITECTURES.values():
            problems.append(f"architecture {self.architecture!r} is not one of "
                            f"{sorted(set(SUPPORTED_HF_ARCHITECTURES.values()))}")
        if self.num_heads % max(self.num_kv_heads, 1):
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim < 2 or self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even and positive for RoPE")
        if self.moe_layers and not (0 < self.num_experts_per_tok <= self.num_experts):
            problems.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts="
                            f"{self.num_experts}")
        if problems:
            raise ValueError("invalid model config: " + "; ".join(problems))

    @property
    def rope_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling or ())

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> "Config":
        """From a Hugging Face config.json dict (Qwen3, Qwen3-MoE, Llama/SmolLM)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_HF_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {model_type!r} in config.json; supported: "
                f"{sorted(SUPPORTED_HF_ARCHITECTURES)}")
        arch = SUPPORTED_HF_ARCHITECTURES[model_type]
        # dense models need intermediate_size; a Qwen3-MoE model may have no dense layer
        required = HF_REQUIRED + (() if arch == "qwen3_moe" else ("intermediate_size",))
        problems = key_problems(hf, HF_CONFIG_KEYS, required)
        theta = hf["rope_parameters"].get("rope_theta") if isinstance(hf.get("rope_parameters"), dict) else None
        if theta is not None and not VALUE_KINDS["positive number"](theta):
            problems.append(f"rope_parameters.rope_theta must be a positive number, got {theta!r}")
        if problems:
            raise ValueError("; ".join(problems))
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported (no Qwen3-family checkpoint uses it)")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope = dict(hf.get("rope_parameters") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if hf.get("rope_scaling"):
            rope.update(hf["rope_scaling"])
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope.pop("type", None)
        rope["rope_type"] = rope_type
        rope_scaling = None if rope_type == "default" else tuple(sorted(rope.items()))
        num_layers = hf["num_hidden_layers"]
        moe_layers: tuple[int, ...] = ()
        num_experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        if arch == "qwen3_moe" and num_experts > 0:
            step = hf.get("decoder_sparse_step", 1) or 1
            dense_only = set(hf.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(num_layers)
                               if i not in dense_only and (i + 1) % step == 0)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=hf.get("intermediate_size", 0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            num_experts=num_experts,
            num_experts_per_tok=hf.get("num_experts_per_tok", 0) or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size", 0) or 0,
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),  # transformers' default
            moe_layers=moe_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], has_output_tensor: bool) -> "Config":
        """From GGUF metadata (llama, qwen3, qwen3moe); `meta` maps keys to decoded values."""
        gguf_arch = meta.get("general.architecture")
        arch_map = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
        if gguf_arch not in arch_map:
            raise ValueError(f"unsupported GGUF architecture {gguf_arch!r}; supported: {sorted(arch_map)}")
        arch = arch_map[gguf_arch]

        def get(key, default=None):
            return meta.get(f"{gguf_arch}.{key}", default)

        problems = key_problems(meta, GGUF_KEYS, GGUF_REQUIRED, prefix=f"{gguf_arch}.")
        if get("vocab_size") is None and not meta.get("tokenizer.ggml.tokens"):
            problems.append(f"missing required key '{gguf_arch}.vocab_size' (or tokenizer.ggml.tokens)")
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            if meta.get(key) is not None and not VALUE_KINDS["token id"](meta[key]):
                problems.append(f"{key} must be a token id, got {meta[key]!r}")
        if problems:
            raise ValueError("; ".join(problems))
        hidden = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        num_layers = int(get("block_count"))
        vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
        num_experts = int(get("expert_count", 0) or 0)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        rope_scaling = None
        if get("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=int(get("attention.key_length", hidden // num_heads)),
            intermediate_size=int(get("feed_forward_length", 0) or 0),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            tie_embeddings=not has_output_tensor,
            max_position_embeddings=int(get("context_length", 32768)),
            num_experts=num_experts,
            num_experts_per_tok=int(get("expert_used_count", 0) or 0),
            moe_intermediate_size=int(get("expert_feed_forward_length", 0) or 0),
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)) if num_experts else (),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
        )


# ----------------------------------------------------------------------------------------------
# Weights


def param_specs(cfg: Config) -> dict[str, Any]:
    """Every weight's shape and logical axes. Matrices are stored (in, out): y = x @ w."""
    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def layer(i: int) -> dict[str, ParamSpec]:
        spec = {
            "attn_norm": ParamSpec((d,), ("embed",), "ones"),
            "wq": ParamSpec((d, q_out), ("embed", "heads")),
            "wk": ParamSpec((d, kv_out), ("embed", "kv_heads")),
            "wv": ParamSpec((d, kv_out), ("embed", "kv_heads")),
            "wo": ParamSpec((q_out, d), ("heads", "embed")),
            "mlp_norm": ParamSpec((d,), ("embed",), "ones"),
        }
        if cfg.attention_bias:
            spec |= {
                "bq": ParamSpec((q_out,), ("heads",), "zeros"),
                "bk": ParamSpec((kv_out,), ("kv_heads",), "zeros"),
                "bv": ParamSpec((kv_out,), ("kv_heads",), "zeros"),
                "bo": ParamSpec((d,), ("embed",), "zeros"),
            }
        if cfg.qk_norm:
            spec |= {
                "q_norm": ParamSpec((hd,), ("head_dim",), "ones"),
                "k_norm": ParamSpec((hd,), ("head_dim",), "ones"),
            }
        if cfg.is_moe_layer(i):
            e, f = cfg.num_experts, cfg.moe_intermediate_size
            spec |= {
                "router": ParamSpec((d, e), ("embed", "experts")),
                "experts_gate": ParamSpec((e, d, f), ("experts", "embed", "mlp")),
                "experts_up": ParamSpec((e, d, f), ("experts", "embed", "mlp")),
                "experts_down": ParamSpec((e, f, d), ("experts", "mlp", "embed")),
            }
        else:
            f = cfg.intermediate_size
            spec |= {
                "w_gate": ParamSpec((d, f), ("embed", "mlp")),
                "w_up": ParamSpec((d, f), ("embed", "mlp")),
                "w_down": ParamSpec((f, d), ("mlp", "embed")),
            }
        return spec

    specs: dict[str, Any] = {
        "embed": ParamSpec((cfg.vocab_size, d), ("vocab", "embed")),
        "layers": [layer(i) for i in range(cfg.num_layers)],
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if not cfg.tie_embeddings:
        specs["lm_head"] = ParamSpec((d, cfg.vocab_size), ("embed", "vocab"))
    return specs


def new_cache(cfg: Config, batch: int, max_len: int, dtype=jnp.float32, page_size: int | None = None,
              num_pages: int | None = None) -> KVCache:
    """Dense, or paged with `page_size` (kv_cache.KVCache.create)."""
    return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype, page_size,
                          num_pages)


# ----------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_inverse_frequencies(cfg: Config) -> jax.Array:
    """Per-pair inverse frequencies (head_dim/2,), fp32, with HF's rope scaling types applied."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    rope = cfg.rope_dict
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(rope["factor"])
    if kind == "llama3":
        factor = float(rope["factor"])
        low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
        old_ctx = float(rope["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        scaled = jnp.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return jnp.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (supported: default, linear, llama3)")


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin (B, T, 1, hd/2) fp32 for positions (B, T)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (B, T, heads, hd); HF's rotate-half layout, computed in fp32."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def project_qkv(x: jax.Array, layer: Mapping[str, jax.Array], cfg: Config):
    if "wqkv" in layer:  # fused for decoding (see fuse_for_decode)
        q, k, v = jnp.split(precision.matmul(x, layer["wqkv"]), _qkv_splits(cfg), axis=-1)
    else:
        q, k, v = (precision.matmul(x, layer[name]) for name in ("wq", "wk", "wv"))
    if cfg.attention_bias:
        q, k, v = q + layer["bq"], k + layer["bk"], v + layer["bv"]
    return q, k, v


def _qkv_splits(cfg: Config) -> tuple[int, int]:
    q_out = cfg.num_heads * cfg.head_dim
    return q_out, q_out + cfg.num_kv_heads * cfg.head_dim


def dense_mlp(x: jax.Array, layer: Mapping[str, jax.Array]) -> jax.Array:
    if "w_gate_up" in layer:
        gate, up = jnp.split(precision.matmul(x, layer["w_gate_up"]), 2, axis=-1)
    else:
        gate, up = precision.matmul(x, layer["w_gate"]), precision.matmul(x, layer["w_up"])
    return precision.matmul(jax.nn.silu(gate) * up, layer["w_down"])


def fuse_for_decode(params: Mapping[str, Any]) -> dict[str, Any]:
    """Concatenates q/k/v and gate/up weights so a decode step launches one matmul for each group
    instead of three and two; small-batch decoding is bound by kernel count, not bandwidth.
    Call once outside the decode loop; `forward` accepts either layout; fused params pass through."""
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        if "wqkv" in layer:
            layers.append(layer)
            continue
        layer["wqkv"] = jnp.concatenate([layer.pop("wq"), layer.pop("wk"), layer.pop("wv")], axis=1)
        if "w_gate" in layer:
            layer["w_gate_up"] = jnp.concatenate([layer.pop("w_gate"), layer.pop("w_up")], axis=1)
        layers.append(layer)
    return {**params, "layers": layers}


def moe_mlp(x: jax.Array, layer: Mapping[str, jax.Array], cfg: Config) -> jax.Array:
    """Qwen3-MoE block: softmax router in fp32, top-k experts, optional renormalisation; tokens are
    sorted by expert and run through grouped matmuls (ragged_dot) so only routed experts compute."""
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])  # (M, D)
    m, k, e = tokens.shape[0], cfg.num_experts_per_tok, cfg.num_experts
    router_probs = jax.nn.softmax(precision.matmul(tokens, layer["router"]).astype(jnp.float32), axis=-1)
    weights, experts = lax.top_k(router_probs, k)  # (M, k)
    if cfg.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat_expert = experts.reshape(-1)  # (M*k,)
    order = jnp.argsort(flat_expert, stable=True)
    token_of = order // k
    sorted_in = tokens[token_of]
    group_sizes = jnp.bincount(flat_expert, length=e).astype(jnp.int32)
    gate = precision.ragged_dot(sorted_in, layer["experts_gate"], group_sizes)
    up = precision.ragged_dot(sorted_in, layer["experts_up"], group_sizes)
    down = precision.ragged_dot(jax.nn.silu(gate) * up, layer["experts_down"], group_sizes)  # (M*k, D)
    sorted_w = weights.reshape(-1)[order].astype(jnp.float32)
    out = jnp.zeros((m, shape[-1]), jnp.float32).at[token_of].add(down.astype(jnp.float32) * sorted_w[:, None])
    return out.astype(x.dtype).reshape(shape)


# ----------------------------------------------------------------------------------------------
# Forward


def attention_inputs(x: jax.Array, layer: Mapping[str, jax.Array], cfg: Config, cos: jax.Array,
                     sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A layer's attention half up to the scores: pre-norm, q/k/v projections, QK-norm and RoPE.
    x (B, T, D) -> q (B, T, H, hd), k and v (B, T, Hkv, hd). Shared by the target and the draft head."""
    b, t, _ = x.shape
    h, hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden = rms_norm(x, layer["attn_norm"], cfg.rms_norm_eps)
    q, k, v = project_qkv(hidden, layer, cfg)
    q, k, v = q.reshape(b, t, h, hd), k.reshape(b, t, hkv, hd), v.reshape(b, t, hkv, hd)
    if cfg.qk_norm:
        q = rms_norm(q, layer["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, layer["k_norm"], cfg.rms_norm_eps)
    qk = apply_rope(jnp.concatenate([q, k], axis=2), cos, sin)  # one kernel for both
    return qk[:, :, :h], qk[:, :, h:], v


def finish_layer(x: jax.Array, attn: jax.Array, layer: Mapping[str, jax.Array], cfg: Config,
                 layer_index: int) -> jax.Array:
    """The rest of a layer after attention (B, T, H, hd): output projection, residual, MLP."""
    b, t = x.shape[:2]
    attn = precision.matmul(attn.reshape(b, t, -1), layer["wo"])
    if cfg.attention_bias:
        attn = attn + layer["bo"]
    x = x + attn
    hidden = rms_norm(x, layer["mlp_norm"], cfg.rms_norm_eps)
    return x + (moe_mlp(hidden, layer, cfg) if cfg.is_moe_layer(layer_index) else dense_mlp(hidden, layer))


def forward(
    params: Mapping[str, Any],
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache,
    cfg: Config,
    *,
    mask: jax.Array | None = None,
    tap_layers: tuple[int, ...] = (),
    logits_indices: jax.Array | None = None,
    attention_impl: str = "xla",
) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """Runs a block of T query tokens per sequence against the cache.

    tokens, positions: (B, T). The block's keys/values go to cache slots lengths..lengths+T-1;
    `mask` (B, T, T) says which block slots each query sees (None: causal); the committed prefix
    is always visible. `cache.lengths` is not advanced.
    tap_layers: layer indices whose outputs to return (HF hidden_states[i+1]), as (B, T, n, D).
    logits_indices: (B, K) block positions whose logits to compute; None computes all T.
    attention_impl: the attention path asked of `kernels.attention` (its IMPLEMENTATIONS; "auto" lets
    it pick a kernel by platform and shape).
    Returns (logits (B, T or K, V) fp32, taps or None, cache).
    """
    t = tokens.shape[1]
    max_len = cache.max_len
    dtype = params["embed"].dtype
    visibility = cache_visibility(cache.lengths, t, max_len, mask, attention_impl)
    x = params["embed"][tokens].astype(dtype)
    cos, sin = rope_tables(positions, rope_inverse_frequencies(cfg))
    new_k, new_v, taps = list(cache.k), list(cache.v), []
    for i, layer in enumerate(params["layers"]):
        q, k, v = attention_inputs(x, layer, cfg, cos, sin)
        new_k[i] = cache.write(new_k[i], k, cache.lengths)
        new_v[i] = cache.write(new_v[i], v, cache.lengths)
        attn = cache_attention(q, k, v, new_k[i], new_v[i], cache.lengths, visibility, pages=cache.pages)
        x = finish_layer(x, attn, layer, cfg, i)
        if i in tap_layers:
            taps.append(x)
    tap_out = None
    if tap_layers:
        order = {layer_idx: n for n, layer_idx in enumerate(sorted(set(tap_layers)))}
        tap_out = jnp.stack([taps[order[layer_idx]] for layer_idx in tap_layers], axis=2)
    if logits_indices is not None:
        x = jnp.take_along_axis(x, logits_indices[:, :, None].astype(jnp.int32), axis=1)
    logits = lm_logits(params, rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cfg)
    return logits, tap_out, cache._replace(k=tuple(new_k), v=tuple(new_v))


def lm_logits(params: Mapping[str, Any], hidden: jax.Array, cfg: Config) -> jax.Array:
    """Final projection to the vocabulary (tied to the embedding when the checkpoint ties it), fp32."""
    if cfg.tie_embeddings:
        return precision.einsum("...d,vd->...v", hidden, params["embed"], preferred_element_type=jnp.float32)
    return precision.einsum("...d,dv->...v", hidden, params["lm_head"], preferred_element_type=jnp.float32)
