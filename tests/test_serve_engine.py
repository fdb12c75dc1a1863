"""The serving engine on a tiny random target: requests admitted into slots as others finish give
exactly offline generation's tokens at T=0, follow the target's distribution at T>0, cancellation,
the queue bound and shutdown behave, and after the full warm-up no request compiles anything."""

from __future__ import annotations

import dataclasses
import itertools
import queue
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_serve_budget import cost_table
from drafters import TargetGreedyDrafter
from test_speculative import chi_square_pvalue, exact_token_distributions

from jetspec_jax.api import random_head
from jetspec_jax.autoregressive import GenerationConfig, generate_tokens, prefill
from jetspec_jax.compilation import CompileWatch
from jetspec_jax.sampling import SamplingConfig
from jetspec_jax.serve import slots as device
from jetspec_jax.serve.budget import PLAIN
from jetspec_jax.serve.engine import (Engine, EngineClosedError, EngineRequest, FinishEvent, QueueFullError,
                                      RequestHandle, SamplingParams, TokenEvent)
from jetspec_jax.speculative import HeadDrafter, SpecConfig, speculative_generate
from jetspec_jax.tokens import pad_prompts

EOS = 7  # a token the random tiny model emits now and then, so some requests stop early
TIMEOUT = 300.0


def collect(handle, timeout: float = TIMEOUT) -> tuple[list[int], FinishEvent]:
    tokens, deadline = [], time.monotonic() + timeout
    while True:
        event = handle.get(timeout=max(0.0, deadline - time.monotonic()))
        if isinstance(event, FinishEvent):
            return tokens, event
        assert isinstance(event, TokenEvent)
        tokens += event.token_ids


def offline(target, head, method, prompts, limits, budget=8, width=3) -> list[list[int]]:
    """Offline generation of every prompt in one batch (one compilation), cut to each request's limit:
    at T=0 a sequence's first n tokens do not depend on its limit."""
    tokens, lengths = pad_prompts(prompts, 0)
    gen = GenerationConfig(max_new_tokens=max(limits), eos_token_ids=(EOS,), pad_token_id=0)
    args = (jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0))
    if method == "ar":
        out = generate_tokens(target.params, *args, cfg=target.cfg, gen=gen, cache_len=256)
    else:
        out = speculative_generate(target.params, head[1], *args, cfg=target.cfg,
                                   drafter=HeadDrafter(head[0], target.cfg), spec=SpecConfig(method, budget, width),
                                   gen=gen, cache_len=256)
    rows = np.asarray(out.tokens)
    return [rows[i, : min(int(out.num_tokens[i]), limit)].tolist() for i, limit in enumerate(limits)]


@pytest.fixture(scope="module")
def target(tiny_qwen3):
    return tiny_qwen3[0]


@pytest.fixture(scope="module")
def heads(target):
    return {"jetspec": random_head(target, "causal", seed=3), "ddtree": random_head(target, "bidirectional", seed=4),
            "ar": None}


PROMPTS = [[5, 12, 40], list(range(10, 27)), [90, 3, 3, 8, 60] * 8, [44] * 9, [2, 70], list(range(30, 52))]
LIMITS = [12, 30, 7, 20, 25, 16]


@pytest.mark.parametrize("method, overlap", [("jetspec", False), ("ddtree", False), ("ar", False), ("ddtree", True),
                                             ("ar", True)])
