"""Device side of regeneration: a fixed set of decoding slots over one KV cache. Prompts are prefilled
into free slots a group at a time; jitted chunks of decode steps run every slot; between chunks the
host collects finished answers and refills their slots, so a short answer never waits for a long one.

Every answer draws from its own PRNG stream, keyed by the run's seed, the prompt's identity and the
answer's number: the same answer whatever batch, slot or order it runs in.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jetspec_jax.autoregressive import is_stop_token
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import qwen3
from jetspec_jax.sampling import SamplingConfig, filtered_logits, sample_rows_inverse_cdf


class SlotState(NamedTuple):
    cache: KVCache  # (S, R) rows per slot; a free slot has length 0, so its attention reads nothing
    last: jax.Array  # (S,) the newest token, not yet in the cache
    num: jax.Array  # (S,) tokens generated so far
    limit: jax.Array  # (S,) the answer's token limit
    live: jax.Array  # (S,) bool
    keys: jax.Array  # (S,) PRNG keys, one stream per answer
    temperature: jax.Array  # (S,) float32, 0 = greedy


def answer_key_ids(prompt_keys: Sequence[str]) -> np.ndarray:
    """A 32-bit id per prompt identity (source:id), folded into the run's key."""
    return np.array([int.from_bytes(hashlib.sha256(k.encode("utf-8")).digest()[:4], "little") for k in prompt_keys],
                    np.uint32)


def new_slot_state(cfg: qwen3.Config, num_slots: int, rows: int, dtype) -> SlotState:
    zeros = lambda dt=jnp.int32: jnp.zeros((num_slots,), dt)  # noqa: E731
    return SlotState(cache=qwen3.new_cache(cfg, num_slots, rows, dtype), last=zeros(), num=zeros(), limit=zeros(),
                     live=zeros(bool), keys=jax.random.split(jax.random.key(0), num_slots),
                     temperature=zeros(jnp.float32))


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: float) -> jax.Array:
    """logits (B, V) -> (B,): greedy rows argmax, sampled rows from softmax(logits / T) (top-p filtered)."""
    if top_p < 1.0:  # the nucleus needs a sort over the vocabulary, done once on the scaled logits
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        logits = filtered_logits(logits.astype(jnp.float32) / t, SamplingConfig(1.0, 0, top_p))  # keeps the argmax
        temperature = jnp.where(temperature > 0, 1.0, 0.0)
    return sample_rows_inverse_cdf(logits, keys, temperature)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_token_ids", "top_p"), donate_argnames=("state",))
def admit(params, state: SlotState, slot_index: jax.Array, prompts: jax.Array, prompt_lens: jax.Array,
          run_key: jax.Array, key_ids: jax.Array, samples: jax.Array, temperature: jax.Array, limit: jax.Array,
          *, cfg: qwen3.Config, eos_token_ids: tuple[int, ...], top_p: float):
    """Prefills the right-padded prompts (A, W) into slots `slot_index` (A,) (an index past the last
    slot marks a padding row, dropped) and picks each answer's first token.
    Returns (state, first tokens (A,), finished (A,))."""
    a, w = prompts.shape
    cache = qwen3.new_cache(cfg, a, w, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (a, w))
    logits, _, cache = qwen3.forward(params, prompts, positions, cache, cfg, attention_impl="prefill",
                                     logits_indices=(prompt_lens - 1)[:, None])
    keys = jax.vmap(lambda i, s: jax.random.fold_in(jax.random.fold_in(run_key, i), s))(key_ids, samples)
    split = jax.vmap(jax.random.split)(keys)
    first = choose_tokens(logits[:, 0], split[:, 1], temperature, top_p)
    finished = is_stop_token(first, eos_token_ids) | (limit <= 1)

    def put(buffer, rows):
        return buffer.at[slot_index, :w].set(rows.astype(buffer.dtype), mode="drop")

    slots = state.cache
    slots = slots._replace(k=tuple(put(b, r) for b, r in zip(slots.k, cache.k)),
                           v=tuple(put(b, r) for b, r in zip(slots.v, cache.v)),
                           lengths=slots.lengths.at[slot_index].set(jnp.where(finished, 0, prompt_lens), mode="drop"))

    def set_rows(field, values):
        return field.at[slot_index].set(values.astype(field.dtype), mode="drop")

    state = state._replace(cache=slots, last=set_rows(state.last, first), num=set_rows(state.num, jnp.ones_like(limit)),
                           limit=set_rows(state.limit, limit), live=set_rows(state.live, ~finished),
                           keys=state.keys.at[slot_index].set(split[:, 0], mode="drop"),
                           temperature=set_rows(state.temperature, temperature))
    return state, first, finished


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "eos_token_ids", "pad_token_id", "top_p", "attention"),
                   donate_argnames=("state",))
