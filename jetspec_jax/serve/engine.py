"""The serving engine: requests are admitted into free slots and leave when done, so a finished
sequence never waits for others. One thread drives the device: it admits queued requests between
chunks, runs a jitted chunk of steps for every live slot (slots.py), and hands each request its
committed tokens as they come. The HTTP layer (http_server.py) only talks to `Engine`."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from jetspec_jax.kv_cache import check_page_size
from jetspec_jax.models import qwen3
from jetspec_jax.sampling import RowSampling, SamplingConfig, seed_words
from jetspec_jax.serve import slots as device
from jetspec_jax.serve.budget import PLAIN, BudgetPolicy, load_bucket
from jetspec_jax.serve.pages import PageBook
from jetspec_jax.serve.warmup import WarmUp
from jetspec_jax.speculative import METHODS, HeadDrafter, SpecConfig, check_gemm_backend
from jetspec_jax.tokens import pad_token, stop_tokens

log = logging.getLogger(__name__)

PROMPT_BUCKET = 64  # prompts are padded to a multiple of this: one admission program per bucket


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None  # None: a fresh seed per request

    def config(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)  # validates the values


@dataclasses.dataclass(frozen=True)
class EngineRequest:
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    request_id: str = ""


class TokenEvent(NamedTuple):
    token_ids: list[int]


class FinishEvent(NamedTuple):
    reason: str  # "stop" (a stop token), "length" (max_new_tokens), "cancelled" or "error"
    prompt_tokens: int
    completion_tokens: int
    message: str | None = None


class QueueFullError(RuntimeError):
    """Every slot is busy and the queue is at its bound: the client should retry later (HTTP 429)."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class EngineFailedError(EngineClosedError):
    """The device thread died (Engine.failure says why): nothing more can be served (HTTP 503)."""


class RequestHandle:
    """A submitted request's stream of events; `next()` for asyncio callers, `get()` for threads."""

    def __init__(self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None):
        self.request = request
        self.loop = loop
        self._events: asyncio.Queue | queue.Queue = asyncio.Queue() if loop is not None else queue.Queue()
        self.cancelled = threading.Event()
        self.completion_tokens = 0
        self.target_forwards = 0  # verify passes (AR: decode steps) while in a slot; read after the FinishEvent
        self.finished = False

    def post(self, event) -> None:
        if isinstance(event, TokenEvent):
            self.completion_tokens += len(event.token_ids)
        if self.loop is None:
            self._events.put(event)
            return
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the client's event loop is gone
            self.cancelled.set()

    def finish(self, reason: str, message: str | None = None) -> bool:
        """Posts the FinishEvent; False if the request had finished already."""
        if self.finished:
            return False
        self.finished = True
        self.post(FinishEvent(reason, len(self.request.prompt_ids), self.completion_tokens, message))
        return True

    async def next(self):
        return await self._events.get()

    def get(self, timeout: float | None = None):
        return self._events.get(timeout=timeout)

    def cancel(self) -> None:
        """Ends the request at the next chunk boundary and frees its slot."""
        self.cancelled.set()


