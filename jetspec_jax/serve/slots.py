"""Device side of the server: a fixed set of sequence slots sharing one target cache and one head
context, a jitted admission (prefill a group of prompts, or a long prompt piece by piece, into free
slots' rows) and a jitted chunk of steps for every live slot, which returns after `steps` steps, or as
soon as a slot finishes when the host has requests waiting for one (a `fixed` chunk always runs
`steps`)."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jetspec_jax.autoregressive import is_stop_token, prefill
from jetspec_jax.kv_cache import SCRATCH_PAGE, KVCache, write_block
from jetspec_jax.models import qwen3
from jetspec_jax.sampling import RowSampling, keys_of_seed_words, select_tokens
from jetspec_jax.speculative import GEMM_BACKENDS, SpecConfig, speculative_cache_rows, speculative_step


class Slots(NamedTuple):
    """Every leaf has the slot axis first. Invariant per live slot, as in speculative.py: the cache
    holds every committed token but the newest (`anchor`), and the head has seen exactly those."""
    cache: KVCache
    draft: Any  # the drafter's state (the head's context), or None for AR
    anchor: jax.Array  # (S,) the newest committed token
    num: jax.Array  # (S,) tokens generated so far
    limit: jax.Array  # (S,) max_new_tokens of the slot's request
    live: jax.Array  # (S,) bool: a request is decoding in this slot
    keys: jax.Array  # (S,) the request's key: token i is drawn with fold_in(key, i)
    sampling: RowSampling
    forwards: jax.Array  # (S,) target passes (verify or decode) since admission


class ChunkOutput(NamedTuple):
    tokens: jax.Array  # (S, steps * (D + 1)) tokens committed in this chunk, per slot
    num_tokens: jax.Array  # (S,) how many of them count
    finished: jax.Array  # (S,) the slot's request ended in this chunk (EOS or its limit)
    steps: jax.Array  # () steps run
    accepted: jax.Array  # () drafts accepted over all live slots and steps (tau numerator - forwards)


def scratch_rows(spec: SpecConfig | None, depth: int) -> int:
    """Rows past a sequence's committed length that one step writes."""
    return 1 if spec is None else speculative_cache_rows(spec.budget, depth)


def new_slots(cfg: qwen3.Config, drafter, drafter_params, num_slots: int, max_len: int, dtype,
              page_size: int | None = None, num_pages: int | None = None) -> Slots:
    """Free slots over a dense cache (max_len rows a slot), or with `page_size` over a pool of
    `num_pages` pages that the host hands out (every table entry starts at the scratch page). A paged
    engine's head context is a pool of as many pages under the same table: a request's pages hold its
    rows of both (the host's pages reach the head's kernel rows too)."""
    def zeros(dtype=jnp.int32):  # a buffer per field: the chunk donates them all
        return jnp.zeros((num_slots,), dtype)

    draft = None if drafter is None else drafter.init_state(drafter_params, num_slots, max_len, dtype, page_size,
                                                            num_pages)
    cache = qwen3.new_cache(cfg, num_slots, max_len, dtype, page_size, num_pages)
    return Slots(cache=cache, draft=draft, anchor=zeros(), num=zeros(),
                 limit=zeros(), live=zeros(bool), keys=keys_of_seed_words(jnp.zeros((num_slots, 2), jnp.uint32)),
                 sampling=RowSampling(zeros(jnp.float32), zeros(), jnp.ones((num_slots,), jnp.float32)),
                 forwards=zeros())


def _set_rows(tree, indices, rows_tree):
    """tree's leaves (S, ...) get rows `indices` (R,) from rows_tree's leaves (R, ...); an index past the
    slots (a padding row) writes nothing."""
    return jax.tree.map(lambda a, r: a.at[indices].set(r.astype(a.dtype), mode="drop"), tree, rows_tree)


def _take_rows(tree, indices):
    """Rows `indices` (R,) of tree's leaves (S, ...); a padding row's index past the slots reads the last."""
    return jax.tree.map(lambda a: jnp.take(a, indices, axis=0, mode="clip"), tree)


