"""Trained draft heads as portable files: `draft_config.json` + `head.safetensors` in one directory, or
`head-00001-of-0000N.safetensors` ... shards where the weights outgrow MAX_SHARD_BYTES.
(Training checkpoints with optimizer state are orbax's business; this is the inference export.)

`draft_config.json` holds the head's shape (DraftConfig), the fingerprint and name of the target it was
trained for, and the sha256 of the weights file (of each shard), so a damaged file or a head paired with
another model is refused with a message instead of decoding with wrong weights."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import tempfile
import typing
from typing import Any

import jax
import numpy as np

from jetspec_jax import draft_vocab as draft_vocab_lib
from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.loading.assemble import CheckpointMismatch, Rule, assemble_params
from jetspec_jax.loading.hf_dir import iter_safetensors
from jetspec_jax.models import draft_head
from jetspec_jax.models.params import flatten_specs, path_to_str
from jetspec_jax.provenance import file_sha256

CONFIG_FILE = "draft_config.json"
WEIGHTS_FILE = "head.safetensors"
# The repository takes no file over 16 MiB, and shipped heads live in it: larger weights are split.
MAX_SHARD_BYTES = 15 * 2**20
# Keys of draft_config.json beside DraftConfig's fields; heads exported before they existed lack them.
RECORD_KEYS = ("target_fingerprint", "target_name", "weights_sha256")
# A sharded head lists its files in order, [{"file": ..., "sha256": ...}], instead of weights_sha256.
SHARDS_KEY = "weights_shards"
TRAIN_HINT = ("train one with: python -m jetspec_jax.train --config train/configs/smollm2-135m-jetspec.toml "
              "run.target=YOUR_MODEL (see docs/training.md)")


@dataclasses.dataclass(frozen=True)
class HeadRecord:
    """What a head directory says about itself, read and checked without loading the weights."""
    path: str
    cfg: draft_head.DraftConfig
    target_fingerprint: str | None
    target_name: str | None
    weights_sha256: str | None
    weights_shards: tuple[tuple[str, str], ...] = ()  # (file name, sha256) of each shard, in order

    @property
    def weight_files(self) -> tuple[tuple[str, str | None], ...]:
        """(path, recorded sha256 or None) of each weights file: head.safetensors, or the shards."""
        if self.weights_shards:
            return tuple((os.path.join(self.path, name), sha) for name, sha in self.weights_shards)
        return ((os.path.join(self.path, WEIGHTS_FILE), self.weights_sha256),)

    def weights_digest(self) -> str:
        """The weights' identity: head.safetensors' sha256 (hashed here if not recorded), or for a sharded
        head the sha256 of its shards' sha256s in order."""
        if self.weights_shards:
            return hashlib.sha256(json.dumps([sha for _, sha in self.weights_shards]).encode()).hexdigest()
        return self.weights_sha256 or file_sha256(self.weight_files[0][0])


def shard_file_name(index: int, count: int) -> str:
    return f"head-{index:05d}-of-{count:05d}.safetensors"


def config_to_json(cfg: draft_head.DraftConfig) -> dict[str, Any]:
    out = dataclasses.asdict(cfg)
    out["tap_layers"] = list(cfg.tap_layers)
    if not isinstance(cfg.attention, str):
        out["attention"] = [list(row) for row in cfg.attention]
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_problem(name: str, annotation: Any, value: Any) -> str | None:
    """Why `value` does not fit the DraftConfig field `name`, or None."""
    if name == "tap_layers":
        ok = isinstance(value, list) and value and all(_is_int(t) and t >= 0 for t in value)
        return None if ok else "a non-empty list of layer numbers (integers >= 0)"
    if name == "attention":
        mask_ok = (isinstance(value, list) and value
                   and all(isinstance(r, list) and all(isinstance(x, bool) for x in r) for r in value))
        return None if isinstance(value, str) or mask_ok else \
            f"one of {draft_head.ATTENTION_PATTERNS} or a block x block list of true/false rows"
    if name == "mask_token_id":
        return None if value is None or (_is_int(value) and value >= 0) else "null or a token id >= 0"
    if annotation is int:
        return None if _is_int(value) and value > 0 else "a positive integer"
    if annotation is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
        return None if ok else "a positive number"
    return None


def _shards_problem(value: Any) -> str | None:
    """Why `value` is not a weights_shards list, or None."""
    entries_ok = isinstance(value, list) and value and all(
        isinstance(e, dict) and set(e) == {"file", "sha256"} and all(isinstance(v, str) for v in e.values())
        for e in value)
    if not entries_ok:
        return 'a non-empty list of {"file": name, "sha256": hex digest} objects'
    names = [shard_file_name(i, len(value)) for i in range(1, len(value) + 1)]
    return None if [e["file"] for e in value] == names else f"the files {names} in this order"


