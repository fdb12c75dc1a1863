"""The rank-1 path gap of each head's draft (the paper's Table 9): how far the drafter's confidence in its
most likely path exceeds the target's.

    python benchmarks/path_gap.py --benchmark math500 --prompts 50 --out benchmarks/results/path_gap.json

At the first draft step of each prompt (the anchor is the target's first greedy token) every head drafts
its rank-1 path of D = block - 1 tokens and the gap is Delta = sum log r - sum log p in nats: r the
drafter's probability of each path token, p the target's, teacher-forced on prompt + anchor + the path
before it. A large positive gap: the drafter is sure of a path the target finds implausible.
- jetspec (causal head) and ddtree (bidirectional head): one block pass gives one distribution per depth,
  shared by every branch; the rank-1 path is the argmax at every depth, r those maxima.
- jetspec-tc (causal head): every depth conditioned on the path's own earlier tokens (the tree-causal
  pass over the chain so far); the rank-1 path is greedy under those distributions, r their maxima.
Reported per head and method: the gap in the paper's bins, its median and mean, and the path's prefix
the target's greedy accepts (leading tokens equal to its argmax; a cheap tau proxy, tau = it + 1).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, leading_true, print_table, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import prefill  # noqa: E402
from jetspec_jax.eval.datasets import BENCHMARKS, load_benchmark  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.speculative import HeadDrafter  # noqa: E402
from jetspec_jax.target import default_dtype, load_target  # noqa: E402
from jetspec_jax.tokens import encode_prompts, pad_prompts, pad_token  # noqa: E402
from jetspec_jax.train.config import DEFAULT_DATA_DIR  # noqa: E402
from jetspec_jax.tree import ancestor_mask  # noqa: E402

METHODS_OF_ATTENTION = {"causal": ("jetspec", "jetspec-tc"), "bidirectional": ("ddtree",)}
GAP_EDGES = (5.0, 20.0, 40.0, 80.0)  # the paper's bins: < +5 ("faithful"), [+5,+20), ..., >= +80
GAP_BINS = ("<+5", "[+5,+20)", "[+20,+40)", "[+40,+80)", ">=+80")


@functools.partial(jax.jit, static_argnames=("target_cfg", "tap_layers", "cache_len"))
def first_step(target_params, tokens, lengths, *, target_cfg, tap_layers, cache_len):
    """The target's prefill of right-padded prompts: the anchor (its greedy first token) (B,), the taps
    (B, P, n, D) and the cache (lengths = prompt lengths, room for a path after the anchor)."""
    logits, taps, cache = prefill(target_params, tokens, lengths, target_cfg, cache_len, tap_layers=tap_layers)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), taps, cache


def head_state(drafter: HeadDrafter, head_params, taps, lengths, dtype):
    """The head's context after the prompt, as inference builds it (the prompt's taps, anchor excluded)."""
    state = drafter.init_state(head_params, taps.shape[0], taps.shape[1], dtype)
    return drafter.observe(head_params, state, taps, lengths)


def block_path(drafter: HeadDrafter, head_params, target_params, state, anchor):
    """jetspec / ddtree: one block pass; the rank-1 path is the argmax at every depth. -> (tokens (B, D)
    int32, log r (B, D) fp32)."""
    logits = drafter.propose(head_params, state, target_params, None, anchor, drafter.max_depth)
    log_r = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.argmax(log_r, axis=-1).astype(jnp.int32), jnp.max(log_r, axis=-1)


def tree_causal_path(drafter: HeadDrafter, head_params, target_params, state, anchor):
    """jetspec-tc: greedy under the path-conditioned distributions. Pass k runs the tree-causal pass over
    the chain [anchor, path_1 .. path_D-1] (nodes past k not yet chosen: node k sees only its ancestors,
    so they do not matter) and takes the argmax of node k's children. -> (tokens (B, D), log r (B, D))."""
    b, d = anchor.shape[0], drafter.max_depth
    chain = jnp.arange(d, dtype=jnp.int32)
    depths = jnp.broadcast_to(chain, (b, d))
    ancestors = jnp.broadcast_to(ancestor_mask(chain - 1, d), (b, d, d))

    def choose(k, carry):
        path, log_r = carry
        nodes = jnp.concatenate([anchor[:, None], path[:, :-1]], axis=1)
        logits = drafter.propose_tree(head_params, state, target_params, None, nodes, depths, ancestors)
        lp = jax.nn.log_softmax(logits[:, k].astype(jnp.float32), axis=-1)  # (B, V)
        return (path.at[:, k].set(jnp.argmax(lp, axis=-1).astype(jnp.int32)), log_r.at[:, k].set(jnp.max(lp, axis=-1)))

    return jax.lax.fori_loop(0, d, choose, (jnp.zeros((b, d), jnp.int32), jnp.zeros((b, d), jnp.float32)))


