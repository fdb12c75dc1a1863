"""Host-side text generation API and CLI, autoregressive or speculative.

    python -m jetspec_jax.generate "What is 7 * 8?"
    python -m jetspec_jax.generate "What is 7 * 8?" --method jetspec --head HEAD_DIR --budget 64
    python -m jetspec_jax.generate "What is 7 * 8?" --method jetspec-tc --budget 64 --candidate-budget 256

Prompts go through the tokenizer's chat template (non-thinking), run through the jitted generator
in one device call, and come back as texts and token ids with timing and acceptance statistics. On a
terminal (or with --stream) the command line instead streams each answer as its tokens commit, through
the serving engine (serve/engine.py), one prompt after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import cache
from jetspec_jax.compilation import compile_in_parallel
from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.errors import InputError, OneLineErrorParser, run_command
from jetspec_jax.loading.head_checkpoint import load_head, no_head_message, packaged_head_path, verify_head_files
from jetspec_jax.models import draft_head
from jetspec_jax.models.params import init_params
from jetspec_jax.sampling import SamplingConfig, keys_of_seed_words, seed_words
from jetspec_jax.speculative import (ATTENTION_IMPLS, ATTENTION_OF_METHOD, GEMM_BACKENDS, METHODS, HeadDrafter,
                                     SpecConfig, check_tree_causal_settings, check_tree_temperature, jitted_generate,
                                     speculative_cache_rows)
from jetspec_jax.target import Target, load_target
from jetspec_jax.tree import validate_tree_settings

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this, bounding the number of compilations
STREAM_CHUNK_STEPS = 8  # streaming: decode steps per device call; each chunk's tokens print when it returns


@dataclasses.dataclass
class GenerationResult:
    texts: list[str]
    token_ids: list[list[int]]  # generated tokens, up to and including EOS
    prompt_token_ids: list[list[int]]
    compile_seconds: float  # 0 when a compiled program for these shapes was reused
    generate_seconds: float  # prefill + decode, device time of the generation call
    method: str = "ar"
    target_forwards: int | None = None  # speculative: verify passes over the batch
    accept_counts: list[int] | None = None  # speculative: steps that accepted 0, 1, .. drafts
    sequence_forwards: list[int] | None = None  # speculative: target_forwards of each sequence
    sequence_accept_counts: list[list[int]] | None = None  # speculative: accept_counts of each sequence

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def tau(self) -> float | None:
        """Tokens committed per target verify pass (accepted drafts + bonus); None for AR."""
        if not self.target_forwards:
            return None
        return (self.num_generated - len(self.token_ids)) / self.target_forwards

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated / self.generate_seconds if self.generate_seconds > 0 else float("nan")


def encode_prompts(tokenizer, prompts: Sequence[str], *, chat: bool = True,
                   system_prompt: str | None = None) -> list[list[int]]:
    if tokenizer is None:
        raise ValueError("this target has no tokenizer; pass token ids to generate_tokens instead")
    encoded = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt {i} is empty; give a non-empty question or instruction")
        if chat:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else [])
            messages.append({"role": "user", "content": prompt})
            ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                enable_thinking=False)
            if hasattr(ids, "input_ids") or isinstance(ids, dict):
                ids = ids["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        encoded.append([int(t) for t in ids])
    return encoded


def pad_prompts(prompt_ids: Sequence[Sequence[int]], pad_id: int,
                bucket: int = PROMPT_BUCKET) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads to a multiple of `bucket`; returns (tokens (B, P), lengths (B,))."""
    if not prompt_ids:
        raise ValueError("no prompts given")
    lengths = np.array([len(p) for p in prompt_ids], np.int32)
    if (lengths == 0).any():
        raise ValueError(f"prompt(s) {np.flatnonzero(lengths == 0).tolist()} have no tokens")
    width = int(-(-lengths.max() // bucket) * bucket)
    tokens = np.full((len(prompt_ids), width), pad_id, np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
    return tokens, lengths


def plan_cache_len(prompt_width: int, longest_prompt: int, max_new_tokens: int, max_positions: int,
                   max_cache_len: int | None = None, extra: int = 0) -> int:
    """Cache rows for a batch: the padded prompt, the new tokens and `extra` scratch rows (a draft
    tree), rounded up to 64. Raises if the prompt and new tokens cannot fit."""
    needed = longest_prompt + max_new_tokens + extra
    if needed > max_positions:
        raise ValueError(
            f"prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) + {extra} scratch "
            f"exceeds the model's {max_positions} positions; shorten the prompt or lower max_new_tokens")
    cache_len = -(-max(prompt_width, needed) // 64) * 64
    if max_cache_len is not None:
        if needed > max_cache_len:
            raise ValueError(
                f"prompt ({longest_prompt} tokens) + max_new_tokens ({max_new_tokens}) + {extra} scratch "
                f"does not fit max_cache_len={max_cache_len}; raise max_cache_len or shorten the prompt")
        cache_len = max(max_cache_len, prompt_width)
    return cache_len


_COMPILED: dict[Any, Any] = {}
_AHEAD: dict[Any, tuple[Any, float]] = {}  # compiled by compile_ahead, not run yet: (executable, seconds)


def call_signature(fn, args: tuple, static: dict[str, Any]) -> tuple:
    """What one compiled executable serves: the function, the arguments' shapes and dtypes, the statics."""
    return (fn, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)), jax.tree.structure(args),
            tuple(sorted(static.items())))


def compiled_call(fn, args: tuple, static: dict[str, Any]):
    """Runs a jitted function through an explicitly compiled executable, cached by shapes and static
    arguments, so compile time and run time are reported separately. Returns (out, compile_s, run_s);
    compile_s > 0 on an executable's first run, also when compile_ahead compiled it (its seconds there)."""
    signature = call_signature(fn, args, static)
    compile_s = 0.0
    if signature not in _COMPILED:
        if signature in _AHEAD:
            _COMPILED[signature], compile_s = _AHEAD.pop(signature)
        else:
            t0 = time.perf_counter()
            _COMPILED[signature] = fn.lower(*args, **static).compile()
            compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(_COMPILED[signature](*args))
    return out, compile_s, time.perf_counter() - t0


def compile_ahead(calls: Sequence["GenerateCall"], workers: int) -> int:
    """Compiles the programs of `calls` that have none yet, `workers` at a time (compile_in_parallel), for
    compiled_call to run; returns how many."""
    pending = {}
    for call in calls:
        signature = call_signature(call.fn, call.args, call.static)
        if signature not in _COMPILED and signature not in _AHEAD:
            pending.setdefault(signature, call)

    def lower(signature):
        call = pending[signature]
        return call.fn.lower(*call.args, **call.static)

    def compiled(signature, executable, seconds: float) -> None:
        _AHEAD[signature] = (executable, seconds)

    compile_in_parallel(pending, lower, compiled, workers)
    return len(pending)


def stop_tokens(target: Target) -> tuple[int, ...]:
    ids = set(target.cfg.eos_token_ids)
    tok = target.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return tuple(sorted(ids))


def pad_token(target: Target) -> int:
    tok = target.tokenizer
    if tok is not None and tok.pad_token_id is not None:
        return int(tok.pad_token_id)
    return next(iter(stop_tokens(target)), 0)


def trim_generated(tokens: np.ndarray, counts: np.ndarray) -> list[list[int]]:
    return [tokens[i, : counts[i]].tolist() for i in range(tokens.shape[0])]


def decode_texts(tokenizer, token_ids: list[list[int]]) -> list[str]:
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in token_ids]


def check_head_attention(spec: SpecConfig, head_cfg: draft_head.DraftConfig) -> None:
    if isinstance(head_cfg.attention, str) and head_cfg.attention != spec.expected_attention():
        raise ValueError(f"method {spec.method!r} expects a {spec.expected_attention()} head, but this head is "
                         f"{head_cfg.attention}; use --method "
                         f"{'jetspec or jetspec-tc' if head_cfg.attention == 'causal' else 'ddtree or dflash'}")
    if spec.tree_causal and not isinstance(head_cfg.attention, str):
        raise ValueError(f"method {spec.method!r} needs a causal head, but this head has an explicit block mask")


def random_head(target: Target, attention: str, seed: int = 0):
    """An untrained head of the default shape: lossless but accepts almost nothing (tau ~ 1)."""
    cfg = draft_head.DraftConfig.for_target(target.cfg, attention=attention)
    return cfg, init_params(draft_head.param_specs(cfg), jax.random.key(seed), target.params["embed"].dtype)


@dataclasses.dataclass(frozen=True)
class GenerateCall:
    """One device call of `generate`: the jitted function, its arguments and statics, and what the
    result needs (the target's tokenizer, the prompts' token ids)."""
    fn: Any
    args: tuple
    static: dict[str, Any]
    method: str
    target: Target
    prompt_ids: list[list[int]]


def prepare_generate(prompts: Sequence[str] | str, target: Target | None = None, *, method: str = "ar",
                     head: tuple[draft_head.DraftConfig, Any] | None = None, budget: int = 64, width: int = 7,
                     max_depth: int | None = None, max_new_tokens: int = 256, temperature: float = 0.0,
                     top_k: int = 0, top_p: float = 1.0, seed: int = 0, chat: bool = True,
                     system_prompt: str | None = None, max_cache_len: int | None = None,
                     attention: str = "auto", prompt_bucket: int = PROMPT_BUCKET,
                     tree_temperature: float = 1.0, gemm_backend: str = "xla", candidate_budget: int | None = None,
                     conditioned_width: int | None = None, draft_attention: str = "auto") -> GenerateCall:
    """The device call `generate` makes for these prompts and options (see `generate`), not run: what
    `compile_ahead` compiles. Raises on bad settings as `generate` does."""
    if method != "ar" and method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {('ar',) + METHODS}")
    target = load_target() if target is None else target
    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    prompt_ids = encode_prompts(target.tokenizer, prompts, chat=chat, system_prompt=system_prompt)
    tokens, lengths = pad_prompts(prompt_ids, pad_token(target), prompt_bucket)
    gen = GenerationConfig(max_new_tokens=max_new_tokens,
                           sampling=SamplingConfig(temperature, top_k, top_p),
                           eos_token_ids=stop_tokens(target), pad_token_id=pad_token(target))
    keys = keys_of_seed_words(jnp.asarray(seed_words([seed + i for i in range(len(prompts))])))
    if method == "ar":
        cache_len = plan_cache_len(tokens.shape[1], int(lengths.max()), max_new_tokens,
                                   target.cfg.max_position_embeddings, max_cache_len)
        return GenerateCall(generate_tokens, (target.params, tokens, lengths, keys),
                            dict(cfg=target.cfg, gen=gen, cache_len=cache_len, attention=attention), method,
                            target, prompt_ids)
    if head is None:
        raise ValueError(f"method {method!r} needs a draft head (head=(config, params))")
    head_cfg, head_params = head
    spec = SpecConfig(method, budget, width, max_depth, attention, tree_temperature=tree_temperature,
                      gemm_backend=gemm_backend, candidate_budget=candidate_budget,
                      conditioned_width=conditioned_width)
    drafter = HeadDrafter(head_cfg, target.cfg, attention_impl=draft_attention).for_specs([spec])
    check_head_attention(spec, head_cfg)
    extra = speculative_cache_rows(budget, spec.depth(drafter.max_depth))
    cache_len = plan_cache_len(tokens.shape[1], int(lengths.max()), max_new_tokens,
                               target.cfg.max_position_embeddings, max_cache_len, extra=extra)
    return GenerateCall(jitted_generate(spec.gemm_backend), (target.params, head_params, tokens, lengths, keys),
                        dict(cfg=target.cfg, drafter=drafter, spec=spec, gen=gen, cache_len=cache_len), method,
                        target, prompt_ids)


def generate(prompts: Sequence[str] | str, target: Target | None = None, **options) -> GenerationResult:
    """Generation for a batch of prompts (greedy when temperature == 0).

    Options (keywords, see `prepare_generate` for the defaults): method "ar" decodes token by token;
    "jetspec", "jetspec-tc", "ddtree" and "dflash" decode speculatively with `head` = (DraftConfig,
    params) and give AR's very tokens at any temperature: the i-th prompt's token at output index j is
    drawn with a key made from `seed` + i and j, whatever the method, budget or batch (`budget`,
    `width`, `max_depth`). `max_new_tokens`, `temperature`, `top_k`, `top_p`, `seed`;
    `chat` applies the chat template (with `system_prompt`); `max_cache_len` fixes the cache size.
    `attention` picks the attention path of decode steps and verify passes (kernels.attention.IMPLEMENTATIONS;
    "auto" is a Pallas tree kernel on GPU). Prompts are right-padded to a multiple of `prompt_bucket`:
    a larger bucket means fewer shapes to compile. `tree_temperature` divides the head's logits before
    the tree is scored and `gemm_backend` picks the speculative loop's GEMM library on GPU;
    `candidate_budget` and `conditioned_width` are jetspec-tc's (all SpecConfig). `draft_attention` is
    the head's attention: "xla" (a dense mask over the head's context buffer), "pallas" (the tree
    kernel on GPU, reading each sequence's own rows; jetspec-tc's second pass too) or "auto" (pallas on
    GPU, xla elsewhere).
    """
    call = prepare_generate(prompts, target, **options)
    out, compile_s, run_s = compiled_call(call.fn, call.args, call.static)
    stats = {}
    if call.method != "ar":
        stats = dict(target_forwards=int(np.sum(out.target_forwards)),
                     accept_counts=np.asarray(out.accept_counts).sum(0).tolist(),
                     sequence_forwards=np.asarray(out.target_forwards).tolist(),
                     sequence_accept_counts=np.asarray(out.accept_counts).tolist())
    generated = trim_generated(np.asarray(out.tokens), np.asarray(out.num_tokens))
    return GenerationResult(texts=decode_texts(call.target.tokenizer, generated), token_ids=generated,
                            prompt_token_ids=call.prompt_ids, compile_seconds=compile_s, generate_seconds=run_s,
                            method=call.method, **stats)


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


def resolve_method_and_head(args, target: Target):
    """(method, head) for the CLI: an explicit --head, else the head shipped for this target (matched by
    its fingerprint, whatever the file is called)."""
    method = args.method
    if method == "auto":
        if args.head or packaged_head_path(target, "jetspec"):
            method = "jetspec"
        else:
            print(f"note: {no_head_message(target, 'jetspec')}; decoding token by token", file=sys.stderr)
            method = "ar"
    if method == "ar":
        return method, None
    path = args.head or packaged_head_path(target, method)
    if path:
        return method, load_head(path, target.params["embed"].dtype, target=target)
    attention = ATTENTION_OF_METHOD[method]
    print(f"warning: {no_head_message(target, method)}; using an untrained head (output is still exact, "
          "but tau ~ 1 and nothing is faster)", file=sys.stderr)
    return method, random_head(target, attention, args.seed)


def load_for_cli(args) -> tuple[Target, str, tuple | None]:
    """(target, method, head) from a command line's --model, --dtype, --method and --head; a damaged
    --head fails before the target loads. Shared by generate and serve."""
    if args.head:
        verify_head_files(args.head)
    target = load_target(args.model, dtype=args.dtype)
    return (target, *resolve_method_and_head(args, target))


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
