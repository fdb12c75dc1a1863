"""The regenerated corpus on disk: token ids in bounded `.npz` shards (prompts once, answers in
shards as they finish) and a manifest with the settings and provenance. Written atomically piece by
piece, so a run can stop anywhere and resume; read back as a grain-ready random-access source."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
from typing import Any, Sequence

import numpy as np

from jetspec_jax.errors import DamagedFileError
from jetspec_jax.provenance import write_bytes_atomic, write_json_atomic

from .mixture import is_heldout

FORMAT = "jetspec-regenerated-v2"
MANIFEST_FILE = "manifest.json"
PROMPTS_FILE = "prompts.npz"
PROMPT_META_FILE = "prompts.jsonl"
SHARD_PATTERN = "answers-{:05d}.npz"


def regenerate_fix(out_dir: str) -> str:
    return (f"delete {out_dir} and regenerate (python -m jetspec_jax.train --stage regenerate --config ...), "
            "or point data.regen_dir elsewhere")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def pack_ragged(rows: Sequence[Sequence[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat tokens, offsets (n+1,) int64): row i is tokens[offsets[i]:offsets[i+1]]."""
    lengths = np.fromiter((len(r) for r in rows), np.int64, len(rows))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = np.fromiter((t for r in rows for t in r), dtype, int(offsets[-1]))
    return flat, offsets


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclasses.dataclass
class Answers:
    """Finished answers waiting to be written: one row per answer."""
    prompt_index: list[int] = dataclasses.field(default_factory=list)
    sample: list[int] = dataclasses.field(default_factory=list)
    tokens: list[list[int]] = dataclasses.field(default_factory=list)
    finished: list[bool] = dataclasses.field(default_factory=list)

    def add(self, prompt_index: int, sample: int, tokens: list[int], finished: bool) -> None:
        self.prompt_index.append(prompt_index)
        self.sample.append(sample)
        self.tokens.append(tokens)
        self.finished.append(finished)

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, n: int) -> "Answers":
        head = Answers(self.prompt_index[:n], self.sample[:n], self.tokens[:n], self.finished[:n])
        del self.prompt_index[:n], self.sample[:n], self.tokens[:n], self.finished[:n]
        return head


class CorpusWriter:
    """Appends answer shards to a corpus directory, rewriting the manifest after each one. A shard
    on disk is always whole and listed; answers still in memory at a stop are regenerated on resume."""

    def __init__(self, out_dir: str, manifest: dict[str, Any], dtype: np.dtype):
        self.out_dir, self.manifest, self.dtype = out_dir, manifest, dtype

    @classmethod
    def create(cls, out_dir: str, settings: dict[str, Any], prompts: Sequence[dict],
               prompt_ids: Sequence[Sequence[int]], vocab_size: int, provenance: dict[str, Any]) -> "CorpusWriter":
        os.makedirs(out_dir, exist_ok=True)
        dtype = token_dtype(vocab_size)
        flat, offsets = pack_ragged(prompt_ids, dtype)
        data = npz_bytes(tokens=flat, offsets=offsets)
        write_bytes_atomic(os.path.join(out_dir, PROMPTS_FILE), data)
        meta = "".join(json.dumps({k: p[k] for k in ("source", "id", "kind")}) + "\n" for p in prompts)
        write_bytes_atomic(os.path.join(out_dir, PROMPT_META_FILE), meta.encode("utf-8"))
        manifest = {"format": FORMAT, "settings": settings, "provenance": provenance, "complete": False,
                    "token_dtype": dtype.name, "prompts_sha256": sha256_hex(data), "shards": [],
                    "num_answers": 0, "num_finished": 0, "num_completion_tokens": 0, "seconds": 0.0,
                    "counts": {}}
        writer = cls(out_dir, manifest, dtype)
        writer.write_manifest()
        return writer

    @classmethod
    def resume(cls, out_dir: str, manifest: dict[str, Any]) -> "CorpusWriter":
        return cls(out_dir, manifest, np.dtype(manifest["token_dtype"]))

    def write_manifest(self) -> None:
        write_json_atomic(os.path.join(self.out_dir, MANIFEST_FILE), self.manifest)

    def write_shard(self, answers: Answers, sources: Sequence[str], seconds: float) -> None:
        """Writes one shard, then the manifest that lists it. `sources[i]` names prompt i's source."""
        if not len(answers):
            return
        flat, offsets = pack_ragged(answers.tokens, self.dtype)
        data = npz_bytes(tokens=flat, offsets=offsets, prompt_index=np.asarray(answers.prompt_index, np.int32),
                         sample=np.asarray(answers.sample, np.int32), finished=np.asarray(answers.finished, bool))
        name = SHARD_PATTERN.format(len(self.manifest["shards"]))
        write_bytes_atomic(os.path.join(self.out_dir, name), data)
        m = self.manifest
        m["shards"].append({"file": name, "answers": len(answers), "completion_tokens": int(offsets[-1]),
                            "sha256": sha256_hex(data)})
        m["num_answers"] += len(answers)
        m["num_finished"] += int(sum(answers.finished))
        m["num_completion_tokens"] += int(offsets[-1])
        m["seconds"] = round(seconds, 2)
        for i in answers.prompt_index:
            m["counts"][sources[i]] = m["counts"].get(sources[i], 0) + 1
        self.write_manifest()

    def finish(self, extra: dict[str, Any]) -> dict[str, Any]:
        self.manifest.update(extra, complete=True)
        self.write_manifest()
        return self.manifest


