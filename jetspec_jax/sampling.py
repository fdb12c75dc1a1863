"""Token selection from logits: greedy, or temperature sampling with top-k / top-p filtering."""

from __future__ import annotations

import dataclasses

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
