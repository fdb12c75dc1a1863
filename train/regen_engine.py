"""Device side of regeneration: a fixed set of decoding slots over one KV cache. Prompts are prefilled
into free slots a group at a time; jitted chunks of decode steps run every slot; between chunks the
host collects finished answers and refills their slots, so a short answer never waits for a long one.

The answers of one prompt (a greedy and sampled ones) share one copy of the prompt's keys and values:
a step attends to its prompt's rows, read once for all of that prompt's answers, and to the answer's
own rows, and merges the two by their log-sum-exps. A long prompt's answers so read (and prefill) its
cache once instead of once each, and more of them fit in the same memory.

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
from jetspec_jax.compilation import compile_all
from jetspec_jax.kernels.tree_attention import combine_partials, tree_attention_with_lse
from jetspec_jax.kv_cache import KVCache, write_block
from jetspec_jax.models import qwen3
from jetspec_jax.sampling import RowSampling, filtered_logits, sample_rows_inverse_cdf


class SlotState(NamedTuple):
    prompts: KVCache  # (P, Wp) each live prompt's rows, once; length 0 once none of its answers is live
    answers: KVCache  # (S, A) each answer's own rows; a free slot has length 0, so its attention reads nothing
    prompt_of: jax.Array  # (S,) the prompt slot an answer slot reads
    member_of: jax.Array  # (S,) its column in `members`
    members: jax.Array  # (P, K) the answer slots reading a prompt slot (unused entries: any slot, never read back)
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


def new_slot_state(cfg: qwen3.Config, num_slots: int, answer_rows: int, prompt_slots: int, prompt_rows: int,
                   answers_per_prompt: int, dtype) -> SlotState:
    zeros = lambda dt=jnp.int32: jnp.zeros((num_slots,), dt)  # noqa: E731
    return SlotState(prompts=qwen3.new_cache(cfg, prompt_slots, prompt_rows, dtype),
                     answers=qwen3.new_cache(cfg, num_slots, answer_rows, dtype), prompt_of=zeros(),
                     member_of=zeros(), members=jnp.zeros((prompt_slots, answers_per_prompt), jnp.int32),
                     last=zeros(), num=zeros(), limit=zeros(), live=zeros(bool),
                     keys=jax.random.split(jax.random.key(0), num_slots), temperature=zeros(jnp.float32))


def round_up_64(n: int) -> int:
    """Cache rows come in multiples of 64, the attention kernel's key block."""
    return -(-n // 64) * 64


def prompt_rows_for(width: int, answers_per_prompt: int) -> int:
    """Cache rows of a prompt slot: the prompt, then room the attention kernel reads past it (one row
    per answer, as tree nodes that nothing sees), rounded to 64."""
    return round_up_64(width + answers_per_prompt)


def choose_tokens(logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_p: float) -> jax.Array:
    """logits (B, V) -> (B,): greedy rows argmax, sampled rows from softmax(logits / T) (top-p filtered)."""
    if top_p < 1.0:  # the nucleus needs a sort over the vocabulary, done once on the scaled logits
        t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        rows = RowSampling(jnp.ones_like(temperature), jnp.zeros(temperature.shape, jnp.int32),
                           jnp.full(temperature.shape, top_p, jnp.float32))
        logits = filtered_logits(logits.astype(jnp.float32) / t, rows)  # keeps the argmax
        temperature = jnp.where(temperature > 0, 1.0, 0.0)
    return sample_rows_inverse_cdf(logits, keys, temperature)


@functools.partial(jax.jit, static_argnames=("cfg", "eos_token_ids", "top_p"), donate_argnames=("state",))
def admit(params, state: SlotState, prompt_slot: jax.Array, prompts: jax.Array, prompt_lens: jax.Array,
          answer_slot: jax.Array, run_key: jax.Array, key_ids: jax.Array, samples: jax.Array, temperature: jax.Array,
          limit: jax.Array, *, cfg: qwen3.Config, eos_token_ids: tuple[int, ...], top_p: float):
    """Prefills the right-padded prompts (A, W) once each into prompt slots `prompt_slot` (A,) and
    starts their answers in answer slots `answer_slot` (A, K), picking each answer's first token.
    An index past the last slot marks a padding row or answer, dropped. samples, temperature, limit:
    (A, K). Returns (state, first tokens (A, K), finished (A, K))."""
    a, w = prompts.shape
    k = answer_slot.shape[1]
    num_slots = state.live.shape[0]
    cache = qwen3.new_cache(cfg, a, w, params["embed"].dtype)
    positions = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (a, w))
    logits, _, cache = qwen3.forward(params, prompts, positions, cache, cfg, attention_impl="prefill",
                                     logits_indices=(prompt_lens - 1)[:, None])
    keys = jax.vmap(lambda i, row: jax.vmap(lambda s: jax.random.fold_in(jax.random.fold_in(run_key, i), s))(row))(
        key_ids, samples).reshape(-1)
    split = jax.vmap(jax.random.split)(keys)
    first = choose_tokens(jnp.repeat(logits[:, 0], k, axis=0), split[:, 1], temperature.reshape(-1), top_p)
    slots, limit = answer_slot.reshape(-1), limit.reshape(-1)
    finished = is_stop_token(first, eos_token_ids) | (limit <= 1)
    alive = ~finished & (slots < num_slots)
    prompt_alive = jnp.any(alive.reshape(a, k), axis=1)

    def put(buffer, rows):
        return buffer.at[prompt_slot, :w].set(rows.astype(buffer.dtype), mode="drop")

    shared = state.prompts
    shared = shared._replace(k=tuple(put(b, r) for b, r in zip(shared.k, cache.k)),
                             v=tuple(put(b, r) for b, r in zip(shared.v, cache.v)),
                             lengths=shared.lengths.at[prompt_slot].set(jnp.where(prompt_alive, prompt_lens, 0),
                                                                        mode="drop"))
    members = state.members.at[prompt_slot].set(jnp.minimum(answer_slot, num_slots - 1), mode="drop")

    def set_rows(field, values):
        return field.at[slots].set(values.astype(field.dtype), mode="drop")

    answers = state.answers._replace(lengths=set_rows(state.answers.lengths, jnp.zeros_like(slots)))
    state = state._replace(prompts=shared, members=members, answers=answers,
                           prompt_of=set_rows(state.prompt_of, jnp.repeat(prompt_slot, k)),
                           member_of=set_rows(state.member_of, jnp.tile(jnp.arange(k), a)),
                           last=set_rows(state.last, first), num=set_rows(state.num, jnp.ones_like(limit)),
                           limit=set_rows(state.limit, limit), live=set_rows(state.live, alive),
                           keys=state.keys.at[slots].set(split[:, 0], mode="drop"),
                           temperature=set_rows(state.temperature, temperature.reshape(-1)))
    return state, first.reshape(a, k), finished.reshape(a, k)


