"""The engine over a paged KV cache (Engine(page_size=, kv_pages=)): requests share one pool of pages,
wait in the queue while too few are free, give AR's very tokens at T=0 (drafts accepted, prompts in
pieces, chunks overlapping the host), and give their pages back however they end."""

from __future__ import annotations

import pytest
from test_serve_engine import (EOS, PROMPTS, TIMEOUT, accepted_drafts, collect, drafting_greedily, offline,
                               prompt_of)

from jetspec_jax.api import random_head
from jetspec_jax.serve.engine import Engine, EngineRequest, SamplingParams


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return tiny_qwen3[0]


def test_requests_share_the_pool_and_equal_offline_ar(target):
    """Six requests and a long prompt on three slots, with pages for about two requests at a time: the
    queue waits for pages while a slot is free, every greedy output is offline AR's token for token with
    drafts accepted (paths compacted across page boundaries), and every page comes back."""
    engine = Engine(target, random_head(target, "causal", seed=3), method="jetspec", slots=3, max_len=256, budget=8,
                    width=3, chunk_steps=4, stop_token_ids=(EOS,), overlap=True, prefill_chunk=64, page_size=16,
                    kv_pages=15)
    engine = drafting_greedily(engine, target)
    waited = []  # at each chunk launch: a slot free while requests were queued (for pages, then)
    launch = engine._launch_chunk

    def logged():
        waited.append(None in engine.owner and bool(engine.pending))
        return launch()
    engine._launch_chunk = logged
    prompts, limits = PROMPTS + [prompt_of(150)], [12, 30, 7, 20, 25, 16, 40]
    try:
        handles = [engine.submit(EngineRequest(p, m, SamplingParams(), f"r{i}"))
                   for i, (p, m) in enumerate(zip(prompts, limits))]
        assert engine.metrics()["kv_pages"] == 14 and engine.metrics()["kv_pages_used"] == 0
        engine.start()
        results = [collect(h) for h in handles]
    finally:
        engine.shutdown()
    assert [tokens for tokens, _ in results] == offline(target, None, "ar", prompts, limits)
    assert accepted_drafts(engine) > 0
    # 14 pages of 16 rows; a request holds ceil((prompt + max_tokens + 16 scratch rows) / 16): 2, 4, 4, ...
    # and 13 for the long prompt, so requests waited for pages with a slot free
    assert any(waited)
    assert engine.metrics()["kv_pages_used"] == 0 and sorted(engine.pages.free) == list(range(1, 15))


def test_a_request_larger_than_the_pool_is_refused(target):
    engine = Engine(target, None, method="ar", slots=2, max_len=256, page_size=16, kv_pages=5)
    assert engine.max_context == 4 * 16 - 1  # the pool's rows less a step's scratch row: what the server offers
    with pytest.raises(ValueError, match=r"max_tokens: .* exceeds the context of 63 tokens \(what 4 cache pages of "
                                         r"16 rows hold\)"):
        engine.submit(EngineRequest(prompt_of(40), 24))
    engine.submit(EngineRequest(prompt_of(40), 23)).cancel()  # 64 rows with the scratch row: 4 pages
    engine.start()
    engine.shutdown()
    assert engine.pages.used == 0


def test_cancelled_and_queued_requests_give_their_pages_back(target):
    engine = Engine(target, None, method="ar", slots=2, max_len=256, chunk_steps=2, stop_token_ids=(),
                    page_size=16, kv_pages=9)
    try:
        running = engine.submit(EngineRequest(prompt_of(20), 100))
        engine.start()
        running.get(timeout=TIMEOUT)  # admitted: it holds 8 pages of the 8
        waiting = engine.submit(EngineRequest(prompt_of(5), 4))
        assert engine.pages.used == 8
        running.cancel()
        tokens, finish = collect(waiting)
        assert len(tokens) == 4 and finish.reason == "length"
        assert collect(running)[1].reason == "cancelled"
    finally:
        engine.shutdown()
    assert engine.pages.used == 0 and sorted(engine.pages.free) == list(range(1, 9))


def test_paged_settings_are_checked(target):
    with pytest.raises(ValueError, match="page_size must be a power of two >= 16"):
        Engine(target, None, method="ar", slots=2, max_len=128, page_size=24)
    with pytest.raises(ValueError, match="kv_pages sizes a paged cache: give page_size too"):
        Engine(target, None, method="ar", slots=2, max_len=128, kv_pages=10)
    with pytest.raises(ValueError, match="kv_pages must be an integer >= 2"):
        Engine(target, None, method="ar", slots=2, max_len=128, page_size=16, kv_pages=1)
    with pytest.raises(ValueError, match="kv_pages=2 holds 16 rows, too few"):
        Engine(target, random_head(target, "causal"), method="jetspec", slots=2, max_len=128, budget=16,
               page_size=16, kv_pages=2)


def test_the_head_s_context_is_paged_with_the_target_s_cache(target):
    """A paged engine keeps the draft head's context in a pool under the target's page table: sampled
    requests with a real (random) head, one prompt prefilled in pieces, draw the dense engine's very
    tokens and accept the very same drafts, so the head drafted the same from its pages."""
    head = random_head(target, "causal", seed=5)
    prompts, limits = PROMPTS[:3] + [prompt_of(150)], [20, 24, 16, 20]
    runs = {}
    for page_size in (None, 16):
        engine = Engine(target, head, method="jetspec", slots=2, max_len=256, budget=8, width=3, chunk_steps=4,
                        stop_token_ids=(EOS,), prefill_chunk=64, page_size=page_size,
                        kv_pages=None if page_size is None else 24)
        if page_size:
            assert engine.slots.draft.paged and engine.slots.draft.k[0].shape[:2] == (24, 16)
        engine.stats.history = []  # each chunk's accepted drafts
        try:
            handles = [engine.submit(EngineRequest(p, m, SamplingParams(temperature=1.0, seed=i)))
                       for i, (p, m) in enumerate(zip(prompts, limits))]
            engine.start()
            runs[page_size] = ([collect(h)[0] for h in handles], accepted_drafts(engine))
        finally:
            engine.shutdown()
    assert runs[16] == runs[None]
    assert runs[16][1] > 0
