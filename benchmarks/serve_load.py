"""Load generator for the OpenAI-compatible server: throughput, time to first token and per-request
tokens/s at each concurrency, for AR, fixed budgets and the adaptive budget, in one run.

    python benchmarks/serve_load.py --concurrency 1 4 8 16 32 --variants ar 16 32 64 128 auto \\
        --out benchmarks/results/serve_load_h200.json

Each variant is a server on 127.0.0.1 (the real app and engine, in this process, over HTTP) with the
same slots (suffixes, which combine, change the engine: `NAME/overlap`, the engine launching each
chunk before it reads the last one; `NAME/steps=N`, N steps a chunk; `NAME/switch=MS`, the
interpreter's thread switch interval, which bounds how long the engine's thread can wait for the lock
the HTTP thread holds; see parse_variant); the clients run in a process of their own (in one process they
would share the engine's interpreter lock, and their SSE parsing would count as the server's host
time); each concurrency level keeps that many streamed chat requests in flight (closed loop) over
MATH-500 and MT-Bench prompts taken in turn, at T=0, and times --requests-per-level x concurrency of them.
Before its first level each variant's engine runs the server's full warm-up (`--warmup full`: every prompt
bucket, batch size and budget compiled; its seconds are in the JSON's `warm_up`) and answers one short
untimed request (the HTTP path's first use). Each row records the compilations jax did inside its timed
window (`compilations`, `compile_s`): both must be 0, else the row's numbers include compile time and
its `warning` says so. The compilation cache (--cache-dir, on by default) keeps the programs for the next
run, and a variant reuses the programs an earlier one compiled (auto's chunks are the fixed budgets').
Each row also keeps, for analysis, its chunks (`chunk_log`: budget, live requests, rows, steps, ms,
accepted draft tokens) and, for `auto`, the expected tokens a millisecond the policy holds for each
budget at that concurrency after the level, with the step time, tau and chunks behind each (`policy_estimates`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (environment, math_and_chat_prompts, print_table, target_and_head,  # noqa: E402
                    write_json_atomic)

from jetspec_jax import cache  # noqa: E402
from jetspec_jax.compilation import CompileWatch  # noqa: E402
from jetspec_jax.kv_cache import is_page_size  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a thread around a fresh engine, which compiles every program (the full warm-up) first."""

    def __init__(self, target, head, variant: str, args):
        import uvicorn

        from jetspec_jax.serve.engine import Engine
        from jetspec_jax.serve.http_server import create_app, uvicorn_config

        options = parse_variant(variant)
        name = options["name"]
        method = "ar" if name == "ar" else args.method
        budget = "auto" if name == "auto" else (int(name) if name != "ar" else 16)
        self.switch_interval = sys.getswitchinterval()
        if options["switch_ms"]:
            sys.setswitchinterval(options["switch_ms"] / 1e3)
        self.engine = Engine(target, None if method == "ar" else head, method=method, slots=args.slots,
                             max_len=options["max_len"] or args.max_len, budget=budget, width=args.width,
                             chunk_steps=options["chunk_steps"] or args.chunk_steps, max_queue=4 * args.slots,
                             cost_table=args.cost_table, max_admit=args.max_admit,
                             overlap=options["overlap"], prefill_chunk=args.prefill_chunk,
                             page_size=options["page_size"]).start(warm_up=True)
        print(f"{variant}: warm-up compiles {self.engine.warm_up.describe()}", flush=True)
        self.engine.warm_up.wait(progress_bar=True)
        self.port = free_port()
        app = create_app(self.engine, target.tokenizer, "target")
        self.server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}/v1/chat/completions"

    def close(self):
        self.server.should_exit = True
        self.thread.join(60)
        self.engine.shutdown(drain=False, timeout=10)
        sys.setswitchinterval(self.switch_interval)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    """The target, head, data and engine settings LiveServer reads from its `args`, and the cache flags."""
    p.add_argument("--model", default=None)
    p.add_argument("--head", default=None, help="default: the head shipped for the target")
    p.add_argument("--method", default="jetspec")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--chunk-steps", type=int, default=8)
    p.add_argument("--max-admit", type=int, default=8, help="prompts prefilled in one admission call")
    p.add_argument("--prefill-chunk", type=int, default=512, help="longer prompts are prefilled this many a call")
    p.add_argument("--cost-table", default=None, help="for 'auto' (default: the shipped table, else online)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default=None)
    cache.add_cache_flags(p)


def parse_variant(variant: str) -> dict:
    """NAME[/overlap][/steps=N][/switch=MS][/len=L][/paged=P]: NAME is ar, auto or a budget; `overlap`
    launches each chunk before reading the last; `steps=N` runs N steps a chunk (default --chunk-steps);
    `switch=MS` sets the interpreter's thread switch interval (sys.setswitchinterval; Python's default
    is 5 ms) while the variant runs, since the engine's thread and the HTTP server's share the
    interpreter lock; `len=L` gives the engine --max-len L instead of the run's; `paged=P` keeps its
    cache paged, pages of P rows (--kv-page-size)."""
    name, *suffixes = variant.split("/")
    if name not in ("ar", "auto") and not (name.isdigit() and int(name) >= 2):
        raise SystemExit(f"variant {variant!r}: {name!r} is not ar, auto or a budget >= 2")
    options = dict(name=name, overlap=False, chunk_steps=None, switch_ms=None, max_len=None, page_size=None)
    for suffix in suffixes:
        key, _, value = suffix.partition("=")
        try:
            if suffix == "overlap":
                options["overlap"] = True
            elif key == "steps" and int(value) >= 1:
                options["chunk_steps"] = int(value)
            elif key == "switch" and float(value) > 0:
                options["switch_ms"] = float(value)
            elif key == "len" and int(value) >= 64:
                options["max_len"] = int(value)
            elif key == "paged" and is_page_size(int(value)):
                options["page_size"] = int(value)
            else:
                raise ValueError(suffix)
        except ValueError:
            raise SystemExit(f"variant {variant!r}: {suffix!r} is not overlap, steps=N (N >= 1), switch=MS "
                             "(MS > 0), len=L (L >= 64) or paged=P (a power of two >= 16)") from None
    return options


async def one_request(client, url: str, prompt: str, max_tokens: int) -> dict:
    body = dict(model="target", messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
    t0 = time.perf_counter()
    first, tokens, last, stall = None, 0, None, 0.0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:  # the server's OpenAI error object says why
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif any(c["delta"].get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter() - t0
                first = now if first is None else first
                stall, last = max(stall, now - last) if last is not None else 0.0, now
    total = time.perf_counter() - t0
    decode = total - (first or 0.0)
    return dict(ttft=first if first is not None else total, seconds=total, tokens=tokens, stall=stall,
                tokens_per_second=(tokens - 1) / decode if tokens > 1 and decode > 0 else 0.0)


async def closed_loop(url: str, prompts, concurrency: int, requests: int, max_tokens: int) -> tuple[list, float]:
    import httpx

    source = itertools.cycle(prompts)
    queue = [next(source) for _ in range(requests)]
    results = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while queue:
                prompt = queue.pop()
                results.append(await one_request(client, url, prompt, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def run_level(url: str, prompts, concurrency: int, requests: int, max_tokens: int) -> tuple[list, float]:
    """closed_loop in the clients' process."""
    return asyncio.run(closed_loop(url, prompts, concurrency, requests, max_tokens))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between the sorted values (numpy's default)."""
    values = sorted(values)
    at = (len(values) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (at - low)


def summarise(variant, concurrency, results, wall, metrics, compiles: CompileWatch, chunks: list[dict],
              admissions: tuple[int, int, float], overlap: bool) -> dict:
    """One level's row. From the engine's side: the chunks it ran in the window, their mean steps and ms a
    step, the requests live in them on average (weighted by chunk time: below the concurrency while
    the level fills and drains), the shares of the wall time in chunks and in admissions (the rest: the
    host between them, or no work; with overlap admissions count in the chunk after them), and the
    requests an admission call prefilled on average. From the clients' side: time to the first token,
    and each request's stall, the longest pause between two of its streamed chunks (a long prompt's
    prefill stalls the requests decoding beside it), at the median and the 99th percentile."""
    tokens = sum(r["tokens"] for r in results)
    steps = sum(c["steps"] for c in chunks)
    chunk_s = sum(c["seconds"] for c in chunks)
    return dict(variant=variant, concurrency=concurrency, requests=len(results), completion_tokens=tokens,
                throughput=tokens / wall, ttft_median_s=statistics.median(r["ttft"] for r in results),
                ttft_p99_s=percentile([r["ttft"] for r in results], 99),
                stall_median_s=statistics.median(r["stall"] for r in results),
                stall_p99_s=percentile([r["stall"] for r in results], 99),
                request_tokens_per_second=statistics.median(r["tokens_per_second"] for r in results),
                tau=metrics.get("tau"), last_budget=metrics.get("budget"),
                budgets_used=dict(collections.Counter(str(c["budget"]) for c in chunks)),
                chunks=len(chunks), steps_per_chunk=steps / len(chunks) if chunks else 0.0,
                ms_per_step=chunk_s * 1e3 / steps if steps else None,
                mean_live=sum(c["live"] * c["seconds"] for c in chunks) / chunk_s if chunk_s else None,
                chunk_share=chunk_s / wall,
                prefill_share=None if overlap else admissions[2] / wall,
                requests_per_admission=admissions[1] / admissions[0] if admissions[0] else None,
                compilations=compiles.programs, compile_s=compiles.seconds,
                compiled_programs=compiles.names,
                warning="COMPILED IN TIMED WINDOW" if compiles.programs or compiles.seconds else None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_flags(p)
    p.add_argument("--variants", nargs="+", default=["ar", "16", "32", "64", "128", "auto"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 8, 16, 32])
    p.add_argument("--requests-per-level", type=int, default=3, help="timed requests = this x concurrency")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--offline-ar", action="store_true",
                   help="also time offline AR generation (api.generate) at each concurrency as the batch, on the "
                        "same prompts, and give the `ar` rows offline_throughput and server_over_offline")
    args = p.parse_args(argv)
    for variant in args.variants:  # a bad one stops the run before the model loads
        parse_variant(variant)
    cache.configure(args.cache_dir, enabled=not args.no_cache)

    target, head = target_and_head(args.model, args.head, args.method)
    prompts = math_and_chat_prompts(args.data_dir)

    rows, warm_up = [], {}
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no fork of this one's jax threads
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as clients:
        for variant in args.variants:
            server = LiveServer(target, head, variant, args)
            print(f"{variant}: warm-up took {server.engine.warm_up.seconds:.1f} s", flush=True)
            try:
                measure_variant(server, variant, clients, prompts, args, rows, warm_up)
            finally:
                server.close()
            if variant == "ar" and args.offline_ar:
                add_offline_ar(target, prompts, args, rows)
            add_ratios_to_ar(rows)
            if args.out:  # after each variant: a run cut short keeps the variants it finished
                write_results(args, target, warm_up, rows, complete=variant == args.variants[-1])
    columns = ["variant", "concurrency", "throughput", "throughput_over_ar", "offline_throughput",
               "server_over_offline", "ttft_median_s", "ttft_p99_s",
               "stall_p99_s",
               "request_tokens_per_second", "tau", "last_budget", "steps_per_chunk", "ms_per_step", "mean_live",
               "chunk_share", "prefill_share", "requests_per_admission", "compile_s", "warning"]
    print_table(rows, columns)
    print_table([dict(variant=v, **w) for v, w in warm_up.items()],
                ["variant", "seconds", "programs", "compilations", "compiled_by_runs",
                 "first_request_compilations"])
    if any(r["warning"] for r in rows):
        print("WARNING: rows flagged above compiled inside their timed window: their numbers include compile time",
              file=sys.stderr)
    return 0


def measure_variant(server: LiveServer, variant: str, clients, prompts, args, rows: list, warm_up: dict) -> None:
    """Every concurrency level against one warmed-up server; the rows and the warm-up record are added."""
    warm = server.engine.warm_up
    with CompileWatch() as first:  # the HTTP path's own first use (chat template, connections), untimed
        clients.submit(run_level, server.url, prompts, 1, 1, 2).result()
    warm_up[variant] = dict(seconds=warm.seconds, programs=warm.total, compilations=warm.compiled_programs,
                            compiled_by_runs=warm.compiled_by_runs, first_request_compilations=first.programs)
    stats = server.engine.stats
    for c in args.concurrency:
        stats.history, before = [], (stats.admissions, stats.admitted, stats.admission_seconds)
        with CompileWatch() as compiles:
            results, wall = clients.submit(run_level, server.url, prompts, c, c * args.requests_per_level,
                                           args.max_tokens).result()
        rows.append(summarise(variant, c, results, wall, server.engine.metrics(), compiles, stats.history,
                              (stats.admissions - before[0], stats.admitted - before[1],
                               stats.admission_seconds - before[2]), server.engine.overlap))
        rows[-1].update(chunk_log=[[h["budget"], h["live"], h["active"], h["steps"], round(h["seconds"] * 1e3, 3),
                                    h["accepted"]] for h in stats.history],
                        policy_estimates=policy_estimates(server.engine, c))
        print_table(rows[-1:], [k for k in rows[-1] if k not in DETAIL_COLUMNS])


DETAIL_COLUMNS = ("compiled_programs", "budgets_used", "chunk_log", "policy_estimates")


def policy_estimates(engine, live: int) -> dict[str, dict] | None:
    """The adaptive budget's estimates for each budget at `live` requests (expected tokens a
    millisecond, step ms, tau, chunks observed), as they stand after a level: what its next choice
    at that load compares."""
    policy = engine.policy
    if policy is None or not policy.adaptive:
        return None
    return {str(b): e for b, e in policy.estimates(live, engine.chunk_rows(live)).items()}


def add_offline_ar(target, prompts: list[str], args, rows: list[dict]) -> None:
    """Offline AR (api.generate, greedy, chat template, the server's max_tokens) with each level's
    concurrency as the batch, over the prompts that level's clients sent (the first concurrency x
    --requests-per-level of the same cycle), on the `ar` rows: completion tokens a second of generation
    (compilation excluded: a warm-up batch runs first)."""
    from jetspec_jax.api import generate

    for row in [r for r in rows if r["variant"] == "ar"]:
        c = row["concurrency"]
        source = list(itertools.islice(itertools.cycle(prompts), c * args.requests_per_level))
        generate(source[:c], target, max_new_tokens=args.max_tokens)  # compiles this batch's program
        tokens = seconds = 0
        for start in range(0, len(source), c):
            out = generate(source[start:start + c], target, max_new_tokens=args.max_tokens)
            tokens, seconds = tokens + sum(len(t) for t in out.token_ids), seconds + out.generate_seconds
        row.update(offline_throughput=tokens / seconds, server_over_offline=row["throughput"] * seconds / tokens)
        print(f"offline AR at batch {c}: {tokens / seconds:.0f} tokens/s (server {row['throughput']:.0f})", flush=True)


def add_ratios_to_ar(rows: list[dict]) -> None:
    """Each row's throughput over AR's at its concurrency, once AR has run there."""
    ar = {r["concurrency"]: r["throughput"] for r in rows if r["variant"] == "ar"}
    for r in rows:
        if r["concurrency"] in ar:
            r["throughput_over_ar"] = r["throughput"] / ar[r["concurrency"]]


def write_results(args, target, warm_up: dict, rows: list[dict], complete: bool) -> None:
    write_json_atomic(args.out, dict(benchmark="serve_load", target=target.name, method=args.method,
                                     slots=args.slots, max_len=args.max_len, max_tokens=args.max_tokens,
                                     complete=complete, environment=environment(), warm_up=warm_up, rows=rows))


if __name__ == "__main__":
    sys.exit(main())
