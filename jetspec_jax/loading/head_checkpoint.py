"""Trained draft heads as portable files: `draft_config.json` + `head.safetensors` in one directory.
(Training checkpoints with optimizer state are orbax's business; this is the inference export.)"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from jetspec_jax.loading.assemble import Rule, assemble_params
from jetspec_jax.models import draft_head
from jetspec_jax.models.params import flatten_specs, path_to_str

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "head.safetensors"


def config_to_json(cfg: draft_head.DraftConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["tap_layers"] = list(cfg.tap_layers)
    if not isinstance(cfg.attention, str):
        out["attention"] = [list(row) for row in cfg.attention]
    return out


def config_from_json(data: dict[str, Any]) -> draft_head.DraftConfig:
    known = {f.name for f in dataclasses.fields(draft_head.DraftConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{CONFIG_FILE} has unknown keys {unknown}; known: {sorted(known)}")
    data = dict(data)
    data["tap_layers"] = tuple(data["tap_layers"])
    if not isinstance(data.get("attention", "causal"), str):
        data["attention"] = tuple(tuple(bool(x) for x in row) for row in data["attention"])
    return draft_head.DraftConfig(**data)


def save_head(path: str, cfg: draft_head.DraftConfig, params: Any, metadata: dict[str, str] | None = None):
    """Writes atomically: a temporary directory is renamed into place."""
    from safetensors.numpy import save_file

    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".head-")
    try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(params)
        flat = {path_to_str(p): np.asarray(jax.device_get(v)) for p, v in leaves}
        save_file(flat, os.path.join(tmp, WEIGHTS_FILE), metadata=metadata or {})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(config_to_json(cfg), f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_head(path: str, dtype) -> tuple[draft_head.DraftConfig, Any]:
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no draft head at {path} (expected {CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(config_path) as f:
        cfg = config_from_json(json.load(f))
    from safetensors import safe_open

    specs = draft_head.param_specs(cfg)
    rules = [Rule(re.escape(name), name) for name in flatten_specs(specs)]
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="numpy") as f:
        tensors = [(key, (lambda key=key: f.get_tensor(key))) for key in f.keys()]
        params = assemble_params(specs, tensors, rules, dtype, source=path)
    return cfg, params


PACKAGED_HEADS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "heads")


def packaged_head_path(target_source: str, method: str) -> str | None:
    """The head shipped in this package for a target file (by basename) and method, if any."""
    index = os.path.join(PACKAGED_HEADS_DIR, "heads.json")
    if not os.path.isfile(index):
        return None
    with open(index) as f:
        entry = json.load(f).get(os.path.basename(os.path.normpath(target_source)), {})
    return os.path.join(PACKAGED_HEADS_DIR, entry[method]) if method in entry else None
