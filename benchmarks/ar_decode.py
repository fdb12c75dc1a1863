"""Greedy autoregressive decode speed of the target: ours (jitted while_loop) vs transformers' static cache.

    python benchmarks/ar_decode.py --out benchmarks/results/ar_decode_h200.json

Steady-state decode time per step = (time for N new tokens - time for 1 new token) / (N - 1), so
prefill is excluded; both engines generate exactly N tokens (EOS ignored), bf16, same prompts.
Also prints the step's distance from the weight-bandwidth floor and the kernels launched per step.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, time_call, write_json_atomic  # noqa: E402

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens  # noqa: E402
from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.target import load_target  # noqa: E402
from jetspec_jax.tokens import encode_prompts, pad_prompts, pad_token, plan_cache_len  # noqa: E402

PROMPTS = [
    "What is the capital of France? Answer in one sentence, then explain its history briefly.",
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Explain the difference between a list and a tuple in Python.",
    "Give me three tips for writing clear technical documentation.",
    "What causes the seasons on Earth?",
    "Summarise the plot of Romeo and Juliet in a paragraph.",
    "How do I compute the derivative of x^3 + 2x?",
]
COPY_BANDWIDTH = 4.3e12  # H200 device-to-device copy, bytes/s counting read+write (measured here)


def kernels_per_step(target, batch: int, cache_len: int) -> int:
    """Kernels XLA launches for one decode step (entry-computation instructions that run on device)."""
    cache = qwen3.new_cache(target.cfg, batch, cache_len, target.params["embed"].dtype)
    tokens = jnp.zeros((batch, 1), jnp.int32)

    def step(params, tokens, cache):
        return qwen3.forward(params, tokens, cache.lengths[:, None], cache, target.cfg)

    params = qwen3.fuse_for_decode(target.params)  # the layout the decode loop uses
    text = jax.jit(step, donate_argnums=2).lower(params, tokens, cache).compile().as_text()
    entry = text[text.index("ENTRY"):]
    entry = entry[: entry.index("\n}")]
    skip = ("parameter", "tuple", "get-tuple-element", "constant", "bitcast")
    ops = re.findall(r"=\s*\S+\s+([a-z\-]+)\(", entry)
    return sum(op not in skip for op in ops)


def bench_ours(target, prompt_ids, batch, new_tokens, repeats):
    ids = [prompt_ids[i % len(prompt_ids)] for i in range(batch)]
    tokens, lengths = pad_prompts(ids, pad_token(target))
    cache_len = plan_cache_len(tokens.shape[1], int(lengths.max()), new_tokens,
                               target.cfg.max_position_embeddings)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

    def run(n):
        gen = GenerationConfig(max_new_tokens=n, eos_token_ids=(), pad_token_id=pad_token(target))
        return lambda: generate_tokens(target.params, tokens, lengths, jax.random.key(0), cfg=target.cfg,
                                       gen=gen, cache_len=cache_len)

    t_full = time_call(run(new_tokens), repeats=repeats)
    t_prefill = time_call(run(1), repeats=repeats)
    step = (t_full - t_prefill) / (new_tokens - 1)
    return dict(engine="jetspec_jax", batch=batch, step_ms=step * 1e3, tok_s=batch / step,
                e2e_tok_s=batch * new_tokens / t_full, prefill_ms=t_prefill * 1e3, cache_len=cache_len,
                kernels_per_step=kernels_per_step(target, batch, cache_len))


def bench_transformers(path, prompts_text, batch, new_tokens, repeats):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.bfloat16).cuda().eval()
    texts = [tok.apply_chat_template([{"role": "user", "content": prompts_text[i % len(prompts_text)]}],
                                     tokenize=False, add_generation_prompt=True) for i in range(batch)]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to("cuda")

    def run(n):
        with torch.no_grad():
            model.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           cache_implementation="static", pad_token_id=tok.pad_token_id)
        torch.cuda.synchronize()

    def timed(n):
        for _ in range(2):
            run(n)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(n)
            times.append(time.perf_counter() - t0)
        return float(np.median(times))

    t_full, t_prefill = timed(new_tokens), timed(1)
    step = (t_full - t_prefill) / (new_tokens - 1)
    return dict(engine="transformers-static", batch=batch, step_ms=step * 1e3, tok_s=batch / step,
                e2e_tok_s=batch * new_tokens / t_full, prefill_ms=t_prefill * 1e3)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--out", default="benchmarks/results/ar_decode.json")
    args = p.parse_args()

    target = load_target()  # bf16 on the GPU, fp32 on the CPU
    prompt_ids = encode_prompts(target.tokenizer, PROMPTS)
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(target.params))
    rows = []
    for batch in args.batch:
        row = bench_ours(target, prompt_ids, batch, args.new_tokens, args.repeats)
        kv_bytes = (batch * row["cache_len"] * target.cfg.num_layers * 2 * target.cfg.num_kv_heads
                    * target.cfg.head_dim * target.params["embed"].dtype.itemsize)
        row["bandwidth_floor_ms"] = (param_bytes + kv_bytes) / COPY_BANDWIDTH * 1e3
        row["us_per_kernel"] = row["step_ms"] * 1e3 / row["kernels_per_step"]
        rows.append(row)
        print(row, flush=True)
        if not args.no_transformers and jax.default_backend() == "gpu":
            rows.append(bench_transformers(target.source, PROMPTS, batch, args.new_tokens, args.repeats))
    for batch in args.batch:
        ours = next(r for r in rows if r["batch"] == batch and r["engine"] == "jetspec_jax")
        hf = next((r for r in rows if r["batch"] == batch and r["engine"] != "jetspec_jax"), None)
        if hf:
            ours["speedup_vs_transformers"] = ours["tok_s"] / hf["tok_s"]
    print_table(rows, ["engine", "batch", "step_ms", "tok_s", "e2e_tok_s", "prefill_ms", "kernels_per_step",
                       "us_per_kernel", "bandwidth_floor_ms", "speedup_vs_transformers"])
    write_json_atomic(args.out, dict(benchmark="ar_decode", model=os.path.basename(target.source),
                                     new_tokens=args.new_tokens, param_bytes=param_bytes,
                                     copy_bandwidth_bytes_per_s=COPY_BANDWIDTH, rows=rows,
                                     environment=environment()))


if __name__ == "__main__":
    main()
