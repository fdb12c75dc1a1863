"""Where each head puts the target's tokens: per-depth rank coverage and teacher-forced tree acceptance.

    python benchmarks/head_rank_coverage.py --benchmark gsm8k --out benchmarks/results/head_rank_coverage_cpu_gsm8k.json

The target answers the first N prompts of an eval benchmark greedily (never trained on). At every
answer position a, each head drafts from anchor a with the context of positions < a, exactly as in
inference, and is scored against the answer that follows a:
- coverage: how often the target's token at depth d is among the head's top r at that depth;
- chain acceptance: the answer's prefix that the head's argmax at each depth gets right, plus one
  (teacher-forced tau of a chain of argmaxes, a DFlash-style draft);
- tree acceptance: the best-first tree of that budget (width W) built from the head's top-W lists,
  and the longest prefix of the answer it contains, plus one (tau if every position were a round's
  anchor); with the share of accepted tokens at depth >= 2 that are not the head's argmax there;
  `--tree-temperatures` scores the trees with the head's logits divided by each, as the engine's
  SpecConfig.tree_temperature does.
Both heads are scored on the same anchors, so their numbers compare directly (one run).
`--decode-check B` also decodes the same prompts speculatively at budget B with each head (and tree
temperature), to set the measured tau beside the teacher-forced one.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, leading_true, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.api import generate  # noqa: E402
from jetspec_jax.eval.datasets import BENCHMARKS, load_benchmark  # noqa: E402
from jetspec_jax.kernels.tree_build import build_trees  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path, verify_head_files  # noqa: E402
from jetspec_jax.models import draft_head  # noqa: E402
from jetspec_jax.target import default_dtype, load_target  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402
from jetspec_jax.train.trainer import teacher  # noqa: E402
from jetspec_jax.tree import top_candidates  # noqa: E402
from jetspec_jax.verify import accept  # noqa: E402

@functools.partial(jax.jit, static_argnames=("target_cfg", "tap_layers"))
def target_taps(target_params, tokens, *, target_cfg, tap_layers):
    """The target's tapped layers over a whole sequence (1, S), as training computes them."""
    return teacher(target_params, target_cfg, tokens, jnp.zeros((1, 1), jnp.int32), tap_layers)[1]


@functools.partial(jax.jit, static_argnames=("target_cfg", "head_cfg", "width", "tree_temperatures"))
def draft_ranks(head_params, target_params, tokens, taps, anchors, *, target_cfg, head_cfg, width,
                tree_temperatures=(1.0,)):
    """For one sequence (1, S), its taps and anchors (1, K): the top-`width` tokens (K, D, W), their
    log-probs at each tree temperature (T, K, D, W; the logits divided by it, as the engine scores
    trees) and the rank of the sequence's own token at each depth (K, D; 1 = argmax, width + 1 = not
    in the list)."""
    s = tokens.shape[1]
    logits = draft_head.training_logits(head_params, target_params, target_cfg, tokens, taps, anchors, head_cfg)
    log_probs = jax.nn.log_softmax(logits[0], axis=-1)  # (K, D, V)
    label_pos = jnp.clip(anchors[0][:, None] + jnp.arange(1, head_cfg.max_depth + 1), 0, s - 1)
    labels = tokens[0][label_pos]  # (K, D)
    label_lp = jnp.take_along_axis(log_probs, labels[..., None], axis=-1)
    rank = jnp.minimum(jnp.sum(log_probs > label_lp, axis=-1) + 1, width + 1)
    cand_tokens, _ = top_candidates(log_probs, width)
    # as the engine scores trees (log_softmax of the logits over the temperature), in fp32, at the same top-W
    logits32 = logits[0].astype(jnp.float32)
    cand_logps = jnp.stack([jnp.take_along_axis(jax.nn.log_softmax(logits32 / t, axis=-1), cand_tokens, axis=-1)
                            for t in tree_temperatures])
    return cand_tokens, cand_logps, rank, labels


