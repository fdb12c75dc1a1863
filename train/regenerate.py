"""Regenerates training data: the target's own answers to training prompts, written as JSONL shards
plus a manifest, so the draft head learns to predict what the target actually says."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import random
import tempfile
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np
from tqdm import tqdm

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.errors import DamagedFileError
from jetspec_jax.generate import (PROMPT_BUCKET, encode_prompts, pad_prompts, pad_token, plan_cache_len,
                                  stop_tokens, trim_generated)
from jetspec_jax.sampling import SamplingConfig
from jetspec_jax.target import Target

from .config import DEFAULT_DATA_DIR, check_samples_per_prompt

MANIFEST_FILE = "manifest.json"
SHARD_PATTERN = "shard-{:05d}.jsonl"
MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
MBPP_TRAIN_IDS = range(601, 975)  # MBPP's train split; every other task id is eval or few-shot


@dataclasses.dataclass(frozen=True)
class PromptSource:
    file: str
    prompt: Callable[[dict], str]
    record_id: Callable[[dict, int], str]  # (record, line index) -> id stable across runs
    keep: Callable[[dict], bool] = lambda record: True


def mbpp_prompt(r: dict) -> str:
    # The statement plus one test, so the answer uses the function name and signature the tests call.
    return (f"{r['text']}\nWrite a Python function that solves this. Your code should pass tests like:\n"
            f"{r['test_list'][0]}")


def chat_prompt(r: dict) -> str:
    # chat_prompts.jsonl holds single-turn instructions; the optional input follows on its own lines.
    return f"{r['instruction']}\n\n{r['context']}" if r.get("context") else r["instruction"]


TRAINING_SOURCES: dict[str, PromptSource] = {
    "gsm8k": PromptSource("gsm8k_train.jsonl", lambda r: r["question"] + MATH_INSTRUCTION,
                          lambda r, line: str(line)),
    "math": PromptSource("math_train.jsonl", lambda r: r["problem"] + MATH_INSTRUCTION,
                         lambda r, line: r["unique_id"]),
    "mbpp": PromptSource("mbpp.jsonl", mbpp_prompt, lambda r, line: str(r["task_id"]),
                         keep=lambda r: r["task_id"] in MBPP_TRAIN_IDS),
    "chat": PromptSource("chat_prompts.jsonl", chat_prompt, lambda r, line: r["id"]),
}


DATA_FIX = "restore the file: one JSON object per line, as the data folder's README.md lists"


def read_jsonl(path: str, fix: str = DATA_FIX) -> Iterator[tuple[int, Any]]:
    """(0-based line index, record) of each non-blank line; a line that is not JSON is a
    DamagedFileError naming the file and line."""
    with open(path, "rb") as f:
        for line, raw in enumerate(f):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise DamagedFileError(f"{path}:{line + 1}", f"not valid JSON ({e})", fix) from None
            yield line, record


def load_training_prompts(data_dir: str | None, sources: dict[str, int | None], seed: int) -> list[dict]:
    """[{"source", "id", "prompt"}] from each source: shuffled by seed, then capped (None = all)."""
    data_dir = DEFAULT_DATA_DIR if data_dir is None else data_dir
    unknown = sorted(set(sources) - set(TRAINING_SOURCES))
    if unknown:
        raise ValueError(f"unknown training source(s) {unknown}; known: {sorted(TRAINING_SOURCES)}")
    prompts = []
    for name, cap in sources.items():
        if cap is not None and cap < 0:
            raise ValueError(f"cap for source {name!r} must be >= 0 or None (all), got {cap}")
        spec = TRAINING_SOURCES[name]
        path = os.path.join(data_dir, spec.file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"training source {name!r} needs {path}, which does not exist; point "
                                    f"--data-dir (or data.data_dir in the config) at the folder holding "
                                    f"{spec.file}")
        rows = []
        for i, r in read_jsonl(path):
            try:
                if spec.keep(r):
                    rows.append({"source": name, "id": spec.record_id(r, i), "prompt": spec.prompt(r)})
            except (KeyError, TypeError, AttributeError, IndexError) as e:
                raise DamagedFileError(f"{path}:{i + 1}", f"not a {name} record ({type(e).__name__}: {e})",
                                       DATA_FIX) from None
        random.Random(f"{name}:{seed}").shuffle(rows)  # per source, so adding a source changes no other
        prompts.extend(rows if cap is None else rows[:cap])
    return prompts


def write_atomic(path: str, lines: Sequence[str]) -> None:
    """Writes to a temporary file in the same directory, then renames it into place."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_previous_output(out_dir: str) -> None:
    """Manifest first, so a crash mid-cleanup never leaves a manifest over missing shards."""
    manifest = os.path.join(out_dir, MANIFEST_FILE)
    if os.path.exists(manifest):
        os.remove(manifest)
    stale = glob.glob(os.path.join(out_dir, "shard-*.jsonl")) + glob.glob(os.path.join(out_dir, ".*.tmp"))
    for path in stale:
        os.remove(path)


