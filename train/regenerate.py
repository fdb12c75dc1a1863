"""Regenerates training data at scale: the frozen target answers every training prompt (greedy and
sampled answers, long prompts included) through the slot engine (regen_engine.py), prompts grouped
by length so each group's cache fits them; answers go to a corpus of token-id shards (corpus.py)
that a run can stop and resume at any point."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Sequence

import jax
from tqdm import tqdm

from jetspec_jax.compilation import CompileWatch, default_workers
from jetspec_jax.errors import InputError
from jetspec_jax.fingerprint import target_fingerprint
from jetspec_jax.provenance import environment
from jetspec_jax.target import Target
from jetspec_jax.tokens import encode_prompts, pad_token, stop_tokens

from .config import DEFAULT_DATA_DIR, DataConfig
from .corpus import Answers, CorpusWriter, done_jobs, read_manifest, read_prompt_ids, sha256_hex
from .mixture import HELDOUT_FRACTION, hashed_share, is_heldout, load_prompts
from .regen_engine import Job, StaticSettings, answer_key_ids, compile_buckets, prompt_rows_for, round_up_64, run_bucket

MIN_BUCKET = 128  # prompt widths are powers of two from here: a handful of compiled shapes
ADMIT_TOKENS = 1 << 16  # prompt tokens per admission call, bounding its activations
# Prompt slots per answer slot, times the answers per prompt: a prompt's slot stays taken until its
# longest answer ends, so spare prompt slots let the answer slots its shorter answers free start others.
PROMPT_SLOT_SPARE = 1.5


def load_regeneration_prompts(data_dir: str | None, sources: dict[str, int], seed: int) -> list[dict]:
    """Both splits of every source (the trainer reads the held-out answers for its evaluation only),
    each capped as `sources` says (-1 = all, 0 = none); the held-out cap keeps the split's share."""
    data_dir = DEFAULT_DATA_DIR if data_dir is None else data_dir
    wanted = {name: cap for name, cap in sources.items() if cap != 0}
    caps = {name: None if cap < 0 else cap for name, cap in wanted.items()}
    heldout_caps = {name: None if cap is None else math.ceil(cap * HELDOUT_FRACTION / (1 - HELDOUT_FRACTION))
                    for name, cap in caps.items()}
    return load_prompts(data_dir, caps, seed, "train") + load_prompts(data_dir, heldout_caps, seed, "heldout")


def prompt_buckets(max_prompt_tokens: int) -> list[int]:
    widths, w = [], MIN_BUCKET
    while w < max_prompt_tokens:
        widths.append(w)
        w *= 2
    return widths + [round_up_64(max_prompt_tokens)]


def regeneration_settings(target: Target, prompts: Sequence[dict], cfg: DataConfig, seed: int) -> dict[str, Any]:
    """Everything that decides the answers; a resumed run must match it. Batch and chunk sizes only
    change the speed, so they may differ between sessions."""
    listing = json.dumps([[p["source"], p["id"], p["prompt"]] for p in prompts], ensure_ascii=False)
    return json.loads(json.dumps({
        "target": os.path.basename(os.path.normpath(target.source)),
        "target_fingerprint": target_fingerprint(target.cfg, target.params),
        "dtype": str(target.params["embed"].dtype), "seed": seed,
        "answer_temperatures": [float(t) for t in cfg.answer_temperatures], "top_p": cfg.top_p,
        **({"resample": cfg.resample} if cfg.resample else {}),  # first-draw corpora keep their settings
        **({"regen_fraction": cfg.regen_fraction} if cfg.regen_fraction < 1 else {}),
        "max_prompt_tokens": cfg.max_prompt_tokens, "max_new_tokens": cfg.max_new_tokens,
        "max_answer_tokens": max(cfg.max_answer_tokens, cfg.max_new_tokens),
        "num_prompts": len(prompts), "prompts_sha256": sha256_hex(listing.encode("utf-8"))}))