@functools.partial(jax.jit, static_argnames=("budget",))
def tree_acceptance(anchor_tokens, cand_tokens, cand_logps, labels, valid, *, budget):
    """Accepted draft tokens (K,) of each anchor's tree, by the engine's greedy acceptance with the
    answer as the target's choices, and of those the ones at depth >= 2 that are not their depth's
    argmax."""
    trees = build_trees(anchor_tokens, cand_tokens, cand_logps, budget=budget)
    # the target's choice after a node at depth d is the answer's token at depth d + 1; past the
    # answer's end, a token no draft holds
    answer = jnp.where(valid, labels, -1)
    answer = jnp.concatenate([answer, jnp.full_like(answer[:, :1], -1)], axis=1)  # (K, D + 1)
    result = accept(trees, jnp.take_along_axis(answer, trees.depths, axis=1), cand_tokens.shape[1])
    path_tokens = jnp.take_along_axis(trees.tokens, result.path, axis=1)[:, 2:]  # depths 2..D
    argmax_tokens = cand_tokens[:, 1:, 0]
    depth = jnp.arange(2, cand_tokens.shape[1] + 1)
    off_argmax = (path_tokens != argmax_tokens) & (depth[None] <= result.accept_len[:, None])
    return result.accept_len, jnp.sum(off_argmax, axis=1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", action="append", default=None,
                   help="head directory (repeat); default: the shipped JetSpec and DFlash/DDTree heads")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--tree-temperatures", type=float, nargs="+", default=[1.0],
                   help="score the trees with the head's logits divided by each (SpecConfig.tree_temperature)")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--benchmark", choices=sorted(BENCHMARKS), default="gsm8k")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--anchors-per-call", type=int, default=32)
    p.add_argument("--decode-check", type=int, default=None, metavar="BUDGET",
                   help="also decode speculatively at this budget and report the measured tau")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--out", default="benchmarks/results/head_rank_coverage.json")
    args = p.parse_args()

    dtype = default_dtype()
    target = load_target(dtype=dtype)
    head_dirs = args.head or [packaged_head_path(target, m) for m in ("jetspec", "ddtree")]
    heads = [(d, *load_head(d, dtype)) for d in head_dirs]
    questions = [item.prompt for item in load_benchmark(args.benchmark, args.data_dir, args.prompts)]
    ar = generate(questions, target, max_new_tokens=args.max_new_tokens)

    temps = tuple(args.tree_temperatures)
    trees = [(b, t) for b in args.budgets for t in temps]
    stats = {d: dict(rank_counts=None, chain=[], accepted={bt: [] for bt in trees},
                     off_argmax={bt: 0 for bt in trees}) for d, _, _ in heads}
    for prompt_ids, answer in zip(ar.prompt_token_ids, ar.token_ids):
        seq = list(prompt_ids) + list(answer)
        # padded to a multiple of 128 (fewer shapes to compile); no anchor sees past its own position
        tokens = jnp.asarray(np.pad(seq, (0, -len(seq) % 128)), jnp.int32)[None]
        taps = {layers: target_taps(target.params, tokens, target_cfg=target.cfg, tap_layers=layers)
                for layers in {head_cfg.tap_layers for _, head_cfg, _ in heads}}  # once per answer
        first, last = len(prompt_ids), len(seq) - 2  # as in decoding, the first anchor is the first answer token
        for start in range(first, last + 1, args.anchors_per_call):
            anchors = np.arange(start, min(start + args.anchors_per_call, last + 1), dtype=np.int32)
            k = len(anchors)
            padded = np.pad(anchors, (0, args.anchors_per_call - k), constant_values=anchors[-1])  # one shape
            for d, head_cfg, head_params in heads:
                cand_tokens, cand_logps, rank, labels = draft_ranks(
                    head_params, target.params, tokens, taps[head_cfg.tap_layers], jnp.asarray(padded)[None],
                    target_cfg=target.cfg, head_cfg=head_cfg, width=args.width, tree_temperatures=temps)
                valid = (padded[:, None] + np.arange(1, head_cfg.max_depth + 1)[None]) < len(seq)
                rank, valid_k = np.asarray(rank)[:k], valid[:k]
                counts = np.stack([np.bincount(rank[:, j][valid_k[:, j]], minlength=args.width + 2)[1:]
                                   for j in range(head_cfg.max_depth)])  # (D, width + 1)
                head_stats = stats[d]
                if head_stats["rank_counts"] is not None:
                    counts += head_stats["rank_counts"]
                head_stats["rank_counts"] = counts
                head_stats["chain"].extend(leading_true((rank == 1) & valid_k).tolist())
                for budget, t in trees:
                    accepted, off = tree_acceptance(tokens[0][padded], cand_tokens, cand_logps[temps.index(t)],
                                                    labels, jnp.asarray(valid), budget=budget)
                    head_stats["accepted"][(budget, t)].extend(np.asarray(accepted)[:k].tolist())
                    head_stats["off_argmax"][(budget, t)] += int(np.asarray(off)[:k].sum())

    rows, per_depth = [], {}
    for d, head_cfg, _ in heads:
        head_stats = stats[d]
        counts = head_stats["rank_counts"]
        cover = np.cumsum(counts, axis=1) / np.maximum(counts.sum(axis=1, keepdims=True), 1)  # (D, width + 1)
        name = os.path.basename(os.path.normpath(d))
        per_depth[name] = dict(attention=head_cfg.attention, top1=cover[:, 0].round(4).tolist(),
                               top_width=cover[:, args.width - 1].round(4).tolist(),
                               rank_counts=counts.tolist())
        for budget, t in trees:
            acc = np.asarray(head_stats["accepted"][(budget, t)])
            beyond_depth_1 = max(int(np.maximum(acc - 1, 0).sum()), 1)
            rows.append(dict(head=name, attention=head_cfg.attention, budget=budget, tree_temperature=t,
                             anchors=len(acc), tree_tau=float(acc.mean() + 1),
                             chain_tau=float(np.mean(head_stats["chain"]) + 1),
                             off_argmax_share=head_stats["off_argmax"][(budget, t)] / beyond_depth_1,
                             top1_d1=float(cover[0, 0]), top1_d2_5=float(cover[1:5, 0].mean()),
                             topw_d2_5=float(cover[1:5, args.width - 1].mean()),
                             rank2_w_d2_5=float((cover[1:5, args.width - 1] - cover[1:5, 0]).mean())))
    payload = dict(benchmark="head_rank_coverage", prompts=f"{args.benchmark}[:{args.prompts}]",
                   max_new_tokens=args.max_new_tokens, width=args.width, dtype=str(jnp.dtype(dtype)),
                   heads=head_dirs, rows=rows, per_depth=per_depth,
                   heads_sha256={d: verify_head_files(d).weights_digest() for d in head_dirs},
                   environment=environment())
    print_table(rows, ["head", "budget", "tree_temperature", "anchors", "tree_tau", "chain_tau", "off_argmax_share",
                       "top1_d1", "top1_d2_5", "topw_d2_5", "rank2_w_d2_5"])
    for name, depth in per_depth.items():
        print(name, "top-1 by depth", depth["top1"])
        print(name, f"top-{args.width} by depth", depth["top_width"])
    if args.decode_check is not None:
        payload["decode_check"] = []
        tree_tau = {(r["head"], r["budget"], r["tree_temperature"]): r["tree_tau"] for r in rows}
        for (d, head_cfg, head_params), t in itertools.product(heads, temps):
            name = os.path.basename(os.path.normpath(d))
            method = "jetspec" if head_cfg.attention == "causal" else "ddtree"
            out = generate(questions, target, method=method, head=(head_cfg, head_params), budget=args.decode_check,
                           width=args.width, max_new_tokens=args.max_new_tokens, tree_temperature=t)
            payload["decode_check"].append(dict(
                head=name, method=method, budget=args.decode_check, tree_temperature=t, tau=out.tau,
                teacher_forced_tree_tau=tree_tau.get((name, args.decode_check, t)),
                outputs_equal_to_ar=sum(a == b for a, b in zip(out.token_ids, ar.token_ids))))
        print_table(payload["decode_check"], ["head", "method", "budget", "tree_temperature", "tau",
                                              "teacher_forced_tree_tau", "outputs_equal_to_ar"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
