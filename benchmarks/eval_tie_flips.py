"""Why an eval run's T=0 speculative outputs part from AR's: the fp32 logit gap at each first mismatch.

    python benchmarks/eval_tie_flips.py eval/results/h200_bf16_gsm8k_math500_humaneval.jsonl.gz \\
        eval/results/h200_bf16_mbpp_mtbench_aime25.jsonl.gz --sample 150 \\
        --out benchmarks/results/eval_tie_flips_h200_bf16.json

(the recorded run read the first eval run's archives, in git at f553b2b:
`git show f553b2b:eval/results/h200_bf16_gsm8k_math500_humaneval.jsonl.gz > ...`; any eval results
file with T=0 rows will do)

For every T=0 line whose tokens differ from AR's, take the first differing position, rebuild the
prefix (the eval's prompt tokens + the tokens both produced) and recompute the target's next-token
logits there in fp32 at highest matmul precision (on this machine, the run's own device not needed).
A reduced-precision tie flip shows as a small fp32 gap between AR's token and the speculative one,
both among the fp32 top two; a bug would show as large gaps or tokens far down the list.
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

BUCKET = 128  # prefixes pad to a multiple of this, so a few compiled forwards serve them all


def divergences(paths):
    """Unique (results file, benchmark, id, position, ar token, spec token) first mismatches at T=0,
    with the methods/budgets that hit each; the AR tokens each file's lines were compared with; and
    the count of compared lines. A line is paired with the AR line of its own file: two runs of one
    prompt (a rerun archived beside the first) can produce different AR text."""
    found, ar, compared = {}, {}, 0
    for path in paths:
        lines = read_lines(path)
        ar.update({(path, ln["benchmark"], ln["id"]): ln["token_ids"] for ln in lines
                   if ln["method"] == "ar" and ln["temperature"] == 0 and "token_ids" in ln})
        for ln in lines:
            if ln["method"] == "ar" or ln["temperature"] != 0 or ln.get("matches_ar") is None:
                continue
            compared += 1
            if ln["matches_ar"]:
                continue
            reference, pos = ar[(path, ln["benchmark"], ln["id"])], ln["first_mismatch"]
            if pos >= min(len(reference), len(ln["token_ids"])):  # one output is a prefix of the other
                key = (path, ln["benchmark"], ln["id"], pos, None, None)
            else:
                key = (path, ln["benchmark"], ln["id"], pos, reference[pos], ln["token_ids"][pos])
            found.setdefault(key, []).append(f"{ln['method']}@{ln['budget']}")
    return found, compared, ar


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", nargs="+", help="eval results files (.jsonl or .jsonl.gz)")
    p.add_argument("--data-dir", default=None)
    p.add_argument("--sample", type=int, default=None,
                   help="analyse a random sample of N divergence points (seeded; fp32 prefills are slow on a CPU)")
    p.add_argument("--out", default="benchmarks/results/eval_tie_flips.json")
    args = p.parse_args()

    found, compared, ar = divergences(args.results)
    jax.config.update("jax_default_matmul_precision", "highest")
    target = load_target(dtype=jnp.float32)
    prompts = eval_prompt_ids(target.tokenizer, [k[1] for k in found], args.data_dir)

    @jax.jit
    def next_logits(tokens, last):
        cache = qwen3.new_cache(target.cfg, 1, tokens.shape[1], jnp.float32)
        logits, _, _ = qwen3.forward(target.params, tokens, jnp.arange(tokens.shape[1])[None], cache, target.cfg,
                                     logits_indices=last[None, None])
        return logits[0, 0]

    rows = []
    keys = sorted(found, key=lambda k: (str(k[1:]), k[0]))  # the order of runs that keyed by prompt only
    if args.sample is not None and args.sample < len(keys):
        picked = np.random.default_rng(0).choice(len(keys), args.sample, replace=False)
        keys = [keys[i] for i in sorted(picked)]
    for n, key in enumerate(keys):
        path, benchmark, item_id, pos, ar_token, spec_token = key
        row = dict(benchmark=benchmark, id=item_id, position=pos, methods=found[key])
        if ar_token is None:
            rows.append(dict(row, kind="length"))
            continue
        prefix = prompts[(benchmark, item_id)] + ar[(path, benchmark, item_id)][:pos]
        width = -(-len(prefix) // BUCKET) * BUCKET
        logits = np.asarray(next_logits(jnp.asarray([prefix + [0] * (width - len(prefix))]),
                                        jnp.int32(len(prefix) - 1)), np.float64)
        order = np.argsort(-logits)
        rank = {int(t): i for i, t in enumerate(order[:64])}
        rows.append(dict(row, kind="token", ar_token=ar_token, spec_token=spec_token,
                         fp32_gap_ar_minus_spec=float(logits[ar_token] - logits[spec_token]),
                         fp32_top2_gap=float(logits[order[0]] - logits[order[1]]),
                         fp32_rank_ar=rank.get(ar_token, 64), fp32_rank_spec=rank.get(spec_token, 64),
                         logit_scale=float(np.abs(logits).max())))
        if n % 10 == 0:
            print(f"{n}/{len(keys)}", rows[-1], flush=True)
    tokens = [r for r in rows if r["kind"] == "token"]
    gaps = np.abs([r["fp32_gap_ar_minus_spec"] for r in tokens])
    summary = dict(
        compared_lines=compared, mismatched_lines=sum(len(v) for v in found.values()),
        divergence_points=len(found), analysed=len(rows), length_only=len(rows) - len(tokens),
        both_in_fp32_top2=sum(max(r["fp32_rank_ar"], r["fp32_rank_spec"]) <= 1 for r in tokens),
        abs_gap_median=float(np.median(gaps)) if len(gaps) else None,
        abs_gap_p99=float(np.quantile(gaps, 0.99)) if len(gaps) else None,
        abs_gap_max=float(gaps.max()) if len(gaps) else None,
        abs_gap_under=dict({str(t): int((gaps < t).sum()) for t in (0.01, 0.03, 0.1, 0.25)}),
        fp32_argmax_is_ar=sum(r["fp32_rank_ar"] == 0 for r in tokens),
        fp32_argmax_is_spec=sum(r["fp32_rank_spec"] == 0 for r in tokens))
    print_table([summary], list(summary))
    write_json_atomic(args.out, dict(benchmark="eval_tie_flips", results=[os.path.basename(p) for p in args.results],
                                     summary=summary, rows=rows, environment=environment()))


if __name__ == "__main__":
    main()
