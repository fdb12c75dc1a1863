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
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
DEFAULT_DATA_DIR = os.path.normpath(os.path.join(REPO_ROOT, "..", "shared", "data"))


def _all_sources() -> dict:
    from .mixture import SOURCES

    return {name: -1 for name in SOURCES}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    data_dir: str = DEFAULT_DATA_DIR
    # prompts per training source (0 = none, -1 = all; train/mixture.py lists them); eval splits and the
    # held-out slice are never read for training
    sources: dict = dataclasses.field(default_factory=_all_sources)
    # training draws a source's answers at weight x its share of the data (1 = as regenerated, 0 = never);
    # a key is a source or a kind (math, code, chat, instruction, long_context, translation, stem_qa)
    mixture: dict = dataclasses.field(default_factory=dict)
    regen_dir: str = "runs/regen"
    # one answer per listed temperature for every prompt (0 = greedy), each seeded by prompt and number
    answer_temperatures: list = dataclasses.field(default_factory=lambda: [0.0])
    top_p: float = 1.0
    # > 0: training prompts' sampled answers are the n-th fresh draw (a campaign's segment n sees new samples);
    # held-out prompts keep the first draw, so held-out numbers compare across corpora. Greedy answers are
    # the same in every draw.
    resample: int = 0
    # < 1: the corpus answers this share of the training prompts, chosen afresh for each draw by a hash of the
    # prompt and the draw number (every held-out prompt stays), where a lease has no time for them all
    regen_fraction: float = 1.0
    # training starts this many steps into the stream: a campaign segment on a corpus earlier segments trained
    # on goes on where they stopped instead of repeating their batches
    start_step: int = 0
    # a file of pinned held-out answers (train/heldout.py) to measure on instead of the corpus's own, so
    # held-out numbers compare across corpora (a campaign pins its first corpus's); "" = the corpus's
    heldout_answers: str = ""
    max_prompt_tokens: int = 4096  # longer prompts are skipped (counted in the manifest)
    max_new_tokens: int = 512  # every answer may run this long
    max_answer_tokens: int = 512  # an unfinished answer goes on up to this where its slot's cache rows allow
    regen_batch_size: int = 256  # sequences decoding at once (fewer for long prompts: regen_cache_gib)
    regen_cache_gib: float = 16.0  # the decoding sequences' KV cache, GiB: long prompts get fewer slots
    regen_chunk_steps: int = 16  # decode steps per device call; finished rows are refilled between calls
    regen_share_prompts: bool = True  # a prompt's answers read one copy of its cache rows (False: one each)
    regen_shard_answers: int = 4096  # answers per shard file
    regen_max_minutes: float = 0.0  # > 0: stop regenerating cleanly after this long (resume later)
    # Training rows: an answer (prompt + completion, whole) is padded to the smallest of these lengths
    # that holds it; one batch holds rows of one length. Beyond the largest, the prompt's start is cut
    # (train/data.py, fit_to_row). [640] is the shipped heads' fixed layout.
    length_buckets: list = dataclasses.field(default_factory=lambda: [512, 1024, 2048, 4608])
    # anchors per row = round(this x bucket length / 1000): every step draws about the same number of
    # anchors (this x optim.tokens_per_batch / 1000), whichever bucket it is (75 = 48 per 640-token row)
    anchors_per_1k_tokens: float = 75.0


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    num_layers: int = 2
    block_size: int = 16
    num_taps: int = 5
    # causal (JetSpec) | bidirectional (DFlash/DDTree); or a list of both, ["causal", "bidirectional"]: one
    # process trains a head of each kind on the same batches, the frozen teacher computed once per step,
    # each head with its own optimizer (head.init_from and run.export_head then list one entry per head)
    attention: str | list = "causal"
    intermediate_size: int = 0  # 0: the target's
    # warm start: an exported head directory (run.export_head of an earlier run) of this shape, for this
    # target, whose weights the run starts from (a fresh optimizer); "" = random init. A resumed run
    # continues from its checkpoint instead.
    init_from: str | list = ""


