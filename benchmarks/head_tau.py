"""Acceptance of a trained head on held-out prompts: tau per method and budget, with AR in the same run.

    python benchmarks/head_tau.py --head jetspec_jax/heads/smollm2-135m-general-jetspec --out benchmarks/results/head_tau.json
    # tree-causal drafting with the same (causal) head, candidate trees of 1, 2 and 4 times the budget
    python benchmarks/head_tau.py --head jetspec_jax/heads/smollm2-135m-general-jetspec --methods jetspec jetspec-tc \
        --candidate-factors 1 2 4

Prompts: the first N GSM8K test questions (never trained on) with the math instruction, chat template,
greedy. Every speculative output is checked token for token against the AR output.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.api import generate  # noqa: E402
from jetspec_jax.eval.datasets import load_benchmark  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head  # noqa: E402
from jetspec_jax.speculative import CANDIDATE_FACTOR  # noqa: E402
from jetspec_jax.target import default_dtype, load_target  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", action="append", required=True, help="head directory (repeat for several)")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--methods", nargs="+", default=None, choices=["jetspec", "jetspec-tc", "ddtree", "dflash"],
                   help="the methods each head runs that suit its attention (default: jetspec for a causal head, "
                        "ddtree and dflash for a bidirectional one)")
    p.add_argument("--candidate-factors", type=int, nargs="+", default=[CANDIDATE_FACTOR],
                   help="jetspec-tc: candidate trees of these multiples of the budget, a row each")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="default: bf16 on GPU, fp32 on CPU; fp32 makes the AR comparison exact")
    p.add_argument("--out", default="benchmarks/results/head_tau.json")
    args = p.parse_args()

    dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
    if dtype == jnp.float32:  # true fp32 matmuls: the GPU default would use TF32 and flip near-ties
        jax.config.update("jax_default_matmul_precision", "highest")
    target = load_target(dtype=dtype)
    questions = [item.prompt for item in load_benchmark("gsm8k", args.data_dir, args.prompts)]
    ar = generate(questions, target, max_new_tokens=args.max_new_tokens)
    ar = generate(questions, target, max_new_tokens=args.max_new_tokens)  # timed warm
    rows = [dict(head="-", method="ar", budget=1, tau=1.0, tok_s=ar.tokens_per_second, mismatches=0)]
    payload = dict(benchmark="head_tau", prompts=f"gsm8k_test[:{args.prompts}]", batch=len(questions),
                   max_new_tokens=args.max_new_tokens, dtype=str(jnp.dtype(dtype)), rows=rows,
                   environment=environment())
    for head_dir in args.head:
        head_cfg, head_params = load_head(head_dir, dtype)
        causal = head_cfg.attention == "causal"
        suited = ("jetspec", "jetspec-tc") if causal else ("ddtree", "dflash")
        methods = [m for m in args.methods if m in suited] if args.methods else (["jetspec"] if causal else suited)
        for method in methods:
            for budget, factor in itertools.product(args.budgets if method != "dflash" else [head_cfg.block_size],
                                                    args.candidate_factors if method == "jetspec-tc" else [None]):
                kwargs = dict(method=method, head=(head_cfg, head_params), budget=budget, width=args.width,
                              max_new_tokens=args.max_new_tokens)
                if factor is not None:
                    kwargs["candidate_budget"] = factor * budget
                generate(questions, target, **kwargs)  # compile
                out = generate(questions, target, **kwargs)
                mismatches = sum(a != b for a, b in zip(out.token_ids, ar.token_ids))
                rows.append(dict(head=os.path.basename(head_dir.rstrip("/")), method=method, budget=budget,
                                 candidate_budget=kwargs.get("candidate_budget"), tau=out.tau, tok_s=out.tokens_per_second,
                                 speedup_vs_ar=out.tokens_per_second / ar.tokens_per_second,
                                 mismatches=mismatches, accept_counts=out.accept_counts))
                print(rows[-1], flush=True)
                write_json_atomic(args.out, payload)  # after every row: a run cut short keeps what it measured
    print_table(rows, ["head", "method", "budget", "candidate_budget", "tau", "tok_s", "speedup_vs_ar", "mismatches"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
