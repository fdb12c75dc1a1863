"""Loads a local Hugging Face checkpoint directory: config.json, *.safetensors (sharded or not),
and the tokenizer with its chat template when the directory has one."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from jetspec_jax.loading.assemble import Rule, assemble_params, swap_last_two, transpose
from jetspec_jax.models import qwen3

_LAYER = r"model\.layers\.(\d+)\."


def _split_gate_up(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """transformers 5 fused experts (E, 2F, D) -> gate (E, D, F), up (E, D, F)."""
    gate, up = np.split(x, 2, axis=1)
    return swap_last_two(gate), swap_last_two(up)


HF_RULES = [
    Rule(r"model\.embed_tokens\.weight", "embed"),
    Rule(r"model\.norm\.weight", "final_norm"),
    Rule(r"lm_head\.weight", "lm_head", transpose),
    Rule(_LAYER + r"input_layernorm\.weight", "layers/{0}/attn_norm"),
    Rule(_LAYER + r"post_attention_layernorm\.weight", "layers/{0}/mlp_norm"),
    Rule(_LAYER + r"self_attn\.q_proj\.weight", "layers/{0}/wq", transpose),
    Rule(_LAYER + r"self_attn\.k_proj\.weight", "layers/{0}/wk", transpose),
    Rule(_LAYER + r"self_attn\.v_proj\.weight", "layers/{0}/wv", transpose),
    Rule(_LAYER + r"self_attn\.o_proj\.weight", "layers/{0}/wo", transpose),
    Rule(_LAYER + r"self_attn\.q_proj\.bias", "layers/{0}/bq"),
    Rule(_LAYER + r"self_attn\.k_proj\.bias", "layers/{0}/bk"),
    Rule(_LAYER + r"self_attn\.v_proj\.bias", "layers/{0}/bv"),
    Rule(_LAYER + r"self_attn\.o_proj\.bias", "layers/{0}/bo"),
    Rule(_LAYER + r"self_attn\.q_norm\.weight", "layers/{0}/q_norm"),
    Rule(_LAYER + r"self_attn\.k_norm\.weight", "layers/{0}/k_norm"),
    Rule(_LAYER + r"mlp\.gate_proj\.weight", "layers/{0}/w_gate", transpose),
    Rule(_LAYER + r"mlp\.up_proj\.weight", "layers/{0}/w_up", transpose),
    Rule(_LAYER + r"mlp\.down_proj\.weight", "layers/{0}/w_down", transpose),
    Rule(_LAYER + r"mlp\.gate\.weight", "layers/{0}/router", transpose),
    Rule(_LAYER + r"mlp\.experts\.(\d+)\.gate_proj\.weight", "layers/{0}/experts_gate[{1}]", transpose),
    Rule(_LAYER + r"mlp\.experts\.(\d+)\.up_proj\.weight", "layers/{0}/experts_up[{1}]", transpose),
    Rule(_LAYER + r"mlp\.experts\.(\d+)\.down_proj\.weight", "layers/{0}/experts_down[{1}]", transpose),
    Rule(_LAYER + r"mlp\.experts\.gate_up_proj",
         ("layers/{0}/experts_gate", "layers/{0}/experts_up"), _split_gate_up),
    Rule(_LAYER + r"mlp\.experts\.down_proj", "layers/{0}/experts_down", swap_last_two),
]
# Buffers some exporters write next to the weights; they carry nothing we need.
HF_IGNORED = (r".*rotary_emb\.inv_freq",)


def read_hf_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model directory")
    with open(config_path) as f:
        return json.load(f)


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (PyTorch .bin files are not read)")
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise FileNotFoundError(f"{path}: shards listed in the index are missing: {missing}")
    return [os.path.join(path, n) for n in names]


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="numpy") as f:
            for key in f.keys():
                yield key, (lambda f=f, key=key: f.get_tensor(key))


def load_hf_dir(path: str, dtype) -> tuple[qwen3.Config, Any]:
    cfg = qwen3.Config.from_hf_config(read_hf_config(path))
    specs = qwen3.param_specs(cfg)
    ignore = HF_IGNORED + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())
    params = assemble_params(specs, iter_safetensors(safetensors_files(path)), HF_RULES, dtype,
                             source=path, ignore=ignore)
    return cfg, params


def load_hf_tokenizer(path: str):
    """The directory's tokenizer, or None when it ships none (tiny test checkpoints)."""
    if not any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
