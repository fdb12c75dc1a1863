"""The paged KV cache (kv_cache.KVCache with a page table): the same logits and tokens as the dense
cache through every attention path, page boundaries inside prompts, trees and accepted paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import qwen3


def shuffled_pages(cache: KVCache, seed: int) -> KVCache:
    """`cache` with its table pointing at pool pages in a random order, page 0 (scratch) left unused."""
    per_sequence = cache.pages.shape[1]
    order = np.random.default_rng(seed).permutation(cache.pages.size) + 1
    pool = (cache.k[0].shape[0] + 1,) + cache.k[0].shape[1:]
    return cache._replace(k=tuple(jnp.zeros(pool, k.dtype) for k in cache.k),
                          v=tuple(jnp.zeros(pool, v.dtype) for v in cache.v),
                          pages=jnp.asarray(order.reshape(-1, per_sequence), jnp.int32))


@pytest.mark.parametrize("attention", ["xla", "pallas_interpret"])
def test_prefill_decode_and_tree_verify_equal_the_dense_cache(tiny_qwen3, attention):
    target = tiny_qwen3[0]
    cfg, params = target.cfg, target.params
    rng = np.random.default_rng(0)
    dense = qwen3.new_cache(cfg, 2, 80)
    paged = shuffled_pages(qwen3.new_cache(cfg, 2, 80, page_size=16), seed=1)
    assert paged.max_len == 80 and paged.batch == 2 and paged.page_size == 16
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 21)), jnp.int32)  # crosses a page boundary
    positions = jnp.broadcast_to(jnp.arange(21), (2, 21))
    # a 13-node tree over rows 22.. / 14..: it spans the page boundary at 32 / 16
    parents = np.array([-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 6, 9, 11])
    ancestors = np.eye(13, dtype=bool)
    for i in range(1, 13):
        ancestors[i] |= ancestors[parents[i]]
    depths = jnp.asarray(ancestors.sum(-1) - 1)[None]
    tree_tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 13)), jnp.int32)
    tree_mask = jnp.broadcast_to(jnp.asarray(ancestors), (2, 13, 13))
    caches, outs = [], []
    for cache in (dense, paged):
        logits, _, cache = qwen3.forward(params, prompt, positions, cache, cfg, attention_impl="xla")
        cache = cache._replace(lengths=jnp.asarray([21, 13], jnp.int32))
        outs.append(logits)
        token = jnp.asarray([[3], [9]], jnp.int32)
        logits, _, cache = qwen3.forward(params, token, cache.lengths[:, None], cache, cfg, attention_impl=attention)
        outs.append(logits)
        cache = cache.advance(jnp.ones((2,), jnp.int32))
        logits, _, cache = qwen3.forward(params, tree_tokens, cache.lengths[:, None] + depths, cache, cfg,
                                         mask=tree_mask, attention_impl=attention)
        outs.append(logits)
        caches.append(cache)
    half = len(outs) // 2
    for d, p in zip(outs[:half], outs[half:]):
        np.testing.assert_allclose(np.asarray(p), np.asarray(d), atol=1e-5, rtol=1e-5)
    # every row written (prompt, decoded token, tree) holds the dense cache's values; past layer 0 they
    # went through attention, whose kernel sums a paged sequence in 16-row blocks (64 when dense)
    rows = jnp.broadcast_to(jnp.arange(36), (2, 36))
    for layer in (0, cfg.num_layers - 1):
        np.testing.assert_allclose(np.asarray(caches[1].gather(caches[1].v[layer], rows)),
                                   np.asarray(caches[0].gather(caches[0].v[layer], rows)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention, compact", [("xla", "xla"), ("pallas_interpret", "pallas_interpret")])
def test_paged_generation_equals_dense(tiny_qwen3, attention, compact):
    """AR and speculative decoding with pages of 16 rows give the dense cache's tokens; the speculative
    run accepts drafts, so accepted paths were compacted within and across pages."""
    from drafters import TargetGreedyDrafter

    from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
    from jetspec_jax.speculative import SpecConfig, speculative_generate
    from jetspec_jax.tokens import pad_prompts

    target = tiny_qwen3[0]
    tokens, lengths = pad_prompts([[5, 12, 40], [7, 1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9, 9]], pad_id=0, bucket=8)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    spec = SpecConfig("jetspec", budget=8, width=2, attention_impl=attention, compact_impl=compact)
    outputs = {}
    for page_size in (None, 16):
        gen = GenerationConfig(max_new_tokens=24, kv_page_size=page_size)
        ar = generate_tokens(target.params, tokens, lengths, jax.random.key(0), cfg=target.cfg, gen=gen,
                             cache_len=48, attention=attention)
        sp = speculative_generate(target.params, None, tokens, lengths, jax.random.key(0), cfg=target.cfg,
                                  drafter=TargetGreedyDrafter(target.cfg, 3), spec=spec, gen=gen, cache_len=56)
        outputs[page_size] = (np.asarray(ar.tokens), np.asarray(sp.tokens), np.asarray(sp.target_forwards))
    np.testing.assert_array_equal(outputs[16][0], outputs[None][0])
    np.testing.assert_array_equal(outputs[16][1], outputs[None][0])
    np.testing.assert_array_equal(outputs[16][1], outputs[None][1])
    assert outputs[16][2].max() < 24  # drafts were accepted


@pytest.mark.parametrize("page_size", [0, 8, 48])
def test_a_bad_page_size_is_named(page_size):
    from jetspec_jax.autoregressive import GenerationConfig

    with pytest.raises(ValueError, match="page_size must be a power of two >= 16"):
        GenerationConfig(kv_page_size=page_size)


@pytest.mark.parametrize("shape", [(1, 1, 32, 8, 128, 64, 300, jnp.bfloat16), (2, 64, 9, 3, 64, 16, 40, jnp.float32)])
def test_the_paged_kernel_lowers_to_a_valid_triton_module(shape, monkeypatch):
    """The kernel's paged form (a page slice per prefix block, a gathered tree chunk) passes MLIR's
    verifier when lowered for CUDA, with no TF32 dot for fp32 inputs."""
    from triton_lowering import lowered_triton_modules, tf32_dots

    from jetspec_jax.kernels.tree_attention import tree_attention_pallas

    b, n, h, hkv, d, page_size, pages, dtype = shape
    per_sequence = 8
    args = (jax.ShapeDtypeStruct((b, n, h, d), dtype), jax.ShapeDtypeStruct((pages, page_size, hkv, d), dtype),
            jax.ShapeDtypeStruct((pages, page_size, hkv, d), dtype), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, -(-n // 32)), jnp.uint32), jax.ShapeDtypeStruct((b, per_sequence), jnp.int32))
    modules = lowered_triton_modules(monkeypatch, lambda: jax.jit(tree_attention_pallas).trace(*args).lower(
        lowering_platforms=("cuda",)))
    for module in modules:
        assert module.operation.verify()
        assert "tt.dot" in str(module) and not tf32_dots(module)


@pytest.mark.parametrize("attention", ["xla", "pallas_interpret"])
def test_the_head_drafts_the_same_from_a_paged_context(tiny_qwen3, attention):
    """The draft head's context paged (pages in a shuffled order) gives the dense context's draft
    logits and jetspec-tc's tree logits: the context is extended across a page boundary and the kernel
    path's block rows land past it in the pages."""
    from drafters import random_head

    from jetspec_jax.autoregressive import prefill
    from jetspec_jax.models import draft_head

    target = tiny_qwen3[0]
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", num_layers=2)
    cfg = drafter.cfg
    seq = jnp.asarray(np.random.default_rng(2).integers(0, target.cfg.vocab_size, (2, 24)), jnp.int32)
    lengths = jnp.asarray([24, 13])
    _, taps, _ = prefill(target.params, seq, lengths, target.cfg, 64, tap_layers=cfg.tap_layers)
    parents = np.array([-1, 0, 0, 1, 2, 3])
    ancestors = np.eye(6, dtype=bool)
    for i in range(1, 6):
        ancestors[i] |= ancestors[parents[i]]
    tree_tokens = jnp.asarray([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]], jnp.int32)
    depths = jnp.broadcast_to(jnp.asarray(ancestors.sum(-1) - 1), (2, 6))
    outs = []
    for page_size in (None, 16):
        ctx = draft_head.new_context(cfg, 2, 64, page_size=page_size)
        if page_size:
            ctx = shuffled_pages(ctx, seed=3)
            assert ctx.paged and ctx.k[0].shape[:2] == (9, 16)
        ctx = draft_head.extend_context(head, ctx, taps[:, :20], jnp.asarray([20, 12]), cfg)
        ctx = draft_head.extend_context(head, ctx, taps[:, 20:], jnp.asarray([3, 0]), cfg)  # across row 16 and 32
        outs.append(draft_head.draft_logits(head, target.params, target.cfg, seq[:, 0], ctx, cfg,
                                            attention_impl=attention))
        outs.append(draft_head.tree_logits(head, target.params, target.cfg, tree_tokens, depths,
                                           jnp.broadcast_to(jnp.asarray(ancestors), (2, 6, 6)), ctx, cfg,
                                           attention_impl=attention))
    np.testing.assert_allclose(np.asarray(outs[2]), np.asarray(outs[0]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(outs[3]), np.asarray(outs[1]), atol=1e-5, rtol=1e-5)
