"""Draft-head training throughput: real (non-pad) tokens/s of the training step per length bucket and over
the bucketed stream as training draws it, against the shipped heads' fixed layout (32 rows of 640
tokens) in the same run.

    python benchmarks/train_throughput.py --config smollm2-135m-general-jetspec \
        --out benchmarks/results/train_throughput_h200.json

The corpus is a regenerated one (`--corpus DIR`) or, by default, a synthetic one shaped like the issue-19
mixture: every kind of prompt in train_mix/README.md's proportions and mean lengths (4 characters a
token), the math/code/chat training prompts, prompts up to data.max_prompt_tokens, answers up to
data.max_new_tokens, one answer per data.answer_temperatures entry; random token ids (the step's cost
does not depend on them). Per bucket: `--steps` steps on that bucket's batches after a compiling
warm-up, timed with block_until_ready. Stream: `--steps` steps of the real iterator (grain prefetch,
host-to-device copies and all) after every shape has compiled. Real tokens are the teacher's non-pad
tokens (prompt + answer), answer tokens the generated ones, padded tokens rows x bucket length (the
unit of the shipped heads' recorded 266K tokens/s: 32 x 640 per step).

`--pair` also times the config with both heads (head.attention=["causal", "bidirectional"]: one teacher
pass, two students) on the same batches, and prints per bucket the pair's step against the one-head step
and what it saves against two one-head runs (the bidirectional head's step costs what the causal one's
does: the same computation under another block mask). Peak memory is the process's peak so far: the pair
runs after the one-head layout, so its reading is the pair's own where it is the larger.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402
from shapes import QWEN3_8B, SMOLLM2_135M  # noqa: E402

from jetspec_jax import sharding  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.target import Target, load_target  # noqa: E402
from jetspec_jax.train.config import load_config  # noqa: E402
from jetspec_jax.train.corpus import Answers, Corpus, CorpusWriter  # noqa: E402
from jetspec_jax.train.data import batch_iterator, bucket_fill, training_stream  # noqa: E402
from jetspec_jax.train.mixture import is_heldout  # noqa: E402
from jetspec_jax.train.trainer import Trainer, check_batch_size  # noqa: E402

# Both heads in one run (train/config.py: head.attention as a list), one teacher pass for the two; random
# weights, nothing exported.
PAIR = ['head.attention=["causal", "bidirectional"]', "head.init_from=[]", "run.export_head=[]"]
# The shipped heads' layout (train/configs/smollm2-135m-jetspec.toml): 32 rows of 640 tokens, 48 anchors each.
FIXED_640 = ["data.length_buckets=[640]", "optim.tokens_per_batch=20480", "data.anchors_per_1k_tokens=75"]
# source, kind, share of prompts, prompt tokens (log-uniform between), answer tokens (uniform between; the
# cap is data.max_new_tokens): train_mix/README.md's categories and mean prompt lengths, and the
# math/code/chat training prompts (about 11K), at 4 characters a token plus the chat template's ~30.
SYNTHETIC_MIX = [
    ("gsm8k", "math", 0.11, (60, 200), (80, 400)), ("math", "math", 0.05, (50, 400), (100, 512)),
    ("mbpp", "code", 0.006, (60, 120), (60, 400)), ("chat", "chat", 0.007, (30, 300), (60, 512)),
    ("code_gpteacher_codegen", "code", 0.1, (30, 120), (60, 512)),
    ("chat_sgd_multiturn", "chat", 0.07, (80, 500), (40, 300)),
    ("instruction_alpaca", "instruction", 0.08, (20, 120), (40, 512)),
    ("summarization_bbc_news", "long_context", 0.035, (300, 1200), (60, 300)),
    ("long_context_qmsum", "long_context", 0.085, (650, 4096), (60, 512)),
    ("translation_wmt_de_en", "translation", 0.25, (25, 90), (15, 120)),
    ("stem_qa_trec_questions", "stem_qa", 0.21, (20, 200), (20, 300)),
]


def synthetic_corpus(out_dir: str, *, prompts: int, answers_per_prompt: int, max_prompt_tokens: int,
                     max_new_tokens: int, vocab_size: int, seed: int = 0) -> Corpus:
    """A corpus of random token ids with SYNTHETIC_MIX's sources, kinds and lengths."""
    rng = np.random.default_rng(seed)
    shares = np.asarray([share for _, _, share, _, _ in SYNTHETIC_MIX])
    counts = np.maximum(1, np.round(prompts * shares / shares.sum()).astype(int))
    meta, prompt_ids, answers = [], [], Answers()
    for (source, kind, _, (p_lo, p_hi), (a_lo, a_hi)), n in zip(SYNTHETIC_MIX, counts):
        p_hi, a_hi = min(p_hi, max_prompt_tokens), min(a_hi, max_new_tokens)
        kept = 0
        for j in range(10 * n + 100):
            if kept == n:
                break
            if is_heldout(source, f"synthetic-{j}"):
                continue
            kept += 1
            meta.append({"source": source, "id": f"synthetic-{j}", "kind": kind})
            length = int(np.exp(rng.uniform(np.log(min(p_lo, p_hi)), np.log(p_hi))))
            prompt_ids.append(rng.integers(3, vocab_size, length).tolist())
            for sample in range(answers_per_prompt):
                length = int(rng.integers(min(a_lo, a_hi), a_hi + 1))
                answers.add(len(meta) - 1, sample, rng.integers(3, vocab_size, length).tolist(), length < a_hi)
    writer = CorpusWriter.create(out_dir, {"synthetic": SYNTHETIC_MIX}, meta, prompt_ids, vocab_size,
                                 {"made_by": "benchmarks/train_throughput.py", "seed": seed})
    sources = [m["source"] for m in meta]
    while len(answers):
        writer.write_shard(answers.take(4096), sources, seconds=0.0)
    writer.finish({})
    return Corpus(out_dir)


