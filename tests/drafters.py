"""Test drafters with known quality, plugged into speculative_generate like the draft head."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import qwen3


@dataclasses.dataclass(frozen=True)
class TargetGreedyDrafter:
    """Proposes the target's own greedy continuation (runs the target `depth` steps on a scratch copy
    of the cache). At temperature 0 every draft is accepted; at temperature > 0 its depth-1 candidates
    are the target's own top tokens, so acceptance is frequent and every branch of `accept` is used.
    `sharpness` scales the logits: a confident drafter puts its chain first in the best-first order."""

    target_cfg: qwen3.Config
    depth: int
    sharpness: float = 30.0
    tap_layers: tuple[int, ...] = ()

    @property
    def max_depth(self) -> int:
        return self.depth

    def init_state(self, params, batch, max_len, dtype, page_size=None, num_pages=None):
        # a drafter's state is a KVCache (the server pages it with the target's table): one of no layers
        return KVCache.create(0, batch, max_len, 1, 1, dtype, page_size, num_pages)

    def observe(self, params, state, taps, counts):
        return state

    def propose(self, params, state, target_params, cache, anchor, num_depths):
        token, logits_per_depth = anchor, []
        for d in range(num_depths):
            scratch = cache._replace(lengths=cache.lengths + d)  # writes land past the committed rows
            logits, _, cache_after = qwen3.forward(target_params, token[:, None], scratch.lengths[:, None],
                                                   scratch, self.target_cfg)
            cache = cache_after._replace(lengths=cache.lengths)
            logits_per_depth.append(logits[:, 0])
            token = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return self.sharpness * jnp.stack(logits_per_depth, axis=1)

    def propose_tree(self, params, state, target_params, cache, tokens, depths, ancestors):
        """jetspec-tc's second pass: the target's own next-token logits at every tree node given its
        path (one forward over the tree, as verification runs it), on a copy of the cache with room
        for the tree."""
        room = tokens.shape[1]
        scratch = cache._replace(k=tuple(jnp.pad(k, ((0, 0), (0, room), (0, 0), (0, 0))) for k in cache.k),
                                 v=tuple(jnp.pad(v, ((0, 0), (0, room), (0, 0), (0, 0))) for v in cache.v))
        logits, _, _ = qwen3.forward(target_params, tokens, cache.lengths[:, None] + depths, scratch,
                                     self.target_cfg, mask=ancestors)
        return self.sharpness * logits


def random_head(target_cfg, key, *, attention="causal", num_layers=1, block_size=8, dtype=jnp.float32):
    from jetspec_jax.models import draft_head
    from jetspec_jax.models.params import init_params
    from jetspec_jax.speculative import HeadDrafter

    cfg = draft_head.DraftConfig.for_target(target_cfg, num_layers=num_layers, num_taps=2,
                                            block_size=block_size, attention=attention)
    return HeadDrafter(cfg, target_cfg), init_params(draft_head.param_specs(cfg), key, dtype, scale=0.1)


def greedy_speculative_and_ar(target, spec, *, max_new_tokens: int, ar_attention: str = "xla"):
    """(speculative output, AR tokens) for two short prompts with TargetGreedyDrafter(depth 3): the
    kernels' end-to-end tests compare the two token for token."""
    from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
    from jetspec_jax.speculative import speculative_generate
    from jetspec_jax.tokens import pad_prompts

    tokens, lengths = pad_prompts([[5, 12, 40], [7, 1, 2, 3, 4]], pad_id=0, bucket=8)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    gen = GenerationConfig(max_new_tokens=max_new_tokens)
    ar = generate_tokens(target.params, tokens, lengths, jax.random.key(0), cfg=target.cfg, gen=gen,
                         cache_len=8 + max_new_tokens + 4, attention=ar_attention)
    spec_out = speculative_generate(target.params, None, tokens, lengths, jax.random.key(0), cfg=target.cfg,
                                    drafter=TargetGreedyDrafter(target.cfg, 3), spec=spec, gen=gen, cache_len=32)
    return spec_out, ar.tokens
