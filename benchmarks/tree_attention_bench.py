"""Tree attention: our Pallas (Triton) kernel vs XLA with a dense mask vs cuDNN, with upstream's Mosaic
GPU FlashAttention-3 as the Mosaic backend's reference point.

    python benchmarks/tree_attention_bench.py --out benchmarks/results/tree_attention_h200.json
    python benchmarks/tree_attention_bench.py --quick          # tiny shapes, any backend
    # against the kernel of an earlier commit, in the same run:
    git show 88616e7:kernels/tree_attention.py > /tmp/tree_attention_88616e7.py
    python benchmarks/tree_attention_bench.py --shapes qwen3-8b --batches 1 \
        --baseline-kernel /tmp/tree_attention_88616e7.py --out ...

Shapes of Qwen3-8B (32 query / 8 KV heads, dim 128) and of the embedded model (9 / 3, 64): prefix L in
{1024, 4096, 16384}, N tree nodes in {16, 64, 256}, batch 1 and 8, bf16, random wide trees. Each
call is timed on the device: `iters` calls written out one after another in one jitted program (each
call's output is the next call's q; K/V copies rotate so they are read from HBM). `us` is wall time:
(chain - chain of one) / (iters-1). Where kernels are short, that is the host's time to launch them,
so each chain is also profiled and the GPU's own clock gives `gpu_busy_us` (summed kernel durations
per call: the layout, kernel and merge of our path) and `kernel_us` (the Pallas kernel alone); the
bandwidth and FLOP fractions use `gpu_busy_us`. Up to commit 78ad6bd the chain was a fori_loop, whose
per-iteration host sync added several microseconds to every call; the target shapes' rows keep that
number as `us_while_loop`. The kernel tuning is swept per call class (`call_class`) on the class's
shapes (by `gpu_busy_us`), and each shape is then timed with its class's best.
Bytes: q, the L+N rows of K and V, and the output; FLOPs: 4 * N * (L+N) * H * D. Ceilings: 4.3 TB/s
copy bandwidth and 790 TFLOP/s bf16 measured on this H200.

"tokamax_mosaic" and "tokamax_triton" are tokamax's dot_product_attention (0.0.17, where tokamax is
installed) with the same dense mask as the XLA path; an implementation that rejects the mask or
shape is reported with its error.

"mosaic_fa3_nomask" is jax.experimental.pallas.ops.gpu.attention_mgpu (Hopper, warp-specialised,
wgmma) run with NO tree mask, q padded to 128 rows and K/V to a multiple of 128, in fp16 (in bf16
it raised a dtype error inside the kernel with jax 0.11.2): it does more work than a tree kernel
needs and ignores the mask, so it bounds from below what a Mosaic port of ours would cost; it is not
a correct tree attention.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (chained_calls, device_seconds, environment, gpu_microseconds, print_table,  # noqa: E402
                    write_json_atomic)

from jetspec_jax.kernels.attention import attention_scores_softmax, block_attention_mask  # noqa: E402
from jetspec_jax.kernels.tree_attention import (  # noqa: E402
    MosaicTreeAttentionTuning, TreeAttentionTuning, ancestors_from_parents, block_rows_for, head_blocked,
    kernel_inputs, merge_mosaic_splits, mosaic_unsupported_reason, pack_tree_mask, random_tree_parents,
    tree_attention, tree_attention_mosaic, tree_attention_mosaic_splits, tree_attention_reference,
    tree_attention_splits)
from jetspec_jax.kernels.tree_attention_mosaic import grid_for as mosaic_grid  # noqa: E402

BANDWIDTH, MATMUL_FLOPS = 4.3e12, 790e12
HEAD_SHAPES = {"qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
MOSAIC_STAGES = (3, 4)  # K/V tiles in flight, each timed as its own path (2 was slower at every shape)
TARGETS_US = {("qwen3-8b", 1, 4096, 256): 50.0, ("qwen3-8b", 1, 16384, 16): 30.0}  # the targets


def inputs(rng, batch, n, heads, kv_heads, d, prefix, dtype, spare=0):
    """A cache of prefix + n + spare rows: spare > 0 is a decode step's, sized for the whole generation."""
    s = prefix + n + spare
    anc = jnp.asarray(np.stack([ancestors_from_parents(random_tree_parents(rng, n, "wide")) for _ in range(batch)]))
    q = jnp.asarray(rng.standard_normal((batch, n, heads, d)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    return q, k, v, jnp.full((batch,), prefix, jnp.int32), anc


def mosaic_fa3():
    """Upstream's Mosaic GPU FlashAttention-3, or None where it cannot run (not Hopper, no Mosaic)."""
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception:  # noqa: BLE001 - any import failure means the backend is unavailable here
        return None

    def run(q, k, v):
        s = k.shape[1]
        block_kv = 128 if s % 128 == 0 else 64
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2)
        return attention_mgpu.attention(q, k, v, config)
    return run


def tokamax_attention(implementation: str):
    """tokamax's dot_product_attention with a dense (B, N, S) mask, or None where tokamax is not
    installed (it is not a dependency; the recorded rows ran tokamax 0.0.17, which needs jax >= 0.11.1)."""
    try:
        import tokamax
        from absl import flags
    except ImportError:
        return None
    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags, which would parse (and reject) our argv
        flags.FLAGS.mark_as_parsed()

    def run(q, k, v, mask):
        return tokamax.dot_product_attention(q, k, v, mask=mask[:, None], implementation=implementation)
    return run


def kernel_only(q, k, v, lengths, anc, kernel_impl, tuning):
    """The pallas_call without the layout and merge around it (where the time goes). Its chain state
    is the kernel's q input; one slice-and-cast op per call links the chain."""
    b, n, h, _ = q.shape
    block_rows = block_rows_for(tuning, h // k.shape[2] * n)
    q_in, words = kernel_inputs(q, pack_tree_mask(anc), k.shape[2], block_rows)
    partial_axis = 1 if head_blocked(n, block_rows) else 2

    def fn(q_in, k, v, lengths, words):
        out, _ = tree_attention_splits(q_in, k, v, lengths, words, num_nodes=n, num_heads=h, block_rows=block_rows,
                                       tuning=tuning, interpret=kernel_impl == "pallas_interpret")
        return jnp.take(out, 0, axis=partial_axis).astype(q_in.dtype)
    return fn, (k, v, lengths, words), q_in


def load_baseline_kernel(path: str):
    """An earlier version of the tree attention kernel's file (saved with `git show`), timed as
    "pallas_baseline" with its own default tuning."""
    spec = importlib.util.spec_from_file_location("tree_attention_baseline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def paths_for(q, k, v, lengths, anc, kernel_impl, tuning, baseline=None):
    """name -> (fn(x, *rest) -> same shape as x, rest, x); x is q unless a path needs another layout."""
    words = pack_tree_mask(anc)
    n, s = q.shape[1], k.shape[1]
    dense = block_attention_mask(lengths, n, s, anc)
    paths = {
        "pallas": (lambda q, k, v, l, w: tree_attention(q, k, v, l, w, implementation=kernel_impl, tuning=tuning),
                   (k, v, lengths, words), q),
        "pallas_kernel_only": kernel_only(q, k, v, lengths, anc, kernel_impl, tuning),
        "one_op_floor": (lambda q: -q, (), q),  # what one trivial XLA op costs in this timing loop
        "xla_dense": (lambda q, k, v, m: attention_scores_softmax(q, k, v, m), (k, v, dense), q),
    }
    if baseline is not None:
        paths["pallas_baseline"] = (
            lambda q, k, v, l, w: baseline.tree_attention_pallas(q, k, v, l, w,
                                                                 interpret=kernel_impl == "pallas_interpret"),
            (k, v, lengths, words), q)
    if jax.default_backend() == "gpu" and mosaic_unsupported_reason(q, k) is None:
        for stages in MOSAIC_STAGES:
            mosaic_tuning = MosaicTreeAttentionTuning(stages=stages)
            paths[f"mosaic_s{stages}"] = (
                lambda q, k, v, l, w, t=mosaic_tuning: tree_attention_mosaic(q, k, v, l, w, tuning=t),
                (k, v, lengths, words), q)
        paths["mosaic_merge_partials"] = (  # the per-slice merge at any split count, for comparison
            lambda q, k, v, l, w: merge_mosaic_splits(*tree_attention_mosaic_splits(q, k, v, l, w), weighted=False
                                                      ).astype(q.dtype), (k, v, lengths, words), q)
        paths["mosaic_kernel_only"] = (
            lambda q, k, v, l, w: tree_attention_mosaic_splits(q, k, v, l, w)[0][:, 0], (k, v, lengths, words), q)
    if jax.default_backend() == "gpu":
        paths["cudnn"] = (lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m[:, None],
                                                                          implementation="cudnn"),
                          (k, v, dense), q)
        for impl in ("mosaic", "triton"):  # an implementation that rejects the call is reported
            run = tokamax_attention(impl)
            if run is not None:
                paths[f"tokamax_{impl}"] = (run, (k, v, dense), q)
        fa3 = mosaic_fa3()
        if fa3 is not None:
            s_pad = -(-s // 128) * 128
            kp = jnp.pad(k, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
            vp = jnp.pad(v, ((0, 0), (0, s_pad - s), (0, 0), (0, 0)))
            n_pad = -(-n // 128) * 128
            qp = jnp.pad(q, ((0, 0), (0, n_pad - n), (0, 0), (0, 0)))
            paths["mosaic_fa3_nomask"] = (fa3, (kp.astype(jnp.float16), vp.astype(jnp.float16)),
                                          qp.astype(jnp.float16))
    return paths


def measure(rows, base, fn, x, rest, iters, nbytes, flops, out_path, payload, also_while_loop=False):
    try:
        many, one = chained_calls(fn, x, rest, iters)
        t = device_seconds(many, one, iters)
        row = dict(base, us=t * 1e6)
        gpu = gpu_microseconds(many, iters)
        if gpu is not None:
            row.update(gpu)
            t = gpu["gpu_busy_us"] / 1e6  # the fractions below use the GPU's own time where there is one
        if nbytes is not None:
            row.update(bandwidth_frac=nbytes / t / BANDWIDTH, flops_frac=flops / t / MATMUL_FLOPS)
        if also_while_loop:
            row["us_while_loop"] = device_seconds(*chained_calls(fn, x, rest, iters, "while_loop"), iters) * 1e6
    except Exception as e:  # noqa: BLE001 - an implementation that rejects a shape is reported, not fatal
        row = dict(base, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    rows.append(row)
    print(row, flush=True)
    write_json_atomic(out_path, payload)  # after every row: a run cut short keeps what it measured
    return row


# The Mosaic kernel's GPU check beyond check_kernel's shape: the CPU tests' cases (odd row-block counts,
# empty prefixes, several splits, f16, head dim 128) and a last tile moved back off the cache's end.
MOSAIC_CHECKS = [  # batch, N, heads, kv heads, head dim, cache rows, lengths, dtype, splits
    (2, 64, 4, 2, 64, 176, [100, 0], jnp.bfloat16, 2), (2, 64, 6, 2, 64, 168, [100, 37], jnp.bfloat16, 3),
    (3, 128, 3, 1, 128, 200, [70, 33, 0], jnp.float16, 4), (1, 64, 2, 1, 64, 400, [300], jnp.bfloat16, None),
    (2, 256, 32, 8, 128, 4360, [4100, 1234], jnp.bfloat16, None), (1, 512, 9, 3, 64, 1032, [517], jnp.bfloat16, 5)]


def check_kernel(kernel_impl, tuning, dtype):
    """The kernel agrees with the reference on one mid-size shape before anything is timed; on the
    GPU, so does the Mosaic kernel there and at MOSAIC_CHECKS."""
    rng = np.random.default_rng(7)
    q, k, v, lengths, anc = inputs(rng, 2, 64, 32, 8, 128, 700, dtype, spare=4)
    lengths = jnp.asarray([700, 333], jnp.int32)
    calls = [(kernel_impl, functools.partial(tree_attention, implementation=kernel_impl, tuning=tuning),
              (q, k, v, lengths, anc))]
    if jax.default_backend() == "gpu" and dtype != jnp.float32:
        calls.append(("mosaic", tree_attention_mosaic, (q, k, v, lengths, anc)))
        for b, n, h, hkv, d, s, lens, dt, splits in MOSAIC_CHECKS:
            qc, kc, vc, _, ac = inputs(rng, b, n, h, hkv, d, s - n, dt, spare=0)
            fn = functools.partial(tree_attention_mosaic, tuning=MosaicTreeAttentionTuning(splits=splits))
            calls.append((f"mosaic B={b} N={n} H={h}/{hkv} D={d} S={s} {jnp.dtype(dt).name}", fn,
                          (qc, kc, vc, jnp.asarray(lens, jnp.int32), ac)))
    errors = {}
    for name, fn, (q, k, v, lengths, anc) in calls:
        words = pack_tree_mask(anc)
        want = tree_attention_reference(q, k, v, lengths, words).astype(jnp.float32)
        errors[name] = float(jnp.max(jnp.abs(fn(q, k, v, lengths, words).astype(jnp.float32) - want)))
        print(f"{name} kernel vs reference max abs error: {errors[name]:.3g}", flush=True)
        if not errors[name] < (3e-2 if dtype == jnp.bfloat16 else 1e-4):
            raise SystemExit(f"the {name} kernel disagrees with the reference (max abs error {errors[name]})")
    return errors


def call_class(heads: int, kv_heads: int, n: int) -> str:
    """Two classes of call: at most one 64-row block of query rows per KV head ("decode",
    bandwidth-bound) or more ("tree", compute-bound). The bench picks a tuning per class; the kernel
    has one default for both, which the sweeps so far kept."""
    return "decode" if heads // kv_heads * n <= 64 else "tree"


def tunings(*specs):
    """(block_rows, block_k, num_warps, num_stages, target_programs[, {other TreeAttentionTuning fields}])."""
    return [TreeAttentionTuning(block_rows=r, block_k=kb, num_warps=w, num_stages=st, target_programs=tp,
                                **(rest[0] if rest else {})) for r, kb, w, st, tp, *rest in specs]


M2, TREE_LAST, KERNEL_MERGE = {"min_blocks_per_split": 2}, {"tree_in_last_split": True}, {"merge_in_kernel": True}
TREE64, BY_LENGTH = {"tree_block_k": 64}, {"split_by_length": True}


# Per class: the shapes it is swept on (batch, prefix, nodes[, spare cache rows]: the target, and
# the embedded model's verify at B=256 or its AR decode step, also mid-generation in the eval's cache of
# 512 prompt + 512 new + 256 tree rows) and the candidates, the kernel's current default for the class
# first. The best candidate has the lowest geometric mean time over the class's shapes.
SWEEP = {
    "tree": ([("qwen3-8b", 1, 4096, 256), ("smollm2-135m", 1, 1024, 256), ("smollm2-135m", 1, 400, 256, 624)],
             tunings((64, 64, 4, 3, 132), (64, 64, 4, 3, 132, TREE_LAST), (64, 64, 4, 3, 132, TREE_LAST | KERNEL_MERGE),
                     (64, 64, 4, 3, 132, TREE64), (64, 64, 4, 3, 132, TREE64 | BY_LENGTH),
                     (64, 64, 4, 3, 132, TREE_LAST | TREE64), (64, 64, 4, 3, 132, TREE_LAST | TREE64 | BY_LENGTH))),
    "decode": ([("qwen3-8b", 1, 16384, 16), ("smollm2-135m", 1, 1024, 1), ("smollm2-135m", 1, 400, 1, 879)],
               tunings((64, 64, 4, 3, 132), (64, 64, 4, 3, 132, TREE_LAST), (64, 64, 4, 3, 132, BY_LENGTH),
                       (64, 64, 4, 3, 264, M2), (64, 64, 4, 3, 264, M2 | BY_LENGTH))),
}
# Swept earlier and dropped as slower at every shape (benchmarks/results/tree_attention_h200_*.json):
# 2 stages, block_k 32 or 128 at 64 rows, 8 warps at 64 rows, 66 or 264 programs without the options,
# 128-row programs (with or without the options), min_blocks_per_split 1, fp32
# partials (merged by XLA), 32-row programs (one partial, but 2x slower: no wgmma below 64 rows), the
# in-kernel merge without the tree in the last split, and with it at the decode shapes.


def tuning_sweep(args, dtype, payload) -> tuple[dict[str, TreeAttentionTuning], dict[tuple, TreeAttentionTuning]]:
    """Every SWEEP tuning of a class on that class's shapes. Returns the best per class (over its
    shapes) and the best at each swept shape without spare cache rows, keyed (shape, batch, L, N): a
    class's best can lose at one shape (the 8B tree shape, to a tuning the embedded model's favour)."""
    rng = np.random.default_rng(0)
    sweep = SWEEP
    if args.quick:
        sweep = {"decode": ([("smollm2-135m", 1, 64, 16)], SWEEP["decode"][1][:2])}
    best, best_at = {}, {}
    for cls, (shapes, candidates) in sweep.items():
        log_times = np.zeros(len(candidates))
        for shape_name, batch, prefix, n, *spare in shapes:
            shape_times = []
            heads, kv_heads, d = HEAD_SHAPES[shape_name]
            q, k, v, lengths, anc = inputs(rng, batch, n, heads, kv_heads, d, prefix, dtype, *spare)
            words = pack_tree_mask(anc)
            want = tree_attention_reference(q, k, v, lengths, words).astype(jnp.float32)
            for i, tuning in enumerate(candidates):
                fn = functools.partial(tree_attention, implementation=args.kernel_impl, tuning=tuning)
                error = float(jnp.max(jnp.abs(fn(q, k, v, lengths, words).astype(jnp.float32) - want)))
                base = dict(shape=shape_name, batch=batch, L=prefix, N=n, call_class=cls, cache_rows=int(k.shape[1]),
                            tuning=tuning_name(tuning),
                            max_abs_error=error)  # some options round differently: their accuracy is part of the row
                row = measure(payload["sweep"], base, fn, q, (k, v, lengths, words), args.iters, None, None,
                              args.out, payload)
                shape_times.append(row.get("gpu_busy_us", row.get("us", np.inf)))
                log_times[i] += np.log(max(shape_times[-1], 1e-3))
            if not spare:
                best_at[(shape_name, batch, prefix, n)] = candidates[int(np.argmin(shape_times))]
        best[cls] = candidates[int(np.argmin(log_times))]
        print(f"best {cls} tuning: {tuning_name(best[cls])}", flush=True)
    best.setdefault("tree", best.get("decode"))
    return best, best_at


def tuning_name(t: TreeAttentionTuning) -> str:
    return (f"rows{t.block_rows}_k{t.block_k}_w{t.num_warps}_s{t.num_stages}_p{t.target_programs}"
            + (f"_m{t.min_blocks_per_split}" if t.min_blocks_per_split != 4 else "")
            + ("_treelast" if t.tree_in_last_split else "") + ("_lowpartials" if t.low_precision_partials else "")
            + ("_kmerge" if t.merge_in_kernel else "") + (f"_tree{t.tree_block_k}" if t.tree_block_k != 32 else "")
            + ("_bylength" if t.split_by_length else ""))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the CPU)")
    p.add_argument("--iters", type=int, default=40,
                   help="calls per timed chain (unrolled, so each is compiled in: more costs compile time)")
    p.add_argument("--out", default="benchmarks/results/tree_attention.json")
    p.add_argument("--shapes", nargs="+", choices=list(HEAD_SHAPES), default=list(HEAD_SHAPES))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--targets-only", action="store_true", help="time only the issue's two target shapes")
    p.add_argument("--paths", nargs="+", default=None,
                   help="time only these paths (e.g. pallas tokamax_mosaic); default: every path")
    p.add_argument("--check-only", action="store_true", help="check the kernels against the reference, then stop")
    p.add_argument("--no-sweep", action="store_true", help="skip the tuning sweep: the kernel's default tuning")
    p.add_argument("--baseline-kernel", default=None,
                   help="the tree attention kernel's file of an earlier commit (git show) to time alongside")
    args = p.parse_args()
    baseline = load_baseline_kernel(args.baseline_kernel) if args.baseline_kernel else None
    on_gpu = jax.default_backend() == "gpu"
    args.kernel_impl = "pallas" if on_gpu else "pallas_interpret"
    if args.quick:
        batches, prefixes, nodes, args.iters = [1], [64], [16], 3
        shapes = {"smollm2-135m": HEAD_SHAPES["smollm2-135m"]}
    else:
        batches, prefixes, nodes = args.batches, [1024, 4096, 16384], [16, 64, 256]
        shapes = {name: HEAD_SHAPES[name] for name in args.shapes}
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    payload = dict(benchmark="tree_attention", sweep=[], attention=[], iters=args.iters,
                   ceilings=dict(bandwidth_bytes_per_s=BANDWIDTH, bf16_flops=MATMUL_FLOPS),
                   targets_us={f"{k[0]} B={k[1]} L={k[2]} N={k[3]}": v for k, v in TARGETS_US.items()},
                   baseline_kernel=args.baseline_kernel, environment=environment())
    if not args.quick:
        payload["kernel_max_abs_error_vs_reference"] = check_kernel(args.kernel_impl, TreeAttentionTuning(), dtype)
        if args.check_only:
            write_json_atomic(args.out, payload)
            return
    best, best_at = (({"tree": TreeAttentionTuning(), "decode": TreeAttentionTuning()}, {}) if args.no_sweep
                     else tuning_sweep(args, dtype, payload))
    payload["tuning"] = {cls: tuning_name(t) for cls, t in best.items()}
    rng = np.random.default_rng(0)
    for shape_name, (heads, kv_heads, d) in shapes.items():
        for batch, prefix, n in itertools.product(batches, prefixes, nodes):
            if args.targets_only and (shape_name, batch, prefix, n) not in TARGETS_US:
                continue
            q, k, v, lengths, anc = inputs(rng, batch, n, heads, kv_heads, d, prefix, dtype)
            nbytes = (q.size * 2 + 2 * k.size) * q.dtype.itemsize
            flops = 4 * n * (prefix + n) * heads * d * batch
            target = TARGETS_US.get((shape_name, batch, prefix, n))
            tuning = best_at.get((shape_name, batch, prefix, n), best[call_class(heads, kv_heads, n)])
            for name, (fn, rest, x) in paths_for(q, k, v, lengths, anc, args.kernel_impl, tuning,
                                                     baseline).items():
                if args.paths is not None and name not in args.paths:
                    continue
                base = dict(shape=shape_name, batch=batch, L=prefix, N=n, path=name, target_us=target)
                if name in ("pallas", "pallas_kernel_only"):
                    base["tuning"] = tuning_name(tuning)
                if name.startswith("mosaic_") and name != "mosaic_fa3_nomask":
                    base["mosaic_splits"] = mosaic_grid(q.shape, k.shape, MosaicTreeAttentionTuning())[2] // batch
                measure(payload["attention"], base, fn, x, rest, args.iters, nbytes, flops, args.out, payload,
                        also_while_loop=target is not None and name in ("pallas", "one_op_floor"))
    print_table(payload["sweep"], ["shape", "batch", "L", "N", "call_class", "tuning", "us", "gpu_busy_us",
                                   "kernel_us", "max_abs_error", "error"])
    print_table(payload["attention"], ["shape", "batch", "L", "N", "path", "tuning", "us", "gpu_busy_us", "kernel_us",
                                       "us_while_loop", "target_us", "bandwidth_frac", "flops_frac", "error"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
