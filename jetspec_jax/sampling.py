"""Token selection from logits: greedy, or temperature sampling with top-k / top-p filtering."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filtered_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """logits (..., V) fp32 scaled by 1/temperature, with tokens outside top-k / top-p set to -inf.
    Sampling from softmax of the result is the target distribution that sampling follows."""
    logits = logits.astype(jnp.float32) / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = lax.top_k(logits, cfg.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p: tokens whose preceding mass < top_p.
        kept = jnp.sum(mass_before < cfg.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, kept - 1, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def select_tokens(logits: jax.Array, key: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """logits (B, V) -> tokens (B,) int32."""
    if cfg.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered_logits(logits, cfg), axis=-1).astype(jnp.int32)


class RowSampling(NamedTuple):
    """Per-sequence sampling settings as arrays (B,), for batches whose rows sample differently (the
    server's slots); a row with temperature 0 is greedy."""
    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32, 0 disables
    top_p: jax.Array  # (B,) float32, 1 disables

    @staticmethod
    def of(configs: list[SamplingConfig]) -> "RowSampling":
        return RowSampling(jnp.asarray([c.temperature for c in configs], jnp.float32),
                           jnp.asarray([c.top_k for c in configs], jnp.int32),
                           jnp.asarray([c.top_p for c in configs], jnp.float32))


def filtered_logits_rows(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """`filtered_logits` with each row's own settings: logits (B, ..., V); rows (B,)."""
    expand = (slice(None),) + (None,) * (logits.ndim - 1)
    temperature = jnp.where(rows.temperature > 0, rows.temperature, 1.0)[expand]
    top_k, top_p = rows.top_k[expand], rows.top_p[expand]
    logits = logits.astype(jnp.float32) / temperature

    def filter_sorted(logits):
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        kth = jnp.take_along_axis(sorted_logits, jnp.clip(top_k - 1, 0, logits.shape[-1] - 1), axis=-1)
        kth = jnp.where(top_k > 0, kth, -jnp.inf)
        logits = jnp.where(logits < kth, -jnp.inf, logits)
        sorted_logits = jnp.where(sorted_logits < kth, -jnp.inf, sorted_logits)  # = sorting the filtered
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, kept - 1, axis=-1)
        return jnp.where((top_p < 1.0) & (logits < cutoff), -jnp.inf, logits)

    # the sort over the vocabulary only runs when some row filters
    return lax.cond(jnp.any(rows.top_k > 0) | jnp.any(rows.top_p < 1.0), filter_sorted, lambda x: x, logits)


def select_tokens_rows(logits: jax.Array, keys: jax.Array, rows: RowSampling) -> jax.Array:
    """logits (B, ..., V), one key per row (B,) -> tokens (B, ...): argmax where a row's temperature is
    0, else independent samples from its filtered distribution."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(logits):
        filtered = filtered_logits_rows(logits, rows)
        sampled = jax.vmap(lambda k, x: jax.random.categorical(k, x, axis=-1))(keys, filtered)
        expand = (slice(None),) + (None,) * (greedy.ndim - 1)
        return jnp.where((rows.temperature > 0)[expand], sampled.astype(jnp.int32), greedy)

    return lax.cond(jnp.any(rows.temperature > 0), sample, lambda _: greedy, logits)


def sample_rows_inverse_cdf(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                            block: int = 128) -> jax.Array:
    """logits (B, V), one key and temperature per row (B,) -> tokens (B,) int32: argmax where the
    temperature is 0, else a draw from softmax(logits / temperature) by inverting its CDF with one
    uniform per row (`select_tokens_rows` draws V Gumbel numbers per row: the cost of large-batch
    sampling). The CDF is searched in two levels, blocks of `block` tokens then within one block,
    so no scan runs over the whole vocabulary."""
    b, v = logits.shape
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample(logits):
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = logits.astype(jnp.float32) / t
        probs = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True))  # unnormalised: u scales instead
        padded = -(-v // block) * block
        probs = jnp.pad(probs, ((0, 0), (0, padded - v))).reshape(b, padded // block, block)
        block_mass = jnp.sum(probs, axis=-1)  # (B, nb)
        block_cdf = jnp.cumsum(block_mass, axis=-1)
        u = jax.vmap(jax.random.uniform)(keys) * block_cdf[:, -1]
        chosen = jnp.minimum(jnp.sum(block_cdf <= u[:, None], axis=-1), padded // block - 1)
        before = jnp.take_along_axis(block_cdf - block_mass, chosen[:, None], axis=1)[:, 0]
        within = jnp.take_along_axis(probs, chosen[:, None, None], axis=1)[:, 0]  # (B, block)
        offset = jnp.sum(jnp.cumsum(within, axis=-1) <= (u - before)[:, None], axis=-1)
        token = chosen * block + jnp.minimum(offset, block - 1)
        # rounding can land on a padded or zero-probability slot: fall back to the argmax there
        token = jnp.where((token < v) & (jnp.take_along_axis(probs.reshape(b, -1), token[:, None], 1)[:, 0] > 0),
                          token, greedy)
        return jnp.where(temperature > 0, token.astype(jnp.int32), greedy)

    return lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, logits)