def test_t0_requests_equal_offline_generation(target, heads, method, overlap):
    """Six requests on three slots (the first three admitted in one call, the later ones as earlier
    ones finish), with sampled requests sharing the batch: each greedy output is offline generation's,
    token for token, whether chunks overlap the host's reading of the last one (and run all their
    steps, slots that ended idling) or not (jetspec after the full warm-up, whose runs leave no trace in
    the slots)."""
    engine = Engine(target, heads[method], method=method, slots=3, max_len=256, budget=8, width=3, chunk_steps=4,
                    stop_token_ids=(EOS,), overlap=overlap)
    try:
        greedy = [engine.submit(EngineRequest(p, m, SamplingParams(), f"g{i}"))
                  for i, (p, m) in enumerate(zip(PROMPTS, LIMITS))]
        sampled = [engine.submit(EngineRequest(p, 10, SamplingParams(temperature=1.0, top_p=0.9, seed=i)))
                   for i, p in enumerate(PROMPTS[:2])]
        engine.start(warm_up=method == "jetspec")
        results = [collect(h) for h in greedy + sampled]
    finally:
        engine.shutdown()
    assert engine.stats.admitted == 8 and engine.stats.admissions < 8
    for (tokens, finish), prompt, expected in zip(results, PROMPTS, offline(target, heads[method], method,
                                                                              PROMPTS, LIMITS)):
        assert tokens == expected
        assert finish.reason == ("stop" if tokens[-1] == EOS else "length")
        assert finish.completion_tokens == len(tokens) and finish.prompt_tokens == len(prompt)
    assert all(finish.reason in ("stop", "length") for _, finish in results[len(greedy):])
    assert engine.metrics()["requests_finished"] == len(greedy) + len(sampled)


@pytest.mark.parametrize("method, overlap", [("jetspec", False), ("ddtree", True), ("ar", False)])
def test_long_prompts_come_in_pieces_between_chunks(target, heads, method, overlap):
    """Prompts longer than prefill_chunk are prefilled 64 tokens at a time while other requests decode:
    chunks run between one prompt's pieces, the decoding slots' tokens and the long prompts' own are
    offline generation's token for token (the chunks' steps write into a slot taking its prompt in
    pieces; what they write there is overwritten or never read), and a request cancelled in the middle
    of its pieces frees its slot."""
    engine = Engine(target, heads[method], method=method, slots=3, max_len=256, budget=8, width=3, chunk_steps=2,
                    stop_token_ids=(EOS,), overlap=overlap, prefill_chunk=64)
    calls, dropped = [], []
    for name in ("_admit_piece", "_launch_chunk"):
        def logged(*args, _name=name, _call=getattr(engine, name)):
            calls.append((_name, dict(engine.prefilling), engine._decoding()))
            if _name == "_admit_piece" and dropped:  # cancel `dropped` once one of its pieces is in
                index, (_, start) = next(iter(engine.prefilling.items()))
                if engine.owner[index] is dropped[0] and start > 0:
                    dropped[0].cancel()
            return _call(*args)
        setattr(engine, name, logged)
    prompts = [PROMPTS[1], prompt_of(150), prompt_of(130)[::-1], prompt_of(65)]
    limits = [60, 20, 9, 12]
    try:
        short = engine.submit(EngineRequest(prompts[0], limits[0]))
        engine.start()
        first = short.get(timeout=TIMEOUT)  # decoding when the long ones come
        dropped.append(engine.submit(EngineRequest(prompt_of(200), 5)))
        handles = [engine.submit(EngineRequest(p, m)) for p, m in zip(prompts[1:], limits[1:])]
        tokens, finish = collect(short)
        results = [(first.token_ids + tokens, finish)] + [collect(h) for h in handles]
        tokens, finish = collect(dropped[0])  # only the hook cancels it, once a piece of it is in
        assert tokens == [] and finish.reason == "cancelled"
        again = engine.submit(EngineRequest(prompt_of(140), 6))  # the slot it freed takes another long prompt
        results.append(collect(again))
    finally:
        engine.shutdown()
    expected = offline(target, heads[method], method, prompts + [prompt_of(140)], limits + [6])
    assert [tokens for tokens, _ in results] == expected
    assert [finish.prompt_tokens for _, finish in results[1:]] == [150, 130, 65, 140]
    # 3 pieces of 64 or fewer tokens for 150, 130 and 140 tokens, 2 for 65, and 2 for the cancelled 200
    # (cancelled as its second piece ran)
    pieces = [name for name, _, _ in calls if name == "_admit_piece"]
    assert engine.metrics()["prefill_pieces_total"] == len(pieces) == 3 + 3 + 2 + 3 + 2
    between = [i for i, (name, held, decoding) in enumerate(calls)
               if name == "_launch_chunk" and held and decoding and i > 0 and calls[i - 1][0] == "_admit_piece"]
    assert between, "no chunk ran for a decoding slot while a prompt was still coming in pieces"
    assert engine.metrics()["live_slots"] == 0 and not engine.prefilling