def config_from_json(data: Any, source: str = CONFIG_FILE) -> draft_head.DraftConfig:
    """DraftConfig from draft_config.json's content; every missing, unknown or ill-typed key is named."""
    fix = "re-export the head (python -m jetspec_jax.train ... run.export_head=DIR) or restore the file"
    if not isinstance(data, dict):
        raise DamagedFileError(source, f"expected a JSON object, found {type(data).__name__}", fix)
    hints = typing.get_type_hints(draft_head.DraftConfig)
    fields = [f.name for f in dataclasses.fields(draft_head.DraftConfig)]
    problems = [f"missing key {name!r}" for name in fields if name not in data]
    problems += [f"unknown key {key!r}" for key in data
                 if key not in fields and key not in RECORD_KEYS and key != SHARDS_KEY]
    for name in fields:
        if name in data and (want := _type_problem(name, hints[name], data[name])):
            problems.append(f"{name!r} is {json.dumps(data[name])}, expected {want}")
    for key in RECORD_KEYS:
        if key in data and not isinstance(data[key], str):
            problems.append(f"{key!r} is {json.dumps(data[key])}, expected a string")
    if SHARDS_KEY in data and (want := _shards_problem(data[SHARDS_KEY])):
        problems.append(f"{SHARDS_KEY!r} is {json.dumps(data[SHARDS_KEY])}, expected {want}")
    if SHARDS_KEY in data and "weights_sha256" in data:
        problems.append(f"both 'weights_sha256' and {SHARDS_KEY!r}: a head has one weights file or shards")
    if problems:
        raise DamagedFileError(source, "; ".join(problems), fix)
    values = {name: data[name] for name in fields}
    values["tap_layers"] = tuple(values["tap_layers"])
    if not isinstance(values["attention"], str):
        values["attention"] = tuple(tuple(row) for row in values["attention"])
    try:
        return draft_head.DraftConfig(**values)
    except ValueError as e:
        raise DamagedFileError(source, str(e), fix) from None


