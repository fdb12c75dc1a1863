"""The Python generation API: `generate` runs a batch of prompts autoregressively or speculatively in one
device call and returns texts, token ids, timings and acceptance statistics; `prepare_generate` builds
that call without running it (the eval harness compiles many ahead).

    from jetspec_jax.api import generate, load_head, load_target
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.compilation import compiled_call
from jetspec_jax.loading.head_checkpoint import load_head
from jetspec_jax.models import draft_head
from jetspec_jax.models.params import init_params
from jetspec_jax.sampling import SamplingConfig, request_keys
from jetspec_jax.speculative import METHODS, HeadDrafter, SpecConfig, jitted_generate, speculative_cache_rows
from jetspec_jax.target import Target, load_target
from jetspec_jax.tokens import (PROMPT_BUCKET, decode_texts, encode_prompts, pad_prompts, pad_token, plan_cache_len,
                                stop_tokens, trim_generated)

__all__ = ["GenerateCall", "GenerationResult", "generate", "load_head", "load_target", "prepare_generate",
           "random_head"]


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
                     conditioned_width: int | None = None, draft_attention: str = "auto",
                     kv_page_size: int | None = None) -> GenerateCall:
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
                           eos_token_ids=stop_tokens(target), pad_token_id=pad_token(target),
                           kv_page_size=kv_page_size)
    keys = request_keys([seed + i for i in range(len(prompts))])
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
    GPU, xla elsewhere). `kv_page_size` keeps the target's cache and the head's context in pages of that
    many rows (a power of two >= 16), the layout the server's shared pool uses; None keeps one dense
    buffer per sequence.
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