def test_tree_causal_requests_on_the_kernel_draft_path_equal_ar(target, heads):
    """jetspec-tc with both head passes on the (interpreted) tree kernel: the engine keeps head-context rows
    for the second pass, and each greedy request's output is AR's."""
    engine = Engine(target, heads["jetspec"], method="jetspec-tc", slots=2, max_len=256, budget=8, width=3,
                    chunk_steps=4, stop_token_ids=(EOS,), draft_attention="pallas_interpret").start()
    spec = engine.spec(8)
    assert engine.drafter.tree_slots == spec.tree_pass_slots(spec.depth(engine.drafter.max_depth)) > 0
    try:
        handles = [engine.submit(EngineRequest(p, m, SamplingParams(), f"g{i}"))
                   for i, (p, m) in enumerate(zip(PROMPTS[:3], LIMITS[:3]))]
        results = [collect(h) for h in handles]
    finally:
        engine.shutdown()
    assert [tokens for tokens, _ in results] == offline(target, None, "ar", PROMPTS[:3], LIMITS[:3])


def test_plain_chunks_keep_the_head_context(target, heads):
    """A plain decoding chunk of a speculative engine (auto's PLAIN arm) shows the head every token it
    commits: after admission and a plain chunk, each slot's head context is the one a prefill of all
    its committed tokens but the newest gives, so the next tree is drafted from the right context."""
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=2, max_len=128, budget="auto", width=3,
                    chunk_steps=5, stop_token_ids=(EOS,))
    greedy = SamplingParams().config()
    args, kwargs = engine._admit_call([(0, PROMPTS[0], greedy, 40, 0), (1, PROMPTS[1], greedy, 40, 0)])
    engine.slots, first, _ = device.admit(*args, **kwargs)
    program, args, kwargs = engine._chunk_call(PLAIN, 2)
    slots, out = program(*args, **kwargs)
    assert int(out.steps) == 5
    for row, prompt in enumerate(PROMPTS[:2]):
        committed = [int(first[row])] + np.asarray(out.tokens[row, : int(out.num_tokens[row])]).tolist()
        seen = prompt + committed[:-1]
        _, taps, _ = prefill(target.params, jnp.asarray([seen]), jnp.asarray([len(seen)]), target.cfg, 128,
                             tap_layers=tuple(engine.drafter.tap_layers))
        state = engine.drafter.init_state(engine.head_params, 1, 128, jnp.float32)
        want = engine.drafter.observe(engine.head_params, state, taps, jnp.asarray([len(seen)]))
        assert int(slots.draft.lengths[row]) == len(seen)
        for got_k, want_k in zip(slots.draft.k + slots.draft.v, want.k + want.v):
            np.testing.assert_allclose(got_k[row, : len(seen)], want_k[0, : len(seen)], rtol=1e-5, atol=1e-5)


def test_auto_mixing_plain_and_tree_chunks_equals_offline_ar(target, heads):
    """Chunks alternating between plain decoding and trees (as auto may choose them): every greedy
    request's output is AR's, and both kinds of chunk ran."""
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=3, max_len=256, budget="auto", width=3,
                    chunk_steps=4, stop_token_ids=(EOS,))
    arms = itertools.cycle([PLAIN, 16])
    engine.policy.choose = lambda live, batch=None: next(arms)
    engine.stats.history = []
    try:
        handles = [engine.submit(EngineRequest(p, m)) for p, m in zip(PROMPTS, LIMITS)]
        engine.start()
        got = [collect(h)[0] for h in handles]
    finally:
        engine.shutdown()
    assert got == offline(target, None, "ar", PROMPTS, LIMITS)
    assert {chunk["budget"] for chunk in engine.stats.history} == {PLAIN, 16}


