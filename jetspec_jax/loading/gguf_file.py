"""Loads a GGUF file with the `gguf` package: dequantises Q4_0/Q4_1/Q8_0/F16/BF16/F32 tensors,
and undoes llama.cpp's Q/K row permutation for Llama checkpoints (the tokenizer: gguf_tokenizer.py)."""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator

import numpy as np

from jetspec_jax.loading.assemble import Rule, assemble_params, identity, swap_last_two, transpose
from jetspec_jax.models import qwen3

_BLK = r"blk\.(\d+)\."


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves for Llama; restore HF's order.
    w: (num_heads * head_dim, in)."""
    rows = w.shape[0]
    # The converter did reshape(heads, 2, half).swapaxes(1, 2); this is its inverse.
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_rules(cfg: qwen3.Config) -> list[Rule]:
    permuted = cfg.architecture == "llama"
    q_fix = functools.partial(unpermute_rope_rows, num_heads=cfg.num_heads) if permuted else identity
    k_fix = functools.partial(unpermute_rope_rows, num_heads=cfg.num_kv_heads) if permuted else identity
    return [
        Rule(r"token_embd\.weight", "embed"),
        Rule(r"output_norm\.weight", "final_norm"),
        Rule(r"output\.weight", "lm_head", transpose),
        Rule(_BLK + r"attn_norm\.weight", "layers/{0}/attn_norm"),
        Rule(_BLK + r"ffn_norm\.weight", "layers/{0}/mlp_norm"),
        Rule(_BLK + r"attn_q\.weight", "layers/{0}/wq", lambda w: transpose(q_fix(w))),
        Rule(_BLK + r"attn_k\.weight", "layers/{0}/wk", lambda w: transpose(k_fix(w))),
        Rule(_BLK + r"attn_v\.weight", "layers/{0}/wv", transpose),
        Rule(_BLK + r"attn_output\.weight", "layers/{0}/wo", transpose),
        Rule(_BLK + r"attn_q\.bias", "layers/{0}/bq", q_fix),
        Rule(_BLK + r"attn_k\.bias", "layers/{0}/bk", k_fix),
        Rule(_BLK + r"attn_v\.bias", "layers/{0}/bv"),
        Rule(_BLK + r"attn_output\.bias", "layers/{0}/bo"),
        Rule(_BLK + r"attn_q_norm\.weight", "layers/{0}/q_norm"),
        Rule(_BLK + r"attn_k_norm\.weight", "layers/{0}/k_norm"),
        Rule(_BLK + r"ffn_gate\.weight", "layers/{0}/w_gate", transpose),
        Rule(_BLK + r"ffn_up\.weight", "layers/{0}/w_up", transpose),
        Rule(_BLK + r"ffn_down\.weight", "layers/{0}/w_down", transpose),
        Rule(_BLK + r"ffn_gate_inp\.weight", "layers/{0}/router", transpose),
        Rule(_BLK + r"ffn_gate_exps\.weight", "layers/{0}/experts_gate", swap_last_two),
        Rule(_BLK + r"ffn_up_exps\.weight", "layers/{0}/experts_up", swap_last_two),
        Rule(_BLK + r"ffn_down_exps\.weight", "layers/{0}/experts_down", swap_last_two),
    ]


def _require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def read_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            meta[key] = field.data  # only its length is used here; transformers decodes the vocab
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # fields the gguf package cannot decode are not needed by us
            continue
    return meta


def iter_gguf_tensors(reader) -> Iterator[tuple[str, Any]]:
    gguf = _require_gguf()

    def load(tensor):
        # ggml lists dims fastest-first; dequantize returns the row-major (slowest-first) array.
        data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(data, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))

    for tensor in reader.tensors:
        yield tensor.name, (lambda t=tensor: load(t))


def load_gguf(path: str, dtype) -> tuple[qwen3.Config, Any]:
    gguf = _require_gguf()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    reader = gguf.GGUFReader(path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    cfg = qwen3.Config.from_gguf(meta, has_output_tensor="output.weight" in names)
    params = assemble_params(qwen3.param_specs(cfg), iter_gguf_tensors(reader), gguf_rules(cfg), dtype,
                             source=path)
    return cfg, params
