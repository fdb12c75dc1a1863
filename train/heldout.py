"""Pinned held-out answers: the held-out completions every segment of a campaign measures on, kept in one
file, so held-out numbers compare across corpora. Each corpus regenerates the held-out prompts' answers, and
one decoded with another batch layout or on another GPU parts from the last at bf16 near-ties; the file
keeps the completions (the target's own tokens) and reads the prompts from the corpus at hand.
"""

from __future__ import annotations

import collections
import hashlib
import io
import os
import zipfile

import numpy as np

from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.provenance import write_bytes_atomic

FORMAT = "jetspec-heldout-v1"
REPIN = "delete it to pin the next corpus's (the learning curve then starts a new held-out set)"


def answer_key(record: dict) -> str:
    return hashlib.sha256(f"{record['source']}:{record['id']}:{record['sample']}".encode()).hexdigest()


def pick_heldout(answers, per_kind: int) -> list[dict]:
    """Up to `per_kind` answers of every kind, in kind order: a stable pick by hash of source, id and sample,
    so it survives a corpus growing."""
    by_kind: dict[str, list[tuple[str, dict]]] = collections.defaultdict(list)
    for i in range(len(answers)):
        record = answers[i]
        by_kind[record["kind"]].append((answer_key(record), record))
    return [r for kind in sorted(by_kind) for _, r in sorted(by_kind[kind], key=lambda x: x[0])[:per_kind]]


def prompt_digest(prompt_ids) -> str:
    return hashlib.sha256(np.asarray(prompt_ids, np.int32).tobytes()).hexdigest()[:16]


def target_fingerprint(corpus) -> str | None:
    return corpus.manifest.get("settings", {}).get("target_fingerprint")


def write_pinned(path: str, corpus, per_kind: int) -> str:
    """Pins the corpus's held-out pick (`per_kind` answers a kind) at `path`; returns the file's sha256."""
    records = pick_heldout(corpus.answers("heldout"), per_kind)
    if not records:
        raise InputError(f"the corpus in {corpus.out_dir} has no held-out answers to pin")
    completions = [np.asarray(r["completion_ids"]) for r in records]  # the corpus's token dtype
    buffer = io.BytesIO()
    np.savez_compressed(
        buffer, format=np.asarray(FORMAT), target_fingerprint=np.asarray(target_fingerprint(corpus) or ""),
        source=np.asarray([r["source"] for r in records]), id=np.asarray([str(r["id"]) for r in records]),
        kind=np.asarray([r["kind"] for r in records]), sample=np.asarray([r["sample"] for r in records], np.int32),
        finished=np.asarray([r["finished"] for r in records], bool),
        prompt_digest=np.asarray([prompt_digest(r["prompt_ids"]) for r in records]),
        offsets=np.cumsum([0] + [len(c) for c in completions]).astype(np.int64),
        tokens=np.concatenate(completions))
    data = buffer.getvalue()
    write_bytes_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def read_pinned(path: str, corpus) -> list[dict]:
    """The pinned answers as corpus records: completions from the file, prompts from `corpus`, which must
    hold every pinned prompt unchanged and come from the same target."""
    if not os.path.exists(path):
        raise InputError(f"data.heldout_answers: no file at {path} (a campaign writes it from its first "
                         "corpus; leave the setting empty to measure on the corpus's own held-out answers)")
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        fmt = str(arrays["format"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DamagedFileError(path, f"not a pinned held-out file ({e})", REPIN) from None
    if fmt != FORMAT:
        raise DamagedFileError(path, f"format {fmt!r}, expected {FORMAT!r}", REPIN)
    pinned_target, corpus_target = str(arrays["target_fingerprint"]), target_fingerprint(corpus) or ""
    if pinned_target != corpus_target:
        raise InputError(f"{path} holds answers of another target ({pinned_target}) than the corpus's "
                         f"({corpus_target}): held-out numbers of two targets do not compare; give a campaign per "
                         "target")
    prompt_of = {(p["source"], str(p["id"])): i for i, p in enumerate(corpus.prompts)}
    records, missing, changed = [], {}, {}  # dicts: each prompt once, in order
    offsets, tokens = arrays["offsets"], arrays["tokens"]
    for i, (source, id_) in enumerate(zip(arrays["source"].tolist(), arrays["id"].tolist())):
        p = prompt_of.get((source, id_))
        if p is None:
            missing[f"{source}:{id_}"] = None
            continue
        prompt_ids = corpus.prompt_ids(p)
        if prompt_digest(prompt_ids) != str(arrays["prompt_digest"][i]):
            changed[f"{source}:{id_}"] = None
            continue
        records.append({"source": source, "id": corpus.prompts[p]["id"], "kind": str(arrays["kind"][i]),
                        "sample": int(arrays["sample"][i]), "prompt_ids": prompt_ids,
                        "completion_ids": tokens[offsets[i]:offsets[i + 1]], "finished": bool(arrays["finished"][i])})
    problems = [f"{len(names)} pinned prompts {what} (e.g. {', '.join(list(names)[:3])})"
                for names, what in ((missing, "are not in the corpus"), (changed, "tokenize differently now")) if names]
    if problems:
        raise InputError(f"{path}: " + "; ".join(problems) + f": regenerate with the data and tokenizer the file "
                         f"was pinned from, or {REPIN}")
    return records