def shared_prompt_forward(params, state: SlotState, cfg: qwen3.Config, attention: str):
    """One decode step of every answer slot: its `last` token at position prompt length + answer
    length attends to its prompt's rows (one kernel call per prompt slot, its answers' queries
    together, so the prompt is read once) and to its own rows, merged by log-sum-exp.
    Returns (logits (S, V) fp32, the answers' cache with this step's keys and values written)."""
    answers, prompts = state.answers, state.prompts
    tokens = state.last[:, None]
    positions = (prompts.lengths[state.prompt_of] + answers.lengths)[:, None]
    x = params["embed"][tokens].astype(params["embed"].dtype)
    cos, sin = qwen3.rope_tables(positions, qwen3.rope_inverse_frequencies(cfg))
    sees_itself = jnp.ones((tokens.shape[0], 1, 1), jnp.uint32)
    sees_no_node = jnp.zeros(state.members.shape + (1,), jnp.uint32)
    new_k, new_v = list(answers.k), list(answers.v)
    for i, layer in enumerate(params["layers"]):
        q, k, v = qwen3.attention_inputs(x, layer, cfg, cos, sin)
        new_k[i] = write_block(new_k[i], k, answers.lengths)
        new_v[i] = write_block(new_v[i], v, answers.lengths)
        own, own_lse = tree_attention_with_lse(q, new_k[i], new_v[i], answers.lengths, sees_itself,
                                               implementation=attention)
        shared, shared_lse = tree_attention_with_lse(q[:, 0][state.members], prompts.k[i], prompts.v[i],
                                                     prompts.lengths, sees_no_node, implementation=attention)
        shared = shared[state.prompt_of, state.member_of][:, None]
        shared_lse = shared_lse[state.prompt_of, state.member_of][:, None]
        attn = combine_partials([own, shared], [own_lse, shared_lse]).astype(x.dtype)
        x = qwen3.finish_layer(x, attn, layer, cfg, i)
    logits = qwen3.lm_logits(params, qwen3.rms_norm(x, params["final_norm"], cfg.rms_norm_eps), cfg)
    return logits[:, 0], answers._replace(k=tuple(new_k), v=tuple(new_v))


