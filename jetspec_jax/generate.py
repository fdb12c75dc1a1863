"""The generation command line, autoregressive or speculative.

    python -m jetspec_jax.generate "What is the capital of France?"
    python -m jetspec_jax.generate "Write a haiku." --method jetspec --head HEAD_DIR --budget 64
    python -m jetspec_jax.generate "Write a haiku." --method jetspec-tc --budget 64 --candidate-budget 256

Prompts go through the tokenizer's chat template (non-thinking) and run as one batch through
`api.generate`. On a terminal (or with --stream) it instead streams each answer as its tokens commit,
through the serving engine (serve/engine.py), one prompt after another. The command line sits on top of
both; neither imports it, nor does the server's command line (they share cli_loading.py).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Sequence

import jax

from jetspec_jax import cache
from jetspec_jax.api import GenerationResult, check_head_attention, generate
from jetspec_jax.cli_loading import add_draft_vocab_flag, load_for_cli
from jetspec_jax.errors import InputError, OneLineErrorParser, run_command
from jetspec_jax.sampling import SamplingConfig, seed_words
from jetspec_jax.speculative import (ATTENTION_IMPLS, GEMM_BACKENDS, METHODS, SpecConfig, check_tree_causal_settings,
                                     check_tree_temperature)
from jetspec_jax.target import Target
from jetspec_jax.tokens import encode_prompts, pad_prompts, pad_token, plan_cache_len
from jetspec_jax.tree import validate_tree_settings

STREAM_CHUNK_STEPS = 8  # streaming: decode steps per device call; each chunk's tokens print when it returns


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.generate",
                                description="Generate answers with the target model (default: the "
                                            "embedded SmolLM2-135M-Instruct). On a terminal each answer "
                                            "streams as its tokens commit; otherwise the prompts run as "
                                            "one batch, in one device call, and the answers are printed "
                                            "when it ends.")
    p.add_argument("prompts", nargs="+", help="one or more questions; several run as one batch, or one after "
                                              "another when streaming")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face directory "
                                                 "(default: $JETSPEC_TARGET or the embedded model)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed in [0, 2**64): the i-th prompt samples with seed + i, batched or "
                        "streamed, whatever the method and budget (speculation draws AR's very tokens)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print each answer as its tokens commit, through the serving engine, prompts one after "
                        "another (default: when stdout is a terminal); at temperature 0 the text is the batch's")
    p.add_argument("--system", default=None, help="system prompt for the chat template")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights/activations (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--method", choices=("auto", "ar") + METHODS, default="auto",
                   help="auto: jetspec when a trained head ships for the target (the embedded model "
                        "has one), else ar; ar: token by token; jetspec: causal head + best-first tree; "
                        "jetspec-tc: causal head, tree-causal (a second head pass over a candidate tree, "
                        "each branch conditioned on its own tokens); ddtree: bidirectional head + "
                        "best-first tree; dflash: bidirectional head, chain")
    p.add_argument("--head", default=None, help="trained draft head directory (draft_config.json + "
                                                "head.safetensors or its shards); default: the head "
                                                "shipped for the target, else an untrained one")
    add_draft_vocab_flag(p)
    p.add_argument("--budget", type=int, default=64, help="tree nodes verified per step, root included")
    p.add_argument("--width", type=int, default=7, help="candidates per depth")
    p.add_argument("--max-depth", type=int, default=None, help="tree depth limit (default: the head's)")
    p.add_argument("--tree-temperature", type=float, default=1.0,
                   help="divide the head's logits by this before scoring the tree: 1 = the published "
                        "scoring; below 1 drafts deeper along likely paths (the output is the same)")
    p.add_argument("--candidate-budget", type=int, default=None,
                   help="jetspec-tc: nodes of the candidate tree the verified one is chosen from (default: 4 x "
                        "budget)")
    p.add_argument("--conditioned-width", type=int, default=None,
                   help="jetspec-tc: new children each candidate parent may get from its path-conditioned "
                        "distribution (default: --width; 0 only re-scores the candidates)")
    p.add_argument("--gemm-backend", choices=list(GEMM_BACKENDS), default="xla",
                   help="GEMM library of the speculative loop on GPU: xla (XLA's autotuned Triton GEMMs) "
                        "or cublas (faster at budget 256 on the H200, slower at 16 and 64)")
    p.add_argument("--attention", choices=ATTENTION_IMPLS, default="auto",
                   help="attention of decode steps and verify passes: xla (dense mask), cudnn, "
                        "pallas (Triton tree kernel, GPU), mosaic (Hopper tree kernel where it applies, "
                        "else pallas), auto (mosaic or pallas per call on GPU, else xla)")
    cache.add_cache_flags(p)
    return p


def check_cli_settings(args) -> None:
    """The command line's numbers, all checked before the target loads."""
    problems = [] if args.max_new_tokens >= 1 else [f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"]
    if not math.isfinite(args.temperature):
        problems.append(f"--temperature must be a finite number >= 0, got {args.temperature}")
    depth = 1 if args.max_depth is None else args.max_depth
    for check in (lambda: SamplingConfig(args.temperature, args.top_k, args.top_p),
                  lambda: seed_words([args.seed, args.seed + len(args.prompts) - 1]),
                  lambda: validate_tree_settings(args.budget, args.width, depth),
                  lambda: check_tree_temperature(args.tree_temperature),
                  lambda: check_tree_causal_settings(args.method, args.budget, args.candidate_budget,
                                                     args.conditioned_width)):
        try:
            check()
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise InputError("; ".join(problems))


def streaming(args) -> bool:
    """Whether this command line streams: --stream/--no-stream, else whether stdout is a terminal. A
    setting the serving engine lacks keeps the batch path, or is an error with an explicit --stream."""
    wanted = sys.stdout.isatty() if args.stream is None else args.stream
    lacking = [f"--{name.replace('_', '-')} {getattr(args, name)}"  # the engine runs jetspec-tc with their defaults
                for name in ("candidate_budget", "conditioned_width") if getattr(args, name) is not None]
    if not wanted or not lacking:
        return wanted
    if args.stream:
        raise InputError(f"--stream cannot use {lacking[0]}: the serving engine's chunks do not take it; drop "
                         "one of the two")
    print(f"note: {lacking[0]} runs the batch path; the answers print when it ends", file=sys.stderr)
    return False


class TerminalAnswer:
    """An answer printed as its tokens arrive, exactly as the batch path prints `text.strip()`: the
    whole answer is decoded each time (IncrementalText: tokenizer spacing as offline decoding gives it,
    a character cut between tokens held back), leading whitespace is dropped and trailing whitespace is
    held back until text follows it."""

    def __init__(self, tokenizer, out):
        from jetspec_jax.serve.detokenize import IncrementalText

        self.text, self.out = IncrementalText(tokenizer), out
        self.started, self.held = False, ""

    def add(self, token_ids: list[int]) -> None:
        self._write(self.text.add(token_ids))

    def finish(self) -> str:
        """Prints the rest and a newline; returns the whole answer as decoded."""
        self._write(self.text.flush())
        self.out.write("\n")
        self.out.flush()
        return self.text.text

    def _write(self, delta: str) -> None:
        if not self.started:
            delta = delta.lstrip()
            self.started = bool(delta)
        pending = self.held + delta
        shown = pending.rstrip()
        self.held = pending[len(shown):]
        if shown:
            self.out.write(shown)
            self.out.flush()


def stream_answers(args, target: Target, method: str, head) -> GenerationResult:
    """The prompts one after another through the serving engine (one slot, the batch path's cache size),
    each answer printed as its tokens commit; at temperature 0 each is the batch path's answer."""
    import queue

    from jetspec_jax.serve.engine import Engine, EngineRequest, FinishEvent, SamplingParams, TokenEvent
    from jetspec_jax.serve.slots import scratch_rows

    prompt_ids = encode_prompts(target.tokenizer, args.prompts, chat=not args.no_chat, system_prompt=args.system)
    spec = None
    if method != "ar":
        spec = SpecConfig(method, args.budget, args.width, args.max_depth, args.attention,
                          tree_temperature=args.tree_temperature)
        check_head_attention(spec, head[0])
    tokens, lengths = pad_prompts(prompt_ids, pad_token(target))  # the batch path's shapes, for its cache size
    cache_len = plan_cache_len(tokens.shape[1], int(lengths.max()), args.max_new_tokens,
                               target.cfg.max_position_embeddings,
                               extra=scratch_rows(spec, 0 if spec is None else spec.depth(head[0].max_depth)))
    engine = Engine(target, head, method=method, slots=1, max_len=cache_len, budget=args.budget, width=args.width,
                    chunk_steps=STREAM_CHUNK_STEPS, attention=args.attention, max_depth=args.max_depth,
                    tree_temperature=args.tree_temperature, gemm_backend=args.gemm_backend)
    texts, token_ids, forwards = [], [], 0
    t0 = time.perf_counter()
    try:
        engine.start()
        for i, (prompt, ids) in enumerate(zip(args.prompts, prompt_ids)):
            if len(args.prompts) > 1:
                print(f"### {prompt}", flush=True)
            sampling = SamplingParams(args.temperature, args.top_p, args.top_k, seed=args.seed + i)
            handle = engine.submit(EngineRequest(ids, args.max_new_tokens, sampling, request_id=str(i)))
            answer, tokens, event = TerminalAnswer(target.tokenizer, sys.stdout), [], None
            while not isinstance(event, FinishEvent):
                try:  # short waits: Ctrl-C is acted on between them
                    event = handle.get(timeout=0.2)
                except queue.Empty:
                    continue
                if isinstance(event, TokenEvent):
                    tokens += event.token_ids
                    answer.add(event.token_ids)
            if event.reason not in ("stop", "length"):
                raise RuntimeError(f"generation failed: {event.message or event.reason}")
            texts.append(answer.finish())
            token_ids.append(tokens)
            forwards += handle.target_forwards
    finally:
        engine.shutdown(drain=False, timeout=5.0)
    seconds = time.perf_counter() - t0
    compile_s = engine.stats.snapshot()["compile_seconds_total"]
    return GenerationResult(texts=texts, token_ids=token_ids, prompt_token_ids=prompt_ids, compile_seconds=compile_s,
                            generate_seconds=max(seconds - compile_s, 1e-9), method=method,
                            target_forwards=None if method == "ar" else forwards)


def generate_command(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_cli_settings(args)
    stream = streaming(args)
    cache.configure(args.cache_dir, enabled=not args.no_cache)
    t0 = time.perf_counter()
    target, method, head = load_for_cli(args)
    load_s = time.perf_counter() - t0
    if stream:
        try:
            result = stream_answers(args, target, method, head)
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130
    else:
        result = generate(args.prompts, target, method=method, head=head,
                          budget=args.budget, width=args.width, max_depth=args.max_depth,
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed, chat=not args.no_chat,
                          system_prompt=args.system, attention=args.attention,
                          tree_temperature=args.tree_temperature, gemm_backend=args.gemm_backend,
                          candidate_budget=args.candidate_budget, conditioned_width=args.conditioned_width)
        for prompt, text in zip(args.prompts, result.texts):
            if len(args.prompts) > 1:
                print(f"### {prompt}")
            print(text.strip())
    spec = "" if result.tau is None else (f", tau {result.tau:.2f} over {result.target_forwards} "
                                          f"verify passes, budget {args.budget}")
    mode = "streamed" if stream else f"batch {len(args.prompts)}"
    print(f"[{jax.default_backend()}] {result.num_generated} tokens in {result.generate_seconds:.2f} s "
          f"= {result.tokens_per_second:.1f} tok/s (compile {result.compile_seconds:.1f} s, load {load_s:.1f} s, "
          f"{mode}, {result.method}{spec})", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: bad input is one `error:` line and exit status 2."""
    return run_command(generate_command, argv)


if __name__ == "__main__":
    sys.exit(main())
