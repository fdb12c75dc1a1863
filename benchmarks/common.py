"""Shared helpers for benchmark scripts: timing (wall clock of chained calls, and the GPU's own
clock from a profile), table printing and the eval's prompt tokens (provenance and atomic JSON
come from jetspec_jax.provenance)."""

from __future__ import annotations

import collections
import glob
import math
import os
import statistics
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
    from jetspec_jax.tokens import encode_prompts

    ids = {}
    for benchmark in sorted(set(benchmarks)):
        items = load_benchmark(benchmark, data_dir, None)
        ids.update({(benchmark, item.id): x for item, x in
                    zip(items, encode_prompts(tokenizer, [item.prompt for item in items]))})
    return ids


def leading_true(flags: np.ndarray) -> np.ndarray:
    """(N, D) bools -> (N,) count of leading Trues per row (e.g. a path's tokens the target accepts)."""
    return np.argmin(np.concatenate([flags, np.zeros((len(flags), 1), bool)], axis=1), axis=1)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max([len(c)] + [len(fmt(r.get(c))) for r in rows]) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


L2_BYTES = 50e6  # the H200's L2: chained calls rotate over enough argument copies that reads come from HBM


def chained_calls(fn, x, rest, iters: int, chain: str = "unrolled"):
    """(many, one): zero-argument calls running `iters` and 1 chained fn(x, *rest) in one jitted program
    (each call's output is the next call's x).
    "unrolled" writes the calls out one after another, as the layers of a forward pass run, each on its
    own copy of `rest` (cycled) so K/V are read from HBM, not from L2 left warm by the previous call.
    "while_loop" is the earlier method (one copy, a fori_loop): XLA's GPU while loop syncs with the host
    every iteration, which adds several microseconds per call (tree_attention_bench's one_op_floor)."""
    if chain == "while_loop":
        loop = jax.jit(lambda x, rest, n: lax.fori_loop(0, n, lambda i, y: fn(y, *rest), x), static_argnums=2)
        return (lambda: loop(x, rest, iters)), (lambda: loop(x, rest, 1))
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(rest))
    copies = [rest] + [jax.tree.map(jnp.copy, rest)
                       for _ in range(min(iters, math.ceil(4 * L2_BYTES / max(nbytes, 1))) - 1)]

    def chained(x, copies, n):
        for i in range(n):
            x = fn(x, *copies[i % len(copies)])
        return x
    run = jax.jit(chained, static_argnums=2)  # both get every copy: passing arguments costs host time too
    return (lambda: run(x, copies, iters)), (lambda: run(x, copies, 1))


def device_seconds(many, one, iters: int) -> float:
    """Wall seconds per call: (chain of `iters` - chain of one) / (iters - 1), so the program's fixed
    cost cancels. Where the host launches kernels more slowly than the GPU runs them, this is the host's
    launch time, not the GPU's (`gpu_microseconds` tells them apart)."""
    t_many = time_call(many, repeats=7)
    t_one = time_call(one, repeats=7)
    return (t_many - t_one) / (iters - 1)


def gpu_kernel_events(fn) -> tuple[list[tuple[str, int]] | None, float]:
    """One fn() profiled after a warm-up call: the (kernel name, duration ns) of every kernel it ran
    on the GPU (None where the profile has no GPU plane, as on the CPU), and its wall seconds under
    the profiler."""
    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            wall = time.perf_counter() - t0
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None, wall
        profile = jax.profiler.ProfileData.from_file(files[0])
    events = [(e.name, e.duration_ns) for plane in profile.planes if plane.name.startswith("/device:GPU")
              for line in plane.lines if line.name.startswith("Stream") for e in line.events]
    return events or None, wall


def gpu_microseconds(many, iters: int, kernel_name: str = "tree_attention") -> dict[str, float] | None:
    """The GPU's own clock, from a profile of one chain: `gpu_busy_us`, the summed durations of every
    kernel the chain ran, per call, and `kernel_us`, the median duration of the launches of the Pallas
    kernel named `kernel_name` (where the path has one), and `other_kernels_us`, the four other kernels
    taking the most time per call. None where the profile has no GPU plane."""
    events, _ = gpu_kernel_events(many)
    if events is None:
        return None
    out = {"gpu_busy_us": sum(d for _, d in events) / 1e3 / iters}
    kernel = sorted(d for name, d in events if kernel_name in name)
    if kernel:
        out["kernel_us"] = kernel[len(kernel) // 2] / 1e3
    others = collections.Counter()
    for name, d in events:
        if kernel_name not in name:
            others[name] += d / 1e3 / iters
    out["other_kernels_us"] = dict(others.most_common(4))  # what else a call runs (layout copies, merges)
    return out


def target_and_head(model: str | None, head_dir: str | None, method: str):
    """The target (default: the embedded model) and a head for `method` (default: the one shipped for it)."""
    from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path
    from jetspec_jax.target import load_target

    target = load_target(model)
    head = load_head(head_dir or packaged_head_path(target, method), target.params["embed"].dtype, target=target)
    return target, head


def math_and_chat_prompts(data_dir: str | None) -> list[str]:
    """MATH-500 and MT-Bench prompts taken in turn: the serving benchmarks' mix of long and short answers."""
    from jetspec_jax.eval.datasets import load_benchmark

    math, chat = ([item.prompt for item in load_benchmark(name, data_dir)] for name in ("math500", "mt_bench"))
    return [p for pair in zip(math, chat) for p in pair]