def drafting_greedily(engine: Engine, target, depth: int = 4) -> Engine:
    """The engine with the target's own greedy chain for a drafter (a head that drafts well): at T>0 its
    drafts are often the target's samples, so acceptance really runs."""
    engine.drafter, engine.head_params = TargetGreedyDrafter(target.cfg, depth, sharpness=1.0), None
    paged = engine.pages is not None
    engine.slots = device.new_slots(target.cfg, engine.drafter, None, engine.num_slots, engine.max_len,
                                    target.params["embed"].dtype, engine.pages.page_size if paged else None,
                                    engine.pages.num_pages if paged else None)
    engine.stats.history = []
    return engine


def accepted_drafts(engine: Engine) -> int:
    return sum(chunk["accepted"] for chunk in engine.stats.history)


@pytest.mark.parametrize("budget", [8, "auto"])
def test_sampled_requests_are_offline_ar_s_own_samples(target, heads, budget):
    """At T>0 with top-k and top-p, each request's tokens through the engine (three slots, requests
    admitted as others finish, drafts accepted) are offline AR's for the same seed, token for token: a
    token is drawn with its request's key and output index, whatever the batch, budget or method; with
    auto, chunks alternate between plain decoding and trees."""
    from jetspec_jax.sampling import request_keys

    sampling = SamplingParams(temperature=0.8, top_p=0.95, top_k=40)
    seeds = [2**40 + 7 * i for i in range(len(PROMPTS))]
    engine = drafting_greedily(Engine(target, heads["jetspec"], method="jetspec", slots=3, max_len=256,
                                      budget=budget, width=3, chunk_steps=4, stop_token_ids=(EOS,)), target)
    if budget == "auto":
        arms = itertools.cycle([PLAIN, 8])
        engine.policy.choose = lambda live, batch=None: next(arms)
    try:
        handles = [engine.submit(EngineRequest(p, m, dataclasses.replace(sampling, seed=s)))
                   for p, m, s in zip(PROMPTS, LIMITS, seeds)]
        engine.start()
        got = [collect(h)[0] for h in handles]
    finally:
        engine.shutdown()
    tokens, lengths = pad_prompts(PROMPTS, 0)
    gen = GenerationConfig(max_new_tokens=max(LIMITS), sampling=sampling.config(), eos_token_ids=(EOS,))
    want = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths),
                           request_keys(seeds), cfg=target.cfg, gen=gen, cache_len=256)
    rows = np.asarray(want.tokens)
    assert got == [rows[i, : min(int(want.num_tokens[i]), m)].tolist() for i, m in enumerate(LIMITS)]
    assert accepted_drafts(engine) > 0
    assert {chunk["budget"] for chunk in engine.stats.history} == ({8} if budget == 8 else {PLAIN, 8})


def test_sampled_requests_follow_the_target_distribution(target, heads):
    """3000 requests of three tokens sampled with top-k and top-p through 64 slots, drafted well enough
    that drafts are accepted, against the exact target distribution (p-values against 1e-3, as the
    offline test: a false alarm rate of at most 0.2%; fixed seeds)."""
    sampling = SamplingConfig(temperature=1.0, top_k=30, top_p=0.9)
    params = SamplingParams(temperature=1.0, top_k=30, top_p=0.9)
    prompt, n = [5, 12, 40], 3000
    engine = drafting_greedily(Engine(target, heads["jetspec"], method="jetspec", slots=64, max_len=64, budget=8,
                                      width=3, chunk_steps=4, max_queue=n, stop_token_ids=(), min_batch=64), target,
                               depth=3)
    engine.start()
    try:
        handles = [engine.submit(EngineRequest(prompt, 3, dataclasses.replace(params, seed=i))) for i in range(n)]
        tokens = np.asarray([collect(h)[0] for h in handles])
        again = collect(engine.submit(EngineRequest(prompt, 3, dataclasses.replace(params, seed=17))))[0]
    finally:
        engine.shutdown()
    assert tokens.shape == (n, 3)
    assert again == tokens[17].tolist()  # a request's seed fixes its sample
    assert accepted_drafts(engine) > n // 4
    joint12, marginal3 = exact_token_distributions(target, prompt, sampling)
    v = target.cfg.vocab_size
    assert chi_square_pvalue(np.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v), joint12) > 1e-3
    assert chi_square_pvalue(np.bincount(tokens[:, 2], minlength=v), marginal3) > 1e-3


