"""The parallel draft head (JetSpec; DFlash/DDTree with a bidirectional block).

Qwen3-style decoder layers over a block `[anchor, MASK x (block-1)]`. The target's tapped hidden
states are fused (concat -> bias-free linear -> RMSNorm) into one context feature per committed token;
every head layer turns it into extra keys/values with its own k/v projections, and only block slots
issue queries. The head shares the target's embedding and LM head and owns neither. Slot i > 0
predicts the token i positions after the anchor, so one pass gives one distribution per depth.

The same layers run any block of slots (`block_hidden`): mask embeddings or real tokens, at positions
context length + depth, under any per-sequence block mask. `tree_logits` is the tree-causal pass
(jetspec-tc): every node of a drafted tree sees only its own ancestors, and gets its children's
distribution conditioned on its path.

Context keys/values are cached per sequence (`new_context`: a kv_cache.KVCache over the head's layers,
dense or paged) and extended as tokens are committed; block slots are never cached. Attention runs
through kernels/head_attention.py, which decides the implementation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.kernels import head_attention, precision
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import qwen3
from jetspec_jax.models.params import ParamSpec
from jetspec_jax.tree import ancestor_mask, tree_causal_block

ATTENTION_PATTERNS = ("causal", "bidirectional")


def default_tap_layers(num_target_layers: int, num_taps: int = 5) -> tuple[int, ...]:
    """Evenly spaced from layer 1 to n-3 (the published rule: {1,9,17,25,33} for 36 layers)."""
    start, end = 1, max(1, num_target_layers - 3)
    if num_taps == 1:
        return (start,)
    return tuple(int(round(start + i * (end - start) / (num_taps - 1))) for i in range(num_taps))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    num_layers: int
    hidden_size: int  # must equal the target's: the head reads the target's embeddings
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's; checked when the head is paired with a target
    target_hidden_size: int
    tap_layers: tuple[int, ...]
    block_size: int = 16
    # None: the head learns its own mask embedding; an id: use the target's embedding of that token.
    mask_token_id: int | None = None
    # "causal" (JetSpec), "bidirectional" (DFlash/DDTree), or an explicit block x block boolean
    # query mask as nested tuples (row i: the block slots query i sees).
    attention: str | tuple[tuple[bool, ...], ...] = "causal"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self):
        problems = []
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2, got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if not self.tap_layers:
            problems.append("tap_layers is empty; the head needs at least one target layer")
        if isinstance(self.attention, str):
            if self.attention not in ATTENTION_PATTERNS:
                problems.append(f"attention {self.attention!r} is not one of {ATTENTION_PATTERNS} "
                                "or an explicit block mask")
        else:
            mask = np.asarray(self.attention, bool)
            if mask.shape != (self.block_size, self.block_size):
                problems.append(f"explicit attention mask has shape {mask.shape}, expected "
                                f"({self.block_size}, {self.block_size})")
            elif not mask.diagonal().all():
                problems.append("explicit attention mask must let every slot see itself")
        if problems:
            raise ValueError("invalid draft head config: " + "; ".join(problems))

    @property
    def max_depth(self) -> int:
        return self.block_size - 1

    def block_mask(self) -> np.ndarray:
        b = self.block_size
        if self.attention == "causal":
            return np.tril(np.ones((b, b), bool))
        if self.attention == "bidirectional":
            return np.ones((b, b), bool)
        return np.asarray(self.attention, bool)

    def layer_config(self) -> qwen3.Config:
        """The Qwen3 layer shape the head's layers share (used for RoPE and norms)."""
        return qwen3.Config(architecture="qwen3", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                            num_layers=self.num_layers, num_heads=self.num_heads,
                            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                            intermediate_size=self.intermediate_size, rms_norm_eps=self.rms_norm_eps,
                            rope_theta=self.rope_theta, qk_norm=True)

    @classmethod
    def for_target(cls, target_cfg: qwen3.Config, *, num_layers: int = 2, num_taps: int = 5,
                   block_size: int = 16, attention="causal", intermediate_size: int | None = None,
                   **overrides) -> "DraftConfig":
        """A head shaped like the target's layers (width, heads, head dim, RoPE base)."""
        return cls(num_layers=num_layers, hidden_size=target_cfg.hidden_size, num_heads=target_cfg.num_heads,
                   num_kv_heads=target_cfg.num_kv_heads, head_dim=target_cfg.head_dim,
                   intermediate_size=intermediate_size or target_cfg.intermediate_size or
                   4 * target_cfg.hidden_size,
                   vocab_size=target_cfg.vocab_size, target_hidden_size=target_cfg.hidden_size,
                   tap_layers=default_tap_layers(target_cfg.num_layers, num_taps), block_size=block_size,
                   attention=attention, rms_norm_eps=target_cfg.rms_norm_eps,
                   rope_theta=target_cfg.rope_theta, **overrides)


