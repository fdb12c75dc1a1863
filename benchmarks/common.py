"""Shared helpers for benchmark scripts: timing with the device clock, table printing and the eval's
prompt tokens (provenance and atomic JSON come from jetspec_jax.provenance)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import jax

from jetspec_jax.provenance import environment, write_json_atomic  # noqa: F401  (re-exported)


def time_call(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of fn() after warm-up; fn's result is waited on with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def eval_prompt_ids(tokenizer, benchmarks, data_dir) -> dict[tuple[str, str], list[int]]:
    """(benchmark, id) -> the prompt tokens the eval runner fed the target (chat template applied)."""
    from jetspec_jax.eval.datasets import load_benchmark
    from jetspec_jax.generate import encode_prompts

    ids = {}
    for benchmark in sorted(set(benchmarks)):
        items = load_benchmark(benchmark, data_dir, None)
        ids.update({(benchmark, item.id): x for item, x in
                    zip(items, encode_prompts(tokenizer, [item.prompt for item in items]))})
    return ids


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