@functools.partial(jax.jit, static_argnames=("drafter", "method"))
def rank1_path(head_params, target_params, taps, lengths, anchor, *, drafter: HeadDrafter, method: str):
    """The rank-1 path of `method`'s draft from the anchor: (tokens (B, D), per-token log r (B, D))."""
    state = head_state(drafter, head_params, taps, lengths, target_params["embed"].dtype)
    draft = tree_causal_path if method == "jetspec-tc" else block_path
    return draft(drafter, head_params, target_params, state, anchor)


@functools.partial(jax.jit, static_argnames=("target_cfg",))
def target_path_logprobs(target_params, cache, anchor, path, *, target_cfg):
    """The target teacher-forced on prompt + anchor + path (the prompt from the prefill's cache, the D
    tokens [anchor, path_1 .. path_D-1] as one causal block at the positions after it): log p of each path
    token (B, D) fp32, and whether each is the target's argmax there (B, D)."""
    d = path.shape[1]
    block = jnp.concatenate([anchor[:, None], path[:, :-1]], axis=1)
    positions = cache.lengths[:, None] + jnp.arange(d, dtype=jnp.int32)
    logits, _, _ = qwen3.forward(target_params, block, positions, cache, target_cfg)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(log_p, path[..., None], axis=-1)[..., 0], jnp.argmax(log_p, axis=-1) == path


def gap_summary(gaps: np.ndarray) -> dict[str, float]:
    """The paper's bins (percent of prompts), median and mean of the gaps."""
    counts = np.bincount(np.searchsorted(GAP_EDGES, gaps, side="right"), minlength=len(GAP_BINS))
    row = {label: float(100 * c / len(gaps)) for label, c in zip(GAP_BINS, counts)}
    return row | dict(median_gap=float(np.median(gaps)), mean_gap=float(np.mean(gaps)))