def check_pairing(head: DraftConfig, target: qwen3.Config) -> None:
    """Raises when a head was built for a different target."""
    problems = []
    if head.hidden_size != target.hidden_size or head.target_hidden_size != target.hidden_size:
        problems.append(f"head width {head.hidden_size} (context width {head.target_hidden_size}) "
                        f"!= target hidden size {target.hidden_size}")
    if head.vocab_size != target.vocab_size:
        problems.append(f"head vocabulary {head.vocab_size} != target vocabulary {target.vocab_size}")
    bad_taps = [t for t in head.tap_layers if not 0 <= t < target.num_layers]
    if bad_taps:
        problems.append(f"tap layers {bad_taps} do not exist in a {target.num_layers}-layer target")
    if head.mask_token_id is not None and not 0 <= head.mask_token_id < target.vocab_size:
        problems.append(f"mask_token_id {head.mask_token_id} is outside the target vocabulary")
    if problems:
        raise ValueError("draft head does not fit this target (was it trained for another model?): "
                         + "; ".join(problems))


def param_specs(cfg: DraftConfig) -> dict[str, Any]:
    d, hd = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def layer():
        return {
            "attn_norm": ParamSpec((d,), ("embed",), "ones"),
            "wq": ParamSpec((d, q_out), ("embed", "heads")),
            "wk": ParamSpec((d, kv_out), ("embed", "kv_heads")),
            "wv": ParamSpec((d, kv_out), ("embed", "kv_heads")),
            "wo": ParamSpec((q_out, d), ("heads", "embed")),
            "q_norm": ParamSpec((hd,), ("head_dim",), "ones"),
            "k_norm": ParamSpec((hd,), ("head_dim",), "ones"),
            "mlp_norm": ParamSpec((d,), ("embed",), "ones"),
            "w_gate": ParamSpec((d, cfg.intermediate_size), ("embed", "mlp")),
            "w_up": ParamSpec((d, cfg.intermediate_size), ("embed", "mlp")),
            "w_down": ParamSpec((cfg.intermediate_size, d), ("mlp", "embed")),
        }

    specs: dict[str, Any] = {
        "fc": ParamSpec((len(cfg.tap_layers) * cfg.target_hidden_size, d), (None, "embed")),
        "hidden_norm": ParamSpec((d,), ("embed",), "ones"),
        "layers": [layer() for _ in range(cfg.num_layers)],
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if cfg.mask_token_id is None:
        specs["mask_embed"] = ParamSpec((d,), ("embed",))
    return specs


def new_context(cfg: DraftConfig, batch: int, max_len: int, dtype=jnp.float32, page_size: int | None = None,
                num_pages: int | None = None) -> KVCache:
    """An empty head context: projected context keys/values of committed tokens per head layer, its
    `lengths` counting context rows (committed tokens - 1). Dense, or paged as KVCache.create lays out."""
    return KVCache.create(cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim, dtype, page_size, num_pages)


def fuse_taps(params: Mapping[str, Any], taps: jax.Array, cfg: DraftConfig) -> jax.Array:
    """taps (B, n, n_taps, D_target) -> fused context features (B, n, D)."""
    b, n = taps.shape[:2]
    flat = taps.reshape(b, n, -1).astype(params["fc"].dtype)
    return qwen3.rms_norm(precision.matmul(flat, params["fc"]), params["hidden_norm"], cfg.rms_norm_eps)


def context_kv(layer: Mapping[str, jax.Array], fused: jax.Array, cos: jax.Array, sin: jax.Array,
               cfg: DraftConfig) -> tuple[jax.Array, jax.Array]:
    b, n = fused.shape[:2]
    k = precision.matmul(fused, layer["wk"]).reshape(b, n, cfg.num_kv_heads, cfg.head_dim)
    v = precision.matmul(fused, layer["wv"]).reshape(b, n, cfg.num_kv_heads, cfg.head_dim)
    k = qwen3.apply_rope(qwen3.rms_norm(k, layer["k_norm"], cfg.rms_norm_eps), cos, sin)
    return k, v


def extend_context(params: Mapping[str, Any], ctx: KVCache, taps: jax.Array, counts: jax.Array,
                   cfg: DraftConfig) -> KVCache:
    """Appends the first counts[b] rows of taps (B, n, n_taps, D_target) to the context, at positions
    ctx.lengths .. ctx.lengths + counts - 1. Rows past counts are written but stay uncommitted."""
    b, n = taps.shape[:2]
    fused = fuse_taps(params, taps, cfg)
    positions = ctx.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    cos, sin = qwen3.rope_tables(positions, qwen3.rope_inverse_frequencies(cfg.layer_config()))
    new_k, new_v = list(ctx.k), list(ctx.v)
    for i, layer in enumerate(params["layers"]):
        k, v = context_kv(layer, fused, cos, sin, cfg)
        new_k[i] = ctx.write(new_k[i], k, ctx.lengths)
        new_v[i] = ctx.write(new_v[i], v, ctx.lengths)
    return ctx._replace(k=tuple(new_k), v=tuple(new_v)).advance(counts)


def head_layer(x: jax.Array, layer: Mapping[str, jax.Array], ctx: KVCache, index: int,
               visibility: head_attention.BlockVisibility, cos: jax.Array, sin: jax.Array,
               cfg: DraftConfig) -> jax.Array:
    """Head layer `index` for block queries x (B, T, D) against [context keys ; block keys], each slot
    seeing what `visibility` allows."""
    layer_cfg = cfg.layer_config()
    q, k, v = qwen3.attention_inputs(x, layer, layer_cfg, cos, sin)
    attn = head_attention.context_block_attention(q, k, v, ctx, index, visibility)
    return qwen3.finish_layer(x, attn, layer, layer_cfg, 0)


def block_embeddings(params: Mapping[str, Any], target_params: Mapping[str, Any], anchor: jax.Array,
                     cfg: DraftConfig) -> jax.Array:
    """[anchor, MASK x (block-1)] embedded with the target's table: (B, block, D)."""
    embed = target_params["embed"]
    b = anchor.shape[0]
    anchor_x = embed[anchor][:, None, :]
    mask_vec = params["mask_embed"] if cfg.mask_token_id is None else embed[cfg.mask_token_id]
    masks = jnp.broadcast_to(mask_vec.astype(embed.dtype), (b, cfg.block_size - 1, embed.shape[-1]))
    return jnp.concatenate([anchor_x, masks], axis=1)


def slot_embeddings(params: Mapping[str, Any], target_params: Mapping[str, Any], tokens: jax.Array,
                    is_mask: jax.Array, cfg: DraftConfig) -> jax.Array:
    """Block slots (B, T) embedded with the target's table, the mask embedding where is_mask: (B, T, D)."""
    embed = target_params["embed"]
    mask_vec = params["mask_embed"] if cfg.mask_token_id is None else embed[cfg.mask_token_id]
    return jnp.where(is_mask[..., None], mask_vec.astype(embed.dtype), embed[tokens])


def block_hidden(params: Mapping[str, Any], x: jax.Array, depths: jax.Array, block_mask: jax.Array,
                 ctx: KVCache, cfg: DraftConfig, attention_impl: str = "xla") -> jax.Array:
    """The head's layers over block slots x (B, T, D) at positions ctx.lengths + depths (B, T): every
    slot sees the committed context and the slots block_mask (B, T, T) allows. attention_impl: a
    head_attention implementation, resolved ("pallas" needs T rows free past every ctx.lengths).
    Returns (B, T, D)."""
    b, t = x.shape[:2]
    positions = ctx.lengths[:, None] + depths
    cos, sin = qwen3.rope_tables(positions, qwen3.rope_inverse_frequencies(cfg.layer_config()))
    block_mask = jnp.broadcast_to(block_mask.astype(bool), (b, t, t))
    visibility = head_attention.block_visibility(ctx.lengths, ctx.max_len, block_mask, attention_impl)
    for i, layer in enumerate(params["layers"]):
        x = head_layer(x, layer, ctx, i, visibility, cos, sin, cfg)
    return x


def slot_logits(params: Mapping[str, Any], target_params: Mapping[str, Any], target_cfg: qwen3.Config,
                hidden: jax.Array, cfg: DraftConfig) -> jax.Array:
    """Final norm and the target's LM head on block slots' hidden states: fp32 logits (..., V), or over
    the head's draft vocabulary where its params carry one (jetspec_jax/draft_vocab.py)."""
    with jax.named_scope("lm_head"):
        normed = qwen3.rms_norm(hidden, params["final_norm"], cfg.rms_norm_eps)
        if "draft_lm_head" in params:
            return precision.einsum("...d,vd->...v", normed, params["draft_lm_head"],
                                    preferred_element_type=jnp.float32)
        return qwen3.lm_logits(target_params, normed, target_cfg)


def draft_logits(params: Mapping[str, Any], target_params: Mapping[str, Any], target_cfg: qwen3.Config,
                 anchor: jax.Array, ctx: KVCache, cfg: DraftConfig, *,
                 block_mask: jax.Array | None = None, num_depths: int | None = None,
                 attention_impl: str = "xla") -> jax.Array:
    """One head pass over [anchor, MASK...] at positions ctx.lengths + i.

    Returns fp32 logits (B, num_depths, V) for depths 1..num_depths (default block-1).
    block_mask (block, block) or (B, block, block) overrides the configured attention pattern.
    attention_impl as `block_hidden` (`HeadDrafter` allocates the rows the kernel path needs).
    """
    x = block_embeddings(params, target_params, anchor, cfg)
    depths = jnp.broadcast_to(jnp.arange(cfg.block_size, dtype=jnp.int32), x.shape[:2])
    if block_mask is None:
        block_mask = jnp.asarray(cfg.block_mask())
    x = block_hidden(params, x, depths, block_mask, ctx, cfg, attention_impl)
    num_depths = cfg.max_depth if num_depths is None else num_depths
    return slot_logits(params, target_params, target_cfg, x[:, 1: num_depths + 1], cfg)


def tree_logits(params: Mapping[str, Any], target_params: Mapping[str, Any], target_cfg: qwen3.Config,
                tokens: jax.Array, depths: jax.Array, ancestors: jax.Array, ctx: KVCache, cfg: DraftConfig, *,
                attention_impl: str = "xla") -> jax.Array:
    """The tree-causal head pass: for every node of a token tree, the head's distribution of its
    children given the path from the anchor to it (`tree.tree_causal_block`: a node slot and a query
    slot per node, each seeing only the node's own ancestors, never siblings or descendants).

    tokens / depths (B, N), ancestors (B, N, N) with node 0 the anchor (the newest committed token) at
    depth 0. Returns fp32 logits (B, N, V); row i equals the last slot of the plain causal block
    [anchor, path tokens..., MASK] run alone, so a causal JetSpec head's weights serve as they are.
    2N slots: attention_impl other than "xla" needs 2N rows free past every ctx.lengths.
    """
    n = tokens.shape[1]
    block = tree_causal_block(tokens, depths, ancestors)
    x = slot_embeddings(params, target_params, block.tokens, block.is_query, cfg)
    x = block_hidden(params, x, block.depths, block.mask, ctx, cfg, attention_impl)
    return slot_logits(params, target_params, target_cfg, x[:, n:], cfg)


def training_logits(params: Mapping[str, Any], target_params: Mapping[str, Any], target_cfg: qwen3.Config,
                    tokens: jax.Array, taps: jax.Array, anchors: jax.Array, cfg: DraftConfig, *,
                    anchors_per_chunk: int | None = None, attention_impl: str = "auto") -> jax.Array:
    """The inference computation for K blocks per sequence at once (training and held-out eval).

    tokens (B, S), taps (B, S, n_taps, D_target) of the target on the same sequence, anchors (B, K).
    Block k is [tokens[a_k], MASK...] at positions a_k + i; it sees the context of positions < a_k
    (exactly what inference has when a_k is the newest committed token) and its own slots under the
    configured pattern, never other blocks. Returns fp32 logits (B, K, block-1, V) for depths 1..D.
    Memory is linear in S and K: the context attention runs over chunks of `anchors_per_chunk`
    anchors (default: head_attention.TRAINING_SCORES_PER_CHUNK context scores per chunk over the batch
    and heads).
    """
    blk = cfg.block_size
    anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)  # (B, K)
    x = jax.vmap(lambda a: block_embeddings(params, target_params, a, cfg), in_axes=1, out_axes=1)(anchor_tokens)
    hidden = anchored_blocks_hidden(params, x, jnp.arange(blk, dtype=jnp.int32), jnp.asarray(cfg.block_mask()),
                                    taps, anchors, cfg, anchors_per_chunk, attention_impl)
    return slot_logits(params, target_params, target_cfg, hidden[:, :, 1:], cfg)


