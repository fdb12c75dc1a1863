"""Where a serving chunk's time goes: the engine's own chunk programs (AR and each budget, at each
batch) on real prompts, timed on the wall and profiled on the GPU, beside the offline AR generation
(`generate_tokens`) of the same prompts, so what the server adds to a step shows.

    python benchmarks/serve_chunk_profile.py --batches 1 8 --budgets 32 64 \\
        --out benchmarks/results/serve_chunk_profile_h200.json

Per configuration: `wall_ms_per_step` (median over --chunks chunks, each read before the next
launches, as the engine does without overlap; offline AR: the generation of --new-tokens less one of
16 tokens, over the difference, so prefill cancels), `gpu_busy_ms_per_step` (summed kernel durations
of one profiled chunk or generation), the idle gap between them (launch gaps, host round trips of the
while loop; an upper bound, since tracing slows the host), kernel launches a step and the costliest
kernel families.
`launch_ms` is how long the chunk's launch call takes to return (median): a chunk whose loop reads
its exit predicate back each step returns only once it has run. `pipelined_ms_per_step` launches each
chunk before reading the last (the engine's `overlap`) over --chunks chunks. `--overlap` runs the
engine's overlap chunks (`fixed`: all their steps, a loop of known trip count); XLA_FLAGS with
`--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL` run the loop and the sampler's conditionals in
CUDA graphs, on the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (environment, gpu_kernel_events, math_and_chat_prompts, print_table,  # noqa: E402
                    target_and_head, write_json_atomic)
from spec_step_profile import summarise  # noqa: E402

from jetspec_jax import cache  # noqa: E402
from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.serve import slots as device  # noqa: E402
from jetspec_jax.serve.engine import Engine, SamplingParams  # noqa: E402
from jetspec_jax.tokens import encode_prompts  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402


def admit_all(engine: Engine, prompts: list[list[int]], batch: int) -> None:
    """Admits `batch` greedy requests into slots 0..batch-1, each allowed to fill its slot's context
    (the engine's stop tokens are off, so every slot stays live through the run)."""
    greedy = SamplingParams().config()
    group = [(i, prompts[i % len(prompts)], greedy, engine.max_context - len(prompts[i % len(prompts)]), i)
             for i in range(batch)]
    for start in range(0, batch, engine.max_admit):
        args, kwargs = engine._admit_call(group[start:start + engine.max_admit])
        engine.slots = device.admit(*args, **kwargs)[0]


def profile_chunks(engine: Engine, budget: int | None, batch: int, args) -> dict:
    rows = engine.chunk_rows(batch)
    last = []

    def chunk():
        program, call_args, kwargs = engine._chunk_call(budget, rows)
        engine.slots, out = program(*call_args, **kwargs)
        last[:] = [out]
        return out.tokens

    walls, launches = [], []
    for i in range(args.warmup_chunks + args.chunks):
        t0 = time.perf_counter()
        chunk()
        returned = time.perf_counter()
        steps = int(last[0].steps)  # waits for the chunk, as the engine reads each one
        if i >= args.warmup_chunks:
            walls.append((time.perf_counter() - t0) / max(steps, 1))
            launches.append(returned - t0)
    t0, previous = time.perf_counter(), None
    for _ in range(args.chunks):  # each chunk launched before the last is read
        launched = chunk()
        if previous is not None:
            np.asarray(previous)
        previous = launched
    np.asarray(previous)
    pipelined = (time.perf_counter() - t0) / (args.chunks * args.chunk_steps)
    events, _ = gpu_kernel_events(chunk)  # the wall time under the profiler is not the one reported
    steps = int(last[0].steps)
    if steps < args.chunk_steps or not bool(np.asarray(engine.slots.live[:batch]).all()):
        raise RuntimeError(f"a slot finished inside the run (batch {batch}, budget {budget}): raise --max-len")
    name = "ar" if budget is None else f"{engine.method}_b{budget}"
    row = summarise(f"serve_{name}_batch{batch}", statistics.median(walls) * steps, events, steps, args.top)
    row.update(source="serve", batch=batch, budget=budget, overlap=engine.overlap,
               launch_ms=statistics.median(launches) * 1e3, pipelined_ms_per_step=pipelined * 1e3)
    return row


def profile_offline_ar(target, prompts: list[list[int]], batch: int, args) -> dict:
    width = max(len(p) for p in prompts[:batch])
    tokens = np.zeros((batch, width), np.int32)
    for i, p in enumerate(prompts[:batch]):
        tokens[i, : len(p)] = p
    lens = np.array([len(p) for p in prompts[:batch]], np.int32)

    def generation(new_tokens):
        gen = GenerationConfig(max_new_tokens=new_tokens, eos_token_ids=())
        return lambda: generate_tokens(target.params, tokens, lens, jax.random.key(0), cfg=target.cfg, gen=gen,
                                       cache_len=args.max_len).tokens

    def seconds(fn):
        jax.block_until_ready(fn())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    long, short = generation(args.new_tokens), generation(16)
    per_step = (seconds(long) - seconds(short)) / (args.new_tokens - 16)
    if per_step <= 0:  # the difference drowned in timing noise: a step time from it would be made up
        raise RuntimeError(f"offline AR at batch {batch}: {args.new_tokens} tokens took no longer than 16; "
                           "raise --new-tokens so the difference outgrows timing noise")
    events, _ = gpu_kernel_events(long)
    row = summarise(f"offline_ar_batch{batch}", per_step * args.new_tokens, events, args.new_tokens, args.top)
    row.update(source="offline", batch=batch, budget=None)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded model)")
    p.add_argument("--head", default=None, help="draft head directory (default: the shipped head for --method)")
    p.add_argument("--method", default="jetspec")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--budgets", nargs="+", type=int, default=[32, 64])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--chunk-steps", type=int, default=8)
    p.add_argument("--chunks", type=int, default=10, help="timed chunks per configuration")
    p.add_argument("--warmup-chunks", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=256, help="offline AR generation length")
    p.add_argument("--max-len", type=int, default=2048, help="cache rows per slot")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--overlap", action="store_true", help="the engine's overlap chunks (all steps, fixed)")
    p.add_argument("--top", type=int, default=15, help="kernel families listed per configuration")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default=None, help="JSON results file")
    cache.add_cache_flags(p)
    args = p.parse_args(argv)
    cache.configure(args.cache_dir, enabled=not args.no_cache)

    target, head = target_and_head(args.model, args.head, args.method)
    prompts = [q for q in encode_prompts(target.tokenizer, math_and_chat_prompts(args.data_dir))
               if len(q) <= args.max_prompt_tokens]
    payload = dict(benchmark="serve_chunk_profile", target=target.name, method=args.method, width=args.width,
                   chunk_steps=args.chunk_steps, max_len=args.max_len, overlap=args.overlap,
                   environment=environment(), rows=[])
    columns = ["config", "steps", "wall_ms_per_step", "launch_ms", "pipelined_ms_per_step", "gpu_busy_ms_per_step",
               "gpu_idle_ms_per_step", "launches_per_step"]
    for batch in args.batches:
        payload["rows"].append(profile_offline_ar(target, prompts, batch, args))
        for budget in [None] + list(args.budgets):
            engine = Engine(target, None if budget is None else head, method="ar" if budget is None else args.method,
                            slots=max(args.batches), max_len=args.max_len, budget=budget or 16, width=args.width,
                            chunk_steps=args.chunk_steps, stop_token_ids=(), overlap=args.overlap)
            admit_all(engine, prompts, batch)
            payload["rows"].append(profile_chunks(engine, budget, batch, args))
            print_table(payload["rows"][-1:], columns)
            if args.out:
                write_json_atomic(args.out, payload)
    print_table(payload["rows"], columns)
    for row in payload["rows"]:
        if "top_kernels" in row:
            print(f"\n{row['config']}:")
            print_table(row["top_kernels"][:10], ["kernel", "us_per_step", "launches_per_step", "share"])
    if args.out:
        write_json_atomic(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