@pytest.mark.parametrize("return_early, steps", [(False, 8), (True, 1)])
def test_a_chunk_returns_when_a_slot_finishes_only_if_asked(target, return_early, steps):
    """The host asks a chunk to return after the step in which a slot finished when requests wait for
    one; otherwise the chunk runs its steps and the finished slot idles."""
    engine = Engine(target, None, method="ar", slots=2, max_len=128, chunk_steps=8, stop_token_ids=())
    greedy = SamplingParams().config()
    args, kwargs = engine._admit_call([(0, PROMPTS[0], greedy, 2, 0), (1, PROMPTS[1], greedy, 20, 0)])
    engine.slots = device.admit(*args, **kwargs)[0]
    program, args, kwargs = engine._chunk_call(None, 2, return_early)
    out = jax.device_get(program(*args, **kwargs)[1])
    assert int(out.steps) == steps and out.finished.tolist() == [True, False]
    assert out.num_tokens.tolist() == [1, steps]


def prompt_of(n: int) -> list[int]:
    return [(5 * i) % 90 + 3 for i in range(n)]


AUTO_TABLE = [(1, 4, 1.0, 2.0), (1, 8, 1.2, 2.5), (4, 4, 1.5, 2.0), (4, 8, 2.0, 2.5)]  # trees of 4 and 8, and plain


def test_cublas_chunks_give_the_same_tokens(target, heads):
    """Chunks compiled for cuBLAS (on the CPU the option changes no result, but compiling with it checks
    that this XLA knows it) give each greedy request offline generation's tokens."""
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=2, max_len=256, budget=8, width=3,
                    chunk_steps=4, stop_token_ids=(EOS,), gemm_backend="cublas").start()
    try:
        handles = [engine.submit(EngineRequest(p, m, SamplingParams())) for p, m in zip(PROMPTS[:2], LIMITS[:2])]
        results = [collect(h) for h in handles]
    finally:
        engine.shutdown()
    assert [tokens for tokens, _ in results] == offline(target, None, "ar", PROMPTS[:2], LIMITS[:2])
    with pytest.raises(ValueError, match="gemm_backend 'cudnn' is not one of xla, cublas"):
        Engine(target, heads["jetspec"], gemm_backend="cudnn")


def test_auto_gemm_backend_is_cublas_for_large_batched_steps_on_gpu(monkeypatch):
    spec = SpecConfig("jetspec", 16, 7)
    assert device.chunk_gemm_backend("auto", spec, 8) == "xla"  # not on a GPU
    monkeypatch.setattr(device.jax, "default_backend", lambda: "gpu")
    assert device.chunk_gemm_backend("auto", spec, 8) == "cublas"  # 128 tokens a step
    assert device.chunk_gemm_backend("auto", spec, 4) == "xla"
    assert device.chunk_gemm_backend("auto", None, 32) == "xla"  # AR keeps XLA's GEMMs
    assert device.chunk_gemm_backend("xla", spec, 32) == "xla"


@pytest.mark.parametrize("method", ["ar", "jetspec"])
def test_overlap_chunks_loop_a_known_number_of_steps(target, heads, method):
    """An overlapping engine's chunk is a loop of known trip count (XLA runs it on a GPU without
    reading a predicate back each step, so its launch returns before it has run); the default chunk's
    loop exits on the slots' state."""
    def loops(overlap: bool) -> list[str]:
        engine = Engine(target, heads[method], method=method, slots=2, max_len=128, budget=8, width=3,
                        chunk_steps=4, overlap=overlap)
        program = next(p for p in engine.programs() if p[0] == "chunk")
        text = engine.lower_program(program).compile().as_text()
        return [line for line in text.splitlines() if " while(" in line]

    fixed, default = loops(True), loops(False)
    assert fixed and all("known_trip_count" in line for line in fixed)
    assert any('"known_trip_count":{"n":"4"}' in line for line in fixed)  # the chunk's own loop
    assert any("known_trip_count" not in line for line in default)