def _without_pool(slots: Slots) -> tuple[Slots, dict | None]:
    """(slots whose every leaf has the slot axis first, the paged pools' (k, v) of the target cache and
    the head's context taken out, or None)."""
    if not slots.cache.paged:
        return slots, None
    caches = {"cache": slots.cache} | ({} if slots.draft is None else {"draft": slots.draft})
    return (slots._replace(**{name: c._replace(k=(), v=()) for name, c in caches.items()}),
            {name: (c.k, c.v) for name, c in caches.items()})


def _with_pool(slots: Slots, pool: dict | None) -> Slots:
    if pool is None:
        return slots
    return slots._replace(**{name: getattr(slots, name)._replace(k=k, v=v) for name, (k, v) in pool.items()})


def _admitted_cache(cache: KVCache, indices: jax.Array, lengths: jax.Array) -> KVCache:
    """The admitted rows' view of a slots' cache (the target's or the head's), at `lengths`: their own
    rows of a dense cache (copied out), or the shared pool with their page-table rows (a padding row's
    pages are the scratch page)."""
    if not cache.paged:
        return _take_rows(cache, indices)._replace(lengths=lengths)
    real = indices < cache.batch
    pages = jnp.where(real[:, None], jnp.take(cache.pages, indices, axis=0, mode="clip"), SCRATCH_PAGE)
    return cache._replace(lengths=lengths, pages=pages)


def _store_admitted(full: KVCache, indices: jax.Array, cache: KVCache) -> KVCache:
    """The slots' cache `full` after the admitted rows' pass wrote `cache`: the rows set back into a dense
    cache, or the pool (written in place) with the rows' lengths."""
    if not cache.paged:
        return _set_rows(full, indices, cache)
    return cache._replace(lengths=full.lengths.at[indices].set(cache.lengths, mode="drop"), pages=full.pages)


@functools.partial(jax.jit, static_argnames=("cfg", "drafter", "eos_token_ids", "resume", "final", "attention"),
                   donate_argnames=("slots",))
def admit(params, drafter_params, slots: Slots, indices: jax.Array, prompts: jax.Array, prompt_lens: jax.Array,
          seeds: jax.Array, sampling: RowSampling, limits: jax.Array, starts: jax.Array | None = None,
          pages: jax.Array | None = None, *, cfg: qwen3.Config, drafter, eos_token_ids: tuple[int, ...],
          resume: bool = False, final: bool = True, attention: str = "auto"):
    """Prefills right-padded prompts (R, P) into slots `indices` (R,) and picks their first tokens; a row
    whose index is past the slots pads the batch and changes nothing. `seeds` (R, 2) uint32 are each
    request's 64-bit seed (sampling.seed_words), its key as sampling.request_keys makes it. Returns
    (slots, first tokens (R,), finished (R,)), finished meaning the request already ended.
    A long prompt comes in pieces (chunked prefill): `resume` appends the rows' tokens to what their
    slots hold, `starts` (R,) tokens, instead of starting afresh; a piece that is not `final` only fills
    the cache and the head's context (the slot stays idle, first and finished are zeros); its piece
    attends to the cache through `attention` (kernels.attention; "auto": the kernel on GPU, which reads
    only the slot's rows so far), a first piece or whole prompt causally to itself alone.
    A paged cache takes the host's whole page table `pages` (S, pages_per_sequence) first: pages it
    handed to these rows, and the scratch page for slots whose pages it took back, so no idle slot
    writes into pages another request now holds; the head's context reads the same table. The prompts
    go straight into the pools."""
    params = qwen3.fuse_for_decode(params)
    rows, width = prompts.shape
    taps_wanted = () if drafter is None else tuple(drafter.tap_layers)
    if pages is not None:
        table = pages.astype(jnp.int32)
        slots = slots._replace(cache=slots.cache._replace(pages=table),
                               draft=None if slots.draft is None else slots.draft._replace(pages=table))
    if resume or slots.cache.paged:
        start = starts if resume else jnp.zeros((rows,), jnp.int32)
        positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None]
        admitted = _admitted_cache(slots.cache, indices, start)
        logits, taps, cache = qwen3.forward(params, prompts, positions, admitted, cfg,
                                            tap_layers=taps_wanted, logits_indices=(prompt_lens - 1)[:, None],
                                            attention_impl=attention if resume else "prefill")
        logits, cache = logits[:, 0], cache._replace(lengths=start + prompt_lens)
    else:
        logits, taps, cache = prefill(params, prompts, prompt_lens, cfg, slots.cache.max_len, tap_layers=taps_wanted)
    draft = slots.draft
    if drafter is not None:
        context = jnp.take(draft.lengths, indices, mode="clip") if resume else jnp.zeros((rows,), jnp.int32)
        state = _admitted_cache(draft, indices, context)
        if taps_wanted:
            state = drafter.observe(drafter_params, state, taps, prompt_lens)
        draft = _store_admitted(draft, indices, state)
    slots = slots._replace(cache=_store_admitted(slots.cache, indices, cache), draft=draft)
    zeros = jnp.zeros((rows,), jnp.int32)
    if not final:
        return slots, zeros, zeros.astype(bool)
    keys = keys_of_seed_words(seeds)
    first = select_tokens(logits, keys, sampling, zeros)
    finished = is_stop_token(first, eos_token_ids) | (limits <= 1)
    new = dict(anchor=first, num=jnp.ones((rows,), jnp.int32), limit=limits, live=~finished, keys=keys,
               forwards=zeros)
    slots = slots._replace(sampling=_set_rows(slots.sampling, indices, sampling),
                           **_set_rows({name: getattr(slots, name) for name in new}, indices, new))
    return slots, first, finished


