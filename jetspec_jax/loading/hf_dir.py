"""Loads a local Hugging Face checkpoint directory: config.json, *.safetensors (sharded or not),
and the tokenizer with its chat template when the directory has one. Every file is checked as it is
read: a malformed config or a truncated shard is one error naming the file."""

from __future__ import annotations

import json
import os
from typing import Any, Iterator

import numpy as np

from jetspec_jax.errors import DamagedFileError
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
REDOWNLOAD = "download the model directory again"


def read_json(path: str, what: str) -> dict[str, Any]:
    """A JSON object from `path`, or DamagedFileError saying what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(path, f"not valid JSON ({e})", f"restore the {what} or {REDOWNLOAD}") from None
    if not isinstance(data, dict):
        raise DamagedFileError(path, f"holds a JSON {type(data).__name__}, not an object",
                               f"restore the {what} or {REDOWNLOAD}")
    return data


def read_hf_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json; expected a Hugging Face model directory")
    return read_json(config_path, "model config")


def safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "shard index").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise DamagedFileError(index, "has no weight_map object of tensor name -> shard file",
                                   f"restore the shard index or {REDOWNLOAD}")
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"{path} has no *.safetensors weights (PyTorch .bin files are not read)")
    missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
    if missing:
        raise FileNotFoundError(f"{path}: shards listed in the index are missing: {missing}; {REDOWNLOAD}")
    return [os.path.join(path, n) for n in names]


def iter_safetensors(files: list[str], fix: str = REDOWNLOAD) -> Iterator[tuple[str, Any]]:
    """(key, loader) of every tensor in `files`; a damaged file is a DamagedFileError naming it and `fix`."""
    from safetensors import SafetensorError, safe_open

    def load(f, file, key):
        try:
            value = f.get_tensor(key)
        except SafetensorError as e:
            raise DamagedFileError(file, f"cannot read tensor {key} ({e})", fix) from None
        bad = value.size - np.count_nonzero(np.isfinite(value))
        if bad:  # safetensors has no checksum; a flipped exponent bit often shows as inf or NaN
            raise DamagedFileError(file, f"corrupt tensor {key}: {bad:,} of its {value.size:,} values are "
                                   "NaN or infinite", fix)
        return value

    for file in files:
        try:  # safetensors checks the header and that the tensors cover the file exactly
            opened = safe_open(file, framework="numpy")
        except SafetensorError as e:
            raise DamagedFileError(file, f"not a readable safetensors file ({e})", fix) from None
        with opened as f:
            for key in f.keys():
                yield key, (lambda f=f, file=file, key=key: load(f, file, key))


def hf_dir_config(path: str) -> qwen3.Config:
    hf = read_hf_config(path)
    try:
        return qwen3.Config.from_hf_config(hf)
    except ValueError as e:
        raise DamagedFileError(os.path.join(path, "config.json"), str(e),
                               f"fix the file or {REDOWNLOAD}") from None


def load_hf_dir(path: str, dtype) -> tuple[qwen3.Config, Any]:
    cfg = hf_dir_config(path)
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

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        # tokenizers reports a malformed tokenizer.json as a bare Exception; other types are bugs
        if not isinstance(e, (ValueError, OSError, KeyError, TypeError)) and type(e) is not Exception:
            raise
        raise DamagedFileError(path, f"cannot load its tokenizer ({type(e).__name__}: {e})",
                               f"restore tokenizer.json and tokenizer_config.json or {REDOWNLOAD}") from None