def read_manifest(out_dir: str) -> dict[str, Any] | None:
    """The corpus manifest, or None where the directory has none."""
    path = os.path.join(out_dir, MANIFEST_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DamagedFileError(path, f"not valid JSON ({e})", regenerate_fix(out_dir)) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedFileError(path, f"not a {FORMAT} manifest (an older regeneration's folder?)",
                               regenerate_fix(out_dir))
    return manifest


def _load_npz(path: str, expected_sha256: str, fix: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}, listed in the corpus manifest, is missing; {fix}")
    with open(path, "rb") as f:
        data = f.read()
    if sha256_hex(data) != expected_sha256:
        raise DamagedFileError(path, "its sha256 differs from the manifest's (damaged or replaced)", fix)
    with np.load(io.BytesIO(data)) as npz:
        return {k: npz[k] for k in npz.files}


def read_prompt_ids(out_dir: str, manifest: dict[str, Any]) -> list[np.ndarray]:
    """Every prompt's token ids as the corpus stored them (a resumed run reuses them, not the tokenizer)."""
    arrays = _load_npz(os.path.join(out_dir, PROMPTS_FILE), manifest["prompts_sha256"], regenerate_fix(out_dir))
    tokens, offsets = arrays["tokens"], arrays["offsets"]
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def done_jobs(out_dir: str, manifest: dict[str, Any]) -> set[tuple[int, int]]:
    """(prompt index, sample) of every answer already in a shard, for a resumed run to skip."""
    fix = regenerate_fix(out_dir)
    done = set()
    for shard in manifest["shards"]:
        arrays = _load_npz(os.path.join(out_dir, shard["file"]), shard["sha256"], fix)
        done.update(zip(arrays["prompt_index"].tolist(), arrays["sample"].tolist()))
    return done


class Corpus:
    """A regenerated corpus, read back. `answers(split)` is a random-access source of records
    {"source", "id", "kind", "sample", "prompt_ids", "completion_ids", "finished"} for grain."""

    def __init__(self, out_dir: str, require_complete: bool = True):
        fix = regenerate_fix(out_dir)
        manifest = read_manifest(out_dir)
        if manifest is None:
            raise FileNotFoundError(f"{out_dir} has no {MANIFEST_FILE}: regeneration has not run there; run it "
                                    "first (python -m jetspec_jax.train --stage regenerate --config ...)")
        if require_complete and not manifest.get("complete"):
            raise ValueError(f"the regeneration in {out_dir} is not finished ({manifest['num_answers']} answers "
                             "so far); run `--stage regenerate` again with the same config to resume it")
        self.out_dir, self.manifest = out_dir, manifest
        prompts = _load_npz(os.path.join(out_dir, PROMPTS_FILE), manifest["prompts_sha256"], fix)
        self.prompt_tokens, self.prompt_offsets = prompts["tokens"], prompts["offsets"]
        meta_path = os.path.join(out_dir, PROMPT_META_FILE)
        try:
            with open(meta_path, encoding="utf-8") as f:
                self.prompts = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DamagedFileError(meta_path, f"unreadable ({e})", fix) from None
        if len(self.prompts) != len(self.prompt_offsets) - 1:
            raise DamagedFileError(meta_path, f"{len(self.prompts)} prompts where {PROMPTS_FILE} has "
                                   f"{len(self.prompt_offsets) - 1}", fix)
        shards = [_load_npz(os.path.join(out_dir, s["file"]), s["sha256"], fix) for s in manifest["shards"]]
        self.shards = shards
        # per answer, in shard order: (shard, row), its prompt, and prompt + completion tokens
        self.index = [(s, r) for s, arrays in enumerate(shards) for r in range(len(arrays["prompt_index"]))]
        self.answer_prompt = np.concatenate([a["prompt_index"] for a in shards] or [np.zeros((0,), np.int32)])
        completion = np.concatenate([np.diff(a["offsets"]) for a in shards] or [np.zeros((0,), np.int64)])
        self.answer_length = np.diff(self.prompt_offsets)[self.answer_prompt] + completion

    def prompt_ids(self, i: int) -> np.ndarray:
        return self.prompt_tokens[self.prompt_offsets[i]:self.prompt_offsets[i + 1]]

    def record(self, position: int) -> dict[str, Any]:
        s, r = self.index[position]
        arrays = self.shards[s]
        p = int(arrays["prompt_index"][r])
        meta = self.prompts[p]
        return {"source": meta["source"], "id": meta["id"], "kind": meta["kind"], "sample": int(arrays["sample"][r]),
                "prompt_ids": self.prompt_ids(p),
                "completion_ids": arrays["tokens"][arrays["offsets"][r]:arrays["offsets"][r + 1]],
                "finished": bool(arrays["finished"][r])}

    def answers(self, split: str = "train") -> "AnswerSource":
        prompt_heldout = np.array([is_heldout(p["source"], p["id"]) for p in self.prompts], bool)
        positions = np.flatnonzero(prompt_heldout[self.answer_prompt] == (split == "heldout"))
        return AnswerSource(self, positions.tolist())


class AnswerSource:
    """A grain random-access source over some of a corpus's answers."""

    def __init__(self, corpus: Corpus, positions: list[int]):
        self.corpus, self.positions = corpus, positions

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.corpus.record(self.positions[i])

    def lengths(self) -> np.ndarray:
        """prompt + completion tokens of every answer, for length bucketing without reading records."""
        return self.corpus.answer_length[self.positions].astype(np.int64)

    def prompt_field(self, field: str) -> list[str]:
        """A prompt field ("source", "id" or "kind") of every answer, without building records."""
        c = self.corpus
        return [c.prompts[p][field] for p in c.answer_prompt[self.positions].tolist()]

    def sources(self) -> list[str]:
        return self.prompt_field("source")

    def kinds(self) -> list[str]:
        return self.prompt_field("kind")