class Engine:
    def __init__(self, target, head=None, *, method: str = "jetspec", slots: int = 8, max_len: int = 2048,
                 budget: int | str = 64, width: int = 7, chunk_steps: int = 8, max_queue: int = 64,
                 cost_table: str | None = None, stop_token_ids: tuple[int, ...] | None = None,
                 attention: str = "auto", min_batch: int = 1, max_depth: int | None = None,
                 tree_temperature: float = 1.0, draft_attention: str = "auto", gemm_backend: str = "auto",
                 max_admit: int = 8, overlap: bool = False, prefill_chunk: int = 512,
                 page_size: int | None = None, kv_pages: int | None = None):
        """`slots` sequences decode at once; chunks run the first 1, 2, 4, ... of them that hold the live
        ones (one compiled program per size; `min_batch` sets the smallest). `max_len` rows of cache
        per slot bound prompt + max_new_tokens; `budget` is a tree size or "auto" (budget.py);
        `max_depth` and `tree_temperature` are SpecConfig's, `draft_attention` HeadDrafter's; `gemm_backend`
        is a speculative.GEMM_BACKENDS name or "auto" (device.chunk_gemm_backend: per chunk size).
        Up to `max_admit` queued prompts are prefilled in one call. A prompt longer than `prefill_chunk`
        tokens (a multiple of PROMPT_BUCKET) is prefilled a piece of that many tokens between chunks, so
        the slots decoding meanwhile wait for one piece at a time, never for the whole prompt.
        With `overlap` the device thread launches the next chunk before it reads the last one's tokens,
        and chunks run all their steps (slots.py's `fixed`): a loop whose exit depends on the slots reads
        its predicate back to the host every step on a GPU, so its launch would return only once it had
        run, while a loop of known trip count returns at once and the host's work between chunks
        overlaps the device's. A slot that ends then idles to the end of its chunk and the one launched
        behind it.
        With `page_size` the target's cache (and the head's context, under the same page table) is one
        pool of `kv_pages` pages of that many rows (default: as many rows as the dense cache, slots x
        max_len) that requests share (kv_cache.KVCache, pages.py):
        a request holds the pages its prompt + max_tokens can reach, so a large `max_len` costs memory
        only for the requests that use it, and one waits in the queue while too few pages are free.
        The engine decodes with the target's weights in the decode layout (qwen3.fuse_for_decode): a copy,
        unless they are fused already (the server fuses them before it builds the engine)."""
        if method != "ar" and method not in METHODS:
            raise ValueError(f"method {method!r} is not one of {('ar',) + METHODS}")
        if method != "ar" and head is None:
            raise ValueError(f"method {method!r} needs a draft head")
        if gemm_backend != "auto":
            check_gemm_backend(gemm_backend)
        self.gemm_backend = gemm_backend
        for name, value in (("slots", slots), ("chunk_steps", chunk_steps), ("max_queue", max_queue),
                            ("max_admit", max_admit)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1 or prefill_chunk % PROMPT_BUCKET:
            raise ValueError(f"prefill_chunk must be a positive multiple of {PROMPT_BUCKET} tokens, got "
                             f"{prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        self.target, self.method, self.num_slots, self.chunk_steps = target, method, slots, chunk_steps
        self.max_queue, self.attention, self.min_batch = max_queue, attention, min_batch
        self.max_admit, self.overlap = min(max_admit, slots), overlap
        self.width, self.max_depth, self.tree_temperature = width, max_depth, tree_temperature
        self.eos_token_ids = tuple(stop_token_ids) if stop_token_ids is not None else stop_tokens(target)
        self.pad_token_id = pad_token(target)
        dtype = target.params["embed"].dtype
        # the decode layout (q/k/v and gate/up concatenated) once: fused inside the programs, the 60
        # concatenations ran in every chunk and admission (21 us of a 1.2 ms step, serve_chunk_profile)
        self.params = qwen3.fuse_for_decode(target.params)  # passes already fused weights through
        specs = []
        if method == "ar":
            self.drafter, self.head_params, self.policy = None, None, None
        else:
            head_cfg, self.head_params = head
            self.drafter = HeadDrafter(head_cfg, target.cfg, attention_impl=draft_attention)
            self.policy = BudgetPolicy.create(budget, width, slots, target, cost_table, method)
            specs = [self.spec(b) for b in self.policy.budgets if b != PLAIN]
            self.drafter = self.drafter.for_specs(specs)  # jetspec-tc's rows
        scratch = max([1] + [device.scratch_rows(s, s.depth(self.drafter.max_depth)) for s in specs])  # validates
        if page_size is not None:
            check_page_size(page_size)
            if self.drafter is not None:  # the head's context shares a request's pages: its kernel rows too
                scratch = max(scratch, self.drafter.kernel_rows)
        elif kv_pages is not None:
            raise ValueError("kv_pages sizes a paged cache: give page_size too")
        align = max(64, page_size or 0)  # whole pages of a slot's rows (both powers of two)
        rows = -(-max_len // align) * align
        if rows > target.cfg.max_position_embeddings + scratch:
            rows = -(-(target.cfg.max_position_embeddings + scratch) // align) * align
        self.max_len, self.scratch = rows, scratch
        self.max_context = min(rows - scratch, target.cfg.max_position_embeddings)
        self.pages = None
        if page_size is not None:
            per_slot = rows // page_size
            kv_pages = slots * per_slot + 1 if kv_pages is None else kv_pages
            self.pages = PageBook(kv_pages, slots, per_slot, page_size)
            # a request must fit the pool alone (with a step's scratch rows), or it would wait forever
            self.max_context = min(self.max_context, self.pages.usable * page_size - scratch)
            if self.max_context < 2:
                raise ValueError(f"kv_pages={kv_pages} holds {self.pages.usable * page_size} rows, too few for a "
                                 f"prompt, a new token and a step's {scratch} scratch rows; give more pages")
        self.slots = device.new_slots(target.cfg, self.drafter, self.head_params, slots, rows, dtype,
                                      page_size, kv_pages)
        self.owner: list[RequestHandle | None] = [None] * slots
        # slot -> (its admission row, prompt tokens in its cache) for a prompt that comes in pieces
        self.prefilling: dict[int, tuple[tuple, int]] = {}
        self.pending: collections.deque[RequestHandle] = collections.deque()
        self.lock = threading.Condition()
        self.closing, self.drain, self.deadline = False, True, math.inf
        self.compiled: set = set()  # programs run so far (see programs())
        self.last_ready = 0.0  # perf_counter when the last chunk was read
        self.thread: threading.Thread | None = None
        self.failure: str | None = None  # why the device thread died, if it did: the engine serves no more
        self.warm_up: WarmUp | None = None
        self.stats = EngineStats()

    def spec(self, budget: int | None) -> SpecConfig | None:
        """The speculative step of a chunk at `budget`; None for a plain decoding chunk (method "ar", or
        the auto policy's PLAIN arm, whose steps also keep the head's context up to date)."""
        if self.method == "ar" or budget in (None, PLAIN):
            return None
        return SpecConfig(self.method, budget, self.width, self.max_depth, self.attention,
                          tree_temperature=self.tree_temperature)

    # -- programs ------------------------------------------------------------------------------

    def prompt_width(self, prompt_len: int, rows: int = 1) -> int:
        """Columns of the admission program that prefills `rows` prompts, the longest `prompt_len` tokens: a
        multiple of PROMPT_BUCKET for one prompt, a power-of-two multiple for a group (fewer programs)."""
        buckets = -(-prompt_len // PROMPT_BUCKET)
        if rows > 1:
            buckets = 1 << (buckets - 1).bit_length()
        return min(buckets * PROMPT_BUCKET, self.max_len)

    def admission_rows(self, requests: int) -> int:
        """Rows of the admission program for a group of `requests` (at most max_admit): a power of two."""
        return 1 << (requests - 1).bit_length()

    def chunk_rows(self, live_top: int) -> int:
        """Slot rows a chunk runs while the highest live slot is number `live_top` - 1 (admission fills
        the lowest free slot, so the live ones are at the front): a power of two, at least min_batch."""
        return min(self.num_slots, max(self.min_batch, load_bucket(live_top)))

    def programs(self) -> list[tuple]:
        """Every program a run can need, chunks first (they compile longest): ("chunk", budget, rows) for
        each budget the policy may pick (None for AR, PLAIN for auto's plain decoding) and each batch size
        chunk_rows can give, and ("admit", width, rows) for each group size and prompt bucket up to the
        longest prompt admitted whole, and ("piece", width, resume, final) for prompts that come in pieces
        (admit's `resume` and `final`: the first piece, the middle ones, and the last's buckets)."""
        budgets = self.policy.budgets if self.policy else (None,)
        rows = sorted({self.chunk_rows(top) for top in range(1, self.num_slots + 1)})
        groups = sorted({self.admission_rows(n) for n in range(1, self.max_admit + 1)})
        longest = min(self.max_context - 1, self.prefill_chunk)  # prompt + >= 1 new token
        admits = [("admit", w, g) for g in groups
                  for w in sorted({self.prompt_width(n, g) for n in range(1, longest + 1)})]
        pieces = []
        if self.max_context - 1 > self.prefill_chunk:
            pieces = [("piece", self.prefill_chunk, False, False), ("piece", self.prefill_chunk, True, False)]
            pieces += [("piece", w, True, True) for w in sorted({self.prompt_width(n) for n in range(1, longest + 1)})]
        return [("chunk", b, r) for b in budgets for r in rows] + admits + pieces

    def _admit_call(self, requests: list[tuple[int, list[int], SamplingConfig, int, int]],
                    width: int | None = None, rows: int | None = None, start: int = 0,
                    final: bool = True) -> tuple[tuple, dict]:
        """device.admit's arguments for a group of (slot, prompt ids, sampling, max_new_tokens, seed),
        padded to its row and prompt buckets (or to `rows` x `width`); from `start` > 0 (one request) the
        prompt's piece from that token on, appended to what its slot holds."""
        rows = rows or self.admission_rows(len(requests))
        if start:
            requests = [(index, ids[start:], *rest) for index, ids, *rest in requests]
        width = width or self.prompt_width(max(len(r[1]) for r in requests), rows)
        if not final:
            requests = [(index, ids[:width], *rest) for index, ids, *rest in requests]
        prompts = np.full((rows, width), self.pad_token_id, np.int32)
        lengths, limits = np.ones(rows, np.int32), np.ones(rows, np.int32)
        indices = np.full(rows, self.num_slots, np.int32)  # past the slots: a padding row writes nothing
        seeds = np.zeros((rows, 2), np.uint32)
        configs = [SamplingParams().config()] * rows
        for r, (index, ids, sampling, max_new_tokens, seed) in enumerate(requests):
            prompts[r, : len(ids)], lengths[r], limits[r] = ids, len(ids), max_new_tokens
            indices[r], seeds[r], configs[r] = index, seed_words([seed])[0], sampling  # all 64 bits
        args = (self.params, self.head_params, self.slots, indices, prompts, lengths, seeds,
                RowSampling.of(configs), limits, np.full(rows, start, np.int32),
                None if self.pages is None else self.pages.table.copy())
        return args, dict(cfg=self.target.cfg, drafter=self.drafter, eos_token_ids=self.eos_token_ids,
                          resume=start > 0, final=final, attention=self.attention)

    def _chunk_call(self, budget: int | None, rows: int, return_early: bool = False):
        """(the chunk program, its arguments) for a chunk of `rows` slot rows at `budget` (None or PLAIN:
        plain decoding)."""
        spec = self.spec(budget)
        program = device.CHUNK_PROGRAMS[device.chunk_gemm_backend(self.gemm_backend, spec, rows)]
        return program, (self.params, self.head_params, self.slots, np.bool_(return_early)), dict(
            cfg=self.target.cfg, drafter=self.drafter, spec=spec, steps=self.chunk_steps,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, attention=self.attention, active=rows,
            fixed=self.overlap)

    def _warm_up_call(self, program: tuple):
        """(jitted function, args, kwargs) of a run of `program` that changes no request: one-token prompts
        admitted into the first slots with max_tokens 1 (they end at admission), or a chunk in which no
        slot is live (its loop runs no step, or with `overlap` steps whose writes no request reads). Only
        while every slot is free."""
        greedy = SamplingParams().config()
        if program[0] == "admit":
            _, width, rows = program
            group = [(i, [self.pad_token_id], greedy, 1, 0) for i in range(min(rows, self.num_slots))]
            return (device.admit, *self._admit_call(group, width, rows))
        if program[0] == "piece":
            _, width, resume, final = program
            prompt = [self.pad_token_id] * (int(resume) + 1)
            return (device.admit, *self._admit_call([(0, prompt, greedy, 1, 0)], width, 1, int(resume), final))
        return self._chunk_call(*program[1:])

    def lower_program(self, program: tuple) -> jax.stages.Lowered:
        """`program` lowered on the arguments the engine passes it: `.compile()` fills jax's caches for
        the engine's own calls (warmup.py)."""
        fn, args, kwargs = self._warm_up_call(program)
        return fn.lower(*args, **kwargs)

    def run_program(self, program: tuple) -> None:
        """Runs `program` once with no request in it (the device thread, every slot free: warm-up)."""
        fn, args, kwargs = self._warm_up_call(program)
        self.slots = fn(*args, **kwargs)[0]
        if program[0] != "chunk":  # and the cancellation's update, once
            self.slots = device.release(self.slots, 0)
        jax.block_until_ready(self.slots)
        self.compiled.add(program)

    # -- requests ------------------------------------------------------------------------------

    def check_request(self, prompt_len: int, max_new_tokens: int) -> None:
        if prompt_len < 1:
            raise ValueError("the prompt has no tokens")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_new_tokens!r}")
        if prompt_len + max_new_tokens > self.max_context:
            pool = "" if self.pages is None else (f" (what {self.pages.usable} cache pages of "
                                                  f"{self.pages.page_size} rows hold)")
            raise ValueError(f"max_tokens: the prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) "
                             f"exceeds the context of {self.max_context} tokens{pool}; lower max_tokens or "
                             "shorten the prompt")

    def rows_reached(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache rows a request can write: its prompt and answer, and a step's scratch rows past them."""
        return min(prompt_len + max_new_tokens + self.scratch, self.max_len)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        vocab = self.target.cfg.vocab_size
        if prompt_ids and not 0 <= min(prompt_ids) <= max(prompt_ids) < vocab:
            raise ValueError(f"prompt: token ids must be in 0..{vocab - 1}, got "
                             f"{[t for t in prompt_ids if not 0 <= t < vocab][:4]}")

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Raises ValueError, its message starting with the field's name, for a value the device cannot
        take: top_k past the vocabulary (the int32 conversion on the device thread failed on 2**31), a seed
        outside [0, 2**64)."""
        sampling.config()
        vocab = self.target.cfg.vocab_size
        if sampling.top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary size {vocab} (0 disables), got {sampling.top_k}")
        if not math.isfinite(sampling.temperature):
            raise ValueError(f"temperature must be finite, got {sampling.temperature}")
        if sampling.seed is not None:
            seed_words([sampling.seed])  # "seed must be in [0, 2**64)": raised here, not on the device thread

    def check(self, request: EngineRequest) -> None:
        """Everything about a request the device needs: submit checks it, the device thread again."""
        self.check_request(len(request.prompt_ids), request.max_new_tokens)
        self.check_prompt(request.prompt_ids)
        self.check_sampling(request.sampling)

    def submit(self, request: EngineRequest, loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        self.check(request)
        handle = RequestHandle(request, loop)
        with self.lock:
            if self.failure is not None:
                raise EngineFailedError(f"the engine failed ({self.failure}); the server must be restarted")
            if self.closing:
                raise EngineClosedError("the server is shutting down")
            busy = sum(o is not None for o in self.owner)
            if busy + len(self.pending) >= self.num_slots + self.max_queue:
                # the bound is on slots + queue together: slots free between chunks take queued requests
                raise QueueFullError(f"the server holds as many requests as it takes ({self.num_slots} slots + "
                                     f"a queue of {self.max_queue}): {busy} decoding and {len(self.pending)} "
                                     "queued; retry later")
            self.pending.append(handle)
            self.stats.requests_total += 1
            self.lock.notify()
        return handle

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self, warm_up: bool = False) -> "Engine":
        """Starts the device thread. With `warm_up` it first compiles every program (warmup.py; follow it
        with `engine.warm_up.wait()`); requests submitted meanwhile wait in the queue."""
        if self.thread is None:
            if warm_up:
                self.warm_up = WarmUp(self)
            self.thread = threading.Thread(target=self._loop, name="jetspec-engine", daemon=True)
            self.thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stops admitting; with `drain`, lets running and queued requests finish for up to `timeout`
        seconds; whatever is left is cancelled. Returns once the device thread has stopped."""
        with self.lock:  # a second call can shorten the wait, never extend it
            self.deadline = min(self.deadline, time.monotonic() + timeout)
            self.drain = self.drain and drain
            self.closing = True
            deadline = self.deadline
            self.lock.notify()
        if self.thread is not None:
            self.thread.join(max(0.0, deadline - time.monotonic()) + 60.0)
        with self.lock:  # the thread never started, or stopped: nothing may be left waiting
            self._end_all("cancelled", "the server shut down")

    def metrics(self) -> dict[str, Any]:
        with self.lock:
            live = sum(o is not None for o in self.owner)
            queued = len(self.pending)
            pages = {} if self.pages is None else {"kv_pages": self.pages.usable, "kv_pages_used": self.pages.used}
        return self.stats.snapshot() | {"live_slots": live, "queue_depth": queued, "slots": self.num_slots,
                                        "method": self.method} | pages

    # -- the device thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        launched: LaunchedChunk | None = None
        try:
            if self.warm_up is not None:
                self.warm_up.run(stop=lambda: self.closing)
            while self._wait_for_work(launched is not None):
                self._drop_cancelled()
                t0 = time.perf_counter()
                admissions = self._admit_pending()
                if not self.overlap:  # first tokens at once, then a chunk read as soon as it is launched
                    self._read_admissions(admissions)
                    if admissions:
                        self.stats.add_admission_seconds(time.perf_counter() - t0)
                    if self._decoding():
                        self._read(self._launch_chunk())
                    continue
                previous = launched
                launched = self._launch_chunk() if self._decoding() else None
                if previous is not None:
                    self._read(previous)
                self._read_admissions(admissions)  # queued after `previous`, so ready soon after it
        except Exception as e:  # a device failure ends every request with an error, never a hang
            log.exception("engine failed")
            with self.lock:
                self.failure = f"{type(e).__name__}: {e}"
                self.closing = True
                self._end_all("error", f"engine failure: {e}")

    def _end_all(self, reason: str, message: str) -> None:
        """Ends every queued and running request (the caller holds the lock)."""
        for handle in list(self.pending) + [o for o in self.owner if o is not None]:
            self._finish(handle, reason, message)
        self.pending.clear()
        for index, owner in enumerate(self.owner):
            if owner is not None and self.pages is not None:
                self.pages.give_back(index)
        self.owner = [None] * self.num_slots
        self.prefilling.clear()

    def _finish(self, handle: RequestHandle, reason: str, message: str | None = None) -> None:
        if handle.finish(reason, message):
            self.stats.add_finished()

    def _wait_for_work(self, launched: bool) -> bool:
        """Whether to go round the loop again: requests to serve, or a launched chunk still to read."""
        with self.lock:
            while True:
                busy = any(o is not None for o in self.owner)
                if self.closing:
                    out_of_time = not self.drain or time.monotonic() >= self.deadline
                    if out_of_time or not (busy or self.pending):
                        self._end_all("cancelled", "the server shut down")
                        return False
                    return True
                if busy or self.pending or launched:
                    return True
                self.lock.wait(timeout=0.5)

    def _drop_cancelled(self) -> None:
        with self.lock:
            for handle in [h for h in self.pending if h.cancelled.is_set()]:
                self.pending.remove(handle)
                self._finish(handle, "cancelled")
        for i, handle in enumerate(self.owner):
            if handle is not None and handle.cancelled.is_set():
                self.slots = device.release(self.slots, i)
                self._free(i, "cancelled")

    def _free(self, index: int, reason: str, message: str | None = None) -> None:
        handle = self.owner[index]
        with self.lock:
            self.owner[index] = None
            if self.pages is not None:  # the next admission's table points the slot at the scratch page
                self.pages.give_back(index)
        self.prefilling.pop(index, None)
        self._finish(handle, reason, message)

    def _owns(self, index: int, handle: RequestHandle) -> bool:
        """Whether `handle` still holds slot `index`: tokens read after it was cancelled (and the slot
        perhaps given to another request) are dropped."""
        return self.owner[index] is handle and not handle.finished

    def _decoding(self) -> list[int]:
        """The slots whose requests decode: held, and not still taking their prompt in pieces."""
        return [i for i, o in enumerate(self.owner) if o is not None and i not in self.prefilling]

    def _admit_pending(self) -> list[Admission]:
        """Launches admissions for queued requests while slots are free, up to max_admit a call, and the
        next piece of the longest-waiting prompt that comes in pieces; the loop reads their first tokens
        (_read_admissions)."""
        admissions = []
        while True:
            with self.lock:
                free = [i for i, o in enumerate(self.owner) if o is None]
                group, pieces, taken = [], [], 0
                while taken < len(free) and self.pending and len(group) < self.max_admit:
                    handle, index = self.pending[0], free[taken]
                    if self.pages is not None:  # in order: the first waits for pages, the rest behind it
                        rows = self.rows_reached(len(handle.request.prompt_ids), handle.request.max_new_tokens)
                        if not self.pages.can_take(rows):
                            break
                        self.pages.take(index, rows)
                    self.pending.popleft()
                    self.owner[index], taken = handle, taken + 1
                    (pieces if len(handle.request.prompt_ids) > self.prefill_chunk else group).append((index, handle))
            if not taken:
                break
            for index, handle in pieces:  # checked once, here; prefilled a piece a turn (_admit_piece)
                row = self._admission_row_or_free(index, handle)
                if row is not None:
                    self.prefilling[index] = (row, 0)
            admission = self._admit([g[0] for g in group], [g[1] for g in group]) if group else None
            if admission is not None:
                admissions.append(admission)
        admission = self._admit_piece() if self.prefilling else None
        return admissions + ([admission] if admission is not None else [])

    def _admit_piece(self) -> Admission | None:
        """Prefills the next piece of the first prompt in self.prefilling; its last piece admits it."""
        index, (request, start) = next(iter(self.prefilling.items()))
        final = len(request[1]) - start <= self.prefill_chunk
        width = None if final else self.prefill_chunk
        args, kwargs = self._admit_call([request], width, 1, start, final)
        t0 = time.perf_counter()
        first, finished = self._launch_admission(("piece", args[4].shape[1], start > 0, final), args, kwargs)
        self.stats.add_prefill_piece()
        if not final:
            self.prefilling[index] = (request, start + self.prefill_chunk)
            if not self.overlap:  # its device time is admission's, not the next chunk's (the policy reads those)
                jax.block_until_ready(self.slots.cache.lengths)
                self.stats.add_admission_seconds(time.perf_counter() - t0)
            return None
        del self.prefilling[index]
        self.stats.add_admission([len(request[1])])
        return Admission([index], [self.owner[index]], first, finished)

    def _admission_row(self, index: int, request: EngineRequest) -> tuple:
        self.check(request)
        seed = request.sampling.seed if request.sampling.seed is not None else int.from_bytes(
            np.random.bytes(8), "little")
        return index, request.prompt_ids, request.sampling.config(), request.max_new_tokens, seed

    def _admission_row_or_free(self, index: int, handle: RequestHandle) -> tuple | None:
        """The request's admission row; None, its slot freed with an error, for one the device cannot take
        (one that skipped submit): it fails alone."""
        try:
            return self._admission_row(index, handle.request)
        except Exception as e:
            log.exception("request %r cannot be admitted", handle.request.request_id)
            self._free(index, "error", f"the request cannot be admitted: {e}")
            return None

    def _launch_admission(self, program: tuple, args: tuple, kwargs: dict) -> tuple[jax.Array, jax.Array]:
        """Runs device.admit (the "admit" or "piece" `program`); returns its (first tokens, finished)."""
        t0 = time.perf_counter()
        self.slots, first, finished = device.admit(*args, **kwargs)
        if program not in self.compiled:  # jax compiles it inside the call, before launching it
            self.stats.add_compile(time.perf_counter() - t0)
            self.compiled.add(program)
        return first, finished

    def _admit(self, indices: list[int], handles: list[RequestHandle]) -> Admission | None:
        rows = [(self._admission_row_or_free(index, handle), handle) for index, handle in zip(indices, handles)]
        requests, handles = [r for r, _ in rows if r is not None], [h for r, h in rows if r is not None]
        if not requests:
            return None
        args, kwargs = self._admit_call(requests)
        first, finished = self._launch_admission(("admit", args[4].shape[1], args[4].shape[0]), args, kwargs)
        self.stats.add_admission([len(r[1]) for r in requests])
        return Admission([r[0] for r in requests], handles, first, finished)

    def _reason(self, handle: RequestHandle, last_token: int) -> str:
        return "stop" if last_token in self.eos_token_ids else "length"

    def _read_admissions(self, admissions: list[Admission]) -> None:
        """Hands each admitted request its first token; frees the slots of those that ended there."""
        for admission, (first, finished) in zip(admissions, jax.device_get([(a.first, a.finished)
                                                                            for a in admissions])):
            for row, (index, handle) in enumerate(zip(admission.indices, admission.handles)):
                if not self._owns(index, handle):
                    continue
                handle.post(TokenEvent([int(first[row])]))
                self.stats.add_tokens(1)
                if finished[row]:
                    self._free(index, self._reason(handle, int(first[row])))

    def _launch_chunk(self) -> LaunchedChunk:
        live_slots = self._decoding()
        live = len(live_slots)
        active = self.chunk_rows(live_slots[-1] + 1)
        budget = self.policy.choose(live, active) if self.policy else None
        with self.lock:
            return_early = bool(self.pending)  # requests wait for a slot: refill one as soon as it is free
        program, args, kwargs = self._chunk_call(budget, active, return_early)
        launched = time.perf_counter()
        self.slots, out = program(*args, **kwargs)  # on the GPU it returns once the loop has run (predicate reads)
        key = ("chunk", budget, active)
        compiled = key not in self.compiled
        if compiled:
            self.stats.add_compile(time.perf_counter() - launched)
            self.compiled.add(key)
        owners = [None if i in self.prefilling else o for i, o in enumerate(self.owner)]
        return LaunchedChunk(out, owners, budget, live, active, launched, compiled)

    def _read(self, chunk: LaunchedChunk) -> None:
        """Waits for a launched chunk and hands out its tokens. Its seconds run from its launch call (with
        overlap: from the last chunk's read, if that came later, and the admissions queued before it
        count in) to its read."""
        tokens, counts, finished, steps, accepted = jax.device_get(
            (chunk.out.tokens, chunk.out.num_tokens, chunk.out.finished, chunk.out.steps, chunk.out.accepted))
        ready = time.perf_counter()
        seconds, self.last_ready = ready - max(chunk.launched, self.last_ready), ready
        steps, accepted, committed = int(steps), int(accepted), int(counts.sum())
        timed = not chunk.compiled
        self.stats.add_chunk(chunk.budget, chunk.live, chunk.active, steps, committed, accepted, seconds, timed=timed)
        if self.policy is not None and steps and timed:
            live_steps = chunk.live * steps
            device_steps = self.chunk_steps if self.overlap else steps  # a fixed chunk runs them all
            self.policy.observe(chunk.budget, chunk.active, seconds / device_steps,
                                (accepted + live_steps) / live_steps, steps)
        for i, handle in enumerate(chunk.owners):
            if handle is None or counts[i] == 0 or not self._owns(i, handle):
                continue
            handle.target_forwards += steps  # a live slot stays live for every step of the chunk
            new = tokens[i, : counts[i]].tolist()
            handle.post(TokenEvent(new))
            if finished[i]:
                self._free(i, self._reason(handle, new[-1]))


class Admission(NamedTuple):
    """A launched admission: the slots and requests of its rows, and its device results (read later)."""
    indices: list[int]
    handles: list[RequestHandle]
    first: jax.Array  # (R,) first tokens (rows past len(handles) pad)
    finished: jax.Array  # (R,) ended at admission


class LaunchedChunk(NamedTuple):
    """A chunk on the device, with what the host knew when it launched it."""
    out: device.ChunkOutput
    owners: list[RequestHandle | None]  # each slot's request at launch
    budget: int | None
    live: int
    active: int
    launched: float  # perf_counter before the launch call
    compiled: bool  # its program compiled in the launch call


class EngineStats:
    """Counters for /metrics; rates over the last `window` seconds of chunks."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.lock = threading.Lock()
        self.recent: collections.deque = collections.deque()  # (time, tokens, forwards, accepted)
        self.requests_total = self.requests_finished = 0  # finished: ended for any reason, cancelled included
        self.tokens_total = self.prompt_tokens_total = 0
        self.admissions = self.admitted = 0  # admission calls, and the requests they prefilled
        self.prefill_pieces = 0  # device calls that prefilled a piece of a long prompt
        self.admission_seconds = 0.0  # from launching admissions to reading their first tokens (without overlap)
        self.compile_seconds = 0.0  # launch calls of admissions and chunks that compiled their program
        self.warm_up_seconds = 0.0  # the warm-up before serving: the full one (warmup.py) or a first request
        self.budget: int | None = None
        self.history: list[dict] | None = None  # a benchmark sets a list to keep every chunk

    def add_tokens(self, n: int) -> None:
        with self.lock:
            self.tokens_total += n

    def add_warm_up(self, seconds: float) -> None:
        with self.lock:
            self.warm_up_seconds += seconds

    def add_finished(self) -> None:
        with self.lock:
            self.requests_finished += 1

    def add_admission(self, prompt_tokens: list[int]) -> None:
        with self.lock:
            self.prompt_tokens_total += sum(prompt_tokens)
            self.admissions += 1
            self.admitted += len(prompt_tokens)

    def add_prefill_piece(self) -> None:
        with self.lock:
            self.prefill_pieces += 1

    def add_admission_seconds(self, seconds: float) -> None:
        with self.lock:
            self.admission_seconds += seconds

    def add_compile(self, seconds: float) -> None:
        with self.lock:
            self.compile_seconds += seconds

    def add_chunk(self, budget, live: int, active: int, steps: int, committed: int, accepted: int,
                  seconds: float, timed: bool = True) -> None:
        now = time.monotonic()
        with self.lock:
            self.budget = budget
            self.tokens_total += committed
            if not timed:  # the first run of this program: it waited for its compilation
                return
            self.recent.append((now, seconds, committed, live * steps, accepted))
            if self.history is not None:
                self.history.append(dict(budget=budget, live=live, active=active, steps=steps, seconds=seconds,
                                         committed=committed, accepted=accepted))
            while self.recent and self.recent[0][0] < now - self.window:
                self.recent.popleft()

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            busy = sum(r[1] for r in self.recent)
            tokens = sum(r[2] for r in self.recent)
            forwards = sum(r[3] for r in self.recent)
            accepted = sum(r[4] for r in self.recent)
            return {"tokens_per_second": tokens / busy if busy else 0.0,
                    "tau": (forwards + accepted) / forwards if forwards else 0.0,
                    "budget": self.budget, "requests_total": self.requests_total,
                    "requests_finished": self.requests_finished, "generated_tokens_total": self.tokens_total,
                    "prompt_tokens_total": self.prompt_tokens_total, "prefill_pieces_total": self.prefill_pieces,
                    "compile_seconds_total": self.compile_seconds, "warm_up_seconds": self.warm_up_seconds}