def test_programs_are_every_bucket_batch_size_and_budget(target, heads, tmp_path):
    """Chunks run 1, 2, 4, ... rows up to the slots (at least min_batch), at each budget `auto` may pick;
    an admission of one prompt pads it to a multiple of 64, of a group of 2, 4 or 8 (max_admit) to 64
    times a power of two, up to the longest prompt a request may have or prefill_chunk; a longer prompt
    comes in pieces: the first, the middle ones, and the last's buckets."""
    table = cost_table(tmp_path, AUTO_TABLE)

    def programs(**kw):
        engine = Engine(target, heads["jetspec"], **dict(method="jetspec", slots=32, max_len=512, width=3) | kw)
        chunks = sorted({p[1:] for p in engine.programs() if p[0] == "chunk"})
        admits = [p[1:] for p in engine.programs() if p[0] == "admit"]
        longest = engine.max_context - 1  # prompt + one new token fit
        assert admits == [(w, 1) for w in range(64, longest + 63, 64)] + [
            (w, g) for g in (2, 4, 8) for w in (64, 128, 256, 512) if w < 2 * longest]
        assert not [p for p in engine.programs() if p[0] == "piece"]  # no prompt passes prefill_chunk (512)
        return chunks, engine.max_context

    chunks, context = programs(budget="auto", cost_table=table)
    assert chunks == [(b, r) for b in (PLAIN, 4, 8) for r in (1, 2, 4, 8, 16, 32)] and 448 < context < 512
    assert programs(budget=8, slots=12, min_batch=4)[0] == [(8, 4), (8, 8), (8, 12)]
    assert programs(budget=16, min_batch=32)[0] == [(16, 32)]
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=4, max_len=512, width=3, prefill_chunk=128)
    assert [p[1:] for p in engine.programs() if p[0] == "admit"] == [(64, 1), (128, 1), (64, 2), (128, 2), (64, 4),
                                                                      (128, 4)]
    assert [p[1:] for p in engine.programs() if p[0] == "piece"] == [(128, False, False), (128, True, False),
                                                                      (64, True, True), (128, True, True)]


@pytest.mark.parametrize("method, slots, prefill_chunk", [("jetspec", 3, 64), ("ar", 5, 512)])
def test_full_warm_up_leaves_nothing_to_compile(target, heads, tmp_path, method, slots, prefill_chunk):
    """After the full warm-up, requests of every prompt bucket (the longest prompt accepted included, in
    pieces with a prefill_chunk of 64), every batch size a chunk runs (1, 2, 3 of 3 slots; 1, 2, 4, 5 of
    5), each budget `auto` may pick (plain included), greedy and sampled, and a cancellation compile
    nothing: not one program, not one eager operation."""
    engine = Engine(target, heads[method], method=method, slots=slots, max_len=192, budget="auto", width=3,
                    chunk_steps=2, max_queue=32, cost_table=cost_table(tmp_path, AUTO_TABLE), stop_token_ids=(),
                    prefill_chunk=prefill_chunk)
    budgets = (PLAIN, 4, 8) if method == "jetspec" else (None,)
    if engine.policy is not None:  # alternate the budgets, so that each runs at each batch size
        choices = iter(budgets * 1000)
        engine.policy.choose = lambda live, batch=None: next(choices)
    engine.stats.history = []
    engine.start(warm_up=True)
    try:
        engine.warm_up.wait(timeout_check(TIMEOUT))
        assert engine.warm_up.done == engine.warm_up.total == len(engine.programs())
        assert engine.warm_up.compiled_programs >= engine.warm_up.total  # CompileWatch sees jax's compilations
        with CompileWatch() as watch:
            last = engine.max_context - 1  # the longest prompt a request may have
            widths = [p[1] for p in engine.programs() if p[0] == "admit" and p[2] == 1]
            for n in sorted({1, last} | {n for w in widths for n in (w, w + 1) if n <= last}):
                request = EngineRequest(prompt_of(n), min(6, engine.max_context - n))  # one at a time, in slot 0
                assert collect(engine.submit(request))[1].reason == "length"
            for k in range(1, slots + 1):  # k at once fill slots 0..k-1
                handles = [engine.submit(EngineRequest(prompt_of(3 + i), 16, SamplingParams(
                    temperature=0.8 * (i % 2), top_k=5 * (i % 3), seed=2**63 - 1 - i))) for i in range(k)]
                assert [collect(h)[1].reason for h in handles] == ["length"] * k
            long = engine.submit(EngineRequest(prompt_of(4), 60))
            assert isinstance(long.get(timeout=TIMEOUT), TokenEvent)
            long.cancel()
            assert collect(long)[1].reason == "cancelled"
    finally:
        engine.shutdown()
    assert watch.programs == 0 and watch.seconds == 0, watch.names
    ran = {("chunk", c["budget"], c["active"]) for c in engine.stats.history}
    assert ran == {p for p in engine.programs() if p[0] == "chunk"}
    assert engine.metrics()["compile_seconds_total"] == 0 and engine.metrics()["warm_up_seconds"] > 0


