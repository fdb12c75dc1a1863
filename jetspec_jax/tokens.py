"""Prompts as token ids and back: chat templating, right-padding to buckets, a batch's cache size, the
target's stop and pad tokens. Below the generation API, the serving engine and regeneration alike."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from jetspec_jax.target import Target

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this, bounding the number of compilations


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