# A head's name in metrics, checkpoints and summaries, by its attention (the decoding method it serves).
HEAD_NAMES = {"causal": "jetspec", "bidirectional": "ddtree"}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    kind: str = "fkl"  # fkl | ce | rkl
    temperature: float = 1.0  # T_KD
    gamma: float = 0.0  # per-depth decay exp(-(k-1)/gamma); 0 = uniform
    # > 0: a causal head also learns jetspec-tc's tree-causal pass, each depth conditioned on the real tokens
    # before it (draft_head.training_tree_logits): loss = block loss + this x that pass's loss. Bidirectional
    # heads have no such pass and train without it.
    tree_causal_weight: float = 0.0

    def for_attention(self, attention: str) -> "LossConfig":
        """The loss a head of that attention trains with (a bidirectional head has no tree-causal pass)."""
        return self if attention == "causal" else dataclasses.replace(self, tree_causal_weight=0.0)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 2000
    weight_decay: float = 0.01
    clip_norm: float = 1.0
    # tokens per step over all devices, pad included: a batch of bucket length L has tokens_per_batch // L
    # rows, which must split evenly over the data-parallel devices
    tokens_per_batch: int = 16384
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
    eval_answers_per_kind: int = 64  # held-out answers measured per kind of prompt (0: no held-out eval)
    log_every: int = 10
    mesh_model: int = 1  # devices along the parameter-sharding axis; the rest is data parallel
    # where to write the final head (draft_config.json + head.safetensors, or shards); one per head
    # for a list of head.attention kinds ("" = not exported)
    export_head: str | list = ""
    max_minutes: float = 0.0  # > 0: stop cleanly (checkpoint + export) after this much training time
    max_steps: int = 0  # > 0: stop cleanly at this step, the schedule still planned over total_steps
    # the heads' context attention in training: "auto" (the prefix-attention kernels on GPU, XLA's dense
    # scores over anchor chunks elsewhere), "xla", "pallas"; the same arithmetic, so not in the fingerprint
    attention: str = "auto"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: DataConfig = DataConfig()
    head: HeadConfig = HeadConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    run: RunConfig = RunConfig()

    def fingerprint(self) -> str:
        """Hash of the training settings that shape the model, its starting weights and the data order (not
        the data's paths, the held-out answers measured on, nor how the corpus was produced: checkpoints
        record the corpus itself, `corpus_fingerprint` in trainer.py)."""
        shape = {k: v for k, v in dataclasses.asdict(self).items() if k != "run"}
        if not self.head.init_from:  # runs from random weights keep the fingerprint they had before it existed
            del shape["head"]["init_from"]
        if not self.loss.tree_causal_weight:  # likewise runs without the tree-causal loss
            del shape["loss"]["tree_causal_weight"]
        shape["data"] = {k: v for k, v in shape["data"].items()
                         if k not in ("data_dir", "regen_dir", "heldout_answers") and not k.startswith("regen_")}
        if not self.data.resample:  # and runs on a first draw
            del shape["data"]["resample"]
        if not self.data.start_step:  # and runs from the stream's start
            del shape["data"]["start_step"]
        shape["seed"] = self.run.seed
        shape["compute_dtype"] = self.run.compute_dtype
        return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_pair(self) -> bool:
        """head.attention lists several kinds: one head of each, trained together on the same batches."""
        return isinstance(self.head.attention, list)

    def single_heads(self) -> dict[str, "TrainConfig"]:
        """Each head's name (HEAD_NAMES) and the config that trains it alone: this config, or for a list of
        head.attention kinds, this one with that head's attention, head.init_from, run.export_head and loss."""
        if not self.is_pair:
            return {HEAD_NAMES[self.head.attention]: self}
        n = len(self.head.attention)
        init_from, export_head = self.head.init_from or [""] * n, self.run.export_head or [""] * n
        return {HEAD_NAMES[attention]: dataclasses.replace(
                    self, head=dataclasses.replace(self.head, attention=attention, init_from=init),
                    loss=self.loss.for_attention(attention),
                    run=dataclasses.replace(self.run, export_head=export))
                for attention, init, export in zip(self.head.attention, init_from, export_head)}

    def buckets(self) -> tuple["Bucket", ...]:
        """The training rows' shapes, one per `data.length_buckets` entry."""
        return tuple(Bucket(length, self.optim.tokens_per_batch // length,
                            max(1, round(self.data.anchors_per_1k_tokens * length / 1000)))
                     for length in self.data.length_buckets)


