"""Many programs compiled at once (lowering on the calling thread, XLA's compilations in a thread pool),
`compiled_call`'s executables cached by signature (compile and run time reported apart), and
`CompileWatch`, which counts what jax compiles and the time it takes."""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Callable, Iterable, Sequence

import jax
from jax import monitoring


def default_workers() -> int:
    """Programs compiled at once: XLA compiles each on one core, and a lowered module holds memory."""
    return min(8, os.cpu_count() or 1)


def compile_in_parallel(items: Iterable, lower: Callable[[Any], Any], compiled: Callable[[Any, Any, float], None],
                        workers: int, stop: Callable[[], bool] = lambda: False) -> bool:
    """Lowers each item (`lower(item)` -> jax.stages.Lowered) on this thread, since tracing holds the GIL,
    while `workers` threads compile the lowered ones (XLA releases it); at most 2 x workers lowered modules
    wait at once (each holds its module). `compiled(item, executable, seconds of lowering and compiling)`
    runs on a pool thread as each finishes. Lowering stops when stop() turns true or a compilation fails
    (the compilations not yet begun are skipped); the first failure is raised once those under way end.
    Returns False if stopped."""
    workers = max(1, workers)
    failed = threading.Event()

    def compile_one(item, lowered, lower_s: float) -> None:
        if stop() or failed.is_set():
            return
        t0 = time.perf_counter()
        try:
            executable = lowered.compile()
        except BaseException:
            failed.set()
            raise
        compiled(item, executable, lower_s + time.perf_counter() - t0)

    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jetspec-compile") as pool:
        futures: list[concurrent.futures.Future] = []
        try:
            for item in items:
                # only the running ones: a finished future in the list would end every wait at once
                while len(running := [f for f in futures if not f.done()]) >= 2 * workers and not stop():
                    concurrent.futures.wait(running, timeout=0.2, return_when=concurrent.futures.FIRST_COMPLETED)
                if stop() or failed.is_set():
                    break
                t0 = time.perf_counter()
                lowered = lower(item)
                futures.append(pool.submit(compile_one, item, lowered, time.perf_counter() - t0))
        except BaseException:
            failed.set()
            raise
        for future in futures:
            future.result()
    return not stop()


def compile_all(items: Iterable, lower: Callable[[Any], Any], workers: int) -> dict:
    """compile_in_parallel, keeping every item's executable: {item: executable}."""
    done = {}
    compile_in_parallel(items, lower, lambda item, executable, _: done.__setitem__(item, executable), workers)
    return done


# jax's own events (jax/_src/dispatch.py): tracing, lowering to MLIR and XLA's compilation (or a load from the
# persistent compilation cache) of one program.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """While open, counts the programs jax compiles in any thread (`programs`, with their `names`) and the
    `seconds` it spends tracing, lowering and compiling them."""

    def __init__(self):
        self.lock = threading.Lock()
        self.programs, self.seconds, self.names = 0, 0.0, []

    def __enter__(self) -> "CompileWatch":
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._listen)

    def _listen(self, event: str, seconds: float, **kwargs) -> None:
        if event not in (TRACE_EVENT, LOWER_EVENT, COMPILE_EVENT):
            return
        with self.lock:
            self.seconds += seconds
            if event == COMPILE_EVENT:
                self.programs += 1
                self.names.append(kwargs.get("fun_name", "?"))


_COMPILED: dict[Any, Any] = {}
_AHEAD: dict[Any, tuple[Any, float]] = {}  # compiled by compile_ahead, not run yet: (executable, seconds)


def call_signature(fn, args: tuple, static: dict[str, Any]) -> tuple:
    """What one compiled executable serves: the function, the arguments' shapes and dtypes, the statics."""
    return (fn, tuple((a.shape, a.dtype) for a in jax.tree.leaves(args)), jax.tree.structure(args),
            tuple(sorted(static.items())))


def compiled_call(fn, args: tuple, static: dict[str, Any]):
    """Runs a jitted function through an explicitly compiled executable, cached by shapes and static
    arguments, so compile time and run time are reported separately. Returns (out, compile_s, run_s);
    compile_s > 0 on an executable's first run, also when compile_ahead compiled it (its seconds there)."""
    signature = call_signature(fn, args, static)
    compile_s = 0.0
    if signature not in _COMPILED:
        if signature in _AHEAD:
            _COMPILED[signature], compile_s = _AHEAD.pop(signature)
        else:
            t0 = time.perf_counter()
            _COMPILED[signature] = fn.lower(*args, **static).compile()
            compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = jax.block_until_ready(_COMPILED[signature](*args))
    return out, compile_s, time.perf_counter() - t0


def compile_ahead(calls: Sequence[Any], workers: int) -> int:
    """Compiles the programs of `calls` (objects with fn, args and static: api.GenerateCall) that have
    none yet, `workers` at a time (compile_in_parallel), for compiled_call to run; returns how many."""
    pending = {}
    for call in calls:
        signature = call_signature(call.fn, call.args, call.static)
        if signature not in _COMPILED and signature not in _AHEAD:
            pending.setdefault(signature, call)

    def lower(signature):
        call = pending[signature]
        return call.fn.lower(*call.args, **call.static)

    def compiled(signature, executable, seconds: float) -> None:
        _AHEAD[signature] = (executable, seconds)

    compile_in_parallel(pending, lower, compiled, workers)
    return len(pending)