def chunks(lengths: np.ndarray, batch: int) -> list[np.ndarray]:
    """Prompt indices sorted by length, in groups of `batch` (less padding); the last group filled up
    with repeats of its last index (one batch shape), which the caller drops."""
    order = np.argsort(lengths, kind="stable")
    groups = [order[i: i + batch] for i in range(0, len(order), batch)]
    return [np.pad(g, (0, batch - len(g)), mode="edge") for g in groups]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--head", action="append", default=None,
                   help="head directory (repeat); default: the shipped JetSpec and DDTree heads of the target")
    p.add_argument("--benchmark", choices=sorted(BENCHMARKS), default="math500")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--batch", type=int, default=16, help="prompts per forward (sorted by length)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--out", default="benchmarks/results/path_gap.json")
    args = p.parse_args()

    t_start = time.perf_counter()
    dtype = jnp.dtype(args.dtype) if args.dtype else default_dtype()
    if dtype == jnp.float32:  # true fp32 matmuls: the GPU default would use TF32
        jax.config.update("jax_default_matmul_precision", "highest")
    target = load_target(dtype=dtype)
    head_dirs = args.head or list(dict.fromkeys(packaged_head_path(target, m) for m in ("jetspec", "ddtree")))
    heads = []
    for d in head_dirs:
        cfg, params = load_head(d, dtype, target=target)
        heads.append((os.path.basename(os.path.normpath(d)), HeadDrafter(cfg, target.cfg), params))
    tap_layers = tuple(sorted({t for _, drafter, _ in heads for t in drafter.tap_layers}))
    items = load_benchmark(args.benchmark, args.data_dir, args.prompts)
    prompt_ids = encode_prompts(target.tokenizer, [item.prompt for item in items])
    lengths_all = np.array([len(x) for x in prompt_ids])
    depth = max(drafter.max_depth for _, drafter, _ in heads)
    rows = [(name, drafter, params, method) for name, drafter, params in heads
            for method in METHODS_OF_ATTENTION[drafter.cfg.attention]]

    anchors = np.zeros(len(items), np.int64)
    results = {(name, method): dict(path=[None] * len(items), log_r=np.zeros(len(items)), log_p=np.zeros(len(items)),
                                    accepted=np.zeros(len(items), np.int64)) for name, _, _, method in rows}
    for group in chunks(lengths_all, min(args.batch, len(items))):
        tokens, lengths = pad_prompts([prompt_ids[i] for i in group], pad_token(target))
        cache_len = -(-(tokens.shape[1] + depth) // 64) * 64
        anchor, taps, cache = first_step(target.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                         target_cfg=target.cfg, tap_layers=tap_layers, cache_len=cache_len)
        anchors[group] = np.asarray(anchor)
        for name, drafter, params, method in rows:
            head_taps = taps[:, :, [tap_layers.index(t) for t in drafter.tap_layers]]
            path, log_r = rank1_path(params, target.params, head_taps, jnp.asarray(lengths), anchor,
                                     drafter=drafter, method=method)
            log_p, is_argmax = target_path_logprobs(target.params, cache, anchor, path, target_cfg=target.cfg)
            res = results[(name, method)]
            res["log_r"][group] = np.asarray(log_r).sum(axis=1)
            res["log_p"][group] = np.asarray(log_p).sum(axis=1)
            res["accepted"][group] = leading_true(np.asarray(is_argmax))
            for i, tokens_i in zip(group, np.asarray(path).tolist()):
                res["path"][i] = tokens_i
        print(f"prompts up to {int(lengths.max())} tokens: done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    table, per_prompt = [], {}
    for name, _, _, method in rows:
        res = results[(name, method)]
        gaps = res["log_r"] - res["log_p"]
        table.append(dict(head=name, method=method, prompts=len(items)) | gap_summary(gaps)
                     | dict(accepted=float(res["accepted"].mean()), sum_log_r=float(res["log_r"].mean()),
                            sum_log_p=float(res["log_p"].mean())))
        per_prompt[f"{name}/{method}"] = [
            dict(id=item.id, gap=float(g), sum_log_r=float(r), sum_log_p=float(lp), accepted=int(a), path=path,
                 path_text=target.tokenizer.decode(path))
            for item, g, r, lp, a, path in zip(items, gaps, res["log_r"], res["log_p"], res["accepted"], res["path"])]
    keys = list(per_prompt)
    gap_of = {k: np.array([x["gap"] for x in per_prompt[k]]) for k in keys}
    wall = time.perf_counter() - t_start
    payload = dict(benchmark="path_gap", prompts=f"{args.benchmark}[:{args.prompts}]", step=0, depth=depth,
                   dtype=str(jnp.dtype(dtype)), heads=head_dirs, gap_bins=list(GAP_BINS), rows=table,
                   # share of prompts where row a's gap exceeds row b's (the paper: diffusion > causal on 92%)
                   gap_larger_share={a: {b: float(np.mean(gap_of[a] > gap_of[b])) for b in keys if b != a}
                                     for a in keys},
                   anchors=[dict(id=item.id, prompt_tokens=int(n), anchor=int(t),
                                 anchor_text=target.tokenizer.decode([int(t)]))
                            for item, n, t in zip(items, lengths_all, anchors)],
                   per_prompt=per_prompt, wall_seconds=wall, environment=environment())
    print_table(table, ["head", "method", "prompts", *GAP_BINS, "median_gap", "mean_gap", "accepted",
                        "sum_log_r", "sum_log_p"])
    print(f"wall time {wall:.0f} s")
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
