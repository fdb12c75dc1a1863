"""A target model's identity, independent of its file: a hash over its architecture and shapes and its
normalisation weights. Heads record the fingerprint of the target they were trained for.

Norm vectors stay unquantised in GGUF files (llama.cpp keeps 1-D tensors in F32), and are bf16 values
in the original checkpoints, so hashing them as bf16 gives the same fingerprint for a GGUF, any file
name or path of it, and a Hugging Face export of the same weights; a fine-tune changes them."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Callable, Iterable, NamedTuple

import jax
import ml_dtypes
import numpy as np

from jetspec_jax.models import qwen3

# Config fields that make two models interchangeable for a draft head (floats such as rope_theta and
# rms_norm_eps are left out: GGUF stores them as float32, HF configs as decimal text).
IDENTITY_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                   "head_dim", "intermediate_size", "qk_norm", "attention_bias", "tie_embeddings",
                   "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_layers")
NORM_NAMES = ("attn_norm", "mlp_norm", "q_norm", "k_norm")
FINGERPRINT_CHARS = 16  # hex digits of sha256 kept: 64 bits, plenty to tell models apart


class TargetIdentity(NamedTuple):
    """What a head is matched by: a target's file name (for messages) and its fingerprint."""
    name: str
    fingerprint: str


def norm_vectors(params: Any) -> dict[str, Any]:
    """Every RMSNorm weight of a parameter tree, by parameter path."""
    out = {"final_norm": params["final_norm"]}
    for i, layer in enumerate(params["layers"]):
        out |= {f"layers/{i}/{name}": layer[name] for name in NORM_NAMES if name in layer}
    return out


def norms_from_tensors(tensors: Iterable[tuple[str, Callable[[], np.ndarray]]], rules) -> dict[str, np.ndarray]:
    """The norm weights of a checkpoint's (key, loader) stream, read through its loader's rule table:
    only those tensors are loaded."""
    norm_rules = [(re.compile(r.pattern), r) for r in rules if isinstance(r.target, str)
                  and r.target.rsplit("/", 1)[-1] in NORM_NAMES + ("final_norm",)]
    out = {}
    for key, load in tensors:
        for pattern, rule in norm_rules:
            if m := pattern.fullmatch(key):
                out[rule.target.format(*m.groups())] = rule.transform(np.asarray(load()))
    return out


def fingerprint_of_norms(cfg: qwen3.Config, norms: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    identity = {name: getattr(cfg, name) for name in IDENTITY_FIELDS}
    digest.update(json.dumps(identity, sort_keys=True, default=list).encode())
    order = ["final_norm"] + [f"layers/{i}/{name}" for i in range(cfg.num_layers) for name in NORM_NAMES]
    for name in order:
        if name in norms:
            values = np.asarray(jax.device_get(norms[name]), np.float32).astype(ml_dtypes.bfloat16)
            digest.update(name.encode())
            digest.update(values.tobytes())
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def target_fingerprint(cfg: qwen3.Config, params: Any) -> str:
    return fingerprint_of_norms(cfg, norm_vectors(params))