def read_head_record(path: str) -> HeadRecord:
    config_path = os.path.join(path, CONFIG_FILE)
    no_head = f"no draft head at {path} (expected {CONFIG_FILE} and {WEIGHTS_FILE} or its shards)"
    if not os.path.isfile(config_path):
        raise FileNotFoundError(no_head)
    try:
        with open(config_path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(config_path, f"not valid JSON ({e})",
                               "restore the file or re-export the head") from None
    cfg = config_from_json(data, config_path)
    shards = tuple((e["file"], e["sha256"]) for e in data.get(SHARDS_KEY, ()))
    record = HeadRecord(path, cfg, *(data.get(key) for key in RECORD_KEYS), shards)
    missing = [file for file, _ in record.weight_files if not os.path.isfile(file)]
    if missing and not shards:
        raise FileNotFoundError(no_head)
    if missing:
        raise DamagedFileError(missing[0], f"missing ({CONFIG_FILE} lists {len(shards)} weight shards; "
                               f"missing: {', '.join(os.path.basename(m) for m in missing)})", WEIGHTS_FIX)
    return record


def check_head_target(record: HeadRecord, target) -> None:
    """Refuses a head trained for another model (`target`: a Target or a TargetIdentity); a head that
    records no target is left to the shape checks of `load_head`."""
    if record.target_fingerprint is not None and record.target_fingerprint != target.fingerprint:
        raise InputError(
            f"the draft head at {record.path} was trained for target {record.target_name!r} (fingerprint "
            f"{record.target_fingerprint}), but the target is {target.name!r} (fingerprint "
            f"{target.fingerprint}); use a head trained for this model, or {TRAIN_HINT}")


WEIGHTS_FIX = "re-export the head, or reinstall jetspec-jax for a shipped head"


def verify_head_files(path: str) -> HeadRecord:
    """Checks the config and, where it records them, the weights files' sha256, without loading anything."""
    record = read_head_record(path)
    for file, sha in record.weight_files:
        if sha is not None and file_sha256(file) != sha:
            raise DamagedFileError(file, f"its sha256 differs from the one {CONFIG_FILE} records "
                                   "(truncated or corrupt)", WEIGHTS_FIX)
    return record


def load_head_weights(record: HeadRecord, dtype) -> Any:
    """The parameters of a head whose files `verify_head_files` checked."""
    from safetensors import SafetensorError

    specs = draft_head.param_specs(record.cfg)
    rules = [Rule(re.escape(name), name) for name in flatten_specs(specs)]
    files = [file for file, _ in record.weight_files]
    source = files[0] if len(files) == 1 else f"{record.path} ({len(files)} shards)"
    try:
        return assemble_params(specs, iter_safetensors(files, fix=WEIGHTS_FIX), rules, dtype, source=source)
    except (CheckpointMismatch, DamagedFileError):
        raise
    except (SafetensorError, OSError, ValueError) as e:
        raise DamagedFileError(source, f"not a readable safetensors file ({e})", WEIGHTS_FIX) from None


def load_head(path: str, dtype, target=None, draft_vocab: int | None = None) -> tuple[draft_head.DraftConfig, Any]:
    """Reads a head directory; with `target`, first checks that the head was trained for it. With
    `draft_vocab` N (target needed) the head drafts over the N tokens the target's answers use most
    (jetspec_jax/draft_vocab.py)."""
    if draft_vocab is not None and target is None:
        raise ValueError("a draft vocabulary takes its rows from the target's LM head: pass target=")
    record = verify_head_files(path)
    if target is not None:
        check_head_target(record, target)
        draft_head.check_pairing(record.cfg, target.cfg)
    params = load_head_weights(record, dtype)
    if draft_vocab is not None:
        params = draft_vocab_lib.for_head(path, params, target, draft_vocab)
    return record.cfg, params


def plan_shards(flat: dict[str, np.ndarray], metadata: dict[str, str], max_bytes: int) -> list[list[str]]:
    """Tensor names per weights file: greedy in sorted order, whole tensors, each file at most `max_bytes`
    (a tensor larger than that gets a file of its own)."""
    # a safetensors file: 8-byte header length, JSON header (tensor entries + metadata) padded to 8, data
    base = 8 + 7 + len(json.dumps({"__metadata__": metadata}))
    shards, size = [[]], base
    for key in sorted(flat):
        entry = {key: {"dtype": "F8_E4M3", "shape": list(flat[key].shape), "data_offsets": [max_bytes] * 2}}
        need = flat[key].nbytes + len(json.dumps(entry))  # json.dumps' spaces make this an upper bound
        if shards[-1] and size + need > max_bytes:
            shards.append([])
            size = base
        shards[-1].append(key)
        size += need
    return shards


def save_head(path: str, cfg: draft_head.DraftConfig, params: Any, metadata: dict[str, str] | None = None,
              target=None, max_shard_bytes: int = MAX_SHARD_BYTES):
    """Writes atomically (a temporary directory is renamed into place); with `target`, records which
    model the head was trained for. Weights over `max_shard_bytes` are split into shards."""
    from safetensors.numpy import save_file

    parent = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".head-")
    try:
        leaves, _ = jax.tree_util.tree_flatten_with_path(params)
        flat = {path_to_str(p): np.asarray(jax.device_get(v)) for p, v in leaves}
        metadata = metadata or {}
        record = config_to_json(cfg)
        if target is not None:
            record |= {"target_fingerprint": target.fingerprint, "target_name": target.name}
        shards = plan_shards(flat, metadata, max_shard_bytes)
        if len(shards) == 1:  # the layout of every head exported before shards existed
            save_file(flat, os.path.join(tmp, WEIGHTS_FILE), metadata=metadata)
            record["weights_sha256"] = file_sha256(os.path.join(tmp, WEIGHTS_FILE))
        else:
            record[SHARDS_KEY] = []
            for index, keys in enumerate(shards, 1):
                name = shard_file_name(index, len(shards))
                save_file({key: flat[key] for key in keys}, os.path.join(tmp, name), metadata=metadata)
                record[SHARDS_KEY].append({"file": name, "sha256": file_sha256(os.path.join(tmp, name))})
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(record, f, indent=2)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


PACKAGED_HEADS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "heads")
PACKAGED_INDEX = os.path.join(PACKAGED_HEADS_DIR, "heads.json")


def packaged_heads(target) -> dict[str, str]:
    """method -> directory of the heads shipped in this package for `target`, matched by fingerprint."""
    if not os.path.isfile(PACKAGED_INDEX):
        return {}
    with open(PACKAGED_INDEX, encoding="utf-8") as f:
        entry = json.load(f).get(target.fingerprint, {})
    return {method: os.path.join(PACKAGED_HEADS_DIR, name) for method, name in entry.items()
            if method != "target"}


def packaged_head_path(target, method: str) -> str | None:
    """The head shipped for `target` (found by what the model is, not by its file name), if any."""
    return packaged_heads(target).get(method)


def no_head_message(target, method: str) -> str:
    return (f"no trained {method} head exists for target {target.name!r} (fingerprint {target.fingerprint}); "
            + TRAIN_HINT)