def training_tree_logits(params: Mapping[str, Any], target_params: Mapping[str, Any], target_cfg: qwen3.Config,
                         tokens: jax.Array, taps: jax.Array, anchors: jax.Array, cfg: DraftConfig, *,
                         anchors_per_chunk: int | None = None, attention_impl: str = "auto") -> jax.Array:
    """The tree-causal pass (`tree_logits`) teacher-forced along the data, K anchors per sequence at once.

    Block k is the chain tokens[a_k .. a_k+D-1] (D = block-1) as a tree: a node slot per token and a
    query slot per node (`tree.tree_causal_block` of a chain, 2D slots, one mask for every block), seeing
    the context of positions < a_k. Query slot j gives the head's distribution of the token at a_k+j+1
    given the true tokens up to a_k+j: fp32 logits (B, K, D, V), the layout of `training_logits`, so its
    labels and teacher logits (depth j+1 after a_k) serve as they are. Tokens past the sequence are
    clipped to its last (their depths are invalid anyway)."""
    s = tokens.shape[1]
    depth = cfg.max_depth
    chain = jnp.arange(depth, dtype=jnp.int32)
    block = tree_causal_block(jnp.zeros_like(chain), chain, ancestor_mask(chain - 1, depth))  # layout only
    positions = jnp.minimum(anchors[:, :, None] + chain, s - 1)  # (B, K, D)
    node_tokens = jnp.take_along_axis(tokens, positions.reshape(tokens.shape[0], -1), axis=1).reshape(positions.shape)
    slot_tokens = jnp.concatenate([node_tokens, jnp.zeros_like(node_tokens)], axis=-1)
    x = slot_embeddings(params, target_params, slot_tokens, jnp.broadcast_to(block.is_query, slot_tokens.shape), cfg)
    hidden = anchored_blocks_hidden(params, x, block.depths, block.mask, taps, anchors, cfg, anchors_per_chunk,
                                    attention_impl)
    return slot_logits(params, target_params, target_cfg, hidden[:, :, depth:], cfg)


