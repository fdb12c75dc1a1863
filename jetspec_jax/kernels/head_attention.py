"""The draft head's attention entry: block slots attend to the head's context keys (one per committed
token) and to the slots of their own block. Which implementation runs is this module's decision, from
the platform, the head's shape and the caller's preference; the head's forward only calls the entries.

Inference (`block_visibility`, then `context_block_attention` in each layer) over the head's context
cache, dense or paged: "xla" scores one dense mask over [context ; block]; "pallas" (and
"pallas_interpret") writes the block past each context in a copy of the context buffer (or pool) and
runs the tree-attention kernel, the block mask as a tree's. Training
(`anchored_attention`): K blocks per sequence, block j seeing the context before its anchor; "xla"
scores anchor chunks densely, "pallas" runs the context part through the prefix-attention kernels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import precision
from jetspec_jax.kernels.attention import attention_scores_softmax
from jetspec_jax.kernels.prefix_attention import prefix_attention, prefix_attention_supported
from jetspec_jax.kernels.tree_attention import pack_tree_mask, tree_attention
from jetspec_jax.kv_cache import KVCache, sequence_rows

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")

# The training path's context scores (rows x heads x block queries x context keys, fp32) per anchor
# chunk: 1 GiB. Longer sequences run more chunks, recomputed in the backward pass, instead of holding
# scores quadratic in length (8 rows of 4,608 tokens with 346 anchors each: 6.8 GiB per layer at once).
TRAINING_SCORES_PER_CHUNK = 1 << 28


def check_implementation(value: str) -> None:
    """Shared by HeadDrafter and the eval's settings (checked there before the target loads)."""
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"draft attention_impl {value!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if value == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"draft_attention 'pallas' runs only on a GPU (this backend is {jax.default_backend()}); "
                         "use 'xla', or 'pallas_interpret' for the kernel's semantics")


def resolve_implementation(value: str) -> str:
    """The inference implementation `value` names here: "auto" is "pallas" on GPU and "xla" elsewhere."""
    check_implementation(value)
    if value == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return value


def resolve_training_implementation(value: str, head_dim: int) -> str:
    """The training pass's context attention: "auto" takes the kernels where they run (GPU, a
    power-of-two head dim), "xla" elsewhere."""
    if value == "auto":
        return "pallas" if jax.default_backend() == "gpu" and prefix_attention_supported(head_dim) else "xla"
    return value


class BlockVisibility(NamedTuple):
    """What each block slot sees, in the form the chosen implementation reads; built once per pass and
    shared by the head's layers."""
    implementation: str
    dense: jax.Array | None  # (B, T, C + T) bool over [context ; block], for "xla"
    block_words: jax.Array | None  # (B, T, W) the packed block mask, for the kernel


def block_visibility(ctx_lengths: jax.Array, ctx_rows: int, block_mask: jax.Array,
                     implementation: str) -> BlockVisibility:
    """Every slot sees the first ctx_lengths (B,) context rows of a buffer of ctx_rows, and the slots
    block_mask (B, T, T) allows. The kernel path needs T rows free past every context length."""
    if implementation == "xla":
        b, t = block_mask.shape[:2]
        ctx_visible = jnp.arange(ctx_rows)[None, :] < ctx_lengths[:, None]  # (B, C)
        dense = jnp.concatenate([jnp.broadcast_to(ctx_visible[:, None, :], (b, t, ctx_rows)), block_mask], axis=2)
        return BlockVisibility(implementation, dense, None)
    return BlockVisibility(implementation, None, pack_tree_mask(block_mask))


