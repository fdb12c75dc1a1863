"""The serving engine's step time and tau at each (live slots, budget): the cost table that the
server's adaptive budget reads (`--budget auto`), and the batched step against an AR step.

    python benchmarks/serve_step_costs.py --batches 1 2 4 8 16 32 --budgets 16 32 64 128 \\
        --out benchmarks/results/serve_step_costs_h200.json --table jetspec_jax/serve/cost_tables/NAME.json

For each batch n an engine of max(--batches) slots serves n requests in a closed loop (a finished
request is replaced at once by the next prompt of MATH-500 and MT-Bench, taken in turn) at one
setting: the AR engine, the speculative engine's plain decoding arm (budget 1), each tree budget.
Its chunks run the first n slots (or 8, the smallest chunk); chunks with n live give step_ms (wall
time of the chunk / its steps: the engine reads each chunk before it launches the next, so host work
between chunks is excluded) and tau. Chunks that compiled are not counted, nor the next
--warmup-chunks; the --seconds of each setting start after its compilation.
"""

from __future__ import annotations

import argparse
import itertools
import os
import queue
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (environment, math_and_chat_prompts, print_table, target_and_head,  # noqa: E402
                    write_json_atomic)

from jetspec_jax import cache  # noqa: E402
from jetspec_jax.serve.budget import PLAIN, BudgetPolicy, CostTable  # noqa: E402
from jetspec_jax.serve.engine import Engine, EngineRequest, FinishEvent  # noqa: E402
from jetspec_jax.tokens import encode_prompts  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402


def measure(target, head, method: str, batch: int, budget: int | None, prompts, args) -> dict:
    """One setting: `budget` None with method "ar" is the AR engine; PLAIN is a speculative engine's
    plain decoding steps (auto's PLAIN arm, which also feeds the head its context)."""
    engine = Engine(target, head, method=method, slots=max(args.batches), max_len=args.max_len,
                    budget="auto" if budget == PLAIN else budget or 16, width=args.width,
                    chunk_steps=args.chunk_steps, max_queue=4 * batch,
                    overlap=False)  # each chunk read before the next launches: its time is its own
    if budget == PLAIN:
        engine.policy = BudgetPolicy((PLAIN,), False, CostTable({}, {}))
    engine.stats.history = []
    engine.start()
    in_flight, source = [], itertools.cycle(prompts)
    give_up, deadline = time.monotonic() + 600, None  # the clock starts at the first chunk that did not compile
    try:
        while time.monotonic() < min(give_up, deadline or give_up):
            if deadline is None and engine.stats.history:
                deadline = time.monotonic() + args.seconds
            while len(in_flight) < batch:
                in_flight.append(engine.submit(EngineRequest(next(source), args.new_tokens)))
            for handle in in_flight[:]:
                try:  # drain its events without blocking on the others
                    while not isinstance(handle.get(timeout=0.001), FinishEvent):
                        pass
                    in_flight.remove(handle)
                except queue.Empty:
                    pass
    finally:
        engine.shutdown(drain=False)
    full = [c for c in engine.stats.history if c["live"] == batch and c["steps"] == args.chunk_steps]
    full = full[args.warmup_chunks:]
    if not full:
        return dict(method=method, batch=batch, budget=budget, chunks=0)
    step_ms = statistics.median(c["seconds"] / c["steps"] for c in full) * 1e3
    forwards = sum(c["live"] * c["steps"] for c in full)
    tau = (forwards + sum(c["accepted"] for c in full)) / forwards
    return dict(method=method, batch=batch, budget=budget, chunks=len(full), step_ms=step_ms, tau=tau,
                tokens_per_second=batch * tau / step_ms * 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target (default: the embedded model)")
    p.add_argument("--head", default=None, help="draft head directory (default: the shipped JetSpec head)")
    p.add_argument("--method", default="jetspec")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 32, 64, 128])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--chunk-steps", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seconds", type=float, default=8.0, help="closed-loop time per setting")
    p.add_argument("--warmup-chunks", type=int, default=3)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default=None, help="JSON results file")
    p.add_argument("--table", default=None, help="also write the server's cost table here")
    cache.add_cache_flags(p)
    args = p.parse_args(argv)
    cache.configure(args.cache_dir, enabled=not args.no_cache)

    target, head = target_and_head(args.model, args.head, args.method)
    prompts = [p for p in encode_prompts(target.tokenizer, math_and_chat_prompts(args.data_dir))
               if len(p) + args.new_tokens + 256 <= args.max_len]

    rows = []
    for batch in args.batches:
        ar = measure(target, None, "ar", batch, None, prompts, args)
        settings = [measure(target, head, args.method, batch, budget, prompts, args)
                    for budget in (PLAIN, *args.budgets)]
        for row in settings:
            if ar.get("step_ms") and row.get("step_ms"):
                row["step_over_ar"] = row["step_ms"] / ar["step_ms"]
        rows += [ar] + settings
        print_table([ar] + settings, ["method", "batch", "budget", "chunks", "step_ms", "tau", "tokens_per_second",
                                      "step_over_ar"])
    env = environment()
    payload = dict(benchmark="serve_step_costs", target=target.name, target_fingerprint=target.fingerprint,
                   method=args.method, width=args.width, chunk_steps=args.chunk_steps, new_tokens=args.new_tokens,
                   environment=env, rows=rows)
    if args.out:
        write_json_atomic(args.out, payload)
    if args.table:
        table_rows = [r for r in rows if r["method"] == args.method and r.get("step_ms")]
        write_json_atomic(args.table, dict(target=target.name, target_fingerprint=target.fingerprint,
                                           method=args.method, width=args.width, device_kind=env["devices"][0],
                                           source=args.out, git_commit=env["git_commit"], rows=[
                                               {k: r[k] for k in ("batch", "budget", "step_ms", "tau")}
                                               for r in table_rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