def anchored_blocks_hidden(params: Mapping[str, Any], x: jax.Array, depths: jax.Array, block_mask: jax.Array,
                           taps: jax.Array, anchors: jax.Array, cfg: DraftConfig,
                           anchors_per_chunk: int | None = None, attention_impl: str = "auto") -> jax.Array:
    """The head's layers over K blocks per sequence at once: x (B, K, T, D) embedded slots, block j's slot
    i at position anchors[j] + depths[i], seeing the context of positions < anchors[j] (the fused taps
    of the whole sequence) and the slots of its own block that block_mask (T, T) allows. -> (B, K, T, D)."""
    b, k, blk = x.shape[:3]
    s = taps.shape[1]
    layer_cfg = cfg.layer_config()
    inv_freq = qwen3.rope_inverse_frequencies(layer_cfg)
    with jax.named_scope("fuse_taps"):
        fused = fuse_taps(params, taps, cfg)
    ctx_cos, ctx_sin = qwen3.rope_tables(jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), inv_freq)
    x = x.reshape(b, k * blk, -1)
    positions = (anchors[:, :, None] + depths).reshape(b, k * blk)
    cos, sin = qwen3.rope_tables(positions, inv_freq)
    attention_impl = head_attention.resolve_training_implementation(attention_impl, cfg.head_dim)
    for layer in params["layers"]:
        with jax.named_scope("context_kv"):
            ctx_k, ctx_v = context_kv(layer, fused, ctx_cos, ctx_sin, cfg)
        with jax.named_scope("qkv"):
            q, bk, bv = qwen3.attention_inputs(x, layer, layer_cfg, cos, sin)
        per_block = lambda t: t.reshape(b, k, blk, *t.shape[2:])  # noqa: E731
        with jax.named_scope("block_attention"):
            args = (per_block(q), per_block(bk).astype(ctx_k.dtype), per_block(bv).astype(ctx_v.dtype), ctx_k,
                    ctx_v, anchors, block_mask)
            attn = head_attention.anchored_attention(*args, attention_impl, anchors_per_chunk)
        with jax.named_scope("out_mlp"):
            x = qwen3.finish_layer(x, attn.reshape(b, k * blk, *attn.shape[3:]).astype(q.dtype), layer, layer_cfg,
                                   0)
    return x.reshape(b, k, blk, -1)