def context_block_attention(q: jax.Array, k: jax.Array, v: jax.Array, ctx: KVCache, layer: int,
                            visibility: BlockVisibility) -> jax.Array:
    """q (B, T, H, hd) and the block's own k/v (B, T, Hkv, hd) against head layer `layer` of the context
    cache `ctx` (dense or paged) -> (B, T, H, hd) in q's dtype."""
    ctx_k, ctx_v = ctx.k[layer], ctx.v[layer]
    if visibility.implementation == "xla":
        if ctx.paged:
            ctx_k, ctx_v = sequence_rows(ctx_k, ctx.pages), sequence_rows(ctx_v, ctx.pages)
        keys = jnp.concatenate([ctx_k, k.astype(ctx_k.dtype)], axis=1)
        values = jnp.concatenate([ctx_v, v.astype(ctx_v.dtype)], axis=1)
        return attention_scores_softmax(q, keys, values, visibility.dense)
    # the block goes past the committed context: scratch rows that extend_context overwrites
    keys, values = ctx.write(ctx_k, k, ctx.lengths), ctx.write(ctx_v, v, ctx.lengths)
    out = tree_attention(q.astype(keys.dtype), keys, values, ctx.lengths, visibility.block_words,
                         implementation=visibility.implementation, pages=ctx.pages)
    return out.astype(q.dtype)