@functools.partial(jax.jit, static_argnames=("cfg", "steps", "eos_token_ids", "pad_token_id", "top_p", "attention"),
                   donate_argnames=("state",))
def decode_chunk(params, state: SlotState, *, cfg: qwen3.Config, steps: int, eos_token_ids: tuple[int, ...],
                 pad_token_id: int, top_p: float, attention: str = "auto"):
    """Up to `steps` decode steps for every slot (fewer once none is live). Returns (state, tokens
    (S, steps), pad where a slot was not live). A slot that finishes gets length 0 and stays free; a
    prompt slot gets length 0 once none of its answers is live."""
    params = qwen3.fuse_for_decode(params)
    n = state.last.shape[0]

    def cond(carry):
        i, state, _ = carry
        return (i < steps) & jnp.any(state.live)

    def body(carry):
        i, state, out = carry
        live = state.live
        logits, answers = shared_prompt_forward(params, state, cfg, attention)
        answers = answers.advance(live)
        split = jax.vmap(jax.random.split)(state.keys)
        token = jnp.where(live, choose_tokens(logits, split[:, 1], state.temperature, top_p), pad_token_id)
        out = out.at[:, i].set(token)
        num = state.num + live.astype(jnp.int32)
        finished = live & (is_stop_token(token, eos_token_ids) | (num >= state.limit))
        live = live & ~finished
        prompt_live = jnp.zeros(state.members.shape[0], jnp.int32).at[state.prompt_of].max(live.astype(jnp.int32)) > 0
        state = state._replace(answers=answers._replace(lengths=jnp.where(finished, 0, answers.lengths)),
                               prompts=state.prompts._replace(lengths=jnp.where(prompt_live, state.prompts.lengths, 0)),
                               last=jnp.where(state.live, token, state.last), num=num, live=live,
                               keys=jnp.where(state.live, split[:, 0], state.keys))
        return i + 1, state, out

    out = jnp.full((n, steps), pad_token_id, jnp.int32)
    _, state, out = lax.while_loop(cond, body, (jnp.int32(0), state, out))
    return state, out


class BucketPrograms(NamedTuple):
    """A bucket's two device programs, called as admit(params, state, ...) and decode_chunk(params, state)
    with the run's static settings bound: jitted (compiled at the first call) or compiled ahead."""
    admit: Callable
    decode_chunk: Callable


@dataclasses.dataclass(frozen=True)
class StaticSettings:
    """What the programs are specialised on besides the shapes."""
    cfg: qwen3.Config
    chunk_steps: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    top_p: float
    attention: str

    def admit_kwargs(self) -> dict:
        return dict(cfg=self.cfg, eos_token_ids=self.eos_token_ids, top_p=self.top_p)

    def chunk_kwargs(self) -> dict:
        return dict(cfg=self.cfg, steps=self.chunk_steps, eos_token_ids=self.eos_token_ids,
                    pad_token_id=self.pad_token_id, top_p=self.top_p, attention=self.attention)

    def jitted(self) -> BucketPrograms:
        return BucketPrograms(functools.partial(admit, **self.admit_kwargs()),
                              functools.partial(decode_chunk, **self.chunk_kwargs()))


