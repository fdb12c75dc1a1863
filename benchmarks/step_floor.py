"""The whole speculative step against the whole AR step, each beside the floor the device allows.

    # Qwen3-8B shape, batch 1 and 8 and 32 (random weights; a paper-sized 5-layer head)
    python benchmarks/step_floor.py --models qwen3-8b-shaped --batches 1 --contexts 1024 4096 \\
        --budgets 64 128 256 --out benchmarks/results/step_floor_h200.json
    python benchmarks/step_floor.py --models qwen3-8b-shaped --batches 8 32 --contexts 1024 \\
        --budgets 16 32 64 128 --out benchmarks/results/step_floor_h200.json
    # Qwen3-30B-A3B shape (MoE) and the embedded target with its shipped head
    python benchmarks/step_floor.py --models qwen3-30b-a3b-shaped embedded --batches 1 8 --contexts 1024 \\
        --budgets 16 64 256 --out benchmarks/results/step_floor_h200.json

A step is timed inside the product's own loops with their defaults (`generate_tokens` for AR,
`speculative_generate` for JetSpec: attention, tree builder, compaction and GEMM backend as a user gets
them): a run of `--new-tokens` less a run of one new token, over the steps the longer run took, so
prefill and the call's fixed cost cancel. Each row holds `ar_step_ms` (the same batch and context),
`loop_step_ms`, their ratio, and the floor of each: the device's measured copy bandwidth and bf16
matmul rate (timed first) against the bytes and FLOPs a pass must move and compute (shapes.py: every
weight it uses read once, an MoE layer's experts as many as the pass's tokens reach, the cache read
once; a speculative step is a head pass and a verify pass). Once the device has more rows than the
cost model has coefficients, each row's step is printed beside the model's prediction from a fit to the
others (step_cost.py). Rows already in `--out` for the same device are kept and skipped, and
`--minutes` stops starting rows past its box, so a grid can be measured over several runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402
from shapes import SHAPES, draft_pass_cost, floor_ms, pass_cost, shape_config, touched_experts  # noqa: E402
from step_cost import COEFFICIENTS, with_predictions  # noqa: E402
from step_cost import COLUMNS as COST_COLUMNS  # noqa: E402

from jetspec_jax import draft_vocab  # noqa: E402
from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.models import draft_head, qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.speculative import HeadDrafter, SpecConfig, speculative_cache_rows, speculative_generate  # noqa: E402
from jetspec_jax.target import default_dtype  # noqa: E402
from jetspec_jax.tokens import plan_cache_len  # noqa: E402

KEY = ("model", "batch", "context", "budget", "draft_vocab")  # draft_vocab None: the whole vocabulary


def device_ceilings(quick: bool) -> dict[str, float]:
    """Copy bandwidth (bytes read + written a second) and bf16 matmul FLOP rate, measured here."""
    n = 1 << (20 if quick else 30)  # bf16 elements: 2 GiB on a GPU
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    bandwidth = 2 * n * 2 / time_call(lambda: copy(x), repeats=10)
    m = 1024 if quick else 8192
    a = jax.random.normal(jax.random.key(1), (m, m), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(2), (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda p, q: p @ q)
    flop_rate = 2 * m ** 3 / time_call(lambda: matmul(a, b), repeats=10)
    return {"copy_bytes_per_s": bandwidth, "matmul_bf16_flops_per_s": flop_rate}


def load_model(name: str, dtype, head_layers: int | None, target_layers: int | None):
    """(target cfg, target params, head cfg, head params, description, narrow) of a shape with random weights
    (the first `target_layers` of them, for a quick check), or of the embedded target with its shipped head;
    `narrow(n)` is the head's params drafting over n tokens (the shipped counts' most frequent, or a
    shape's first n: a pass's time does not depend on which)."""
    if name == "embedded":
        from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path
        from jetspec_jax.target import load_target

        target = load_target(dtype=dtype, with_tokenizer=False)
        path = packaged_head_path(target, "jetspec")
        head_cfg, head = load_head(path, dtype)
        return (target.cfg, target.params, head_cfg, head, f"{os.path.basename(target.source)}, shipped JetSpec head",
                lambda n: draft_vocab.for_head(path, head, target, n))
    _, description, default_layers = SHAPES[name]
    cfg = shape_config(name, target_layers)
    params = init_params(qwen3.param_specs(cfg), jax.random.key(0), dtype)
    head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=head_layers or default_layers)
    head = init_params(draft_head.param_specs(head_cfg), jax.random.key(1), dtype)
    return (cfg, params, head_cfg, head, f"{description}, random weights, {head_cfg.num_layers}-layer head",
            lambda n: draft_vocab.attach(head, params, cfg.tie_embeddings, np.arange(n)))


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in KEY)  # rows from before draft vocabularies lack the key: the whole one


def per_step_ms(run, new_tokens: int) -> tuple[float, int]:
    """(ms a step, steps) of `run(n)`: a generation of n new tokens, less one of a single token."""
    out = jax.block_until_ready(run(new_tokens)())
    steps = int(np.max(np.asarray(out.target_forwards))) if hasattr(out, "target_forwards") else new_tokens - 1
    return (time_call(run(new_tokens)) - time_call(run(1))) / steps * 1e3, steps


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-8b-shaped"], choices=list(SHAPES) + ["embedded"])
    p.add_argument("--batches", type=int, nargs="+", default=[1])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024], help="committed tokens before the steps")
    p.add_argument("--budgets", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--draft-vocabs", type=int, nargs="+", default=[0], metavar="N",
                   help="the head drafting over N tokens (jetspec_jax/draft_vocab.py); 0 = the whole vocabulary")
    p.add_argument("--new-tokens", type=int, default=33, help="tokens of the timed run (one more than AR's steps)")
    p.add_argument("--head-layers", type=int, default=None, help="layers of a shape's random head (default: the "
                                                                 "paper-sized one of shapes.SHAPES)")
    p.add_argument("--target-layers", type=int, default=None, help="a shape's first layers only (a quick check)")
    p.add_argument("--minutes", type=float, default=None, help="start no row past this many minutes")
    p.add_argument("--quick", action="store_true", help="small ceilings' arrays (a CPU check of the script)")
    p.add_argument("--out", default="benchmarks/results/step_floor.json")
    args = p.parse_args()
    started = time.monotonic()
    vocabs = [n or None for n in dict.fromkeys(args.draft_vocabs)]
    dtype = default_dtype()
    device = jax.devices()[0].device_kind
    old = {}
    if os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
    rows = [r for r in old.get("rows", []) if r.get("device") == device]
    done = {row_key(r) for r in rows}
    ceilings = device_ceilings(args.quick)
    # each run's environment (commit, versions, command) and ceilings; a row names the run that made it
    runs = old.get("runs", []) + [dict(environment=environment(), ceilings=ceilings, new_tokens=args.new_tokens,
                                       width=args.width)]
    payload = dict(benchmark="step_floor", runs=runs, rows=rows)
    columns = ["model", "batch", "context", "budget", "draft_vocab", "ar_step_ms", "loop_step_ms", "step_over_ar",
               "floor_ar_ms", "floor_step_ms", "floor_step_over_ar", "step_over_floor"]

    def out_of_time() -> bool:
        return args.minutes is not None and time.monotonic() - started > 60 * args.minutes

    for name in args.models:
        wanted = [(b, c, budget, n) for b in args.batches for c in args.contexts for budget in args.budgets
                  for n in vocabs if (name, b, c, budget, n) not in done]
        if not wanted or out_of_time():
            continue
        cfg, params, head_cfg, whole_head, description, narrow = load_model(name, dtype, args.head_layers,
                                                                            args.target_layers)
        heads = {n: whole_head if n is None else narrow(n) for n in {n for *_, n in wanted}}  # those rows left
        params = jax.jit(qwen3.fuse_for_decode)(params)
        itemsize = jnp.dtype(dtype).itemsize
        ar_ms: dict[tuple[int, int], float] = {}
        for batch, context, budget, vocab in wanted:
            if out_of_time():
                break
            head = heads[vocab]
            prompt = jax.random.randint(jax.random.key(batch + context), (batch, context), 0, cfg.vocab_size)
            lengths = jnp.full((batch,), context, jnp.int32)
            keys = jax.random.key(0)
            if (batch, context) not in ar_ms:
                def ar(n):
                    gen = GenerationConfig(max_new_tokens=n)
                    cache_len = plan_cache_len(context, context, n, cfg.max_position_embeddings)
                    return lambda: generate_tokens(params, prompt, lengths, keys, cfg=cfg, gen=gen,
                                                   cache_len=cache_len)
                ar_ms[batch, context] = per_step_ms(ar, args.new_tokens)[0]
            spec = SpecConfig("jetspec", budget, args.width)
            drafter = HeadDrafter(head_cfg, cfg).for_specs([spec])

            def speculative(n):
                gen = GenerationConfig(max_new_tokens=n)
                extra = speculative_cache_rows(budget, spec.depth(drafter.max_depth))
                cache_len = plan_cache_len(context, context, n, cfg.max_position_embeddings, extra=extra)
                return lambda: speculative_generate(params, head, prompt, lengths, keys, cfg=cfg, drafter=drafter,
                                                    spec=spec, gen=gen, cache_len=cache_len)
            step_ms, steps = per_step_ms(speculative, args.new_tokens)
            floors = ceilings["copy_bytes_per_s"], ceilings["matmul_bf16_flops_per_s"]
            floor_ar = floor_ms(pass_cost(cfg, 1, batch, context, itemsize), *floors)
            floor_step = (floor_ms(pass_cost(cfg, budget, batch, context, itemsize), *floors)
                          + floor_ms(draft_pass_cost(head_cfg, cfg, batch, context, itemsize, vocab), *floors))
            row = dict(model=name, description=description, device=device, run=len(runs) - 1, batch=batch,
                       context=context, target_layers=cfg.num_layers, head_layers=head_cfg.num_layers,
                       budget=budget, draft_vocab=vocab, steps=steps, ar_step_ms=ar_ms[batch, context], loop_step_ms=step_ms,
                       step_over_ar=step_ms / ar_ms[batch, context], floor_ar_ms=floor_ar, floor_step_ms=floor_step,
                       floor_step_over_ar=floor_step / floor_ar, step_over_floor=step_ms / floor_step,
                       experts_touched_ar=touched_experts(cfg, batch),
                       experts_touched_verify=touched_experts(cfg, batch * budget))
            rows.append(row)
            payload["rows"] = rows
            write_json_atomic(args.out, payload)
            print_table([row], columns)
        params = head = heads = whole_head = narrow = None  # free the model before the next one loads
    rows.sort(key=lambda r: tuple(v or 0 for v in row_key(r)))
    payload["rows"] = rows
    write_json_atomic(args.out, payload)
    print_table(rows, columns)
    if len(rows) > len(COEFFICIENTS):
        print("The cost model (step_cost.py), each row's step predicted by a fit to the other rows:")
        print_table(with_predictions(rows, ceilings)[0], COST_COLUMNS)
    measured = {row_key(r) for r in rows}
    left = [(m, b, c, budget, n) for m in args.models for b in args.batches for c in args.contexts
            for budget in args.budgets for n in vocabs if (m, b, c, budget, n) not in measured]
    if left:
        print(f"{len(left)} rows left at the {args.minutes}-minute box; run again with the same --out to go on")


if __name__ == "__main__":
    main()
