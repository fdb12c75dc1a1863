"""Tree attention over a paged KV pool against the dense cache: the Triton kernel's time on the GPU's own
clock for each layout, and the paged output's error against the reference.

    python benchmarks/paged_attention_bench.py --out benchmarks/results/paged_attention_h200.json
    python benchmarks/paged_attention_bench.py --quick      # tiny shapes, any backend (interpret mode off GPU)

A dense cache has `capacity` rows a sequence (a server's --max-len); a paged pool holds the sequence's
prefix + N rows in pages of 16 or 64 rows, scattered over the pool in random order, as a server's
pages end up. Decode steps (N=1) and trees (N=64, 256) of Qwen3-8B's heads (32 / 8, dim 128) and the
embedded model's (9 / 3, dim 64), bf16. `us` is wall time per call of a chain of calls, `gpu_busy_us`
the GPU's summed kernel time per call (benchmarks/common.py)."""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (chained_calls, device_seconds, environment, gpu_microseconds, print_table,  # noqa: E402
                    write_json_atomic)

from jetspec_jax.kernels.tree_attention import (ancestors_from_parents, pack_tree_mask,  # noqa: E402
                                                random_tree_parents, tree_attention, tree_attention_reference)
from jetspec_jax.kv_cache import pages_for  # noqa: E402

HEAD_SHAPES = {"qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def paged_pool(rng, rows: jax.Array, page_size: int, spare_pages: int = 7):
    """Dense rows (B, S, Hkv, D) as a pool whose pages hold them in random order, and its table."""
    b, s = rows.shape[:2]
    per = pages_for(s, page_size)
    padded = jnp.pad(rows, ((0, 0), (0, per * page_size - s), (0, 0), (0, 0)))
    order = rng.permutation(b * per + spare_pages)[: b * per]
    pool = jnp.zeros((b * per + spare_pages, page_size) + rows.shape[2:], rows.dtype)
    pool = pool.at[order].set(padded.reshape((b * per, page_size) + rows.shape[2:]))
    return pool, jnp.asarray(order.reshape(b, per), jnp.int32)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the CPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/paged_attention.json")
    p.add_argument("--models", nargs="+", choices=list(HEAD_SHAPES), default=list(HEAD_SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    impl = "pallas" if on_gpu else "pallas_interpret"
    if args.quick:
        grid = [("smollm2-135m", 1, 100, n, cap) for n in (1, 13) for cap in (None, 256)]
    else:
        grid = [("qwen3-8b", b, length, n, cap) for b, length, n, cap in
                itertools.product(args.batches, (1024, 4096), (1, 64, 256), (None, 16384))]
        grid += [("smollm2-135m", b, 1024, n, cap)
                 for b, n, cap in itertools.product(args.batches, (1, 64), (None, 8192))]
        grid = [g for g in grid if g[0] in args.models]
    rows, payload = [], {"environment": environment(), "implementation": impl, "rows": None}
    payload["rows"] = rows
    rng = np.random.default_rng(0)
    for model, batch, length, n, capacity in grid:
        if batch == 8 and n == 256:
            continue  # 2,048 tree tokens a step: past the budgets batch 8 runs
        heads, kv_heads, d = HEAD_SHAPES[model]
        s = capacity or length + n
        q = jnp.asarray(rng.standard_normal((batch, n, heads, d)), jnp.bfloat16)
        k = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), jnp.bfloat16)
        anc = np.stack([ancestors_from_parents(random_tree_parents(rng, n, "wide")) for _ in range(batch)])
        words, lengths = pack_tree_mask(jnp.asarray(anc)), jnp.full((batch,), length, jnp.int32)
        want = np.asarray(tree_attention_reference(q, k, v, lengths, words), np.float32)
        layouts = [("dense", None)] + ([] if capacity else [("paged", 16), ("paged", 64)])
        for layout, page_size in layouts:
            base = dict(model=model, batch=batch, prefix=length, nodes=n, layout=layout, page_size=page_size,
                        cache_rows=s if page_size is None else length + n)
            if page_size is None:
                rest = (k, v, lengths, words)

                def fn(x, k, v, lengths, words):
                    return tree_attention(x, k, v, lengths, words, implementation=impl)
            else:
                kp, pages = paged_pool(np.random.default_rng(1), k, page_size)
                vp, _ = paged_pool(np.random.default_rng(1), v, page_size)  # the same permutation
                rest = (kp, vp, lengths, words, pages)

                def fn(x, k, v, lengths, words, pages):
                    return tree_attention(x, k, v, lengths, words, implementation=impl, pages=pages)
            got = np.asarray(fn(q, *rest), np.float32)
            row = dict(base, max_abs_error=float(np.max(np.abs(got - want))))
            if on_gpu:
                many, one = chained_calls(fn, q, rest, args.iters)
                row["us"] = device_seconds(many, one, args.iters) * 1e6
                row.update(gpu_microseconds(many, args.iters) or {})
                row.pop("other_kernels_us", None)
            rows.append(row)
            print(row, flush=True)
            write_json_atomic(args.out, payload)
    print_table(rows, ["model", "batch", "prefix", "nodes", "layout", "page_size", "cache_rows", "us", "gpu_busy_us",
                       "kernel_us", "max_abs_error"])


if __name__ == "__main__":
    main()
