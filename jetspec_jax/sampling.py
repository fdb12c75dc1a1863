"""Token selection from logits: greedy, or temperature sampling with top-k / top-p filtering, with per-row
settings and keys drawn from a request's seed and the token's output position."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
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


class RowSampling(NamedTuple):
    """Sampling settings per sequence as arrays (B,), the one form every sampler here reads (AR steps,
    verification, the server's slots); a row with temperature 0 is greedy. Built from constants under
    jit (`uniform`), the branches a batch does not need fold away at compile time."""
    temperature: jax.Array  # (B,) float32
    top_k: jax.Array  # (B,) int32, 0 disables
    top_p: jax.Array  # (B,) float32, 1 disables

    @staticmethod
    def of(configs: list[SamplingConfig]) -> "RowSampling":
        return RowSampling(jnp.asarray([c.temperature for c in configs], jnp.float32),
                           jnp.asarray([c.top_k for c in configs], jnp.int32),
                           jnp.asarray([c.top_p for c in configs], jnp.float32))

    @staticmethod
    def uniform(cfg: SamplingConfig, batch: int) -> "RowSampling":
        return RowSampling.of([cfg] * batch)


def filtered_logits(logits: jax.Array, rows: RowSampling) -> jax.Array:
    """logits (B, ..., V) in fp32 scaled by each row's 1/temperature, with tokens outside its top-k and
    top-p set to -inf: softmax of the result is the distribution that row samples from. Top-p keeps the
    smallest prefix of the (top-k filtered) sorted distribution whose mass reaches p."""
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


def request_keys(seeds) -> jax.Array:
    """Requests' PRNG keys (N,) from seeds in [0, 2**64): both 32-bit halves go into a key (threefry's
    two words, as jax.random.key takes a 64-bit seed), so seeds that differ above bit 31 differ."""
    return keys_of_seed_words(jnp.asarray(seed_words(seeds)))


def seed_words(seeds) -> np.ndarray:
    """Seeds in [0, 2**64) as (N, 2) uint32 (high word, low word): `keys_of_seed_words` makes their keys
    on the device, for a batch of requests."""
    bad = [s for s in seeds if not 0 <= int(s) < 1 << 64]
    if bad:
        raise ValueError(f"seed must be in [0, 2**64), got {bad[0]}")
    seeds = np.asarray([int(s) for s in seeds], dtype=np.uint64)
    return np.stack([seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)], axis=-1).astype(np.uint32)


def keys_of_seed_words(words: jax.Array) -> jax.Array:
    return jax.random.wrap_key_data(words, impl="threefry2x32")


def row_keys(keys: jax.Array, batch: int) -> jax.Array:
    """One key per row (B,): `keys` itself when it is one already, else the single key split."""
    return keys if keys.ndim == 1 else jax.random.split(keys, batch)


def select_tokens(logits: jax.Array, keys: jax.Array, rows: RowSampling, positions: jax.Array) -> jax.Array:
    """The token at each of logits' (B, ..., V) positions: its argmax where the row's temperature is 0,
    else a sample from the row's filtered distribution drawn with fold_in(keys[b], positions[b, ...]).

    `keys` (B,) are the rows' request keys and `positions` the output index each token would take, so a
    request's sample depends on its seed, its prefix and nothing else: the same for any batch, budget or
    method, and speculative decoding commits exactly the tokens autoregressive decoding draws."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    positions = jnp.broadcast_to(positions, greedy.shape).astype(jnp.uint32)

    def sample(logits):
        filtered = filtered_logits(logits, rows)
        token_keys = jax.vmap(lambda key, at: jax.vmap(lambda p: jax.random.fold_in(key, p))(at.reshape(-1)))(
            keys, positions.reshape(positions.shape[0], -1))  # (B, n)
        draws = jax.vmap(jax.vmap(lambda k, x: jax.random.categorical(k, x)))(
            token_keys, filtered.reshape(filtered.shape[0], -1, filtered.shape[-1]))
        expand = (slice(None),) + (None,) * (greedy.ndim - 1)
        return jnp.where((rows.temperature > 0)[expand], draws.reshape(greedy.shape).astype(jnp.int32), greedy)

    return lax.cond(jnp.any(rows.temperature > 0), sample, lambda _: greedy, logits)


def sample_rows_inverse_cdf(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                            block: int = 128) -> jax.Array:
    """logits (B, V), one key and temperature per row (B,) -> tokens (B,) int32: argmax where the
    temperature is 0, else a draw from softmax(logits / temperature) by inverting its CDF with one
    uniform per row (`select_tokens` draws V Gumbel numbers per row: the cost of large-batch
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
