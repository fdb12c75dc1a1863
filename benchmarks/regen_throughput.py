"""Regeneration throughput: where a large-batch decode step goes, and the slot engine end to end on
the training mixture against the static-batch generator in the same run.

    python benchmarks/regen_throughput.py --per-source 400 --out benchmarks/results/regen_throughput_shared_h200.json

Step table: one decode step of the slot engine (regen_engine.decode_chunk, median per step over a
chunk) at each (slots, prompt width), with a prompt's rows read once for 3 answers or copied for each
(--step-shares), greedy and sampled, and the sampler alone (Gumbel over the vocabulary vs
one-uniform inverse CDF). End to end: `regenerate` on `--per-source` prompts of every training source
(greedy + sampled answers), completion tokens/s per prompt bucket, with shared prompt rows and with a
copy per answer; the baseline is `generate_tokens` (one static batch that runs until its longest
answer ends) on the shortest bucket's prompts at the same batch size.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, gpu_kernel_events, print_table, time_call, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.sampling import RowSampling, sample_rows_inverse_cdf, select_tokens  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402
from jetspec_jax.tokens import pad_prompts, pad_token, plan_cache_len, stop_tokens  # noqa: E402
from jetspec_jax.train.config import DataConfig  # noqa: E402
from jetspec_jax.train.corpus import Corpus  # noqa: E402
from jetspec_jax.train.mixture import SOURCES  # noqa: E402
from jetspec_jax.train.regen_engine import decode_chunk, new_slot_state, prompt_rows_for  # noqa: E402
from jetspec_jax.train.regenerate import load_regeneration_prompts, regenerate  # noqa: E402


def repeated_chunk(target, slots: int, width: int, share: int, chunk: int, temperature: float, attention: str,
                   answer_rows: int = 512):
    """(run, mean context): run() decodes one chunk for `slots` live answers, `share` of them reading
    one prompt slot (prompts of random lengths in (width/2, width], answers of random lengths in
    [0, answer_rows - 2 chunk)), and puts the lengths back, so every call times the same cache reads."""
    prompt_slots = -(-slots // share)
    state = new_slot_state(target.cfg, slots, answer_rows, prompt_slots, prompt_rows_for(width, share), share,
                           target.params["embed"].dtype)
    rng = np.random.default_rng(0)
    prompt_lengths = rng.integers(width // 2 + 1, width + 1, prompt_slots).astype(np.int32)
    answer_lengths = rng.integers(0, answer_rows - 2 * chunk, slots).astype(np.int32)
    slot = np.arange(slots)
    state = state._replace(prompts=state.prompts._replace(lengths=jnp.asarray(prompt_lengths)),
                           answers=state.answers._replace(lengths=jnp.asarray(answer_lengths)),
                           prompt_of=jnp.asarray(slot // share, jnp.int32),
                           member_of=jnp.asarray(slot % share, jnp.int32),
                           members=jnp.asarray(np.minimum(np.arange(prompt_slots * share), slots - 1).reshape(
                               prompt_slots, share), jnp.int32),
                           live=jnp.ones((slots,), bool), limit=jnp.full((slots,), 10**6, jnp.int32),
                           temperature=jnp.full((slots,), temperature, jnp.float32))
    holder = [state]

    def run():
        holder[0], toks = decode_chunk(target.params, holder[0], cfg=target.cfg, steps=chunk, eos_token_ids=(),
                                       pad_token_id=pad_token(target), top_p=1.0, attention=attention)
        holder[0] = holder[0]._replace(prompts=holder[0].prompts._replace(lengths=jnp.asarray(prompt_lengths)),
                                       answers=holder[0].answers._replace(lengths=jnp.asarray(answer_lengths)))
        return toks

    context = float(prompt_lengths[slot // share].mean() + answer_lengths.mean())
    return run, context


def step_rows(target, slots_list, widths, shares, chunk: int, attentions) -> list[dict]:
    out = []
    for slots, width in zip(slots_list, widths):
        for share in shares:
            for attention in attentions:
                for temperature in (0.0, 1.0):
                    run, context = repeated_chunk(target, slots, width, share, chunk, temperature, attention)
                    seconds = time_call(run, warmup=2, repeats=5)
                    out.append({"part": "decode step", "slots": slots, "prompt_width": width,
                                "answers_per_prompt": share, "attention": attention, "temperature": temperature,
                                "mean_context": context, "step_ms": seconds / chunk * 1e3,
                                "tokens_per_second": slots * chunk / seconds})
        vocab = target.cfg.vocab_size
        logits = jax.random.normal(jax.random.key(0), (slots, vocab), jnp.float32)
        keys = jax.random.split(jax.random.key(1), slots)
        temps = jnp.ones((slots,), jnp.float32)
        rows = RowSampling(temps, jnp.zeros((slots,), jnp.int32), jnp.ones((slots,), jnp.float32))
        gumbel = jax.jit(lambda l, k: select_tokens(l, k, rows, jnp.zeros((slots,), jnp.int32)))
        cdf = jax.jit(lambda l, k: sample_rows_inverse_cdf(l, k, temps))
        for name, fn in (("gumbel", gumbel), ("inverse_cdf", cdf)):
            out.append({"part": f"sampler {name}", "slots": slots,
                        "step_ms": time_call(lambda: fn(logits, keys), warmup=2, repeats=10) * 1e3})
    return out


def profile_rows(target, slots: int, width: int, share: int, chunk: int, top: int = 15) -> list[dict]:
    """GPU time per decode step by kernel (summed over the chunk's steps), from one profiled chunk."""
    run, _ = repeated_chunk(target, slots, width, share, chunk, 1.0, "auto")
    events, wall = gpu_kernel_events(run)
    if events is None:
        return []
    by_name = collections.Counter()
    for name, ns in events:
        by_name[name] += ns / 1e3 / chunk
    busy = sum(by_name.values())
    out = [{"part": "profile total", "slots": slots, "prompt_width": width, "answers_per_prompt": share,
            "gpu_us_per_step": busy, "wall_us_per_step": wall / chunk * 1e6}]
    return out + [{"part": "kernel", "kernel": name[:60], "gpu_us_per_step": us, "share": us / busy}
                  for name, us in by_name.most_common(top)]


def baseline_rows(target, prompt_ids: list[list[int]], batch: int, max_new: int) -> dict:
    """The static-batch generator over the first `batch` prompts (greedy), completion tokens/s."""
    gen = GenerationConfig(max_new_tokens=max_new, eos_token_ids=stop_tokens(target), pad_token_id=pad_token(target))
    ids = (prompt_ids * (-(-batch // len(prompt_ids))))[:batch]
    tokens, lengths = pad_prompts(ids, gen.pad_token_id, 64)
    cache_len = plan_cache_len(tokens.shape[1], int(lengths.max()), max_new, target.cfg.max_position_embeddings)

    def run():
        return generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                               cfg=target.cfg, gen=gen, cache_len=cache_len)

    jax.block_until_ready(run())
    t0 = time.perf_counter()
    out = jax.block_until_ready(run())
    seconds = time.perf_counter() - t0
    completion = int(np.asarray(out.num_tokens).sum())
    return {"part": "static batch (generate_tokens)", "slots": batch, "answers": batch, "completion_tokens": completion,
            "seconds": seconds, "tokens_per_second": completion / seconds,
            "decode_steps": int(out.decode_steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--per-source", type=int, default=100, help="prompts per training source (end to end)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7, 1.0])
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--cache-gib", type=float, default=45.0, help="the slots' KV cache (45: 2M rows of the embedded model)")
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-prompt-tokens", type=int, default=4096)
    p.add_argument("--step-slots", type=int, nargs="*", default=[1024, 2048, 4096, 456])
    p.add_argument("--step-widths", type=int, nargs="*", default=[128, 128, 128, 4096],
                   help="prompt bucket of each --step-slots entry")
    p.add_argument("--step-shares", type=int, nargs="+", default=[1, 3],
                   help="answers reading one prompt slot (1: a copy of the prompt per answer)")
    p.add_argument("--attentions", nargs="+", default=["auto"])
    p.add_argument("--profile", type=int, nargs=3, default=None, metavar=("SLOTS", "WIDTH", "SHARE"),
                   help="profile one decode chunk at this size: GPU time per step by kernel")
    p.add_argument("--share-prompts", choices=["on", "off", "both"], default="both",
                   help="end to end with a prompt's answers sharing its cache rows, a copy each, or both")
    p.add_argument("--skip-end-to-end", action="store_true")
    p.add_argument("--keep-corpus", default=None, help="write the end-to-end corpus here instead of a temp dir")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    target = load_target(args.model, dtype=args.dtype)
    if len(args.step_slots) != len(args.step_widths):
        p.error("--step-slots and --step-widths need one entry each per step shape")
    rows = step_rows(target, args.step_slots, args.step_widths, args.step_shares, 16, args.attentions)
    print_table(rows, ["part", "slots", "prompt_width", "answers_per_prompt", "attention", "temperature",
                       "mean_context", "step_ms", "tokens_per_second"])
    profile = profile_rows(target, *args.profile, 16) if args.profile else []
    if profile:
        print_table(profile, ["part", "slots", "prompt_width", "kernel", "gpu_us_per_step", "wall_us_per_step",
                              "share"])
    end_to_end = []
    if not args.skip_end_to_end:
        prompts = load_regeneration_prompts(args.data_dir, {name: args.per_source for name in SOURCES}, seed=0)
        shortest = []
        for share in {"on": [True], "off": [False], "both": [False, True]}[args.share_prompts]:
            cfg = DataConfig(answer_temperatures=args.temperatures, max_new_tokens=args.max_new_tokens,
                             max_answer_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
                             regen_batch_size=args.batch_size, regen_cache_gib=args.cache_gib,
                             regen_chunk_steps=args.chunk_steps, regen_shard_answers=1 << 14,
                             regen_share_prompts=share)
            keep = args.keep_corpus and os.path.join(args.keep_corpus, "shared" if share else "copies")
            out_dir = keep or tempfile.mkdtemp(prefix="regen-bench-")
            engine = "slot engine, shared prompts" if share else "slot engine, a prompt copy per answer"
            try:
                session = regenerate(target, prompts, out_dir, cfg)["sessions"][-1]
                end_to_end += [{"part": engine, **b} for b in session["buckets"]]
                end_to_end.append({"part": f"{engine}, all buckets", "answers": session["answers"],
                                   "completion_tokens": session["completion_tokens"], "seconds": session["seconds"],
                                   "tokens_per_second": session["tokens_per_second"]})
                corpus = Corpus(out_dir)
                shortest = [corpus.prompt_ids(i).tolist() for i in range(len(corpus.prompts))
                            if len(corpus.prompt_ids(i)) <= 128]
            finally:
                if not keep:
                    shutil.rmtree(out_dir, ignore_errors=True)
        end_to_end.append(baseline_rows(target, shortest, min(args.batch_size, 1024), args.max_new_tokens))
        print_table(end_to_end, ["part", "prompt_width", "slots", "prompt_slots", "answers", "completion_tokens",
                                 "decode_steps", "admissions", "admission_seconds", "chunk_seconds", "seconds",
                                 "tokens_per_second"])
    if args.out:
        write_json_atomic(args.out, {"environment": environment(), "args": vars(args), "steps": rows, "profile": profile,
                                     "end_to_end": end_to_end})


if __name__ == "__main__":
    main()