def draw_prompts(prompts: Sequence[dict], fraction: float, resample: int) -> list[dict]:
    """The prompts a draw answers: every held-out prompt, and each training prompt with probability `fraction`
    by a hash of its identity and the draw number, so successive draws cover different parts."""
    if fraction >= 1:
        return list(prompts)
    return [p for p in prompts
            if is_heldout(p["source"], p["id"]) or hashed_share(f"draw{resample}:{p['source']}:{p['id']}") < fraction]


def sample_key(prompt: dict, resample: int) -> str:
    """The identity an answer's random stream is keyed by: the prompt's, and for a training prompt the
    draw number when it is not the first (held-out prompts always draw the first)."""
    key = f"{prompt['source']}:{prompt['id']}"
    return key if not resample or is_heldout(prompt["source"], prompt["id"]) else f"{key}#draw{resample}"


def check_settings(cfg: DataConfig, target: Target) -> None:
    positions = target.cfg.max_position_embeddings
    if cfg.max_prompt_tokens + cfg.max_new_tokens > positions:
        raise InputError(f"data.max_prompt_tokens ({cfg.max_prompt_tokens}) + data.max_new_tokens "
                         f"({cfg.max_new_tokens}) exceeds the target's {positions} positions; lower either")
    widths = prompt_buckets(cfg.max_prompt_tokens)
    longest = widths[-1]
    shortest_prompt = widths[-2] + 1 if len(widths) > 1 else 1
    answer_tokens = min(max(cfg.max_answer_tokens, cfg.max_new_tokens), bucket_rows(longest, cfg) - shortest_prompt)
    share = answers_sharing_a_prompt(cfg)
    rows = layout_rows(share, round_up_64(answer_tokens), prompt_rows_for(longest, share), share)
    if cache_rows(cfg, target) < rows:
        need = rows * kv_bytes_per_row(target) / 2**30
        raise InputError(f"data.regen_cache_gib ({cfg.regen_cache_gib}) cannot hold the answers of one of the longest "
                         f"prompts ({rows} rows, {need:.3g} GiB); raise it or lower data.max_prompt_tokens")


def answers_sharing_a_prompt(cfg: DataConfig) -> int:
    return len(cfg.answer_temperatures) if cfg.regen_share_prompts else 1


def prompt_slot_spare(share: int) -> float:
    return PROMPT_SLOT_SPARE if share > 1 else 1.0


def prompt_slots_for(num_slots: int, share: int) -> int:
    """Prompt slots beside `num_slots` answer slots: PROMPT_SLOT_SPARE per group of `share` answers, so
    that answer slots freed early can start new prompts (one per answer without sharing)."""
    return max(1, math.ceil(num_slots * prompt_slot_spare(share) / share))


def layout_rows(num_slots: int, answer_rows: int, prompt_rows: int, share: int) -> int:
    """Cache rows of `num_slots` answer slots and their prompt slots."""
    return num_slots * answer_rows + prompt_slots_for(num_slots, share) * prompt_rows


def kv_bytes_per_row(target: Target) -> int:
    c = target.cfg
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * target.params["embed"].dtype.itemsize


