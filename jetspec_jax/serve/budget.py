"""The draft budget of each chunk, chosen from the load: large trees when few slots are live, small
ones when many are, plain decoding (PLAIN) where no tree pays, by the expected tokens per second
n * tau(B) / step_time(n, B).

The step times and taus come from a cost table (`benchmarks/serve_step_costs.py` writes one; tables for
known targets and devices ship in cost_tables/) and are refined online from what the engine observes;
with no table the policy learns online alone, trying every budget at each load first."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import jax
import numpy as np

from jetspec_jax.errors import DamagedFileError

AUTO_BUDGETS = (16, 32, 64, 128)
PLAIN = 1  # a tree of the root alone: a plain decoding step (tau 1), the arm that keeps auto >= AR
TABLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cost_tables")
TABLE_CHUNKS = 4.0  # the table's value counts as 4 chunks: the first observations correct it fast ...
OBSERVED_WEIGHT = 0.05  # ... then a moving average over ~20 chunks (one chunk's tau is a noisy sample)
REFERENCE_STEPS = 8  # a chunk's worth of steps; a chunk cut short (a request ended) counts for less
OUTLIER_RATIO = 2.0  # a step time is clipped to [1/2, 2] x the estimate: one stalled chunk cannot exile a budget
TRIES_PER_ARM = 2  # online: chunks each (load, budget) runs before the best is exploited
PROBE_EVERY = 32  # every 32nd chunk at a load runs the runner-up budget chosen longest ago ...
PROBE_MARGIN = 0.2  # ... if its expected rate is within 20% of the best: estimates stay fresh for <= 0.6%


def load_bucket(live: int) -> int:
    """Loads are grouped by powers of two (1, 2, 4, 8, ...): step time grows smoothly with the batch."""
    return 1 << max(0, math.ceil(math.log2(max(live, 1))))


@dataclasses.dataclass
class CostTable:
    step_ms: dict[tuple[int, int], float]  # (batch, budget) -> milliseconds a step; budget PLAIN: plain decoding
    tau: dict[int, float]  # budget -> tokens committed per verify pass
    source: str = "online"

    @staticmethod
    def read(path: str) -> "CostTable":
        fix = "write it again with benchmarks/serve_step_costs.py, or pass another --cost-table"
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            rows = data["rows"]
            step_ms = {(int(r["batch"]), int(r["budget"])): float(r["step_ms"]) for r in rows}
            taus: dict[int, list[float]] = {}
            for r in rows:
                taus.setdefault(int(r["budget"]), []).append(float(r["tau"]))
        except FileNotFoundError:
            raise FileNotFoundError(f"no cost table at {path}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DamagedFileError(path, f"not a cost table ({type(e).__name__}: {e})", fix) from None
        if not step_ms or any(v <= 0 for v in step_ms.values()):
            raise DamagedFileError(path, "needs rows with positive step_ms", fix)
        return CostTable(step_ms, {b: sum(v) / len(v) for b, v in taus.items()}, source=path)

    def step_time(self, live: int, budget: int) -> float | None:
        """Linear in the batch between the measured batches around `live`; past the largest, along the
        line through the last two (a step's cost grows by a fixed amount a row: proportional scaling
        put B=16 at 32 live at 3.96 ms where the H200 took 2.60), never below the last measured."""
        batches = sorted(b for b, bud in self.step_ms if bud == budget)
        if not batches:
            return None
        ms = [self.step_ms[(b, budget)] for b in batches]
        if live > batches[-1]:
            if len(batches) == 1:  # no slope known: proportional, an upper bound
                return ms[-1] * live / batches[-1]
            slope = max(0.0, (ms[-1] - ms[-2]) / (batches[-1] - batches[-2]))
            return ms[-1] + slope * (live - batches[-1])
        if live <= batches[0]:
            return ms[0]
        return float(np.interp(live, batches, ms))


def shipped_table(target, method: str) -> str | None:
    """A table shipped for this target (by fingerprint), method and device kind, if any."""
    kind = jax.devices()[0].device_kind
    for path in sorted(glob.glob(os.path.join(TABLES_DIR, "*.json"))):
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        if (meta.get("target_fingerprint") == target.fingerprint and meta.get("method") == method
                and meta.get("device_kind") == kind):
            return path
    return None


@dataclasses.dataclass
class BudgetPolicy:
    budgets: tuple[int, ...]
    adaptive: bool
    table: CostTable
    observed_ms: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, budget)
    observed_tau: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # (bucket, budget)
    tries: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # (bucket, budget) -> chunks
    chunks: dict[int, int] = dataclasses.field(default_factory=dict)  # bucket -> chunks chosen
    last_chosen: dict[tuple[int, int], int] = dataclasses.field(default_factory=dict)  # -> its chunk number
    ms_chunks: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)  # chunks behind each estimate
    tau_chunks: dict[tuple[int, int], float] = dataclasses.field(default_factory=dict)

    @staticmethod
    def create(budget: int | str, width: int, num_slots: int, target, cost_table: str | None,
               method: str = "jetspec") -> "BudgetPolicy":
        if budget != "auto":
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 2:
                raise ValueError(f"budget must be an integer >= 2 or 'auto', got {budget!r}")
            return BudgetPolicy((budget,), False, CostTable({}, {}))
        path = cost_table or shipped_table(target, method)
        table = CostTable.read(path) if path else CostTable({}, {})
        trees = tuple(sorted({b for _, b in table.step_ms} - {PLAIN})) or AUTO_BUDGETS
        return BudgetPolicy((PLAIN, *trees), True, table)

    def step_ms(self, batch: int, budget: int) -> float | None:
        """The step time estimate of a step of `batch` rows: observed at its load, else the table's."""
        ms = self.observed_ms.get((load_bucket(batch), budget))
        return self.table.step_time(batch, budget) if ms is None else ms

    def tau(self, batch: int, budget: int) -> float | None:
        """The tau estimate at a step of `batch` rows: observed at its load, else the table's. Kept per
        load, not shared: the requests live at one load (a quiet hour's few) would otherwise set the
        ranking at another (a busy one's many), and a moving average takes ~20 chunks to forget them."""
        if budget == PLAIN:
            return 1.0
        return self.observed_tau.get((load_bucket(batch), budget), self.table.tau.get(budget))

    def expected_rate(self, live: int, budget: int, batch: int | None = None) -> float | None:
        """Expected committed tokens per millisecond with `live` sequences in a step of `batch` rows
        (default: live), or None if unknown."""
        ms, tau = self.step_ms(batch or live, budget), self.tau(batch or live, budget)
        if ms is None or tau is None:
            return None
        return live * tau / ms

    def estimates(self, live: int, batch: int | None = None) -> dict[int, dict[str, float | None]]:
        """What the next choice at this load compares, per budget: expected tokens a millisecond, step
        ms, tau, and the chunks observed at this load (0: the table's values as they are)."""
        bucket = load_bucket(batch or live)
        return {b: {"rate": self.expected_rate(live, b, batch), "step_ms": self.step_ms(batch or live, b),
                    "tau": self.tau(batch or live, b), "chunks": self.tries.get((bucket, b), 0)} for b in self.budgets}

    def choose(self, live: int, batch: int | None = None) -> int:
        """The budget of the next chunk: untried ones first (online, no table), then the best expected
        rate, except that every PROBE_EVERY-th chunk at a load re-measures a close runner-up, so an
        estimate that went wrong (a noisy table, a workload unlike the table's) is corrected."""
        if not self.adaptive:
            return self.budgets[0]
        bucket = load_bucket(batch or live)
        number = self.chunks.get(bucket, 0)
        self.chunks[bucket] = number + 1
        untried = [b for b in self.budgets if self.expected_rate(live, b, batch) is None
                   or (not self.table.step_ms and self.tries.get((bucket, b), 0) < TRIES_PER_ARM)]
        if untried:
            choice = untried[0]
        else:
            rates = {b: self.expected_rate(live, b, batch) for b in self.budgets}
            choice = max(self.budgets, key=rates.get)
            close = [b for b in self.budgets if b != choice and rates[b] >= (1 - PROBE_MARGIN) * rates[choice]]
            if close and number % PROBE_EVERY == PROBE_EVERY - 1:
                choice = min(close, key=lambda b: self.last_chosen.get((bucket, b), -1))
        self.last_chosen[(bucket, choice)] = number
        return choice

    def observe(self, budget: int, batch: int, step_seconds: float, tau: float,
                steps: int = REFERENCE_STEPS) -> None:
        """A chunk of `steps` steps refines the estimates of its (load, budget) step time and tau: a
        running mean that starts from the table's value worth TABLE_CHUNKS chunks (or from the
        first observation where the table has none) and becomes a moving average of weight
        OBSERVED_WEIGHT per chunk; the step time is first clipped to within OUTLIER_RATIO of the
        estimate."""
        key = (load_bucket(batch), budget)
        self.tries[key] = self.tries.get(key, 0) + 1
        chunks = steps / REFERENCE_STEPS
        ms = step_seconds * 1e3
        prior_ms = self.step_ms(batch, budget)
        if prior_ms is not None:
            ms = min(max(ms, prior_ms / OUTLIER_RATIO), prior_ms * OUTLIER_RATIO)
        self.observed_ms[key] = self._refine(self.ms_chunks, key, prior_ms, ms, chunks)
        self.observed_tau[key] = self._refine(self.tau_chunks, key, self.tau(batch, budget), tau, chunks)

    @staticmethod
    def _refine(counts: dict, key, prior: float | None, value: float, chunks: float) -> float:
        seen = counts.get(key, 0.0 if prior is None else TABLE_CHUNKS)
        counts[key] = seen + chunks
        weight = max(chunks / (seen + chunks), 1 - (1 - OBSERVED_WEIGHT) ** chunks)
        return value if prior is None else (1 - weight) * prior + weight * value