# The shapes `--target` takes with random weights (the step's cost does not depend on them).
SHAPES = {"random": (SMOLLM2_135M, "SmolLM2-135M-shaped"), "qwen3-8b-shaped": (QWEN3_8B, "Qwen3-8B-shaped")}


def build_target(kind: str, cfg) -> Target:
    """The config's target ("config"), or a shape of SHAPES with random weights."""
    if kind in SHAPES:
        shape, name = SHAPES[kind]
        params = init_params(qwen3.param_specs(shape), jax.random.key(0), cfg.run.compute_dtype)
        return Target(shape, params, None, f"{name}, random weights")
    return load_target(cfg.run.target or None, dtype=cfg.run.compute_dtype)


def peak_memory_gib() -> float | None:
    stats = jax.devices()[0].memory_stats() or {}
    return round(stats["peak_bytes_in_use"] / 2**30, 2) if "peak_bytes_in_use" in stats else None


def measure_layout(name: str, cfg, target, mesh, answers, steps: int) -> list[dict]:
    """One row per bucket (its batches alone) and one for the stream in training order."""
    check_batch_size(cfg, mesh)
    trainer = Trainer(cfg, target, mesh)
    stream = training_stream(answers, cfg.buckets(), mixture=cfg.data.mixture, seed=cfg.run.seed)
    by_bucket: dict[int, list[dict]] = {b.length: [] for b in cfg.buckets()}
    for step in range(1_000_000):  # each bucket's first batches in the order training draws them
        mine = by_bucket[cfg.buckets()[stream.indices[step][0]].length]
        if len(mine) < steps:
            mine.append(stream.dataset[step])
        if all(len(v) == steps for v in by_bucket.values() if v) and step >= 50 * steps:
            break
    state = trainer.init_state(0)
    rows = []
    for bucket in cfg.buckets():
        batches = by_bucket[bucket.length]
        if not batches:
            continue
        t0 = time.perf_counter()
        state, metrics = trainer.train_step(state, batches[0])  # compiles this shape
        jax.block_until_ready((state, metrics))
        compile_s = time.perf_counter() - t0
        placed = [trainer.place_batch(b) for b in batches]
        t0 = time.perf_counter()
        for batch in placed:
            state, metrics = trainer.train_step(state, batch)
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - t0
        real = sum(int(b["length"].sum()) for b in batches)
        answer = sum(int((b["length"] - b["prompt_len"]).sum()) for b in batches)
        padded = len(batches) * bucket.rows * bucket.length
        rows.append(dict(layout=name, bucket=bucket.length, rows=bucket.rows, anchors=bucket.anchors,
                         steps=len(batches),
                         step_ms=1e3 * seconds / len(batches), real_tok_s=real / seconds, answer_tok_s=answer / seconds,
                         padded_tok_s=padded / seconds, fill=real / padded, compile_s=compile_s,
                         peak_gib=peak_memory_gib()))
        print(rows[-1], flush=True)
    # the stream as training reads it: the iterator's prefetch threads, host-to-device copies, bucket changes
    it = batch_iterator(stream.dataset)
    real = answer = padded = 0
    t0 = time.perf_counter()
    for _ in range(steps * len(rows)):
        batch = next(it)
        state, metrics = trainer.train_step(state, batch)
        real += int(batch["length"].sum())
        answer += int((batch["length"] - batch["prompt_len"]).sum())
        padded += batch["tokens"].size
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - t0
    n = steps * len(rows)
    rows.append(dict(layout=name, bucket="stream", rows=None, anchors=None, steps=n, step_ms=1e3 * seconds / n,
                     real_tok_s=real / seconds, answer_tok_s=answer / seconds, padded_tok_s=padded / seconds,
                     fill=real / padded, compile_s=None, peak_gib=peak_memory_gib()))
    print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="smollm2-135m-general-jetspec", help="a file in train/configs (name or path)")
    p.add_argument("--target", choices=["config", *SHAPES], default="config",
                   help="the config's target; random: SmolLM2-135M's shape with random weights (the same cost; for "
                        "a machine without the embedded model); qwen3-8b-shaped: Qwen3-8B's, random weights")
    p.add_argument("--corpus", default=None, help="a regenerated corpus directory (default: a synthetic one)")
    p.add_argument("--prompts", type=int, default=2000, help="synthetic corpus: prompts (each with its answers)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per bucket (and per bucket in the stream)")
    p.add_argument("--no-fixed-640", action="store_true", help="skip the shipped heads' fixed layout")
    p.add_argument("--pair", action="store_true",
                   help="also time both heads in one step (one teacher pass) beside the config's one head")
    p.add_argument("--out", default="benchmarks/results/train_throughput.json")
    p.add_argument("overrides", nargs="*", help="section.key=value for the config, e.g. head.num_layers=4")
    args = p.parse_args()

    cfg = load_config(args.config, args.overrides)
    if args.pair and cfg.is_pair:
        p.error(f"--pair times a one-head config beside its pair; {args.config} already trains "
                f"{', '.join(cfg.single_heads())}")
    target = build_target(args.target, cfg)
    mesh = sharding.make_mesh(cfg.run.mesh_model)
    with tempfile.TemporaryDirectory() as tmp:
        if args.corpus:
            corpus = Corpus(args.corpus, require_complete=False)  # a part of a corpus times the same
            corpus_info = {"dir": os.path.abspath(args.corpus), "complete": corpus.manifest["complete"]}
        else:
            corpus = synthetic_corpus(tmp, prompts=args.prompts, answers_per_prompt=len(cfg.data.answer_temperatures),
                                      max_prompt_tokens=cfg.data.max_prompt_tokens,
                                      max_new_tokens=cfg.data.max_new_tokens, vocab_size=target.cfg.vocab_size)
            corpus_info = {"synthetic": SYNTHETIC_MIX, "prompts": args.prompts}
        answers = corpus.answers("train")
        lengths = np.asarray(answers.lengths())
        corpus_info.update(answers=len(answers), mean_tokens=float(lengths.mean()),
                           p50_p90_p99_tokens=np.percentile(lengths, [50, 90, 99]).tolist())
        layouts = [("buckets", cfg)]
        if args.pair:
            layouts.append(("buckets-pair", load_config(args.config, [*args.overrides, *PAIR])))
        if not args.no_fixed_640:
            layouts.append(("fixed-640", load_config(args.config, [*args.overrides, *FIXED_640])))
        payload = dict(benchmark="train_throughput", config=args.config, overrides=args.overrides,
                       target=target.source, corpus=corpus_info,
                       layouts={name: dict(buckets=[b._asdict() for b in c.buckets()], head=dataclasses.asdict(c.head),
                                           fill_of_corpus=bucket_fill(lengths, c.buckets()))
                                for name, c in layouts},
                       mesh=dict(mesh.shape), rows=[], environment=environment())
        for name, layout_cfg in layouts:
            payload["rows"] += measure_layout(name, layout_cfg, target, mesh, answers, args.steps)
            write_json_atomic(args.out, payload)  # after every layout: a run cut short keeps what it measured
    print_table(payload["rows"], ["layout", "bucket", "rows", "anchors", "steps", "step_ms", "real_tok_s",
                                  "answer_tok_s", "padded_tok_s", "fill", "compile_s", "peak_gib"])
    if args.pair:
        one = {r["bucket"]: r for r in payload["rows"] if r["layout"] == "buckets"}
        payload["pair_vs_one_head"] = [
            dict(bucket=r["bucket"], one_head_ms=one[r["bucket"]]["step_ms"], pair_ms=r["step_ms"],
                 pair_over_one=r["step_ms"] / one[r["bucket"]]["step_ms"],
                 saved_vs_two_runs=1 - r["step_ms"] / (2 * one[r["bucket"]]["step_ms"]),
                 one_head_peak_gib=one[r["bucket"]]["peak_gib"], pair_peak_gib=r["peak_gib"])
            for r in payload["rows"] if r["layout"] == "buckets-pair" and r["bucket"] in one]
        print_table(payload["pair_vs_one_head"], ["bucket", "one_head_ms", "pair_ms", "pair_over_one",
                                                  "saved_vs_two_runs", "one_head_peak_gib", "pair_peak_gib"])
    stream = {r["layout"]: r for r in payload["rows"] if r["bucket"] == "stream"}
    if "buckets" in stream:
        print(f"buckets, whole stream: {stream['buckets']['real_tok_s'] / 1e3:.0f}K real tokens/s "
              f"(goal: >= 266K, the shipped heads' padded rate at 32 x 640)")
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
