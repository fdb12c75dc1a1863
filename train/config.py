"""Training configuration: TOML files under train/configs plus `section.key=value` overrides."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import tomllib
import typing
from typing import Any

from jetspec_jax.errors import DamagedFileError, InputError

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


SECTIONS = {"data": DataConfig, "head": HeadConfig, "loss": LossConfig, "optim": OptimConfig, "run": RunConfig}


def _at_least(low):
    return lambda v: v >= low, f">= {low}"


def _one_of(*choices):
    return lambda v: v in choices, f"one of {', '.join(choices)}"


_POSITIVE = (lambda v: v > 0, "> 0")
_FRACTION = (lambda v: 0 <= v < 1, "in [0, 1)")
_NOT_EMPTY = (lambda v: bool(v.strip()), "a non-empty string")
# section.key -> (check, what the value must be); unlisted keys take any value of their type.
LIMITS = {
    "data.max_new_tokens": _at_least(1), "data.temperature": _at_least(0),
    "data.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "data.samples_per_prompt": _at_least(1),
    "data.regen_batch_size": _at_least(1), "data.max_prompt_tokens": _at_least(1), "data.seq_len": _at_least(2),
    "data.anchors_per_seq": _at_least(1), "data.heldout_fraction": _FRACTION, "data.regen_dir": _NOT_EMPTY,
    "head.num_layers": _at_least(1), "head.block_size": _at_least(2), "head.num_taps": _at_least(1),
    "head.attention": _one_of("causal", "bidirectional"), "head.intermediate_size": _at_least(0),
    "loss.kind": _one_of("fkl", "ce", "rkl"), "loss.temperature": _POSITIVE, "loss.gamma": _at_least(0),
    "optim.learning_rate": _POSITIVE, "optim.warmup_steps": _at_least(0), "optim.total_steps": _at_least(1),
    "optim.weight_decay": _at_least(0), "optim.clip_norm": _POSITIVE, "optim.batch_size": _at_least(1),
    "optim.b1": _FRACTION, "optim.b2": _FRACTION,
    "run.name": _NOT_EMPTY, "run.out_dir": _NOT_EMPTY, "run.compute_dtype": _one_of("float32", "bfloat16"),
    "run.checkpoint_every": _at_least(1), "run.keep_checkpoints": _at_least(1), "run.eval_every": _at_least(1),
    "run.eval_sequences": _at_least(0), "run.log_every": _at_least(1), "run.mesh_model": _at_least(1),
    "run.max_minutes": _at_least(0), "run.max_steps": _at_least(0),
}


def _coerce(cls, section: str, key: str, value: Any) -> tuple[Any, str | None]:
    """(value as the field's type, None) or (None, what is wrong with it)."""
    hint = typing.get_type_hints(cls)[key]
    name = f"{section}.{key}"
    if isinstance(value, str) and hint is not str:
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"{name}={value!r} is not a valid {hint.__name__}"
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        return None, f"{name} must be {hint.__name__}, got {value!r}"
    if hint is float and not math.isfinite(value):
        return None, f"{name} must be a finite number, got {value!r}"
    check, what = LIMITS.get(name, (None, None))
    if check is not None and not check(value):
        return None, f"{name} must be {what}, got {value!r}"
    return value, None


def _sources_problems(sources: dict) -> list[str]:
    from .regenerate import TRAINING_SOURCES  # here: regenerate imports this module

    problems = [f"data.sources has unknown source {name!r} (known: {', '.join(TRAINING_SOURCES)})"
                for name in sources if name not in TRAINING_SOURCES]
    return problems + [f"data.sources.{name} must be an int >= -1 (-1 = all, 0 = none), got {n!r}"
                       for name, n in sources.items() if not isinstance(n, int) or isinstance(n, bool) or n < -1]


def build_config(raw: dict[str, Any], where: str) -> TrainConfig:
    """The TrainConfig of a parsed TOML dict; every problem in it is raised together, in one error."""
    sections, problems = {}, []
    for name, values in raw.items():
        if name not in SECTIONS:
            problems.append(f"unknown section [{name}]; known: {', '.join(SECTIONS)}")
            continue
        if not isinstance(values, dict):
            problems.append(f"[{name}] must be a table of keys, got {values!r}")
            continue
        cls = SECTIONS[name]
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            problems.append(f"unknown key(s) {', '.join(name + '.' + k for k in unknown)}; [{name}] has "
                            f"{', '.join(known)}")
        fields = {}
        for key in (k for k in values if k in known):
            value, problem = _coerce(cls, name, key, values[key])
            if problem:
                problems.append(problem)
            else:
                fields[key] = value
        if isinstance(fields.get("sources"), dict):
            problems += _sources_problems(fields["sources"])
        sections[name] = cls(**fields)
    cfg = TrainConfig(**sections)
    try:
        check_samples_per_prompt(cfg.data.samples_per_prompt, cfg.data.temperature)
    except ValueError as e:
        problems.append(str(e))
    if problems:
        raise InputError(f"{where}: {'; '.join(problems)}")
    return cfg


def resolve_config_path(path: str) -> str:
    for candidate in (path, os.path.join(CONFIG_DIR, path), os.path.join(CONFIG_DIR, path + ".toml")):
        if os.path.isfile(candidate):
            return candidate
    available = sorted(n[:-5] for n in os.listdir(CONFIG_DIR) if n.endswith(".toml"))
    raise FileNotFoundError(f"no config file {path!r}; available in train/configs: {available}")


def load_config(path: str, overrides: list[str] = ()) -> TrainConfig:
    """Reads a TOML config and applies `section.key=value` overrides (values parsed as JSON, else text).
    Every setting is checked here, before anything runs; all problems come back in one error."""
    path = resolve_config_path(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(path, f"not valid TOML ({e})", "fix the file (see train/configs/*.toml)") from None
    bad_overrides = []
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            bad_overrides.append(f"override {item!r} must look like section.key=value "
                                 "(e.g. optim.total_steps=500)")
            continue
        dotted, value = item.split("=", 1)
        section, key = dotted.split(".", 1)
        table = raw.setdefault(section, {})
        if isinstance(table, dict):
            table[key] = value
    try:
        cfg = build_config(raw, where=path)
    except InputError as e:
        if not bad_overrides:
            raise
        raise InputError(f"{e}; {'; '.join(bad_overrides)}") from None
    if bad_overrides:
        raise InputError(f"{path}: {'; '.join(bad_overrides)}")
    return cfg


def check_samples_per_prompt(samples_per_prompt: int, temperature: float) -> None:
    """Shared by config loading (fails before the target loads) and regenerate()."""
    if samples_per_prompt < 1:
        raise ValueError(f"data.samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if samples_per_prompt > 1 and temperature == 0:
        raise ValueError(f"data.samples_per_prompt={samples_per_prompt} needs a temperature > 0 (set "
                         f"data.temperature > 0): greedy decoding gives the same answer every time")
