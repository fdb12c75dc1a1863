"""Cost of one speculative step, stage by stage, against one autoregressive step.

    python benchmarks/spec_step_breakdown.py --out benchmarks/results/spec_step_breakdown_h200.json

Embedded target (bf16 on GPU) and an untrained JetSpec head of the default shape (timing does not
depend on the head's values). Stages, each jitted alone with its buffers donated as in the loop:
draft pass, tree build, verify pass, accept + cache compaction + head-context update. The last
column is the same step measured inside `speculative_generate`'s while_loop.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, prefill  # noqa: E402
from jetspec_jax.models import draft_head, qwen3  # noqa: E402
from jetspec_jax.models.params import init_params  # noqa: E402
from jetspec_jax.speculative import HeadDrafter, SpecConfig, speculative_generate  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402
from jetspec_jax.tree import build_tree, top_candidates  # noqa: E402
from jetspec_jax.verify import accept, compact_cache, target_choices, verify_tree  # noqa: E402


def time_threaded(step, state, repeats=30, warmup=3):
    """Median seconds of state = step(state), threading donated buffers through like a loop does."""
    for _ in range(warmup):
        state = jax.block_until_ready(step(state))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state = jax.block_until_ready(step(state))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--width", type=int, default=7)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="committed tokens before the step")
    p.add_argument("--head-layers", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/spec_step_breakdown.json")
    args = p.parse_args()

    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    target = load_target(dtype=dtype, with_tokenizer=False)
    cfg = target.cfg
    params = jax.jit(qwen3.fuse_for_decode)(target.params)
    head_cfg = draft_head.DraftConfig.for_target(cfg, num_layers=args.head_layers)
    head = init_params(draft_head.param_specs(head_cfg), jax.random.key(0), dtype)
    drafter = HeadDrafter(head_cfg, cfg)
    depth = head_cfg.max_depth
    b, ctx_len = args.batch, args.context
    cache_len = ctx_len + 64 + max(args.budgets) + depth + 1
    prompt = jax.random.randint(jax.random.key(1), (b, ctx_len), 0, cfg.vocab_size)
    lens = jnp.full((b,), ctx_len, jnp.int32)

    @jax.jit
    def setup(params, head):
        logits, taps, cache = prefill(params, prompt, lens, cfg, cache_len, tap_layers=head_cfg.tap_layers)
        ctx = drafter.observe(head, drafter.init_state(head, b, cache_len, dtype), taps, lens)
        return jnp.argmax(logits, -1).astype(jnp.int32), cache, ctx

    anchor, cache, ctx = setup(params, head)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def ar_step(params, cache):
        _, _, cache = qwen3.forward(params, anchor[:, None], cache.lengths[:, None], cache, cfg)
        return cache

    ar_ms = time_threaded(lambda c: ar_step(params, c), cache) * 1e3
    anchor, cache, ctx = setup(params, head)

    draft = jax.jit(lambda head, params, ctx, anchor: drafter.propose(head, ctx, params, None, anchor, depth))
    draft_ms = time_call(lambda: draft(head, params, ctx, anchor), repeats=30) * 1e3
    logits = draft(head, params, ctx, anchor)
    rows = []
    for budget in args.budgets:
        @jax.jit
        def make_tree(logits, anchor, budget=budget):
            tokens, logps = top_candidates(jax.nn.log_softmax(logits, axis=-1), args.width)
            return jax.vmap(functools.partial(build_tree, budget=budget))(anchor, tokens, logps)

        tree_ms = time_call(lambda: make_tree(logits, anchor), repeats=30) * 1e3
        tree = make_tree(logits, anchor)

        @functools.partial(jax.jit, donate_argnums=(2,))
        def verify(params, tree, cache):
            vlogits, taps, cache = verify_tree(params, tree, cache, cfg, head_cfg.tap_layers)
            return vlogits, taps, cache

        def verify_step(state):
            return verify(params, tree, state[2])

        anchor, cache, ctx = setup(params, head)
        verify_ms = time_threaded(verify_step, verify(params, tree, cache)) * 1e3
        anchor, cache, ctx = setup(params, head)
        vlogits, taps, cache = verify(params, tree, cache)

        @functools.partial(jax.jit, donate_argnums=(3, 4))
        def accept_commit(tree, vlogits, taps, cache, ctx):
            result = accept(tree, target_choices(vlogits, jax.random.key(0), GenerationConfig().sampling), depth)
            keep = jnp.zeros_like(result.accept_len)  # commit nothing so repeats see the same state
            cache = compact_cache(cache, result.path, keep)
            path_taps = jax.vmap(lambda t, p: t[p])(taps, result.path)
            return cache, drafter.observe(head, ctx, path_taps, keep)

        accept_ms = time_threaded(lambda s: accept_commit(tree, vlogits, taps, *s), (cache, ctx)) * 1e3

        spec = SpecConfig("jetspec", budget, args.width)

        def full(n):
            gen = GenerationConfig(max_new_tokens=n)
            return lambda: speculative_generate(target.params, head, prompt, lens, jax.random.key(0), cfg=cfg,
                                                drafter=drafter, spec=spec, gen=gen, cache_len=cache_len)

        n_new = 65
        out = full(n_new)()
        steps = int(out.target_forwards.max())
        loop_ms = (time_call(full(n_new), repeats=5) - time_call(full(1), repeats=5)) / steps * 1e3
        total = draft_ms + tree_ms + verify_ms + accept_ms
        rows.append(dict(budget=budget, width=args.width, batch=b, context=ctx_len, draft_ms=draft_ms,
                         tree_ms=tree_ms, verify_ms=verify_ms, accept_commit_ms=accept_ms, sum_ms=total,
                         loop_step_ms=loop_ms, ar_step_ms=ar_ms, verify_over_ar=verify_ms / ar_ms,
                         step_over_ar=loop_ms / ar_ms))
        print(rows[-1], flush=True)
    print_table(rows, ["budget", "draft_ms", "tree_ms", "verify_ms", "accept_commit_ms", "sum_ms",
                       "loop_step_ms", "ar_step_ms", "step_over_ar"])
    write_json_atomic(args.out, dict(benchmark="spec_step_breakdown", model=os.path.basename(target.source),
                                     head=dict(layers=head_cfg.num_layers, block=head_cfg.block_size,
                                               taps=list(head_cfg.tap_layers)),
                                     rows=rows, environment=environment()))


if __name__ == "__main__":
    main()
