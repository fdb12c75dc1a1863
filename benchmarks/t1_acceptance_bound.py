"""Why tau is low at temperature 1 for the embedded target: how often its own samples fall outside
its top-W tokens.

    python benchmarks/t1_acceptance_bound.py eval/results/h200_bf16_t1_heads7000_*.jsonl.gz \\
        --prompts 8 --out benchmarks/results/t1_acceptance_bound.json

(the recorded JSON replayed the first heads' run, `h200_bf16_t1_allkernels_*`, in git at 04117a5).

At T=1 a verify pass accepts a draft at depth 1 only when the target's sample is one of the root's W
children, at best the target's own top-W. This replays the eval's T=1 AR outputs through the target
(fp32, one forward per output) and measures, per generated position, the target's top-W probability
mass and whether the sampled token was inside it (and the same for the top token alone); compare
with the eval's share of passes that accepted at least one draft.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, eval_prompt_ids, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.eval.records import read_lines  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+")
    p.add_argument("--prompts", type=int, default=8, help="T=1 AR outputs per benchmark to replay")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--out", default="benchmarks/results/t1_acceptance_bound.json")
    args = p.parse_args()

    lines = [ln for path in args.results for ln in read_lines(path)]
    outputs = {}
    for ln in lines:
        if ln["method"] == "ar" and ln["temperature"] == 1 and ln.get("token_ids"):
            outputs.setdefault(ln["benchmark"], []).append(ln)
    accepted_any = {}  # benchmark -> share of T=1 verify passes that accepted >= 1 draft
    for ln in lines:
        if ln["temperature"] == 1 and ln["method"] != "ar" and ln.get("accept_counts"):
            counts = accepted_any.setdefault(ln["benchmark"], [0, 0])
            counts[0] += sum(ln["accept_counts"][1:])
            counts[1] += sum(ln["accept_counts"])
    target = load_target(dtype=jnp.float32)
    prompts = eval_prompt_ids(target.tokenizer, outputs, args.data_dir)

    @jax.jit
    def log_probs(tokens):
        cache = qwen3.new_cache(target.cfg, 1, tokens.shape[1], jnp.float32)
        logits, _, _ = qwen3.forward(target.params, tokens, jnp.arange(tokens.shape[1])[None], cache, target.cfg)
        return jax.nn.log_softmax(logits[0], axis=-1)

    rows = []
    with jax.default_matmul_precision("highest"):
        for benchmark, runs in sorted(outputs.items()):
            mass, inside, top1_mass, is_top1 = [], [], [], []
            for ln in sorted(runs, key=lambda r: r["id"])[:args.prompts]:
                prompt, out = prompts[(benchmark, ln["id"])], ln["token_ids"]
                tokens = prompt + out
                width = -(-len(tokens) // 128) * 128
                lp = np.asarray(log_probs(jnp.asarray([tokens + [0] * (width - len(tokens))])))
                lp = lp[len(prompt) - 1:len(tokens) - 1]  # the distributions the outputs were sampled from
                top = np.argsort(-lp, axis=-1)[:, :args.width]
                mass.extend(np.exp(np.take_along_axis(lp, top, axis=-1)).sum(-1))
                inside.extend((top == np.asarray(out)[:, None]).any(-1))
                top1_mass.extend(np.exp(lp.max(-1)))
                is_top1.extend(top[:, 0] == np.asarray(out))
            share = accepted_any.get(benchmark)
            rows.append(dict(benchmark=benchmark, outputs=min(len(runs), args.prompts), positions=len(mass),
                             mean_top1_mass=float(np.mean(top1_mass)), sample_is_top1=float(np.mean(is_top1)),
                             mean_top_w_mass=float(np.mean(mass)), sample_in_top_w=float(np.mean(inside)),
                             eval_passes_accepting_any=share[0] / share[1] if share else None))
            print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    write_json_atomic(args.out, dict(benchmark="t1_acceptance_bound", width=args.width, rows=rows,
                                     results=[os.path.basename(p) for p in args.results], environment=environment()))


if __name__ == "__main__":
    main()