def lower_program(name: str, params, static: StaticSettings, run_key: jax.Array, *, width: int, answer_rows: int,
                  num_slots: int, prompt_slots: int, answers_per_prompt: int, admit_prompts: int) -> jax.stages.Lowered:
    """One of a bucket's programs (`name`: a BucketPrograms field) lowered for the arguments run_bucket
    gives it."""
    k, a = answers_per_prompt, admit_prompts
    state = jax.eval_shape(lambda: new_slot_state(static.cfg, num_slots, answer_rows, prompt_slots,
                                                  prompt_rows_for(width, k), k, params["embed"].dtype))
    if name == "decode_chunk":
        return decode_chunk.lower(params, state, **static.chunk_kwargs())
    shape = jax.ShapeDtypeStruct
    args = (shape((a,), jnp.int32), shape((a, width), jnp.int32), shape((a,), jnp.int32), shape((a, k), jnp.int32),
            run_key, shape((a,), jnp.uint32), shape((a, k), jnp.int32), shape((a, k), jnp.float32),
            shape((a, k), jnp.int32))
    return admit.lower(params, state, *args, **static.admit_kwargs())


def compile_buckets(params, static: StaticSettings, run_key: jax.Array, layouts: dict[int, dict], workers: int,
                    answers_per_prompt: int) -> dict[int, BucketPrograms]:
    """Every bucket's programs (layouts: prompt width -> run_bucket's slot layout) compiled before any
    runs, `workers` at a time (compiled at their first calls, bucket after bucket, they took a quarter
    of a whole-corpus run on an H200)."""
    done = compile_all([(width, name) for width in layouts for name in BucketPrograms._fields],
                       lambda item: lower_program(item[1], params, static, run_key, width=item[0],
                                                  answers_per_prompt=answers_per_prompt, **layouts[item[0]]),
                       workers)
    return {width: BucketPrograms(*(done[(width, name)] for name in BucketPrograms._fields)) for width in layouts}


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
    admission_seconds: float = 0.0  # prefill calls, from launch to their first tokens on the host
    chunk_seconds: float = 0.0  # decode chunks, from launch to their tokens on the host; the rest is the host's


def group_by_prompt(jobs: Sequence[Job], answers_per_prompt: int) -> list[list[Job]]:
    """Consecutive jobs of one prompt, up to `answers_per_prompt` a group (1: every answer alone)."""
    groups: list[list[Job]] = []
    for job in jobs:
        if groups and groups[-1][0].prompt_index == job.prompt_index and len(groups[-1]) < answers_per_prompt:
            groups[-1].append(job)
        else:
            groups.append([job])
    return groups


