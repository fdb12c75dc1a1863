"""Tree build: the reference builder (XLA, one pop loop of small kernels) against the Pallas kernel
(jetspec_jax/kernels/tree_build.py), at the eval's budgets, depth 15 and width 7, batch 1 and 8.

    python benchmarks/tree_build_bench.py --out benchmarks/results/tree_build_h200.json
    python benchmarks/tree_build_bench.py --quick          # tiny, any backend (interpret mode)

Inputs are per-depth top-7 log-probs of random logits rounded to bf16 (ties as on the GPU). Before
timing, the two builders' trees are compared field by field. Each build is timed as in
tree_attention_bench.py: `us` is wall time per call of an unrolled chain (each call's output feeds
the next call's input through one small op), `gpu_busy_us` the summed kernel durations per call
from a profile of the chain (the GPU's own clock), `kernel_us` the Pallas kernel alone.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (chained_calls, device_seconds, environment, gpu_microseconds, print_table,  # noqa: E402
                    write_json_atomic)

from jetspec_jax.kernels.tree_build import build_trees  # noqa: E402
from jetspec_jax.tree import top_candidates  # noqa: E402


def candidates(batch: int, depth: int, width: int, seed: int):
    logits = jax.random.normal(jax.random.key(seed), (batch, depth, 512)) * 3
    log_probs = jax.nn.log_softmax(logits.astype(jnp.bfloat16).astype(jnp.float32), axis=-1)
    return top_candidates(log_probs.astype(jnp.bfloat16).astype(jnp.float32), width)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (for the CPU)")
    p.add_argument("--iters", type=int, default=40, help="calls per timed chain")
    p.add_argument("--out", default="benchmarks/results/tree_build.json")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    kernel = "pallas" if on_gpu else "pallas_interpret"
    budgets, batches, depth, width = ([16, 32, 64, 128, 256], [1, 8], 15, 7) if not args.quick else ([16], [1], 4, 3)
    iters = args.iters if not args.quick else 3
    payload = dict(benchmark="tree_build", depth=depth, width=width, iters=iters, rows=[], environment=environment())
    for batch in batches:
        tokens, logps = candidates(batch, depth, width, seed=batch)
        root = jnp.arange(batch, dtype=jnp.int32)
        for budget in budgets:
            trees = {impl: build_trees(root, tokens, logps, budget=budget, implementation=impl)
                     for impl in ("xla", kernel)}
            same = all(bool(jnp.array_equal(getattr(trees["xla"], f), getattr(trees[kernel], f)))
                       for f in trees["xla"]._fields)
            if not same:
                raise SystemExit(f"the kernel's tree differs from the reference at batch {batch}, budget {budget}")
            for impl in ("xla", kernel):
                def fn(x, tokens, root, impl=impl):  # the next input depends on this tree: nothing hoists
                    tree = build_trees(root, tokens, x, budget=budget, implementation=impl)
                    return x + 1e-30 * tree.scores[:, -1:, None]
                many, one = chained_calls(fn, logps, (tokens, root), iters)
                row = dict(batch=batch, budget=budget, builder=impl, us=device_seconds(many, one, iters) * 1e6)
                row.update(gpu_microseconds(many, iters, kernel_name="tree_build") or {})
                payload["rows"].append(row)
                print(row, flush=True)
                write_json_atomic(args.out, payload)
    print_table(payload["rows"], ["batch", "budget", "builder", "us", "gpu_busy_us", "kernel_us"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