def timeout_check(seconds: float):
    deadline = time.monotonic() + seconds

    def check():
        assert time.monotonic() < deadline, f"the warm-up took over {seconds} s"
    return check


@pytest.mark.parametrize("overlap", [False, True])
def test_cancel_frees_the_slot_for_the_next_request(target, heads, overlap):
    """With overlap the cancelled request's slot is refilled while a chunk launched for it is still to
    be read: that chunk's tokens are dropped, and the next request's output is its own."""
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=1, max_len=256, budget=8, width=3,
                    chunk_steps=2, stop_token_ids=(), overlap=overlap).start()
    try:
        long = engine.submit(EngineRequest(PROMPTS[0], 200))
        waiting = engine.submit(EngineRequest(PROMPTS[1], 5))
        assert isinstance(long.get(timeout=TIMEOUT), TokenEvent)
        long.cancel()
        tokens, finish = collect(long)
        assert finish.reason == "cancelled" and len(tokens) < 200
        tokens, finish = collect(waiting)
        with pytest.raises(queue.Empty):  # nothing reached the cancelled request after its end
            long.get(timeout=0.5)
        assert finish.reason == "length" and tokens == offline(target, None, "ar", PROMPTS[1:2], [5])[0]
        assert engine.metrics()["live_slots"] == 0
    finally:
        engine.shutdown()


def test_engine_decodes_with_fused_weights_made_once(target, heads):
    """The chunk and admission programs take the decode layout as arguments (fused inside them, every
    chunk concatenated the weights again); weights already fused are used as they are, not copied."""
    engine = Engine(target, heads["jetspec"], slots=2, max_len=128, budget=8, width=3)
    layer = engine.params["layers"][0]
    assert "wqkv" in layer and "wq" not in layer
    assert engine._chunk_call(8, 2)[1][0] is engine.params
    fused = dataclasses.replace(target, params=engine.params)
    again = Engine(fused, heads["jetspec"], slots=2, max_len=128, budget=8, width=3)
    assert again.params["layers"][0]["wqkv"] is layer["wqkv"]


def test_queue_is_bounded(target, heads):
    engine = Engine(target, heads["ar"], method="ar", slots=2, max_len=128, max_queue=3)  # not started
    for _ in range(5):
        engine.submit(EngineRequest([1, 2], 4))
    # what is full, not "all 2 slots are busy": none is, the 5 requests wait in the queue
    with pytest.raises(QueueFullError, match=r"\(2 slots \+ a queue of 3\): 0 decoding and 5 queued; retry later"):
        engine.submit(EngineRequest([1, 2], 4))
    engine.shutdown()


def test_requests_cancelled_while_queued_count_as_finished(target):
    """They leave the queue before any admission (so nothing compiles here) and /metrics counts them."""
    engine = Engine(target, None, method="ar", slots=2, max_len=128)
    handles = [engine.submit(EngineRequest([1, 2], 4)) for _ in range(3)]
    for handle in handles:
        handle.cancel()
    engine.start()
    try:
        assert [collect(h)[1].reason for h in handles] == ["cancelled"] * 3
        m = engine.metrics()
        assert m["requests_finished"] == m["requests_total"] == 3 and m["queue_depth"] == 0
    finally:
        engine.shutdown()


