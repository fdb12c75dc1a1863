"""Cost of one speculative step, stage by stage, against one autoregressive step.

    python benchmarks/spec_step_breakdown.py --out benchmarks/results/spec_step_breakdown_h200.json

Embedded target (bf16 on GPU) and an untrained JetSpec head of the default shape (timing does not
depend on the head's values). Each stage runs `--iters` times inside one jitted `fori_loop`, its
buffers threaded through the loop as in generation, so the per-iteration time is device time without
per-call dispatch: draft pass, tree build (top-W + best-first), verify pass, accept + cache
compaction + head-context update. `loop_step_ms` is the whole step measured inside
`speculative_generate`, and `ar_step_ms` one decode step measured the same way as the stages.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, prefill  # noqa: E402
from jetspec_jax.models import draft_head, qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.speculative import HeadDrafter, SpecConfig, speculative_generate  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402
from jetspec_jax.tree import build_tree, top_candidates  # noqa: E402
from jetspec_jax.verify import accept, compact_cache, target_choices, verify_tree  # noqa: E402


def per_iteration_ms(body, init, iters: int, *inputs) -> float:
    """Device time of one `state = body(i, state, *inputs)`, from a jitted fori_loop of `iters`
    iterations minus one of a single iteration (cancels the call's fixed cost). Arrays go in as
    arguments, never as closed-over constants, which XLA would try to constant-fold."""
    run = jax.jit(lambda state, inputs, n: lax.fori_loop(0, n, lambda i, s: body(i, s, *inputs), state),
                  static_argnums=2)
    t_many = time_call(lambda: run(init, inputs, iters), repeats=5)
    t_one = time_call(lambda: run(init, inputs, 1), repeats=5)
    return (t_many - t_one) / (iters - 1) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="committed tokens before the step")
    p.add_argument("--head-layers", type=int, default=2)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/spec_step_breakdown.json")
    args = p.parse_args()

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    target = load_target(dtype=dtype, with_tokenizer=False)
    cfg = target.cfg
    params = jax.jit(qwen3.fuse_for_decode)(target.params)
    head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=args.head_layers)
    head = init_params(draft_head.param_specs(head_cfg), jax.random.key(0), dtype)
    drafter = HeadDrafter(head_cfg, cfg)
    depth, taps_wanted = head_cfg.max_depth, head_cfg.tap_layers
    b, ctx_len = args.batch, args.context
    cache_len = ctx_len + 80 + max(args.budgets) + depth + 1
    prompt = jax.random.randint(jax.random.key(1), (b, ctx_len), 0, cfg.vocab_size)
    lens = jnp.full((b,), ctx_len, jnp.int32)

    @jax.jit
    def setup(params, head, prompt, lens):
        logits, taps, cache = prefill(params, prompt, lens, cfg, cache_len, tap_layers=taps_wanted)
        ctx = drafter.observe(head, drafter.init_state(head, b, cache_len, dtype), taps, lens)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache, ctx

    anchor, cache, ctx = setup(params, head, prompt, lens)

    def ar_body(i, cache, params, anchor):
        _, _, cache = qwen3.forward(params, anchor[:, None], cache.lengths[:, None], cache, cfg)
        return cache

    ar_ms = per_iteration_ms(ar_body, cache, args.iters, params, anchor)

    def draft_body(i, anchor, head, params, ctx):  # the next anchor depends on the draft: nothing hoists
        logits = drafter.propose(head, ctx, params, None, anchor, depth)
        return (anchor + jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)) % cfg.vocab_size

    draft_ms = per_iteration_ms(draft_body, anchor, args.iters, head, params, ctx)
    draft_logits = jax.jit(lambda h, p, c, a: drafter.propose(h, c, p, None, a, depth))(head, params, ctx, anchor)
    rows = []
    for budget in args.budgets:
        def make_tree(logits, anchor, budget=budget):
            tokens, logps = top_candidates(jax.nn.log_softmax(logits, axis=-1), args.width)
            return jax.vmap(functools.partial(build_tree, budget=budget))(anchor, tokens, logps)

        def tree_body(i, logits, anchor):
            tree = make_tree(logits, anchor)
            return logits + 1e-6 * tree.scores[:, -1:, None]  # carried, so each build is real

        tree_ms = per_iteration_ms(tree_body, draft_logits, args.iters, anchor)
        tree = jax.jit(make_tree)(draft_logits, anchor)

        def verify_body(i, cache, params, tree):
            _, _, cache = verify_tree(params, tree, cache, cfg, taps_wanted)
            return cache

        verify_ms = per_iteration_ms(verify_body, cache, args.iters, params, tree)
        vlogits, node_taps, verified_cache = jax.jit(
            lambda p, t, c: verify_tree(p, t, c, cfg, taps_wanted))(params, tree, cache)

        def accept_body(i, state, tree, vlogits, node_taps, head):
            cache, ctx = state
            result = accept(tree, target_choices(vlogits, jax.random.key(0), GenerationConfig().sampling), depth)
            keep = jnp.zeros_like(result.accept_len)  # commit nothing so every iteration sees one state
            path_taps = jax.vmap(lambda t, p: t[p])(node_taps, result.path)
            return compact_cache(cache, result.path, keep), drafter.observe(head, ctx, path_taps, keep)

        accept_ms = per_iteration_ms(accept_body, (verified_cache, ctx), args.iters, tree, vlogits, node_taps, head)

        spec = SpecConfig("jetspec", budget, args.width)

        def full(n):
            gen = GenerationConfig(max_new_tokens=n)
            return lambda: speculative_generate(target.params, head, prompt, lens, jax.random.key(0), cfg=cfg,
                                                drafter=drafter, spec=spec, gen=gen, cache_len=cache_len)

        n_new = 65
        steps = int(full(n_new)().target_forwards.max())
        loop_ms = (time_call(full(n_new), repeats=5) - time_call(full(1), repeats=5)) / steps * 1e3
        total = draft_ms + tree_ms + verify_ms + accept_ms
        rows.append(dict(budget=budget, width=args.width, batch=b, context=ctx_len, draft_ms=draft_ms,
                         tree_ms=tree_ms, verify_ms=verify_ms, accept_commit_ms=accept_ms, sum_ms=total,
                         loop_step_ms=loop_ms, ar_step_ms=ar_ms, verify_over_ar=verify_ms / ar_ms,
                         step_over_ar=loop_ms / ar_ms))
        print(rows[-1], flush=True)
    print_table(rows, ["budget", "draft_ms", "tree_ms", "verify_ms", "accept_commit_ms", "sum_ms",
                       "loop_step_ms", "ar_step_ms", "verify_over_ar", "step_over_ar"])
    write_json_atomic(args.out, dict(benchmark="spec_step_breakdown", model=os.path.basename(target.source),
                                     head=dict(layers=head_cfg.num_layers, block=head_cfg.block_size,
                                               taps=list(head_cfg.tap_layers)),
                                     iters=args.iters, rows=rows, environment=environment()))


if __name__ == "__main__":
    main()