class Bucket(typing.NamedTuple):
    length: int  # tokens per row, pad included
    rows: int  # rows per batch over all devices: optim.tokens_per_batch // length
    anchors: int  # anchors per row: data.anchors_per_1k_tokens x length / 1000, rounded


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
    "data.max_new_tokens": _at_least(1), "data.max_answer_tokens": _at_least(1),
    "data.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "data.regen_cache_gib": _POSITIVE,
    "data.regen_batch_size": _at_least(1), "data.max_prompt_tokens": _at_least(1),
    "data.regen_chunk_steps": _at_least(1), "data.regen_shard_answers": _at_least(1),
    "data.regen_max_minutes": _at_least(0),
    "data.anchors_per_1k_tokens": _POSITIVE, "data.resample": _at_least(0),
    "data.regen_fraction": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "data.start_step": _at_least(0), "data.regen_dir": _NOT_EMPTY,
    "head.num_layers": _at_least(1), "head.block_size": _at_least(2), "head.num_taps": _at_least(1),
    "head.attention": _one_of("causal", "bidirectional"), "head.intermediate_size": _at_least(0),
    "loss.kind": _one_of("fkl", "ce", "rkl"), "loss.temperature": _POSITIVE, "loss.gamma": _at_least(0),
    "loss.tree_causal_weight": _at_least(0),
    "optim.learning_rate": _POSITIVE, "optim.warmup_steps": _at_least(0), "optim.total_steps": _at_least(1),
    "optim.weight_decay": _at_least(0), "optim.clip_norm": _POSITIVE, "optim.tokens_per_batch": _at_least(2),
    "optim.b1": _FRACTION, "optim.b2": _FRACTION,
    "run.name": _NOT_EMPTY, "run.out_dir": _NOT_EMPTY, "run.compute_dtype": _one_of("float32", "bfloat16"),
    "run.checkpoint_every": _at_least(1), "run.keep_checkpoints": _at_least(1), "run.eval_every": _at_least(1),
    "run.eval_answers_per_kind": _at_least(0), "run.log_every": _at_least(1), "run.mesh_model": _at_least(1),
    "run.max_minutes": _at_least(0), "run.max_steps": _at_least(0),
    "run.attention": _one_of("auto", "xla", "pallas"),
}


def _coerce(cls, section: str, key: str, value: Any) -> tuple[Any, str | None]:
    """(value as the field's type, None) or (None, what is wrong with it)."""
    hint = typing.get_type_hints(cls)[key]
    name = f"{section}.{key}"
    if hint == str | list:
        return _coerce_text_or_list(name, value)
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