def cache_rows(cfg: DataConfig, target: Target) -> int:
    """KV cache rows over all slots that data.regen_cache_gib holds for this target."""
    return int(cfg.regen_cache_gib * 2**30 // kv_bytes_per_row(target))


def regenerate(target: Target, prompts: Sequence[dict], out_dir: str, cfg: DataConfig, *, seed: int = 0,
               attention: str = "auto", config_name: str | None = None) -> dict[str, Any]:
    """Answers every prompt (of the training prompts, the draw's share: `cfg.regen_fraction`) once per
    `cfg.answer_temperatures` entry into the corpus at `out_dir`;
    returns its manifest. A finished corpus with the same settings is returned as it is; an unfinished
    one is resumed; one with other settings is refused (nothing is deleted)."""
    check_settings(cfg, target)
    prompts = draw_prompts(prompts, cfg.regen_fraction, cfg.resample)
    settings = regeneration_settings(target, prompts, cfg, seed)
    manifest = read_manifest(out_dir)
    if manifest is not None:
        if manifest["settings"] != settings:
            differ = sorted(k for k in set(settings) | set(manifest["settings"])
                            if settings.get(k) != manifest["settings"].get(k))
            raise InputError(f"{out_dir} holds a regeneration with other settings ({', '.join(differ)} differ); "
                             "point data.regen_dir at a new folder, or delete this one to start over")
        if manifest["complete"]:
            return manifest

    if manifest is None:
        prompt_ids = encode_prompts(target.tokenizer, [p["prompt"] for p in prompts])
        writer = CorpusWriter.create(out_dir, settings, prompts, prompt_ids, target.cfg.vocab_size,
                                     provenance={"config": config_name, "target_path": target.source})
        done = set()
    else:  # the same prompts (their sha256 is in the settings): reuse their stored token ids
        prompt_ids = read_prompt_ids(out_dir, manifest)
        writer = CorpusWriter.resume(out_dir, manifest)
        done = done_jobs(out_dir, manifest)

    eos, pad = stop_tokens(target), pad_token(target)
    temperatures = settings["answer_temperatures"]
    key_ids = answer_key_ids([sample_key(p, cfg.resample) for p in prompts])
    widths = prompt_buckets(cfg.max_prompt_tokens)
    skipped = {}
    by_width: dict[int, list[Job]] = {w: [] for w in widths}
    positions = target.cfg.max_position_embeddings
    for i in sorted(range(len(prompts)), key=lambda i: (len(prompt_ids[i]), i)):
        n = len(prompt_ids[i])
        if n > cfg.max_prompt_tokens:
            skipped[prompts[i]["source"]] = skipped.get(prompts[i]["source"], 0) + 1
            continue
        width = next(w for w in widths if w >= n)
        rows = bucket_rows(width, cfg)
        limit = min(settings["max_answer_tokens"], rows - n, positions - n + 1)
        by_width[width] += [Job(i, s, int(key_ids[i]), t, limit) for s, t in enumerate(temperatures)
                            if (i, s) not in done]

    total = sum(len(jobs) for jobs in by_width.values())
    run_key = jax.random.key(seed)
    deadline = time.perf_counter() + cfg.regen_max_minutes * 60 if cfg.regen_max_minutes > 0 else math.inf
    sources = [p["source"] for p in prompts]
    pending = Answers()
    start, seconds_before = time.perf_counter(), writer.manifest["seconds"]
    session = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "answers": 0,
               "completion_tokens": 0, "environment": environment(), "batch_size": cfg.regen_batch_size,
               "share_prompts": cfg.regen_share_prompts,
               "cache_gib": cfg.regen_cache_gib,
               "cache_rows": cache_rows(cfg, target), "chunk_steps": cfg.regen_chunk_steps, "buckets": []}
    progress = tqdm(total=total, unit="answer", desc="regenerate", dynamic_ncols=True)

    def on_answer(job: Job, tokens: list[int], finished: bool) -> None:
        pending.add(job.prompt_index, job.sample, tokens, finished)
        session["answers"] += 1
        session["completion_tokens"] += len(tokens)
        progress.update(1)
        if len(pending) >= cfg.regen_shard_answers:
            writer.write_shard(pending.take(cfg.regen_shard_answers), sources,
                               seconds_before + time.perf_counter() - start)
        elapsed = time.perf_counter() - start
        # refresh=False: the bar redraws on its own interval, not once per answer (65 us each)
        progress.set_postfix(tok_s=f"{session['completion_tokens'] / max(elapsed, 1e-9):.0f}", refresh=False)

    share = answers_sharing_a_prompt(cfg)
    layouts = {width: slot_layout(width, max(job.limit for job in jobs), share, cfg, session["cache_rows"])
               for width, jobs in by_width.items() if jobs}
    static = StaticSettings(target.cfg, cfg.regen_chunk_steps, tuple(eos), pad, cfg.top_p, attention)
    workers, compile_start = default_workers(), time.perf_counter()
    programs = compile_buckets(target.params, static, run_key, layouts, workers, share)
    session.update(compile_seconds=round(time.perf_counter() - compile_start, 2), compile_workers=workers)
    for width, layout in layouts.items():
        if time.perf_counter() > deadline:
            break
        # compile_seconds: what the bucket still compiled (small eager ops), its programs being ready
        with CompileWatch() as compiles:
            stats = run_bucket(target.params, target.cfg, by_width[width], prompt_ids, width=width,
                               answers_per_prompt=share, chunk_steps=cfg.regen_chunk_steps, run_key=run_key,
                               eos_token_ids=eos, pad_token_id=pad, top_p=cfg.top_p, attention=attention,
                               on_answer=on_answer, deadline=deadline, programs=programs[width], **layout)
        session["buckets"].append({"prompt_width": width, "slots": layout["num_slots"],
                                   "prompt_slots": layout["prompt_slots"], "answer_rows": layout["answer_rows"],
                                   "admit_prompts": layout["admit_prompts"], "answers": stats.answers,
                                   "completion_tokens": stats.completion_tokens, "decode_steps": stats.decode_steps,
                                   "seconds": round(stats.seconds, 2),
                                   "admissions": stats.admissions,
                                   "admission_seconds": round(stats.admission_seconds, 2),
                                   "chunks": stats.chunks, "chunk_seconds": round(stats.chunk_seconds, 2),
                                   "compile_seconds": round(compiles.seconds, 2),
                                   "tokens_per_second": round(stats.completion_tokens / max(stats.seconds, 1e-9))})
    progress.close()
    writer.write_shard(pending, sources, seconds_before + time.perf_counter() - start)
    session["seconds"] = round(time.perf_counter() - start, 2)
    session["tokens_per_second"] = round(session["completion_tokens"] / max(session["seconds"], 1e-9))
    writer.manifest.setdefault("sessions", []).append(session)
    writer.manifest["skipped_too_long"] = skipped
    remaining = total - session["answers"]
    if remaining > 0:  # stopped by the time box: the manifest lists what is done; run again to resume
        writer.write_manifest()
        return writer.manifest
    return writer.finish({"num_prompt_tokens": sum(len(prompt_ids[i]) for i in range(len(prompts))
                                                   if len(prompt_ids[i]) <= cfg.max_prompt_tokens),
                          "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})


def slot_layout(width: int, answer_tokens: int, share: int, cfg: DataConfig, total_rows: int) -> dict[str, int]:
    """Slots of a bucket within `total_rows` cache rows: each answer slot holds up to `answer_tokens`
    (the bucket's largest limit), and a prompt slot, shared by `share` answers, the prompt; answers
    up to data.regen_batch_size, and at least one prompt's."""
    answer_rows = round_up_64(answer_tokens)
    prompt_rows = prompt_rows_for(width, share)
    fit = int(total_rows // (answer_rows + prompt_rows * prompt_slot_spare(share) / share))  # before rounding up
    num_slots = max(share, min(cfg.regen_batch_size, fit))  # check_settings made sure `share` fit
    while num_slots > share and layout_rows(num_slots, answer_rows, prompt_rows, share) > total_rows:
        num_slots -= 1  # the prompt slots, rounded up, took a few more rows
    prompt_slots = prompt_slots_for(num_slots, share)
    # small groups keep few slots waiting for admission; each group is one prefill call
    admit_prompts = max(1, min(prompt_slots, max(num_slots // (32 * share), 8), ADMIT_TOKENS // width))
    return {"num_slots": num_slots, "prompt_slots": prompt_slots, "answer_rows": answer_rows,
            "admit_prompts": admit_prompts}


def bucket_rows(width: int, cfg: DataConfig) -> int:
    """Cache rows of a prompt up to `width` tokens and its answer: the prompt and max_new_tokens, rounded
    to 64. An answer's limit is what these rows leave (up to data.max_answer_tokens)."""
    return round_up_64(width + cfg.max_new_tokens)