def run_bucket(params, cfg: qwen3.Config, jobs: Sequence[Job], prompt_ids: Sequence[Sequence[int]], *,
               width: int, answer_rows: int, num_slots: int, prompt_slots: int, answers_per_prompt: int,
               admit_prompts: int, chunk_steps: int, run_key: jax.Array, eos_token_ids: tuple[int, ...],
               pad_token_id: int, top_p: float, attention: str, on_answer: Callable[[Job, list[int], bool], None],
               deadline: float = float("inf"), programs: BucketPrograms | None = None) -> BucketStats:
    """Generates every job (prompts no longer than `width`) through `num_slots` answer slots of
    `answer_rows` rows and `prompt_slots` prompt slots, the jobs of one prompt (consecutive in `jobs`,
    up to `answers_per_prompt`) sharing one; calls on_answer(job, tokens, finished_by_eos) as each
    answer ends. Stops early at `deadline` (time.perf_counter()), dropping the answers still decoding.
    `programs`: this bucket's from compile_buckets (default: jitted, compiled at their first call)."""
    if programs is None:
        programs = StaticSettings(cfg, chunk_steps, tuple(eos_token_ids), pad_token_id, top_p, attention).jitted()
    stats = BucketStats()
    start = time.perf_counter()
    k = answers_per_prompt
    state = new_slot_state(cfg, num_slots, answer_rows, prompt_slots, prompt_rows_for(width, k), k,
                           params["embed"].dtype)
    queue = list(reversed(group_by_prompt(jobs, k)))  # the next group is the last
    owner: list[Job | None] = [None] * num_slots
    live = np.zeros((num_slots,), bool)  # owner[s] is not None, for whole-array tests over 1000s of slots
    prompt_of = np.zeros((num_slots,), np.int64)
    readers = np.zeros((prompt_slots,), np.int64)  # live answers of each prompt slot; 0 = free
    answer = np.zeros((num_slots, answer_rows), np.int32)  # host copy of each slot's tokens so far
    count = np.zeros((num_slots,), np.int64)
    eos = set(eos_token_ids)

    def finish(slot: int) -> None:
        job, tokens = owner[slot], answer[slot, :count[slot]].tolist()
        owner[slot], live[slot] = None, False
        readers[prompt_of[slot]] -= 1
        stats.answers += 1
        stats.completion_tokens += len(tokens)
        on_answer(job, tokens, bool(tokens) and tokens[-1] in eos)

    while queue or live.any():
        if time.perf_counter() > deadline:
            break
        while queue:
            # Admit in full groups; a partial group only when nothing else would run.
            free = np.flatnonzero(~live).tolist()
            free_prompts = np.flatnonzero(readers == 0).tolist()
            batch, needed = [], 0
            for group in reversed(queue):
                if len(batch) == min(admit_prompts, len(free_prompts)) or needed + len(group) > len(free):
                    break
                batch.append(group)
                needed += len(group)
            if not batch or (len(batch) < min(admit_prompts, len(queue)) and live.any()):
                break
            del queue[len(queue) - len(batch):]
            padded_prompts = np.full((admit_prompts,), prompt_slots, np.int32)  # past the end: dropped
            padded_prompts[:len(batch)] = free_prompts[:len(batch)]
            slots = np.full((admit_prompts, k), num_slots, np.int32)
            tokens = np.full((admit_prompts, width), pad_token_id, np.int32)
            lens = np.ones((admit_prompts,), np.int32)
            key_ids = np.zeros((admit_prompts,), np.uint32)
            fields = np.zeros((3, admit_prompts, k), np.float64)  # sample, temperature, limit
            fields[2] = 1
            taken = iter(free)
            for r, group in enumerate(batch):
                ids = prompt_ids[group[0].prompt_index]
                tokens[r, :len(ids)] = ids
                lens[r], key_ids[r] = len(ids), group[0].key_id
                for c, job in enumerate(group):
                    slots[r, c] = next(taken)
                    fields[:, r, c] = (job.sample, job.temperature, job.limit)
            launched = time.perf_counter()
            state, first, done = programs.admit(
                params, state, jnp.asarray(padded_prompts), jnp.asarray(tokens), jnp.asarray(lens),
                jnp.asarray(slots), run_key, jnp.asarray(key_ids), jnp.asarray(fields[0].astype(np.int32)),
                jnp.asarray(fields[1], jnp.float32), jnp.asarray(fields[2].astype(np.int32)))
            first, done = np.asarray(first), np.asarray(done)
            stats.admissions += 1
            stats.admission_seconds += time.perf_counter() - launched
            for r, group in enumerate(batch):
                for c, job in enumerate(group):
                    slot = int(slots[r, c])
                    owner[slot], prompt_of[slot], answer[slot, 0], count[slot] = job, padded_prompts[r], first[r, c], 1
                    live[slot] = True
                    readers[padded_prompts[r]] += 1
                    if done[r, c]:
                        finish(slot)
        if not live.any():
            continue
        was_live = live.copy()
        launched = time.perf_counter()
        state, out = programs.decode_chunk(params, state)
        out, num, now_live = np.asarray(out), np.asarray(state.num), np.asarray(state.live)
        stats.chunks += 1
        stats.chunk_seconds += time.perf_counter() - launched
        new = np.where(was_live, num - count, 0)
        stats.decode_steps += int(new.max(initial=0))
        slot, step = np.nonzero(np.arange(chunk_steps)[None, :] < new[:, None])  # vectorised: 1000s of slots
        answer[slot, count[slot] + step] = out[slot, step]
        count = np.where(was_live, num, count)
        for s in np.flatnonzero(was_live & ~now_live):
            finish(s)
    stats.seconds = time.perf_counter() - start
    return stats
