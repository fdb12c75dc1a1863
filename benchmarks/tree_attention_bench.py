"""Tree attention: our Pallas kernel vs XLA with a dense mask vs cuDNN, and one verify forward of a
Qwen3-8B-shaped target with each path.

    python benchmarks/tree_attention_bench.py --out benchmarks/results/tree_attention_h200.json
    python benchmarks/tree_attention_bench.py --quick          # tiny shapes, any backend

Attention: shapes of Qwen3-8B (32 query / 8 KV heads, dim 128) and of the embedded model (9 / 3, 64),
prefix L in {1024, 4096, 16384}, N tree nodes in {16, 64, 256}, batch 1 and 8, bf16, random trees.
Bytes counted: q, the L+N rows of K and V, and the output; FLOPs: 4 * N * (L+N) * H * D. Ceilings:
4.3 TB/s copy bandwidth and 790 TFLOP/s bf16 measured on this H200.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402

from jetspec_jax.kernels.tree_attention import (TreeAttentionTuning, ancestors_from_parents, pack_tree_mask,  # noqa: E402
                                                random_tree_parents, tree_attention)
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402

BANDWIDTH, MATMUL_FLOPS = 4.3e12, 790e12
HEAD_SHAPES = {"qwen3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


def inputs(rng, batch, n, heads, kv_heads, d, prefix, dtype):
    s = prefix + n
    parents = [random_tree_parents(rng, n, "wide") for _ in range(batch)]
    anc = jnp.asarray(np.stack([ancestors_from_parents(p) for p in parents]))
    q = jnp.asarray(rng.standard_normal((batch, n, heads, d)), dtype)
    k = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    v = jnp.asarray(rng.standard_normal((batch, s, kv_heads, d)), dtype)
    return q, k, v, jnp.full((batch,), prefix, jnp.int32), anc


def cudnn_attention(q, k, v, lengths, anc):
    """jax.nn.dot_product_attention with a dense boolean mask (cuDNN accepts masks as a bias)."""
    n, s = q.shape[1], k.shape[1]
    mask = qwen3.block_attention_mask(lengths, n, s, anc)[:, None]  # (B, 1, N, S)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="cudnn")


def attention_rows(args, dtype):
    rng = np.random.default_rng(0)
    rows = []
    for shape_name, (heads, kv_heads, d) in HEAD_SHAPES.items():
        for batch in args.batches:
            for prefix in args.prefixes:
                for n in args.nodes:
                    q, k, v, lengths, anc = inputs(rng, batch, n, heads, kv_heads, d, prefix, dtype)
                    words = pack_tree_mask(anc)
                    dense_mask = qwen3.block_attention_mask(lengths, n, k.shape[1], anc)
                    paths = {
                        "pallas": jax.jit(functools.partial(tree_attention, implementation=args.kernel_impl,
                                                            tuning=TreeAttentionTuning())),
                        "xla_dense": jax.jit(lambda q, k, v, lengths, words, m=dense_mask:
                                             qwen3.attention_scores_softmax(q, k, v, m)),
                    }
                    if jax.default_backend() == "gpu":
                        paths["cudnn"] = jax.jit(lambda q, k, v, lengths, words, a=anc:
                                                 cudnn_attention(q, k, v, lengths, a))
                    nbytes = (q.size * 2 + 2 * k.size) * q.dtype.itemsize
                    flops = 4 * n * (prefix + n) * heads * d * batch
                    for name, fn in paths.items():
                        try:
                            t = time_call(lambda: fn(q, k, v, lengths, words), repeats=args.repeats)
                        except Exception as e:  # an implementation that rejects the shape is reported
                            rows.append(dict(shape=shape_name, batch=batch, L=prefix, N=n, path=name,
                                             error=str(e).splitlines()[0][:120]))
                            continue
                        rows.append(dict(shape=shape_name, batch=batch, L=prefix, N=n, path=name, us=t * 1e6,
                                         bandwidth_frac=nbytes / t / BANDWIDTH, flops_frac=flops / t / MATMUL_FLOPS))
                    print(rows[-1], flush=True)
    return rows


def qwen3_8b_config(layers: int) -> qwen3.Config:
    return qwen3.Config(architecture="qwen3", vocab_size=151936, hidden_size=4096, num_layers=layers,
                        num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1e6)


def verify_rows(args, dtype):
    cfg = qwen3_8b_config(args.verify_layers)
    params = qwen3.fuse_for_decode(init_params(qwen3.param_specs(cfg), jax.random.key(0), dtype))
    rng = np.random.default_rng(1)
    rows = []
    for prefix in args.verify_prefixes:
        for n in args.verify_nodes:
            parents = random_tree_parents(rng, n, "wide")
            anc = jnp.asarray(ancestors_from_parents(parents))[None]
            depths = jnp.asarray([[len(np.flatnonzero(a)) - 1 for a in np.asarray(anc[0])]])
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, n)), jnp.int32)
            for impl in ("xla", args.kernel_impl):
                cache = qwen3.new_cache(cfg, 1, prefix + n, dtype)._replace(lengths=jnp.asarray([prefix], jnp.int32))

                @functools.partial(jax.jit, donate_argnums=(1,))
                def verify(params, cache, impl=impl):
                    logits, _, cache = qwen3.forward(params, tokens, prefix + depths, cache, cfg, mask=anc,
                                                     attention_impl=impl)
                    return logits, cache

                state = {"cache": cache}  # the donated cache is threaded through the repeats

                def run():
                    logits, state["cache"] = verify(params, state["cache"])
                    return logits

                t = time_call(run, repeats=args.repeats)
                rows.append(dict(model=f"qwen3-8b-shaped x{cfg.num_layers} layers", L=prefix, N=n, path=impl,
                                 ms=t * 1e3))
                print(rows[-1], flush=True)
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (for the CPU)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default="benchmarks/results/tree_attention.json")
    args = p.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    args.kernel_impl = "pallas" if on_gpu else "pallas_interpret"
    if args.quick:
        args.batches, args.prefixes, args.nodes = [1], [64], [16]
        args.verify_layers, args.verify_prefixes, args.verify_nodes, args.repeats = 1, [64], [16], 2
        HEAD_SHAPES.pop("qwen3-8b")
    else:
        args.batches, args.prefixes, args.nodes = [1, 8], [1024, 4096, 16384], [16, 64, 256]
        args.verify_layers, args.verify_prefixes, args.verify_nodes = 36, [1024, 4096], [1, 16, 64, 256]
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    attn = attention_rows(args, dtype)
    print_table(attn, ["shape", "batch", "L", "N", "path", "us", "bandwidth_frac", "flops_frac", "error"])
    verify = verify_rows(args, dtype)
    print_table(verify, ["model", "L", "N", "path", "ms"])
    write_json_atomic(args.out, dict(benchmark="tree_attention", attention=attn, verify_forward=verify,
                                     ceilings=dict(bandwidth_bytes_per_s=BANDWIDTH, bf16_flops=MATMUL_FLOPS),
                                     environment=environment()))


if __name__ == "__main__":
    main()