def decode_chunk(params, state: SlotState, *, cfg: qwen3.Config, steps: int, eos_token_ids: tuple[int, ...],
                 pad_token_id: int, top_p: float, attention: str = "auto"):
    """Up to `steps` decode steps for every slot (fewer once none is live). Returns (state, tokens
    (S, steps), pad where a slot was not live). A slot that finishes gets length 0 and stays free."""
    params = qwen3.fuse_for_decode(params)
    n = state.last.shape[0]

    def cond(carry):
        i, state, _ = carry
        return (i < steps) & jnp.any(state.live)

    def body(carry):
        i, state, out = carry
        live = state.live
        logits, _, cache = qwen3.forward(params, state.last[:, None], state.cache.lengths[:, None], state.cache, cfg,
                                         attention_impl=attention)
        cache = cache.advance(live)
        split = jax.vmap(jax.random.split)(state.keys)
        token = jnp.where(live, choose_tokens(logits[:, 0], split[:, 1], state.temperature, top_p), pad_token_id)
        out = out.at[:, i].set(token)
        num = state.num + live.astype(jnp.int32)
        finished = live & (is_stop_token(token, eos_token_ids) | (num >= state.limit))
        cache = cache._replace(lengths=jnp.where(finished, 0, cache.lengths))
        state = state._replace(cache=cache, last=jnp.where(live, token, state.last), num=num, live=live & ~finished,
                               keys=jnp.where(live, split[:, 0], state.keys))
        return i + 1, state, out

    out = jnp.full((n, steps), pad_token_id, jnp.int32)
    _, state, out = lax.while_loop(cond, body, (jnp.int32(0), state, out))
    return state, out


@dataclasses.dataclass(frozen=True)
class Job:
    prompt_index: int
    sample: int
    key_id: int  # answer_key_ids of the prompt
    temperature: float
    limit: int  # tokens this answer may generate


@dataclasses.dataclass
class BucketStats:
    answers: int = 0
    completion_tokens: int = 0
    decode_steps: int = 0
    chunks: int = 0
    admissions: int = 0
    seconds: float = 0.0


def run_bucket(params, cfg: qwen3.Config, jobs: Sequence[Job], prompt_ids: Sequence[Sequence[int]], *,
               width: int, rows: int, num_slots: int, admit_rows: int, chunk_steps: int, run_key: jax.Array,
               eos_token_ids: tuple[int, ...], pad_token_id: int, top_p: float, attention: str,
               on_answer: Callable[[Job, list[int], bool], None], deadline: float = float("inf")) -> BucketStats:
    """Generates every job (prompts no longer than `width`) through `num_slots` slots of `rows` cache
    rows; calls on_answer(job, tokens, finished_by_eos) as each answer ends. Stops early at `deadline`
    (time.perf_counter()), dropping the answers still decoding."""
    stats = BucketStats()
    start = time.perf_counter()
    state = new_slot_state(cfg, num_slots, rows, params["embed"].dtype)
    queue = list(reversed(jobs))  # pop() takes them in order
    owner: list[Job | None] = [None] * num_slots
    answer = np.zeros((num_slots, rows), np.int32)  # host copy of each slot's tokens so far
    count = np.zeros((num_slots,), np.int64)
    eos = set(eos_token_ids)

    def finish(slot: int) -> None:
        job, tokens = owner[slot], answer[slot, :count[slot]].tolist()
        owner[slot] = None
        stats.answers += 1
        stats.completion_tokens += len(tokens)
        on_answer(job, tokens, bool(tokens) and tokens[-1] in eos)

    while queue or any(o is not None for o in owner):
        if time.perf_counter() > deadline:
            break
        free = [s for s, o in enumerate(owner) if o is None]
        live = num_slots - len(free)
        # Admit in full groups; a partial group only when nothing else would run.
        while queue and (len(free) >= admit_rows or (live == 0 and free)):
            group, free = free[:admit_rows], free[admit_rows:]
            batch = [queue.pop() for _ in range(min(len(group), len(queue)))]
            group = group[:len(batch)]
            padded_slots = np.full((admit_rows,), num_slots, np.int32)  # past the end: dropped
            padded_slots[:len(group)] = group
            tokens = np.full((admit_rows, width), pad_token_id, np.int32)
            lens = np.ones((admit_rows,), np.int32)
            fields = np.zeros((4, admit_rows), np.float64)  # key id, sample, temperature, limit
            for r, job in enumerate(batch):
                ids = prompt_ids[job.prompt_index]
                tokens[r, :len(ids)] = ids
                lens[r] = len(ids)
                fields[:, r] = (job.key_id, job.sample, job.temperature, job.limit)
            fields[3, len(batch):] = 1
            state, first, done = admit(params, state, jnp.asarray(padded_slots), jnp.asarray(tokens), jnp.asarray(lens),
                                       run_key, jnp.asarray(fields[0].astype(np.uint32)),
                                       jnp.asarray(fields[1].astype(np.int32)), jnp.asarray(fields[2], jnp.float32),
                                       jnp.asarray(fields[3].astype(np.int32)), cfg=cfg, eos_token_ids=eos_token_ids,
                                       top_p=top_p)
            first, done = np.asarray(first), np.asarray(done)
            stats.admissions += 1
            for r, (slot, job) in enumerate(zip(group, batch)):
                owner[slot], answer[slot, 0], count[slot] = job, first[r], 1
                if done[r]:
                    finish(slot)
                    free.append(slot)
            live = sum(o is not None for o in owner)
        if live == 0:
            continue
        was_live = np.array([o is not None for o in owner])
        state, out = decode_chunk(params, state, cfg=cfg, steps=chunk_steps, eos_token_ids=eos_token_ids,
                                  pad_token_id=pad_token_id, top_p=top_p, attention=attention)
        out, num, now_live = np.asarray(out), np.asarray(state.num), np.asarray(state.live)
        stats.chunks += 1
        new = np.where(was_live, num - count, 0)
        stats.decode_steps += int(new.max(initial=0))
        slot, step = np.nonzero(np.arange(chunk_steps)[None, :] < new[:, None])  # vectorised: 1000s of slots
        answer[slot, count[slot] + step] = out[slot, step]
        count = np.where(was_live, num, count)
        for s in np.flatnonzero(was_live & ~now_live):
            finish(s)
    stats.seconds = time.perf_counter() - start
    return stats
