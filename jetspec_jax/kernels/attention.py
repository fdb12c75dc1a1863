"""The target's attention entry: a block of T queries per sequence against a KV cache whose first
`lengths` rows are the committed prefix and whose next T rows hold the block itself (a decode step,
a tree's nodes, a prompt). Which implementation runs is this module's decision, from the platform,
the dtype and the caller's preference: the tree-attention kernels on GPU, a dense mask through XLA
elsewhere, cuDNN's fused causal kernel for a bf16 prefill."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import precision
from jetspec_jax.kernels.tree_attention import default_implementation, pack_tree_mask, tree_attention
from jetspec_jax.kv_cache import sequence_rows

# "auto": the kernels on GPU (`tree_attention` picks Triton or Mosaic per call), "xla" elsewhere;
# "xla": a dense (T, S) mask; "cudnn": that mask through cuDNN (GPU, bf16/f16); "pallas" / "mosaic"
# and their "_interpret" forms: the tree-attention kernels; "prefill": the block attends causally to
# itself alone, for a cache empty before it (no (T, S) mask; cuDNN's fused kernel on GPU in bf16).
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret", "prefill")
GPU_ONLY = ("pallas", "cudnn", "mosaic")


class CacheVisibility(NamedTuple):
    """What each query of a block sees, in the form the chosen implementation reads; built once per
    forward and shared by its layers."""
    implementation: str
    dense: jax.Array | None  # (B, T, S) bool, for "xla" and "cudnn"
    tree_words: jax.Array | None  # (B, T, W) packed block mask, for the kernels


def resolve_implementation(implementation: str) -> str:
    """`implementation` checked against the platform; "auto" off the GPU becomes "xla"."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"attention_impl {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if implementation == "auto" and default_implementation() == "xla":
        return "xla"
    if implementation in GPU_ONLY and jax.default_backend() != "gpu":
        raise ValueError(f"attention {implementation!r} runs only on a GPU (this backend is "
                         f"{jax.default_backend()}); use 'auto' or 'xla'"
                         + (f", or '{implementation}_interpret' for the kernel's semantics"
                            if implementation != "cudnn" else ""))
    return implementation


def cache_visibility(lengths: jax.Array, block_len: int, max_len: int, block_mask: jax.Array | None,
                     implementation: str = "auto") -> CacheVisibility:
    """The committed prefix is visible to every query; the block's rows where `block_mask` (B, T, T)
    allows (causal if None)."""
    implementation = resolve_implementation(implementation)
    if implementation == "prefill":
        if block_mask is not None:
            raise ValueError("attention 'prefill' is causal over the block; it takes no mask")
        return CacheVisibility(implementation, None, None)
    if implementation in ("xla", "cudnn"):
        return CacheVisibility(implementation, block_attention_mask(lengths, block_len, max_len, block_mask), None)
    b = lengths.shape[0]
    block = jnp.tril(jnp.ones((block_len, block_len), bool))[None] if block_mask is None else block_mask
    return CacheVisibility(implementation, None, pack_tree_mask(jnp.broadcast_to(block, (b, block_len, block_len))))


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                    lengths: jax.Array, visibility: CacheVisibility, pages: jax.Array | None = None) -> jax.Array:
    """q (B, T, H, hd) with the block's own k/v (B, T, Hkv, hd), against k_cache/v_cache (B, S, Hkv, hd)
    with the block already written at rows lengths..lengths+T-1 ("prefill" reads only the block's).
    With `pages` (B, pages_per_sequence) the cache is a paged pool (pages, page_size, Hkv, hd)
    (kv_cache.KVCache): the tree kernels read each sequence's pages in place, the dense-mask paths
    gather them into rows first."""
    implementation = visibility.implementation
    if implementation == "prefill":
        return causal_self_attention(q, k, v)
    if pages is not None and implementation in ("xla", "cudnn"):
        k_cache, v_cache = sequence_rows(k_cache, pages), sequence_rows(v_cache, pages)
        pages = None
    if implementation == "xla":
        return attention_scores_softmax(q, k_cache, v_cache, visibility.dense)
    if implementation == "cudnn":
        return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=visibility.dense[:, None],
                                            implementation="cudnn")
    return tree_attention(q, k_cache, v_cache, lengths, visibility.tree_words, implementation=implementation,
                          pages=pages)


def block_attention_mask(lengths: jax.Array, block_len: int, max_len: int,
                         block_mask: jax.Array | None) -> jax.Array:
    """(B, T, S) bool over cache slots: the committed prefix is always visible; slots written by
    this block (lengths .. lengths+T-1) are visible where `block_mask` (B, T, T) allows, causal if None."""
    rel = jnp.arange(max_len, dtype=jnp.int32)[None, :] - lengths[:, None]  # (B, S)
    in_prefix = rel < 0
    in_block = (rel >= 0) & (rel < block_len)
    rel_b = jnp.clip(rel, 0, block_len - 1)
    if block_mask is None:
        visible = rel_b[:, None, :] <= jnp.arange(block_len, dtype=jnp.int32)[None, :, None]
    else:
        b = lengths.shape[0]
        index = jnp.broadcast_to(rel_b[:, None, :], (b, block_len, max_len))
        visible = jnp.take_along_axis(block_mask.astype(bool), index, axis=2)
    return in_prefix[:, None, :] | (in_block[:, None, :] & visible)


def attention_scores_softmax(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention. q (B,T,H,hd), k/v (B,S,Hkv,hd), mask (B,T,S) -> (B,T,H,hd).
    Scores and softmax in fp32."""
    b, t, h, hd = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, t, hkv, h // hkv, hd)
    scores = precision.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = precision.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


def causal_self_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of a block over itself, q (B,T,H,hd), k/v (B,T,Hkv,hd): cuDNN's fused kernel
    on GPU for bf16/f16 (memory linear in T), `attention_scores_softmax` elsewhere (its dots take the
    operands' precision, which jax.nn.dot_product_attention's XLA path leaves to the global default)."""
    if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn").astype(q.dtype)
    b, t = q.shape[:2]
    return attention_scores_softmax(q, k, v, jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t)))


