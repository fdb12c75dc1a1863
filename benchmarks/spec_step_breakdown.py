"""Cost of one speculative step, stage by stage, against one autoregressive step.

    # the embedded target with its shipped JetSpec head (issue: per-stage breakdown)
    python benchmarks/spec_step_breakdown.py --attention xla pallas \\
        --out benchmarks/results/spec_step_breakdown_h200.json
    # a Qwen3-8B-shaped target and 5-layer head with random bf16 weights (the cost model)
    python benchmarks/spec_step_breakdown.py --target qwen3-8b-shaped --contexts 1024 4096 \\
        --budgets 16 32 64 128 256 --attention xla cudnn pallas --out benchmarks/results/qwen3_8b_cost_h200.json
    # tree-causal drafting (issue #20): jetspec and jetspec-tc rows side by side
    python benchmarks/spec_step_breakdown.py --methods jetspec jetspec-tc --budgets 16 64 256 \\
        --out benchmarks/results/spec_step_breakdown_tree_causal_h200.json

Stages: draft pass (head forward over [anchor, MASK...] and its LM head), tree build (top-W per depth
+ best-first), verify pass (one target forward over the tree), accept + cache compaction +
head-context update; jetspec-tc rows build the candidate tree in the tree stage and add its second
head pass over that tree (`tc_pass_ms`: the candidate parents' node and query slots through the head,
the LM head and log-softmax on the query slots) and the re-selection of the verified tree
(`tc_select_ms`). Each runs `--iters` times inside one jitted fori_loop, its buffers threaded
through the loop as in generation; the loop's trip count is an argument, so one executable times
`iters` and 1 iterations and the difference cancels the call's fixed cost. `loop_step_ms` is a whole
step measured inside `speculative_generate` (embedded target only), `ar_step_ms` one decode step
timed like the stages. c = draft_ms / (N * verify_ms) is the per-draft-token cost of the paper's
Table 12. Timing does not depend on weight values, so the 8B shape uses random weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402
from shapes import QWEN3_8B  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, prefill  # noqa: E402
from jetspec_jax.loading.head_checkpoint import load_head, packaged_head_path  # noqa: E402
from jetspec_jax.models import draft_head, qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.speculative import (ATTENTION_IMPLS, CANDIDATE_FACTOR, DRAFT_ATTENTION_IMPLS,  # noqa: E402
                                     GEMM_BACKENDS, HeadDrafter, SpecConfig, resolve_draft_attention, select_trees,
                                     speculative_generate, tree_causal_pass)
from jetspec_jax.target import default_dtype, load_target  # noqa: E402
from jetspec_jax.kernels.cache_compact import IMPLEMENTATIONS as COMPACT_IMPLS  # noqa: E402
from jetspec_jax.kernels.top_k import IMPLEMENTATIONS as TOP_K_IMPLS  # noqa: E402
from jetspec_jax.kernels.tree_build import IMPLEMENTATIONS as TREE_IMPLS  # noqa: E402
from jetspec_jax.kernels.tree_build import build_trees  # noqa: E402
from jetspec_jax.tree import top_candidates  # noqa: E402
from jetspec_jax.verify import accept, compact_cache, verify_tree  # noqa: E402



def per_iteration_ms(body, init, iters: int, *inputs) -> float:
    """Device time of one `state = body(i, state, *inputs)`. Arrays go in as arguments, never as
    closed-over constants, which XLA would try to constant-fold."""
    run = jax.jit(lambda state, inputs, n: lax.fori_loop(0, n, lambda i, s: body(i, s, *inputs), state))
    many, one = jnp.int32(iters), jnp.int32(1)
    t_many = time_call(lambda: run(init, inputs, many), repeats=5)
    t_one = time_call(lambda: run(init, inputs, one), repeats=5)
    return (t_many - t_one) / (iters - 1) * 1e3


def load_models(args, dtype):
    """(target cfg, fused target params, head cfg, head params, description)."""
    if args.target == "qwen3-8b-shaped":
        cfg = dataclasses.replace(QWEN3_8B, num_layers=args.target_layers or QWEN3_8B.num_layers)
        params = qwen3.fuse_for_decode(init_params(qwen3.param_specs(cfg), jax.random.key(0), dtype))
        head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=args.head_layers or 5)
        head = init_params(draft_head.param_specs(head_cfg), jax.random.key(1), dtype)
        return cfg, params, head_cfg, head, f"Qwen3-8B-shaped ({cfg.num_layers} layers), random weights"
    target = load_target(dtype=dtype, with_tokenizer=False)
    path = args.head or packaged_head_path(target, "jetspec")
    if path and path != "untrained":
        head_cfg, head = load_head(path, dtype)
        head_name = os.path.basename(os.path.normpath(path))
    else:
        head_cfg = draft_head.DraftConfig.for_target(target.cfg, num_layers=args.head_layers or 2)
        head = init_params(draft_head.param_specs(head_cfg), jax.random.key(0), dtype)
        head_name = "untrained"
    return (target.cfg, jax.jit(qwen3.fuse_for_decode)(target.params), head_cfg, head,
            f"{os.path.basename(target.source)} with head {head_name}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", choices=["embedded", "qwen3-8b-shaped"], default="embedded")
    p.add_argument("--head", default=None, help="head directory, or 'untrained' (embedded target; default: "
                                                "the shipped JetSpec head)")
    p.add_argument("--head-layers", type=int, default=None, help="layers of an untrained head (2; 8B: 5)")
    p.add_argument("--target-layers", type=int, default=None, help="8B shape only: fewer layers (CPU checks)")
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--tree-builders", nargs="+", default=["auto"], choices=TREE_IMPLS,
                   help="the first builds the trees of every row and the whole step; the others' build "
                        "times are added as tree_ms_<builder>")
    p.add_argument("--top-k", nargs="+", default=["auto"], choices=TOP_K_IMPLS,
                   help="the tree stage's top-W over the vocabulary; as --tree-builders (others: tree_ms_topk_<impl>)")
    p.add_argument("--compactions", nargs="+", default=["auto"], choices=COMPACT_IMPLS,
                   help="cache compaction; as --tree-builders (others: accept_commit_ms_<compaction>)")
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--methods", nargs="+", default=["jetspec"], choices=["jetspec", "jetspec-tc"],
                   help="one row per method and budget; jetspec-tc rows add tc_pass_ms and tc_select_ms")
    p.add_argument("--candidate-factor", type=int, default=CANDIDATE_FACTOR,
                   help="jetspec-tc: candidate tree nodes per verified node")
    p.add_argument("--conditioned-width", type=int, default=None,
                   help="jetspec-tc: new children per candidate parent from the second pass (default: --width)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--contexts", type=int, nargs="+", default=[512], help="committed tokens before the step")
    p.add_argument("--attention", nargs="+", default=["xla"], choices=ATTENTION_IMPLS,
                   help="verify attention paths to time")
    p.add_argument("--draft-attention", nargs="+", default=["auto"], choices=DRAFT_ATTENTION_IMPLS,
                   help="the head's attention paths to time (the first is the step's; the others add draft_ms_* "
                        "and, for jetspec-tc's second pass, tc_pass_ms_*; auto: the kernel on GPU, as generation)")
    p.add_argument("--gemm-backends", nargs="+", default=["xla"], choices=list(GEMM_BACKENDS),
                   help="the generation loop's GEMM backends to time the whole step with (embedded target; "
                        "the first is loop_step_ms, the others add loop_step_ms_*); the stages keep XLA's")
    p.add_argument("--loop-step", action=argparse.BooleanOptionalAction, default=True,
                   help="also time a whole step inside speculative_generate (two compilations per row)")
    p.add_argument("--iters", type=int, default=None, help="loop length (default 50; 8B: 10)")
    p.add_argument("--out", default="benchmarks/results/spec_step_breakdown.json")
    args = p.parse_args()
    # named by the implementation that runs ("auto" and the one it picks are one path)
    args.draft_attention = list(dict.fromkeys(resolve_draft_attention(a) for a in args.draft_attention))
    iters = args.iters or (10 if args.target == "qwen3-8b-shaped" else 50)

    dtype = default_dtype()
    cfg, params, head_cfg, head, description = load_models(args, dtype)
    # rows for the largest tree-causal pass, kept by each draft-attention path timed (each runs on its own)
    drafter = HeadDrafter(head_cfg, cfg, attention_impl=args.draft_attention[0]).for_specs(
        method_spec(args, m, b) for m in args.methods for b in args.budgets)
    depth, taps_wanted = head_cfg.max_depth, head_cfg.tap_layers
    b = args.batch
    payload = dict(benchmark="spec_step_breakdown", model=description, batch=b, width=args.width,
                   methods=args.methods, candidate_factor=args.candidate_factor,
                   conditioned_width=args.conditioned_width,
                   head=dict(layers=head_cfg.num_layers, width=head_cfg.hidden_size, block=head_cfg.block_size,
                             taps=list(head_cfg.tap_layers)),
                   iters=iters, rows=[], environment=environment())
    rows = payload["rows"]
    for ctx_len in args.contexts:
        cache_len = -(-(ctx_len + 80 + max(args.budgets) + depth + 1) // 64) * 64  # as plan_cache_len rounds
        prompt = jax.random.randint(jax.random.key(1), (b, ctx_len), 0, cfg.vocab_size)
        lens = jnp.full((b,), ctx_len, jnp.int32)

        @jax.jit
        def setup(params, head, prompt, lens):
            logits, taps, cache = prefill(params, prompt, lens, cfg, cache_len, tap_layers=taps_wanted)
            ctx = drafter.observe(head, drafter.init_state(head, b, cache_len, dtype), taps, lens)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache, ctx

        anchor, cache, ctx = setup(params, head, prompt, lens)

        def draft_ms_with(attention_impl):
            other = dataclasses.replace(drafter, attention_impl=attention_impl)

            def draft_body(i, anchor, head, params, ctx):  # the next anchor depends on the draft: nothing hoists
                logits = other.propose(head, ctx, params, None, anchor, depth)
                return (anchor + jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)) % cfg.vocab_size
            return per_iteration_ms(draft_body, anchor, iters, head, params, ctx)

        draft_ms = draft_ms_with(args.draft_attention[0])
        other_drafts = {f"draft_ms_{impl}": draft_ms_with(impl) for impl in args.draft_attention[1:]}
        draft_logits = jax.jit(lambda h, p, c, a: drafter.propose(h, c, p, None, a, depth))(head, params, ctx, anchor)
        for impl in args.attention:
            def ar_body(i, cache, params, anchor, impl=impl):
                _, _, cache = qwen3.forward(params, anchor[:, None], cache.lengths[:, None], cache, cfg,
                                            attention_impl=impl)
                return cache

            ar_ms = per_iteration_ms(ar_body, cache, iters, params, anchor)
            state = ContextState(args, cfg, params, head, drafter, anchor, cache, ctx, draft_logits, prompt, lens,
                                 cache_len, iters)
            for budget in args.budgets:
                for method in args.methods:
                    rows.append(dict(stage_row(state, budget, impl, method), draft_ms=draft_ms, **other_drafts,
                                     ar_step_ms=ar_ms, draft_attention=args.draft_attention[0]))
                    finish_row(rows[-1], budget)
                    print(rows[-1], flush=True)
                    write_json_atomic(args.out, payload)  # after every row: a run cut short keeps what it measured
    print_table(rows, ["context", "attention", "method", "budget", "draft_ms"]
                + [f"draft_ms_{impl}" for impl in args.draft_attention[1:]] + ["tree_builder", "tree_ms"]
                + (["candidate_budget", "tc_pass_ms"] + [f"tc_pass_ms_{impl}" for impl in args.draft_attention[1:]]
                   + ["tc_select_ms"] if "jetspec-tc" in args.methods else [])
                + [f"tree_ms_{b}" for b in args.tree_builders[1:]] + [f"tree_ms_topk_{k}" for k in args.top_k[1:]]
                + ["verify_ms", "accept_commit_ms"] + [f"accept_commit_ms_{c}" for c in args.compactions[1:]]
                + ["sum_ms", "loop_step_ms"] + [f"loop_step_ms_{g}" for g in args.gemm_backends[1:]]
                + ["ar_step_ms", "verify_over_ar", "c_percent"])
    write_json_atomic(args.out, payload)


@dataclasses.dataclass(frozen=True)
class ContextState:
    """Everything the stage timings of one context length share."""
    args: argparse.Namespace
    cfg: qwen3.Config
    params: dict
    head: dict
    drafter: HeadDrafter
    anchor: jax.Array
    cache: object
    ctx: object
    draft_logits: jax.Array
    prompt: jax.Array
    lens: jax.Array
    cache_len: int
    iters: int

    @property
    def depth(self) -> int:
        return self.drafter.max_depth


def method_spec(args, method: str, budget: int, impl: str = "auto") -> SpecConfig:
    """The step's settings for one row (jetspec-tc: a candidate tree of candidate_factor x budget)."""
    tc = method == "jetspec-tc"
    return SpecConfig(method, budget, args.width, attention_impl=impl, tree_impl=args.tree_builders[0],
                      top_k_impl=args.top_k[0], compact_impl=args.compactions[0],
                      candidate_budget=args.candidate_factor * budget if tc else None,
                      conditioned_width=args.conditioned_width if tc else None)