def prompts_fingerprint(prompts: Sequence[dict]) -> str:
    payload = json.dumps([[p["source"], p["id"], p["prompt"]] for p in prompts], ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def regenerate(target: Target, prompts: Sequence[dict], out_dir: str, *, max_new_tokens: int,
               temperature: float, top_p: float, top_k: int, seed: int, batch_size: int, shard_size: int,
               max_prompt_tokens: int, samples_per_prompt: int = 1,
               config_name: str | None = None) -> dict[str, Any]:
    """Generates the target's completion of every prompt into `out_dir`, `samples_per_prompt` of them
    each (records numbered by "sample"); returns the manifest. A directory whose manifest has the same
    settings is returned as it is (nothing regenerated)."""
    if batch_size < 1 or shard_size < 1:
        raise ValueError(f"batch_size and shard_size must be >= 1, got {batch_size} and {shard_size}")
    check_samples_per_prompt(samples_per_prompt, temperature)
    max_positions = target.cfg.max_position_embeddings
    if max_prompt_tokens + max_new_tokens > max_positions:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds the target's {max_positions} positions")
    sampling = SamplingConfig(temperature, top_k, top_p)
    settings = json.loads(json.dumps({  # JSON round trip so it compares equal to a loaded manifest
        "target": os.path.basename(os.path.normpath(target.source)),
        "target_config": f"{target.cfg.architecture}-{target.cfg.num_layers}x{target.cfg.hidden_size}",
        "dtype": str(target.params["embed"].dtype), "sampling": dataclasses.asdict(sampling),
        "seed": seed, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
        "batch_size": batch_size, "shard_size": shard_size, "num_prompts": len(prompts),
        "samples_per_prompt": samples_per_prompt,
        "prompts_sha256": prompts_fingerprint(prompts)}))
    manifest_path = os.path.join(out_dir, MANIFEST_FILE)
    if os.path.isfile(manifest_path):
        try:
            with open(manifest_path, encoding="utf-8") as f:
                previous = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError):
            previous = {}  # a damaged manifest: the directory is regenerated below
        if isinstance(previous, dict) and previous.get("settings") == settings:
            return previous
    os.makedirs(out_dir, exist_ok=True)
    remove_previous_output(out_dir)

    prompt_ids = encode_prompts(target.tokenizer, [p["prompt"] for p in prompts])
    skipped = {p["source"]: 0 for p in prompts}
    for p, ids in zip(prompts, prompt_ids):
        skipped[p["source"]] += len(ids) > max_prompt_tokens
    kept = sorted((i for i, ids in enumerate(prompt_ids) if len(ids) <= max_prompt_tokens),
                  key=lambda i: (len(prompt_ids[i]), i))  # similar lengths share a batch: less padding
    # A prompt's samples sit side by side; each row of a batch draws its own tokens.
    jobs = [(i, sample) for i in kept for sample in range(samples_per_prompt)]
    eos = stop_tokens(target)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, sampling=sampling, eos_token_ids=eos,
                           pad_token_id=pad_token(target))
    base_key = jax.random.key(seed)
    counts = {p["source"]: 0 for p in prompts}
    shards, pending, completion_tokens, finished_count = [], [], 0, 0
    start = time.perf_counter()
    progress = tqdm(total=len(jobs), unit="answer", desc="regenerate", dynamic_ncols=True)
    for batch_index, first in enumerate(range(0, len(jobs), batch_size)):
        batch_jobs = jobs[first:first + batch_size]
        rows = [i for i, _ in batch_jobs]
        padded_rows = rows + [rows[0]] * (batch_size - len(rows))  # one batch shape: no extra compile
        tokens, lengths = pad_prompts([prompt_ids[i] for i in padded_rows], gen.pad_token_id,
                                      PROMPT_BUCKET)
        width = tokens.shape[1]
        # The cache length depends on the bucketed width alone, so each width compiles once.
        cache_len = plan_cache_len(width, min(width, max_prompt_tokens), max_new_tokens, max_positions)
        out = generate_tokens(target.params, tokens, lengths, jax.random.fold_in(base_key, batch_index),
                              cfg=target.cfg, gen=gen, cache_len=cache_len)
        completions = trim_generated(np.asarray(out.tokens), np.asarray(out.num_tokens))
        for (i, sample), completion in zip(batch_jobs, completions):
            finished = bool(completion) and completion[-1] in eos
            source, record_id = prompts[i]["source"], prompts[i]["id"]
            pending.append({"source": source, "id": record_id, "sample": sample, "prompt_ids": prompt_ids[i],
                            "completion_ids": completion, "finished": finished})
            counts[source] += 1
            completion_tokens += len(completion)
            finished_count += finished
        while len(pending) >= shard_size or (pending and first + batch_size >= len(jobs)):
            shards.append(SHARD_PATTERN.format(len(shards)))
            write_atomic(os.path.join(out_dir, shards[-1]), [json.dumps(r) for r in pending[:shard_size]])
            pending = pending[shard_size:]
        progress.update(len(rows))
        progress.set_postfix(tok_s=f"{completion_tokens / (time.perf_counter() - start):.0f}")
    progress.close()

    manifest = {
        "settings": settings, "config_name": config_name, "target_path": target.source,
        "counts": counts, "skipped_too_long": skipped, "num_records": len(jobs),
        "num_finished": finished_count, "num_prompt_tokens": sum(len(prompt_ids[i]) for i, _ in jobs),
        "num_completion_tokens": completion_tokens, "seconds": round(time.perf_counter() - start, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "shards": shards}
    write_atomic(manifest_path, [json.dumps(manifest, indent=2)])  # last: a manifest means complete
    return manifest


def read_shards(out_dir: str) -> list[dict]:
    """All records of a finished regeneration, in shard order."""
    manifest_path = os.path.join(out_dir, MANIFEST_FILE)
    if not os.path.isfile(manifest_path):
        raise FileNotFoundError(f"{out_dir} has no {MANIFEST_FILE}: regeneration has not run there or did "
                                f"not finish; run it first (python -m jetspec_jax.train --stage regenerate "
                                f"--config ...)")
    fix = f"delete {out_dir} and regenerate (python -m jetspec_jax.train --stage regenerate --config ...)"
    try:
        with open(manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        shards = [os.path.join(out_dir, shard) for shard in manifest["shards"]]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise DamagedFileError(manifest_path, f"not a regeneration manifest ({type(e).__name__}: {e})",
                               fix) from None
    records = []
    for shard in shards:
        if not os.path.isfile(shard):
            raise FileNotFoundError(f"{shard}, listed in {manifest_path}, is missing; {fix}")
        for line, record in read_jsonl(shard, fix):
            if not (isinstance(record, dict) and isinstance(record.get("prompt_ids"), list)
                    and isinstance(record.get("completion_ids"), list)):
                raise DamagedFileError(f"{shard}:{line + 1}", "not a regenerated record (it needs prompt_ids and "
                                       "completion_ids lists)", fix)
            records.append(record)
    return records
