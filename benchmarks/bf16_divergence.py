"""Where speculative and AR greedy outputs part in reduced precision, and why.

    python benchmarks/bf16_divergence.py --dtype bfloat16 --prompts 8 --out benchmarks/results/bf16_divergence_cpu.json

For every prompt whose speculative tokens differ from the AR tokens, take the first differing
position and recompute the target's next-token logits there (prefix = prompt + the common tokens)
in the run's dtype and in fp32 at highest precision: a near-tie shows as a top-2 gap within the
dtype's rounding, and the fp32 argmax says which side was "right".
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.api import generate  # noqa: E402
from jetspec_jax.eval.datasets import load_benchmark  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402


def next_logits(target, ids):
    cache = qwen3.new_cache(target.cfg, 1, len(ids) + 1, target.params["embed"].dtype)
    logits, _, _ = qwen3.forward(target.params, jnp.asarray([ids]), jnp.arange(len(ids))[None], cache, target.cfg,
                                 logits_indices=jnp.asarray([[len(ids) - 1]]))
    return np.asarray(logits[0, 0], np.float64)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--budget", type=int, default=64)
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default="benchmarks/results/bf16_divergence.json")
    args = p.parse_args()

    target = load_target(dtype=jnp.dtype(args.dtype))
    with jax.default_matmul_precision("highest"):
        exact = load_target(dtype=jnp.float32, with_tokenizer=False)
    head = load_head(packaged_head_path(target, "jetspec"), target.params["embed"].dtype)
    questions = [item.prompt for item in load_benchmark("gsm8k", args.data_dir, args.prompts)]
    ar = generate(questions, target, max_new_tokens=args.max_new_tokens)
    spec = generate(questions, target, method="jetspec", head=head, budget=args.budget,
                    max_new_tokens=args.max_new_tokens)
    rows = []
    for i, (a, s) in enumerate(zip(ar.token_ids, spec.token_ids)):
        if a == s:
            rows.append(dict(prompt=i, identical=True))
            continue
        pos = next(j for j in range(min(len(a), len(s))) if a[j] != s[j])
        prefix = ar.prompt_token_ids[i] + a[:pos]
        low = next_logits(target, prefix)
        with jax.default_matmul_precision("highest"):
            ref = next_logits(exact, prefix)
        top2 = np.sort(low)[-2:]
        rows.append(dict(prompt=i, identical=False, position=pos, ar_token=a[pos], spec_token=s[pos],
                         gap_top2=float(top2[1] - top2[0]), logit_scale=float(np.abs(low).max()),
                         gap_ar_vs_spec=float(low[a[pos]] - low[s[pos]]),
                         fp32_gap_ar_vs_spec=float(ref[a[pos]] - ref[s[pos]]),
                         fp32_argmax_is=("ar" if ref.argmax() == a[pos] else
                                         "spec" if ref.argmax() == s[pos] else "other")))
        print(rows[-1], flush=True)
    print_table(rows, ["prompt", "identical", "position", "gap_top2", "logit_scale", "gap_ar_vs_spec",
                       "fp32_gap_ar_vs_spec", "fp32_argmax_is"])
    write_json_atomic(args.out, dict(benchmark="bf16_divergence", dtype=args.dtype, budget=args.budget,
                                     max_new_tokens=args.max_new_tokens, rows=rows, environment=environment()))


if __name__ == "__main__":
    main()
