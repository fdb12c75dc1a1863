"""The full warm-up: every program a serving engine can run (Engine.programs) compiled before it serves,
so that no request waits for a compilation."""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable

from tqdm import tqdm

from jetspec_jax.compilation import CompileWatch, compile_in_parallel, default_workers

class WarmUp:
    """Compiles every program of an engine before it serves. Its device thread runs `run` first: the
    programs are lowered and compiled ahead of time in `workers` threads at once (XLA compiles without
    the GIL), on the very arguments the engine passes, which fills jax's caches for those calls; then
    each runs once on free slots (an admission that ends at once, a chunk with no live slot), which
    also compiles the small eager operations around them, and would compile anything the ahead-of-time
    path missed. Other threads follow it through `done`, `total` and `wait`."""

    def __init__(self, engine, workers: int | None = None):
        self.engine = engine
        self.programs = engine.programs()
        self.workers = workers or default_workers()
        self.done = 0  # programs compiled so far
        self.seconds = 0.0
        self.compiled_programs = 0  # what jax compiled in all (CompileWatch.programs), eager operations included
        self.compiled_by_runs = 0  # of those, by the runs after the compilations: eager operations only, unless
        # the ahead-of-time path stopped filling the caches the engine's calls hit (a jax change)
        self.stopped = False
        self.error: BaseException | None = None
        self.finished = threading.Event()

    @property
    def total(self) -> int:
        return len(self.programs)

    def run(self, stop: Callable[[], bool]) -> None:
        """On the engine's device thread, before it serves. Returns early, once the compilations under
        way end, when stop() turns true; raises what a compilation raised."""
        t0 = time.perf_counter()
        try:
            with CompileWatch() as watch:
                self._compile_ahead(stop)
                before = watch.programs
                for program in self.programs:
                    if stop():
                        self.stopped = True
                        return
                    self.engine.run_program(program)
                self.compiled_by_runs = watch.programs - before
                self.compiled_programs = watch.programs
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.seconds = time.perf_counter() - t0
            self.engine.stats.add_warm_up(self.seconds)
            self.finished.set()

    def _compile_ahead(self, stop: Callable[[], bool]) -> None:
        def compiled(program, executable, seconds: float) -> None:
            self.done += 1  # one writer per program; `+=` under the GIL is enough for a progress count

        # lowering reads the engine's slots (its arguments are the engine's), so it stays on this thread
        if not compile_in_parallel(self.programs, self.engine.lower_program, compiled, self.workers, stop):
            self.stopped = True

    def describe(self) -> str:
        """What it compiles, in one line."""
        chunks = [p for p in self.programs if p[0] == "chunk"]
        budgets = list(dict.fromkeys(p[1] for p in chunks))
        label = "AR" if budgets == [None] else "budgets " + ", ".join(map(str, budgets))
        return (f"{len(chunks)} chunks ({label} x {len(chunks) // len(budgets)} batch sizes) and "
                f"{self.total - len(chunks)} admissions (prompt bucket x group size, and long prompts' pieces), "
                f"{self.workers} at once")

    def wait(self, check: Callable[[], None] = lambda: None, poll: float = 0.2,
             progress_bar: bool = False) -> float:
        """Blocks until the warm-up ends, calling check() (which may raise to stop waiting) every `poll`
        seconds, with a progress bar on stderr if asked; returns its seconds, raises its error."""
        bar = tqdm(total=self.total, desc="warm-up", unit="program", file=sys.stderr, mininterval=2.0,
                   disable=not progress_bar)
        with bar:
            while not self.finished.wait(poll):
                check()
                bar.update(self.done - bar.n)
            check()
            bar.update(self.done - bar.n)
        if self.error is not None:
            raise RuntimeError(f"warm-up failed: {type(self.error).__name__}: {self.error}") from self.error
        return self.seconds