def test_a_request_the_device_cannot_take_fails_alone(target):
    """A request that got past submit's checks with a top_k the device's int32 cannot hold (the server's
    top_k of 2**31 did, and its exception closed the engine for good) ends with an error; the requests
    admitted with it and after it are served, and the engine stays up. (One token each: they end at
    admission, so no chunk compiles.)"""
    engine = Engine(target, None, method="ar", slots=2, max_len=128, stop_token_ids=())
    good = engine.submit(EngineRequest(PROMPTS[0], 1))
    bad = [RequestHandle(EngineRequest(PROMPTS[1], 1, SamplingParams(temperature=1.0, top_k=2**31)), None),
           RequestHandle(EngineRequest(PROMPTS[2], 1, SamplingParams(temperature=1.0, seed=2**64)), None)]
    engine.pending.extend(bad)  # as if submit had not checked them
    engine.start()
    try:
        for handle, field in zip(bad, ("top_k", "seed")):
            tokens, finish = collect(handle)
            assert (tokens, finish.reason) == ([], "error") and field in finish.message
        tokens, finish = collect(good)
        assert (len(tokens), finish.reason) == (1, "length")
        tokens, finish = collect(engine.submit(EngineRequest(PROMPTS[1], 1)))
        assert (len(tokens), finish.reason) == (1, "length")
        assert engine.failure is None and engine.metrics()["requests_finished"] == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("drain", [True, False])
def test_shutdown_under_load_ends_every_request(target, heads, drain):
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=2, max_len=256, budget=8, width=3,
                    chunk_steps=2, max_queue=16, stop_token_ids=()).start()
    handles = [engine.submit(EngineRequest(p, 40)) for p in PROMPTS]
    handles[0].get(timeout=TIMEOUT)
    start = time.monotonic()
    engine.shutdown(drain=drain, timeout=120.0)
    assert time.monotonic() - start < 180.0
    reasons = [collect(h, timeout=5.0)[1].reason for h in handles]
    assert set(reasons) <= ({"length"} if drain else {"length", "cancelled"})
    if not drain:
        assert "cancelled" in reasons
    with pytest.raises(EngineClosedError):
        engine.submit(EngineRequest([1, 2], 4))


def test_bad_requests_name_the_field(target, heads):
    engine = Engine(target, heads["jetspec"], method="jetspec", slots=1, max_len=128, budget=8, width=3)
    with pytest.raises(ValueError, match="max_tokens.*exceeds the context"):
        engine.submit(EngineRequest([1] * 100, 50))
    with pytest.raises(ValueError, match="no tokens"):
        engine.submit(EngineRequest([], 5))
    with pytest.raises(ValueError, match="top_p"):
        engine.submit(EngineRequest([1], 5, SamplingParams(temperature=1.0, top_p=0.0)))
    with pytest.raises(ValueError, match="temperature"):
        engine.submit(EngineRequest([1], 5, SamplingParams(temperature=-1.0)))
    for top_k in (98, 2**31, 10**12):  # past the vocabulary of 97; 2**31 killed the device thread (int32)
        with pytest.raises(ValueError, match="^top_k must be at most the vocabulary size 97"):
            engine.submit(EngineRequest([1], 5, SamplingParams(temperature=1.0, top_k=top_k)))
    with pytest.raises(ValueError, match="^prompt: token ids"):
        engine.submit(EngineRequest([1, 97], 5))
    for seed in (-1, 2**64):  # past 64 bits: it killed the device thread
        with pytest.raises(ValueError, match=r"^seed must be in \[0, 2\*\*64\)"):
            engine.submit(EngineRequest([1], 5, SamplingParams(temperature=1.0, seed=seed)))
    with pytest.raises(ValueError, match="budget"):
        Engine(target, heads["jetspec"], method="jetspec", budget=1)
    with pytest.raises(ValueError, match="needs a draft head"):
        Engine(target, None, method="jetspec")
    engine.shutdown()