def _coerce_text_or_list(name: str, value: Any) -> tuple[Any, str | None]:
    """A text setting that may list one entry per head instead: an override starting with "[" is JSON."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None, f"{name}={value!r} is not a valid JSON list"
    if not (isinstance(value, str) or isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None, f"{name} must be a string or a list of strings (one per head), got {value!r}"
    check, what = LIMITS.get(name, (None, None))
    bad = [v for v in ([value] if isinstance(value, str) else value) if check is not None and not check(v)]
    if bad:
        return None, f"{name} {'entries ' if isinstance(value, list) else ''}must be {what}, got {bad[0]!r}"
    return value, None


def _head_problems(cfg: TrainConfig) -> list[str]:
    """A list of head.attention kinds (several heads) and the per-head lists that go with it."""
    attention = cfg.head.attention
    per_head = {"head.init_from": cfg.head.init_from, "run.export_head": cfg.run.export_head}
    if not isinstance(attention, list):
        problems = [] if attention == "causal" or not cfg.loss.tree_causal_weight else [
            f"loss.tree_causal_weight={cfg.loss.tree_causal_weight} trains a causal head's tree-causal pass "
            f"(jetspec-tc), which head.attention={attention!r} has none of: set it to 0, or train a causal head"]
        return problems + [f"{name}={value!r} is a list, but head.attention={attention!r} names one head: give "
                           f"one directory (a list goes with a list of head.attention kinds)"
                           for name, value in per_head.items() if isinstance(value, list)]
    kinds = ", ".join(HEAD_NAMES)
    if len(attention) < 2:
        return [f"head.attention={attention!r} lists {len(attention)} kind(s): a list trains several heads, "
                f"one per kind ({kinds}); write a single kind as a string for one head"]
    problems = [f"head.attention lists {kind!r} {attention.count(kind)} times: a list trains one head of each kind"
                for kind in sorted(set(attention)) if attention.count(kind) > 1]
    for name, value in per_head.items():
        if isinstance(value, str) and value:
            example = json.dumps([f"{value}-{HEAD_NAMES.get(a, a)}" for a in attention])
            problems.append(f"{name}={value!r} must list one directory per head.attention entry ({attention!r}; "
                            f"\"\" for none), e.g. {example}")
        elif isinstance(value, list) and value and len(value) != len(attention):
            problems.append(f"{name} lists {len(value)} entries for the {len(attention)} heads of head.attention="
                            f"{attention!r}: one per head, in the same order (\"\" for none)")
    exports = [e for e in cfg.run.export_head if e] if isinstance(cfg.run.export_head, list) else []
    if len(set(map(os.path.normpath, exports))) < len(exports):
        problems.append(f"run.export_head={cfg.run.export_head!r} names a directory twice: each head needs its own")
    return problems


# Training settings that length buckets replaced: a config or override naming one is told what took its place.
REPLACED = {
    "data.seq_len": "data.length_buckets, a list of row lengths ([640] is the old fixed layout)",
    "data.anchors_per_seq": "data.anchors_per_1k_tokens (48 anchors per 640-token row is 75)",
    "optim.batch_size": "optim.tokens_per_batch, rows x row length (32 rows of 640 tokens is 20480)",
    "run.eval_sequences": "run.eval_answers_per_kind",
}


def _layout_problems(cfg: TrainConfig) -> list[str]:
    """Length buckets, token budget and anchors fit together (devices are checked by check_data_parallel)."""
    buckets = cfg.data.length_buckets
    if not buckets or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in buckets) or any(
            a >= b for a, b in zip(buckets, buckets[1:])):
        return [f"data.length_buckets must be a non-empty list of increasing row lengths >= 2 (e.g. "
                f"[512, 1024, 2048, 4608]), got {buckets!r}"]
    problems = []
    if cfg.optim.tokens_per_batch < buckets[-1]:
        problems.append(f"optim.tokens_per_batch={cfg.optim.tokens_per_batch} holds no row of the largest bucket "
                        f"({buckets[-1]} tokens); raise it to at least {buckets[-1]} (a multiple of {buckets[-1]} "
                        "x the data-parallel devices keeps every bucket's rows splitting evenly)")
    too_many = [f"{b.anchors} in {b.length}" for b in cfg.buckets() if b.anchors >= b.length]
    if too_many:
        problems.append(f"data.anchors_per_1k_tokens={cfg.data.anchors_per_1k_tokens} asks for more anchors per "
                        f"row than the row has positions ({', '.join(too_many)}); lower it")
    return problems


def check_data_parallel(cfg: TrainConfig, data_parallel: int, processes: int = 1) -> None:
    """Every bucket's rows split evenly over the data-parallel devices and the processes feeding them;
    else one InputError naming a `optim.tokens_per_batch` that works."""
    split = math.lcm(data_parallel, processes)
    buckets = cfg.buckets()
    if all(b.rows % split == 0 for b in buckets):
        return
    rows = ", ".join(f"{b.rows} rows of {b.length}" for b in buckets)
    raise InputError(
        f"optim.tokens_per_batch={cfg.optim.tokens_per_batch} gives {rows} tokens; every bucket's rows must "
        f"split evenly over the {data_parallel} data-parallel devices and {processes} processes: use "
        f"optim.tokens_per_batch={even_tokens_per_batch(cfg.data.length_buckets, cfg.optim.tokens_per_batch, split)}"
        f", or length buckets that divide tokens_per_batch / {split}")


def even_tokens_per_batch(lengths: list[int], tokens: int, split: int) -> int:
    """The smallest budget >= tokens whose rows (budget // length) are multiples of `split` for every length.
    It is `tokens` itself or the start of one bucket's run of good budgets (a multiple of split x length)."""
    def good(t):
        return all((t // n) % split == 0 and t >= n for n in lengths)

    lcm_budget = split * math.lcm(*lengths) * max(1, math.ceil(tokens / (split * math.lcm(*lengths))))
    candidates = {tokens} | {m * split * n for n in lengths
                             for m in range(max(1, tokens // (split * n)), tokens // (split * n) + 10_000)}
    return min([t for t in candidates if t >= tokens and good(t)] + [lcm_budget])


def _data_problems(fields: dict) -> list[str]:
    from .mixture import KINDS, SOURCES

    problems = []
    sources = fields.get("sources", {})
    if isinstance(sources, dict):
        problems += [f"data.sources has unknown source {name!r} (known: {', '.join(SOURCES)})"
                     for name in sources if name not in SOURCES]
        problems += [f"data.sources.{name} must be an int >= -1 (-1 = all, 0 = none), got {n!r}"
                     for name, n in sources.items() if not isinstance(n, int) or isinstance(n, bool) or n < -1]
    mixture = fields.get("mixture", {})
    if isinstance(mixture, dict):
        problems += [f"data.mixture has unknown key {name!r} (a source: {', '.join(SOURCES)}; or a kind: "
                     f"{', '.join(KINDS)})" for name in mixture if name not in SOURCES and name not in KINDS]
        problems += [f"data.mixture.{name} must be a number >= 0, got {w!r}" for name, w in mixture.items()
                     if isinstance(w, bool) or not isinstance(w, (int, float)) or not w >= 0]
    temperatures = fields.get("answer_temperatures", [0.0])
    if isinstance(temperatures, list) and (not temperatures or any(
            isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < math.inf for t in temperatures)):
        problems.append(f"data.answer_temperatures must be a non-empty list of numbers >= 0 (one answer per "
                        f"temperature, 0 = greedy), got {temperatures!r}")
    if isinstance(temperatures, list) and sum(t == 0 for t in temperatures) > 1:
        problems.append("data.answer_temperatures lists 0 (greedy) more than once: greedy answers are all alike")
    return problems


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
        replaced = sorted(k for k in set(values) - set(known) if f"{name}.{k}" in REPLACED)
        problems += [f"{name}.{k} was replaced by {REPLACED[name + '.' + k]}" for k in replaced]
        unknown = sorted(set(values) - set(known) - set(replaced))
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
        if name == "data":
            problems += _data_problems(fields)
        sections[name] = cls(**fields)
    cfg = TrainConfig(**sections)
    if not any(p.startswith(("data.length_buckets", "optim.tokens_per_batch", "data.anchors_per_1k_tokens"))
               for p in problems):
        problems += _layout_problems(cfg)
    if not any(p.startswith(("head.attention", "head.init_from", "run.export_head")) for p in problems):
        problems += _head_problems(cfg)
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
        # a bad value may come from the file or from an override: name both places
        cfg = build_config(raw, where=f"{path} with {' '.join(overrides)}" if overrides else path)
    except InputError as e:
        if not bad_overrides:
            raise
        raise InputError(f"{e}; {'; '.join(bad_overrides)}") from None
    if bad_overrides:
        raise InputError(f"{path}: {'; '.join(bad_overrides)}")
    return cfg
