"""Training configuration: TOML files under train/configs plus `section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
import typing
from typing import Any

CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
# the checkout's sibling shared/data (an installed copy must be given data.data_dir)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DATA_DIR = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))


@dataclasses.dataclass(frozen=True)
class DataConfig:
    data_dir: str = DEFAULT_DATA_DIR
    # prompts per training source (0 = none, -1 = all); eval splits are never read
    sources: dict = dataclasses.field(default_factory=lambda: {"gsm8k": -1, "math": -1, "mbpp": -1,
                                                               "chat": -1})
    regen_dir: str = "runs/regen"
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    samples_per_prompt: int = 1  # answers per training prompt; > 1 needs temperature > 0 (more, varied data)
    regen_batch_size: int = 64
    max_prompt_tokens: int = 512
    seq_len: int = 768  # prompt + completion, truncated/padded to this
    anchors_per_seq: int = 32
    heldout_fraction: float = 0.02


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    num_layers: int = 2
    block_size: int = 16
    num_taps: int = 5
    attention: str = "causal"  # causal (JetSpec) | bidirectional (DFlash/DDTree)
    intermediate_size: int = 0  # 0: the target's


@dataclasses.dataclass(frozen=True)
class LossConfig:
    kind: str = "fkl"  # fkl | ce | rkl
    temperature: float = 1.0  # T_KD
    gamma: float = 0.0  # per-depth decay exp(-(k-1)/gamma); 0 = uniform


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 2000
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    batch_size: int = 16  # sequences per step, over all devices
    b1: float = 0.9
    b2: float = 0.95


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    out_dir: str = "runs"
    target: str = ""  # "" = embedded default / $JETSPEC_TARGET
    compute_dtype: str = "bfloat16"  # activations and target weights; head master weights stay fp32
    seed: int = 0
    checkpoint_every: int = 200
    keep_checkpoints: int = 3
    eval_every: int = 200
    eval_sequences: int = 64
    log_every: int = 10
    mesh_model: int = 1  # devices along the parameter-sharding axis; the rest is data parallel
    export_head: str = ""  # where to write the final head (draft_config.json + head.safetensors)
    max_minutes: float = 0.0  # > 0: stop cleanly (checkpoint + export) after this much training time
    max_steps: int = 0  # > 0: stop cleanly at this step, the schedule still planned over total_steps


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = DataConfig()
    head: HeadConfig = HeadConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    run: RunConfig = RunConfig()

    def fingerprint(self) -> str:
        """Hash of everything that shapes the model and the data order (not paths or bookkeeping)."""
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k != "run"}
        shape["data"] = {k: v for k, v in shape["data"].items() if k not in ("data_dir", "regen_dir")}
        shape["seed"] = self.run.seed
        shape["compute_dtype"] = self.run.compute_dtype
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {f.name: f.type for f in dataclasses.fields(TrainConfig)}


def _section_class(name: str):
    return {"data": DataConfig, "head": HeadConfig, "loss": LossConfig, "optim": OptimConfig,
            "run": RunConfig}[name]


def _coerce(cls, key: str, value: Any, where: str) -> Any:
    hint = typing.get_type_hints(cls)[key]
    if isinstance(value, str) and hint is not str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{where}: {key}={value!r} is not a valid {hint.__name__}") from None
    if hint is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {key} must be {hint.__name__}, got {value!r}")
    return value


def build_config(raw: dict[str, Any], where: str) -> TrainConfig:
    sections = {}
    for name, values in raw.items():
        if name not in SECTIONS:
            raise ValueError(f"{where}: unknown section [{name}]; known: {sorted(SECTIONS)}")
        cls = _section_class(name)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(name + '.' + k for k in unknown)}; "
                             f"[{name}] has {sorted(known)}")
        sections[name] = cls(**{k: _coerce(cls, k, v, where) for k, v in values.items()})
    return TrainConfig(**sections)


def resolve_config_path(path: str) -> str:
    for candidate in (path, os.path.join(CONFIG_DIR, path), os.path.join(CONFIG_DIR, path + ".toml")):
        if os.path.isfile(candidate):
            return candidate
    available = sorted(n[:-5] for n in os.listdir(CONFIG_DIR) if n.endswith(".toml"))
    raise FileNotFoundError(f"no config file {path!r}; available in train/configs: {available}")


def load_config(path: str, overrides: list[str] = ()) -> TrainConfig:
    """Reads a TOML config and applies `section.key=value` overrides (values parsed as JSON, else text)."""
    path = resolve_config_path(path)
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. optim.total_steps=500)")
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        raw.setdefault(section, {})[key] = value
    cfg = build_config(raw, where=os.path.basename(path))
    if cfg.loss.kind not in ("fkl", "ce", "rkl"):
        raise ValueError(f"loss.kind {cfg.loss.kind!r} is not one of fkl, ce, rkl")
    if cfg.head.attention not in ("causal", "bidirectional"):
        raise ValueError(f"head.attention {cfg.head.attention!r} is not causal or bidirectional")
    check_samples_per_prompt(cfg.data.samples_per_prompt, cfg.data.temperature)
    return cfg


def check_samples_per_prompt(samples_per_prompt: int, temperature: float) -> None:
    """Shared by config loading (fails before the target loads) and regenerate()."""
    if samples_per_prompt < 1:
        raise ValueError(f"data.samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError(f"data.samples_per_prompt={samples_per_prompt} needs a temperature > 0 (set "
                         f"data.temperature > 0): greedy decoding gives the same answer every time")
