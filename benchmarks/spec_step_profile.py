"""Where a decode step's time goes on the GPU: profiles whole generations (AR, and each method at each
budget) on the embedded target and sums the GPU's kernels per target forward.

    python benchmarks/spec_step_profile.py --out benchmarks/results/spec_step_profile_h200.json
    # jetspec-tc's second pass and re-selection in a batch
    python benchmarks/spec_step_profile.py --methods jetspec jetspec-tc --batch 10 --budgets 64 256 \
        --out benchmarks/results/spec_step_profile_tree_causal_batch10_h200.json

Per configuration: `wall_ms_per_step` (the generation's wall time over its target forwards, prefill
included but amortised over `--new-tokens`), `gpu_busy_ms_per_step` (summed kernel durations on the
GPU's own clock), their difference (GPU idle: launch gaps, host syncs of while loops; an upper bound,
since tracing slows the host's launches), kernel launches per step, and the kernel families taking
the most time, each with its share. The stage breakdown (spec_step_breakdown.py) says which stage
costs; this says which kernels, and how many launches, make it up.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, gpu_kernel_events, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.kernels.tree_build import IMPLEMENTATIONS as TREE_IMPLS  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path  # noqa: E402
from jetspec_jax.speculative import HeadDrafter, SpecConfig, speculative_generate  # noqa: E402
from jetspec_jax.target import default_dtype, load_target  # noqa: E402


def kernel_family(name: str) -> str:
    """Groups kernel names so that numbered fusions of one kind add up (fusion_12 -> fusion)."""
    return re.sub(r"[._]\d+$", "", re.sub(r"(\.\d+)+$", "", name))


def summarise(name: str, wall: float, events, steps: int, top: int) -> dict:
    row = dict(config=name, steps=steps, wall_ms_per_step=wall * 1e3 / steps)
    if events is None:
        return row
    busy = sum(d for _, d in events) / 1e6 / steps
    by_family = collections.defaultdict(lambda: [0, 0])
    for kernel, ns in events:
        entry = by_family[kernel_family(kernel)]
        entry[0] += ns
        entry[1] += 1
    ranked = sorted(by_family.items(), key=lambda kv: -kv[1][0])[:top]
    row.update(gpu_busy_ms_per_step=busy, gpu_idle_ms_per_step=row["wall_ms_per_step"] - busy,
               launches_per_step=len(events) / steps,
               top_kernels=[dict(kernel=k, us_per_step=ns / 1e3 / steps, launches_per_step=n / steps,
                                 share=ns / 1e6 / steps / busy) for k, (ns, n) in ranked])
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--methods", nargs="+", default=["jetspec"], choices=["jetspec", "jetspec-tc"])
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--context", type=int, default=512, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--tree-impl", default="auto", choices=TREE_IMPLS)
    p.add_argument("--top", type=int, default=25, help="kernel families listed per configuration")
    p.add_argument("--out", default="benchmarks/results/spec_step_profile.json")
    args = p.parse_args()

    dtype = default_dtype()
    target = load_target(dtype=dtype, with_tokenizer=False)
    cfg = target.cfg
    head_cfg, head = load_head(packaged_head_path(target, "jetspec"), dtype)
    drafter = HeadDrafter(head_cfg, cfg)
    prompt = jax.random.randint(jax.random.key(1), (args.batch, args.context), 0, cfg.vocab_size)
    lens = jnp.full((args.batch,), args.context, jnp.int32)
    cache_len = args.context + args.new_tokens + max(args.budgets) + head_cfg.max_depth + 1
    gen = GenerationConfig(max_new_tokens=args.new_tokens, eos_token_ids=())
    payload = dict(benchmark="spec_step_profile", model=os.path.basename(target.source), context=args.context,
                   batch=args.batch, new_tokens=args.new_tokens, width=args.width, tree_impl=args.tree_impl,
                   draft_attention=drafter.attention_impl, rows=[],
                   environment=environment())

    def record(name, fn, steps):
        events, wall = gpu_kernel_events(fn)
        row = summarise(name, wall, events, steps, args.top)
        payload["rows"].append(row)
        print({k: v for k, v in row.items() if k != "top_kernels"}, flush=True)
        write_json_atomic(args.out, payload)

    ar = lambda: generate_tokens(target.params, prompt, lens, jax.random.key(0), cfg=cfg, gen=gen,  # noqa: E731
                                 cache_len=cache_len)
    record("ar", ar, args.new_tokens)
    for method, budget in itertools.product(args.methods, args.budgets):
        spec = SpecConfig(method, budget, args.width, tree_impl=args.tree_impl)
        step_drafter = drafter.for_specs([spec])

        def run(spec=spec, step_drafter=step_drafter):
            return speculative_generate(target.params, head, prompt, lens, jax.random.key(0), cfg=cfg,
                                        drafter=step_drafter, spec=spec, gen=gen, cache_len=cache_len)

        steps = int(run().target_forwards.max())
        record(f"{method}_b{budget}", run, steps)
    for row in payload["rows"]:
        print(f"\n{row['config']}: {row['steps']} steps, {row['wall_ms_per_step']:.3f} ms/step wall"
              + (f", {row['gpu_busy_ms_per_step']:.3f} GPU busy, {row['launches_per_step']:.0f} launches"
                 if "top_kernels" in row else ""))
        if "top_kernels" in row:
            print_table(row["top_kernels"][:12], ["kernel", "us_per_step", "launches_per_step", "share"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
