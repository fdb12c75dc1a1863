"""Results files: one JSON line per (benchmark, id, method, budget, temperature), appended and flushed
as runs finish, plus a `<results>.meta.json` sidecar holding the settings (one batch size per file),
commands and environment."""

from __future__ import annotations

import gzip
import json
import logging
import os
import shlex
from typing import Iterable

from jetspec_jax.errors import DamagedFileError
from jetspec_jax.provenance import environment, write_json_atomic

log = logging.getLogger(__name__)

KEY_FIELDS = ("benchmark", "id", "method", "budget", "temperature")
SHIPPED_HEADS = "shipped"  # the head-set label of the heads packaged with jetspec_jax


def line_key(line: dict) -> tuple:
    return tuple(line[k] for k in KEY_FIELDS)


def is_packaged_head(name: str) -> bool:
    """Whether a line's `head` is a head shipped in the package (jetspec_jax/heads/NAME, on any machine)."""
    return os.path.normpath(name).split(os.sep)[-3:-1] == ["jetspec_jax", "heads"]


def heads_label(head_names: Iterable[str]) -> str:
    """The default name of a run's head set (`--heads-label`): the names of its head directories other
    than the packaged ones ("untrained" for a random head), sorted and joined by "+"; "shipped" when
    every head is a packaged one (or the run used none: AR alone)."""
    names = {os.path.basename(os.path.normpath(n)) for n in head_names if not is_packaged_head(n)}
    return "+".join(sorted(names)) or SHIPPED_HEADS


def label_heads(lines: list[dict]) -> list[dict]:
    """The lines of one results file, each with its `heads_label`; lines written before the label was
    recorded get the one their run would get now, from the file's head directories."""
    unlabelled = [line for line in lines if not line.get("heads_label")]
    if not unlabelled:
        return lines
    label = heads_label(line["head"] for line in unlabelled if line.get("head"))
    return [line if line.get("heads_label") else {**line, "heads_label": label} for line in lines]


def meta_path(results_path: str) -> str:
    return results_path + ".meta.json"


def read_lines(path: str) -> list[dict]:
    """Every complete JSON line of a results file, plain or gzipped (archived runs); a torn last line
    from a crash is skipped."""
    if not os.path.isfile(path):
        return []
    lines = []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                log.warning("%s:%d is not a complete JSON line; ignored", path, number)
    return lines


def drop_torn_tail(path: str) -> None:
    """Cuts a partial last line (a crash mid-write) so the next append starts on a fresh line."""
    if not os.path.isfile(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if data.endswith(b"\n"):
            return
        keep = data.rfind(b"\n") + 1
        log.warning("%s ends in a partial line (%d bytes); removing it", path, len(data) - keep)
        f.truncate(keep)


class ResultsWriter:
    """Appends lines, flushed one by one, so an interrupted run keeps everything it finished."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        drop_torn_tail(path)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, line: dict) -> None:
        self.file.write(json.dumps(line, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_meta(results_path: str) -> dict | None:
    path = meta_path(results_path)
    if not os.path.isfile(path):
        return None
    fix = f"restore it or write to a new --results file (it records how {results_path} was made)"
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(path, f"not valid JSON ({e})", fix) from None
    if not (isinstance(meta, dict) and isinstance(meta.get("settings"), dict)
            and isinstance(meta.get("heads"), dict) and isinstance(meta.get("runs"), list)):
        raise DamagedFileError(path, "lacks its settings, heads or runs", fix)
    return meta


# settings added after results files existed: an older file ran with these values
SETTINGS_BEFORE_RECORDED = {"tree_temperature": 1.0, "gemm_backend": "xla", "draft_attention": "xla", "batch": 1,
                            "draft_vocab": None}


def check_compatible(results_path: str, settings: dict, heads: dict[str, str | None]) -> None:
    """Raises if the file was made with other settings or another head for a role, since new lines
    would not be comparable with its old ones (a later run may add heads for new roles)."""
    meta = read_meta(results_path)
    if meta is None:
        return
    recorded = {**SETTINGS_BEFORE_RECORDED, **meta["settings"]}
    if "heads_label" not in recorded:  # a file from before the label: the one `report` gives its lines
        lines = label_heads(read_lines(results_path))
        recorded["heads_label"] = lines[0]["heads_label"] if lines else settings.get("heads_label")
    changed = sorted(k for k in set(recorded) | set(settings) if recorded.get(k) != settings.get(k))
    changed += [f"{role} head" for role, sha in heads.items() if meta["heads"].get(role, sha) != sha]
    if "batch" in changed:  # a batched run pointed at a batch-1 file (or back): say why and what to do
        others = [k for k in changed if k != "batch"]
        raise ValueError(f"{results_path} holds --batch {recorded['batch']} runs and this run is --batch "
                         f"{settings.get('batch')}" + (f" (and other settings differ: {', '.join(others)})"
                                                        if others else "")
                         + ": a results file keeps one batch size, since the timings of two are not comparable; "
                         "write this run to a new --results file (report takes both and keeps the batch sizes "
                         "apart)")
    if changed:
        raise ValueError(f"{results_path} was made with different settings ({', '.join(changed)}); "
                         "resume with the same ones or write to a new --results file")


def record_run(results_path: str, settings: dict, heads: dict[str, str | None],
               command: Iterable[str]) -> int:
    """Adds this run (command, environment, time) to the sidecar; returns the run's index."""
    check_compatible(results_path, settings, heads)
    meta = read_meta(results_path) or {"settings": settings, "heads": {}, "runs": []}
    meta["heads"].update(heads)
    meta["runs"].append({"command": shlex.join(command), "environment": environment()})
    write_json_atomic(meta_path(results_path), meta)
    return len(meta["runs"]) - 1