def release(slots: Slots, index: int) -> Slots:
    """Ends the request in slot `index` (cancelled); its rows are overwritten by the next admission."""
    return slots._replace(live=slots.live.at[index].set(False))


def _run_chunk(params, drafter_params, slots: Slots, return_early: jax.Array, *, cfg: qwen3.Config, drafter,
               spec: SpecConfig | None, steps: int, eos_token_ids: tuple[int, ...], pad_token_id: int,
               attention: str = "auto", active: int | None = None, fixed: bool = False) -> tuple[Slots, ChunkOutput]:
    """Up to `steps` steps for the slots (speculative with `spec`, else one AR token each, with
    `attention` as the decode steps' attention; with a drafter, plain steps keep its context up to
    date). With `return_early` (a bool the host sets when requests wait for a slot) it returns after
    the step in which any slot finished, so the host can refill it. With `fixed` it runs all `steps`
    (a slot that ends idles, `return_early` is ignored): a loop of known trip count, which XLA runs on
    a GPU without reading a predicate back each step, so the launch returns at once and the host can
    queue the next chunk behind it. Only the first `active` slots run (the host keeps the live ones
    there): a light load pays for a small batch, not for every slot."""
    if active is not None and active < slots.anchor.shape[0]:
        rows, pool = _without_pool(slots)  # a paged pool is shared, not sliced
        head = _with_pool(jax.tree.map(lambda a: a[:active], rows), pool)
        head, out = _run_chunk(params, drafter_params, head, return_early, cfg=cfg, drafter=drafter, spec=spec,
                               steps=steps, eos_token_ids=eos_token_ids, pad_token_id=pad_token_id,
                               attention=attention, fixed=fixed)
        head, pool = _without_pool(head)
        return _with_pool(jax.tree.map(lambda a, h: a.at[:active].set(h), rows, head), pool), out
    params = qwen3.fuse_for_decode(params)
    depth = 0 if spec is None else spec.depth(drafter.max_depth)
    tap_layers = () if drafter is None else tuple(drafter.tap_layers)
    per_step = depth + 1
    n = slots.anchor.shape[0]
    out = jnp.full((n, steps * per_step), pad_token_id, jnp.int32)

    def step(slots: Slots):
        live, remaining = slots.live, slots.limit - slots.num
        if spec is None:
            logits, taps, cache = qwen3.forward(params, slots.anchor[:, None], slots.cache.lengths[:, None],
                                                slots.cache, cfg, tap_layers=tap_layers, attention_impl=attention)
            cache = cache.advance(live)
            if tap_layers:  # a plain step of a speculative engine: the head sees the anchor enter the cache
                slots = slots._replace(draft=drafter.observe(drafter_params, slots.draft, taps,
                                                             live.astype(jnp.int32)))
            token = select_tokens(logits[:, 0], slots.keys, slots.sampling, slots.num)
            committed = jnp.where(live, 1, 0)
            hit_eos = live & is_stop_token(token, eos_token_ids)
            tokens = jnp.where(live, token, pad_token_id)[:, None]
            slots = slots._replace(cache=cache, anchor=jnp.where(live, token, slots.anchor))
            accepted = jnp.int32(0)
        else:
            result = speculative_step(params, drafter_params, slots.anchor, slots.cache, slots.draft, live, remaining,
                                      lambda logits, depths: select_tokens(logits, slots.keys, slots.sampling,
                                                                           slots.num[:, None] + depths),
                                      cfg=cfg, drafter=drafter, spec=spec, depth=depth,
                                      eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
            committed, hit_eos, tokens = result.num_committed, result.hit_eos, result.tokens
            slots = slots._replace(cache=result.cache, draft=result.state, anchor=result.anchor)
            accepted = jnp.sum(jnp.where(live, jnp.minimum(result.accept_len, committed - 1), 0))
        num = slots.num + committed
        finished = live & (hit_eos | (num >= slots.limit))
        slots = slots._replace(num=num, live=live & ~finished,
                               forwards=slots.forwards + live.astype(jnp.int32))
        return slots, tokens, committed, finished, accepted

    def cond(carry):
        i, slots, _, _, finished, _ = carry
        return (i < steps) & ~(return_early & jnp.any(finished)) & jnp.any(slots.live)

    def body(carry):
        i, slots, out, emitted, finished, accepted = carry
        ran = jnp.any(slots.live).astype(jnp.int32)  # a fixed loop's steps after every slot ended count not
        slots, tokens, committed, newly_finished, step_accepted = step(slots)
        out = write_block(out, tokens, emitted)
        return i + ran, slots, out, emitted + committed, finished | newly_finished, accepted + step_accepted

    zeros = jnp.zeros((n,), jnp.int32)
    carry = (jnp.int32(0), slots, out, zeros, jnp.zeros((n,), bool), jnp.int32(0))
    if fixed:
        carry = lax.fori_loop(0, steps, lambda _, c: body(c), carry)
    else:
        carry = lax.while_loop(cond, body, carry)
    i, slots, out, emitted, finished, accepted = carry
    return slots, ChunkOutput(tokens=out, num_tokens=emitted, finished=finished, steps=i, accepted=accepted)


# one jitted chunk per GEMM backend (compiler options are per executable): see chunk_gemm_backend
CHUNK_PROGRAMS = {name: jax.jit(_run_chunk, static_argnames=("cfg", "drafter", "spec", "steps", "eos_token_ids",
                                                             "pad_token_id", "attention", "active", "fixed"),
                                donate_argnames=("slots",), compiler_options=options)
                  for name, options in GEMM_BACKENDS.items()}

# Verified tokens a step (rows x budget) from which cuBLAS runs the step's matmuls faster than XLA's
# Triton GEMMs on the H200: a whole batch-8 B=16 step 1.52 against 1.68 ms, batch 1 B=256 1.52 against
# 1.71; batch 1 B=64 1.30 against 1.26 (benchmarks/results/spec_step_breakdown_batch8_gemm_h200.json,
# spec_step_breakdown_gemm_*_h200.json).
CUBLAS_FROM_TOKENS = 128


def chunk_gemm_backend(setting: str, spec: SpecConfig | None, rows: int) -> str:
    """The GEMM backend of a chunk: `setting` itself unless it is "auto", which picks cuBLAS on GPU for
    speculative chunks that verify at least CUBLAS_FROM_TOKENS tokens a step (AR keeps XLA's)."""
    if setting != "auto":
        return setting
    if spec is None or jax.default_backend() != "gpu":
        return "xla"
    return "cublas" if rows * spec.budget >= CUBLAS_FROM_TOKENS else "xla"