def anchored_attention(q: jax.Array, k: jax.Array, v: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                       anchors: jax.Array, block_mask: jax.Array, implementation: str,
                       anchors_per_chunk: int | None = None) -> jax.Array:
    """K blocks per sequence at once: block j's slots see the context positions < anchors[j] and the
    slots of their own block that block_mask (blk, blk) allows, never another block. q (B, K, blk, H, hd),
    k/v (B, K, blk, Hkv, hd), ctx_k/ctx_v (B, S, Hkv, hd), anchors (B, K) -> (B, K, blk, H, hd).
    `implementation` as resolve_training_implementation gives; "xla" runs chunks of `anchors_per_chunk`
    anchors (default: TRAINING_SCORES_PER_CHUNK context scores per chunk)."""
    if implementation != "xla":
        return _anchored_attention_prefix(q, k, v, ctx_k, ctx_v, anchors, block_mask, implementation)
    if anchors_per_chunk is None:
        b, _, blk, h = q.shape[:4]
        anchors_per_chunk = max(1, TRAINING_SCORES_PER_CHUNK // (b * h * blk * ctx_k.shape[1]))
    return _anchored_attention_chunked(q, k, v, ctx_k, ctx_v, anchors, block_mask, anchors_per_chunk)


def anchored_attention_dense(q: jax.Array, k: jax.Array, v: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array,
                             anchors: jax.Array, block_mask: jax.Array) -> jax.Array:
    """`anchored_attention` in one softmax (fp32) over all anchors at once. The two key sets are scored
    apart (no K x K block mask) and merged by their maxima and sums, as flash attention merges key tiles."""
    b, nk, blk, h, hd = q.shape
    hkv, s = k.shape[3], ctx_k.shape[1]
    scale = 1.0 / math.sqrt(hd)
    q = q.reshape(b, nk, blk, hkv, h // hkv, hd)
    ctx_scores = precision.einsum("bnqkgd,bskd->bnkgqs", q, ctx_k, preferred_element_type=jnp.float32) * scale
    ctx_visible = jnp.arange(s)[None, None, :] < anchors[:, :, None]  # (B, K, S)
    ctx_scores = jnp.where(ctx_visible[:, :, None, None, None, :], ctx_scores, -jnp.inf)
    own_scores = precision.einsum("bnqkgd,bnskd->bnkgqs", q, k, preferred_element_type=jnp.float32) * scale
    own_scores = jnp.where(block_mask, own_scores, -jnp.inf)  # every slot sees itself: a finite maximum
    peak = jax.lax.stop_gradient(jnp.maximum(jnp.max(ctx_scores, axis=-1), jnp.max(own_scores, axis=-1)))[..., None]
    ctx_p, own_p = jnp.exp(ctx_scores - peak), jnp.exp(own_scores - peak)
    total = jnp.sum(ctx_p, axis=-1) + jnp.sum(own_p, axis=-1)  # (B, K, Hkv, G, blk)
    out = (precision.einsum("bnkgqs,bskd->bnqkgd", ctx_p.astype(ctx_v.dtype), ctx_v, preferred_element_type=jnp.float32)
           + precision.einsum("bnkgqs,bnskd->bnqkgd", own_p.astype(v.dtype), v, preferred_element_type=jnp.float32))
    out = out / jnp.moveaxis(total, -1, 2)[..., None]
    return out.reshape(b, nk, blk, h, hd).astype(q.dtype)


def _anchored_attention_chunked(q, k, v, ctx_k, ctx_v, anchors, block_mask, anchors_per_chunk: int):
    """`anchored_attention_dense` over chunks of at most `anchors_per_chunk` anchors (as few chunks as that
    allows, evened out) in a loop, each chunk's scores recomputed in the backward pass instead of stored,
    so memory holds one chunk's scores."""
    nk = q.shape[1]
    if nk <= anchors_per_chunk:
        return anchored_attention_dense(q, k, v, ctx_k, ctx_v, anchors, block_mask)
    chunks = -(-nk // anchors_per_chunk)
    anchors_per_chunk = -(-nk // chunks)
    pad = chunks * anchors_per_chunk - nk

    def split(x):  # (B, K, ...) -> (chunks, B, anchors_per_chunk, ...); padded anchors are dropped after
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], chunks, anchors_per_chunk, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_chunk(args):
        q_c, k_c, v_c, a_c = args
        return anchored_attention_dense(q_c, k_c, v_c, ctx_k, ctx_v, a_c, block_mask)

    out = jax.lax.map(one_chunk, (split(q), split(k), split(v), split(anchors)))
    out = jnp.moveaxis(out, 0, 1)
    return out.reshape(out.shape[0], chunks * anchors_per_chunk, *out.shape[3:])[:, :nk]


def _anchored_attention_prefix(q, k, v, ctx_k, ctx_v, anchors, block_mask, implementation: str):
    """`anchored_attention_dense` with the context part through `prefix_attention` (a block's slots see
    the keys before its anchor: limits = the anchor, flash-attention kernels on GPU, no score in memory)
    and the block's own slots scored here; the two merged by their log-sum-exps."""
    b, nk, blk, h, hd = q.shape
    hkv = k.shape[3]
    limits = jnp.broadcast_to(anchors[:, :, None], (b, nk, blk)).reshape(b, nk * blk)
    ctx_out, ctx_lse = prefix_attention(q.reshape(b, nk * blk, h, hd), ctx_k, ctx_v, limits,
                                        implementation=implementation)
    qg = q.reshape(b, nk, blk, hkv, h // hkv, hd)
    own = precision.einsum("bnqkgd,bnskd->bnkgqs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    own = jnp.where(block_mask, own, -jnp.inf)  # every slot sees itself: a finite log-sum-exp
    own_lse = jax.nn.logsumexp(own, axis=-1)  # (B, K, Hkv, G, blk)
    own_out = precision.einsum("bnkgqs,bnskd->bnqkgd", jax.nn.softmax(own, axis=-1).astype(v.dtype), v,
                               preferred_element_type=jnp.float32).reshape(b, nk, blk, h, hd)
    own_lse = jnp.moveaxis(own_lse, -1, 2).reshape(b, nk, blk, h)
    ctx_lse = ctx_lse.reshape(b, nk, blk, h)
    peak = jax.lax.stop_gradient(jnp.maximum(ctx_lse, own_lse))
    ctx_w, own_w = jnp.exp(ctx_lse - peak), jnp.exp(own_lse - peak)  # a context of nothing weighs 0
    out = (ctx_w[..., None] * ctx_out.reshape(b, nk, blk, h, hd).astype(jnp.float32)
           + own_w[..., None] * own_out) / (ctx_w + own_w)[..., None]
    return out.astype(q.dtype)