def stage_row(st: ContextState, budget: int, impl: str, method: str = "jetspec") -> dict:
    """Tree build, verify and accept+commit times (ms) at one budget and verify attention path (for
    jetspec-tc also its second head pass and re-selection), plus the whole step inside
    speculative_generate for the embedded target."""
    args, cfg, taps_wanted = st.args, st.cfg, st.drafter.cfg.tap_layers
    tc = method == "jetspec-tc"
    spec = method_spec(args, method, budget, impl)
    tree_budget = spec.candidates if tc else budget  # jetspec-tc: this stage builds the candidate tree

    def make_tree(logits, anchor, builder=args.tree_builders[0], top_k=args.top_k[0]):
        tokens, logps = top_candidates(jax.nn.log_softmax(logits, axis=-1), args.width, implementation=top_k)
        return build_trees(anchor, tokens, logps, budget=tree_budget, implementation=builder)

    tree_ms = {}
    variants = [(b, args.top_k[0], b) for b in args.tree_builders] + [
        (args.tree_builders[0], k, f"topk_{k}") for k in args.top_k[1:]]
    for builder, top_k, name in variants:
        def tree_body(i, logits, anchor, builder=builder, top_k=top_k):
            tree = make_tree(logits, anchor, builder, top_k)
            return logits + 1e-6 * tree.scores[:, -1:, None]  # carried, so each build is real

        tree_ms[name] = per_iteration_ms(tree_body, st.draft_logits, st.iters, st.anchor)
    tree = jax.jit(make_tree)(st.draft_logits, st.anchor)
    tc_ms = {}
    if tc:
        candidates = tree
        for impl_name in st.args.draft_attention:  # the drafter's first, the others beside it
            drafter = dataclasses.replace(st.drafter, attention_impl=impl_name)

            def pass_body(i, tokens, head, params, ctx, candidates, drafter=drafter):  # reads the last pass's choice
                _, _, logps = tree_causal_pass(params, head, candidates._replace(tokens=tokens), None, ctx,
                                               drafter=drafter, spec=spec, depth=st.depth)
                return (tokens + jnp.argmax(logps[:, :1], axis=-1).astype(jnp.int32)) % cfg.vocab_size

            key = "tc_pass_ms" if impl_name == st.drafter.attention_impl else f"tc_pass_ms_{impl_name}"
            tc_ms[key] = per_iteration_ms(pass_body, candidates.tokens, st.iters, st.head, st.params, st.ctx,
                                          candidates)
        second_pass = jax.jit(lambda p, h, c, t: tree_causal_pass(p, h, t, None, c, drafter=st.drafter, spec=spec,
                                                                  depth=st.depth))
        nodes, real, logps = second_pass(st.params, st.head, st.ctx, candidates)

        def select_body(i, logps, candidates, nodes, real):
            chosen = select_trees(candidates, nodes, real, logps, spec=spec, depth=st.depth)
            return logps + 1e-6 * chosen.scores[:, -1:, None]  # carried, so each selection is real

        tc_ms["tc_select_ms"] = per_iteration_ms(select_body, logps, st.iters, candidates, nodes, real)
        tree = jax.jit(lambda c, n, r, lp: select_trees(c, n, r, lp, spec=spec, depth=st.depth))(
            candidates, nodes, real, logps)

    def verify_body(i, cache, params, tree):
        _, _, cache = verify_tree(params, tree, cache, cfg, taps_wanted, impl)
        return cache

    verify_ms = per_iteration_ms(verify_body, st.cache, st.iters, st.params, tree)
    vlogits, node_taps, verified_cache = jax.jit(
        lambda p, t, c: verify_tree(p, t, c, cfg, taps_wanted, impl))(st.params, tree, st.cache)

    accept_ms = {}
    for compaction in args.compactions:
        def accept_body(i, state, tree, vlogits, node_taps, head, compaction=compaction):
            cache, ctx = state
            result = accept(tree, jnp.argmax(vlogits, axis=-1).astype(jnp.int32), st.depth)  # T=0's choices
            keep = jnp.zeros_like(result.accept_len)  # commit nothing so every iteration sees one state
            path_taps = jax.vmap(lambda t, p: t[p])(node_taps, result.path)
            return (compact_cache(cache, result.path, keep, compaction),
                    st.drafter.observe(head, ctx, path_taps, keep))

        accept_ms[compaction] = per_iteration_ms(accept_body, (verified_cache, st.ctx), st.iters, tree, vlogits,
                                                 node_taps, st.head)
    row = dict(context=st.prompt.shape[1], attention=impl, method=method, budget=budget, width=args.width,
               tree_builder=args.tree_builders[0], tree_ms=tree_ms[args.tree_builders[0]], verify_ms=verify_ms,
               compaction=args.compactions[0], accept_commit_ms=accept_ms[args.compactions[0]], **tc_ms)
    if tc:
        row.update(candidate_budget=spec.candidates, conditioned_width=spec.extend_width,
                   tc_pass_slots=spec.tree_pass_slots(st.depth))
    row.update({f"tree_ms_{builder}": ms for builder, ms in tree_ms.items() if builder != args.tree_builders[0]})
    row.update({f"accept_commit_ms_{c}": ms for c, ms in accept_ms.items() if c != args.compactions[0]})
    for backend in args.gemm_backends if args.target == "embedded" and args.loop_step else ():
        def full(n, spec=dataclasses.replace(spec, gemm_backend=backend)):
            gen = GenerationConfig(max_new_tokens=n)
            return lambda: speculative_generate(st.params, st.head, st.prompt, st.lens, jax.random.key(0), cfg=cfg,
                                                drafter=st.drafter, spec=spec, gen=gen, cache_len=st.cache_len)

        n_new = 65
        steps = int(full(n_new)().target_forwards.max())
        key = "loop_step_ms" if backend == args.gemm_backends[0] else f"loop_step_ms_{backend}"
        row[key] = (time_call(full(n_new), repeats=5) - time_call(full(1), repeats=5)) / steps * 1e3
    row["gemm_backend"] = args.gemm_backends[0]
    return row


def finish_row(row: dict, budget: int) -> None:
    """Adds the sums and ratios once the draft and AR step times are in the row."""
    tc_ms = row.get("tc_pass_ms", 0.0) + row.get("tc_select_ms", 0.0)
    row["sum_ms"] = row["draft_ms"] + row["tree_ms"] + tc_ms + row["verify_ms"] + row["accept_commit_ms"]
    row["verify_over_ar"] = row["verify_ms"] / row["ar_step_ms"]
    # the drafting cost: the head's passes (jetspec-tc: both)
    row["c_percent"] = 100 * (row["draft_ms"] + row.get("tc_pass_ms", 0.0)) / (budget * row["verify_ms"])
    if "loop_step_ms" in row:
        row["step_over_ar"] = row["loop_step_ms"] / row["ar_step_ms"]


if __name__ == "__main__":
    main()
