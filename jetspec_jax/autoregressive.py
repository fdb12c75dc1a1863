"""Jitted autoregressive generation: prefill, then decode steps inside one `lax.while_loop`.

Batch is a real axis: prompts are right-padded with per-sequence lengths, every sequence stops on
its own (EOS or max_new_tokens), and the loop ends when all have stopped.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jetspec_jax.kv_cache import check_page_size
from jetspec_jax.models import qwen3
from jetspec_jax.sampling import RowSampling, SamplingConfig, row_keys, select_tokens


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = SamplingConfig()
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    kv_page_size: int | None = None  # the caches' layout (target's, head's): dense, or pages of this many rows

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.kv_page_size is not None:
            check_page_size(self.kv_page_size)


class GenerationOutput(NamedTuple):
    tokens: jax.Array  # (B, max_new_tokens) int32, pad_token_id after a sequence stops
    num_tokens: jax.Array  # (B,) generated tokens per sequence, the EOS token included
    decode_steps: jax.Array  # () target forwards after prefill


def is_stop_token(tokens: jax.Array, eos_token_ids: tuple[int, ...]) -> jax.Array:
    stop = jnp.zeros(tokens.shape, bool)
    for eos in eos_token_ids:
        stop = stop | (tokens == eos)
    return stop


def prefill(params: Any, prompt_tokens: jax.Array, prompt_lens: jax.Array, cfg: qwen3.Config,
            cache_len: int, *, tap_layers: tuple[int, ...] = (), page_size: int | None = None):
    """Runs the right-padded prompts through the target; returns (last-token logits (B, V), taps,
    cache with lengths = prompt_lens), dense or with `page_size` paged. The cache is empty before the
    prompts, so they attend causally among themselves alone ("prefill": no mask over the cache's
    rows, cuDNN's fused kernel on GPU in bf16)."""
    b, p = prompt_tokens.shape
    cache = qwen3.new_cache(cfg, b, cache_len, params["embed"].dtype, page_size)
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    logits, taps, cache = qwen3.forward(params, prompt_tokens, positions, cache, cfg, tap_layers=tap_layers,
                                        logits_indices=(prompt_lens - 1)[:, None], attention_impl="prefill")
    return logits[:, 0], taps, cache._replace(lengths=prompt_lens.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "gen", "cache_len", "attention"))
def generate_tokens(params: Any, prompt_tokens: jax.Array, prompt_lens: jax.Array, keys: jax.Array,
                    *, cfg: qwen3.Config, gen: GenerationConfig, cache_len: int,
                    attention: str = "auto") -> GenerationOutput:
    """prompt_tokens (B, P) right-padded, prompt_lens (B,); cache_len >= P + max_new_tokens.
    `attention`: the decode steps' attention path (kernels.attention.IMPLEMENTATIONS; auto = the Pallas
    kernel on GPU, which reads only each sequence's valid cache rows). `keys`: one per row (B,) (a
    single key is split), the token at output index i drawn with fold_in(row key, i) (sampling.py)."""
    b = prompt_tokens.shape[0]
    params = qwen3.fuse_for_decode(params)
    keys, rows = row_keys(keys, b), RowSampling.uniform(gen.sampling, b)
    logits, _, cache = prefill(params, prompt_tokens, prompt_lens, cfg, cache_len, page_size=gen.kv_page_size)
    first = select_tokens(logits, keys, rows, jnp.zeros((b,), jnp.int32))
    out = jnp.full((b, gen.max_new_tokens), gen.pad_token_id, jnp.int32).at[:, 0].set(first)
    done = is_stop_token(first, gen.eos_token_ids) | (gen.max_new_tokens <= 1)
    num_tokens = jnp.ones((b,), jnp.int32)

    def cond(state):
        step, _, _, _, done, _ = state
        return (step < gen.max_new_tokens) & ~jnp.all(done)

    def body(state):
        step, last, cache, out, done, num_tokens = state
        logits, _, cache = qwen3.forward(params, last[:, None], cache.lengths[:, None], cache, cfg,
                                         attention_impl=attention)
        cache = cache.advance(~done)  # `last` is now in the cache for live sequences
        token = jnp.where(done, gen.pad_token_id, select_tokens(logits[:, 0], keys, rows, num_tokens))
        out = lax.dynamic_update_slice(out, token[:, None], (0, step))
        num_tokens = num_tokens + (~done).astype(jnp.int32)
        done = done | is_stop_token(token, gen.eos_token_ids)
        return step + 1, token, cache, out, done, num_tokens

    state = (jnp.int32(1), first, cache, out, done, num_tokens)
    step, _, _, out, _, num_tokens = lax.while_loop(cond, body, state)
    return GenerationOutput(tokens=out, num_tokens=num_tokens, decode_steps=step - 1)
