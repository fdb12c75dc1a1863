"""The speedup the paper's tau would give with our measured Qwen3-8B-shaped step costs, beside the paper's
own speedups: speedup = tau x AR step / speculative step, from step_floor rows at batch 1.

    python benchmarks/paper_speedup.py benchmarks/results/step_floor_h100.json \\
        --out benchmarks/results/paper_speedup_h100.json

The paper's numbers are its Table 2 (Qwen3-8B on an H100, T=0, JetSpec, batch 1; speedup and tau per
benchmark at budgets 64, 128 and 256). Its speedup is measured against an AR loop of Hugging Face calls,
so the step cost it implies (tau / speedup) is against a slower baseline than our AR step.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402
from step_cost import read_step_floor  # noqa: E402

MODEL = "qwen3-8b-shaped"
# benchmark -> budget -> (speedup, tau): the paper's Table 2, JetSpec, T=0
PAPER_TABLE_2 = {
    "GSM8K": {64: (5.98, 6.56), 128: (7.34, 8.05), 256: (7.82, 8.62)},
    "MATH-500": {64: (6.76, 7.42), 128: (8.93, 9.95), 256: (9.64, 10.76)},
    "AIME25": {64: (6.47, 7.00), 128: (8.26, 9.10), 256: (8.78, 9.82)},
    "HumanEval": {64: (5.53, 6.06), 128: (6.66, 7.28), 256: (7.12, 7.78)},
    "MBPP": {64: (5.34, 5.88), 128: (6.31, 6.95), 256: (6.73, 7.43)},
    "LiveCodeBench": {64: (5.95, 6.59), 128: (7.29, 8.21), 256: (7.67, 8.79)},
    "MT-Bench": {64: (3.97, 4.77), 128: (4.37, 5.52), 256: (4.58, 5.94)},
}


def step_costs(path: str) -> dict[tuple[int, int], dict]:
    """(context, budget) -> the newest batch-1 row of the 8B shape over the whole vocabulary."""
    rows = {}
    for row in read_step_floor(path)["rows"]:
        if row["model"] == MODEL and row["batch"] == 1 and row.get("draft_vocab") is None:
            rows[row["context"], row["budget"]] = row
    if not rows:
        raise SystemExit(f"error: {path} has no batch-1 rows of {MODEL} over the whole vocabulary")
    return rows


def speedup_rows(costs: dict[tuple[int, int], dict]) -> list[dict]:
    table = []
    for benchmark, budgets in PAPER_TABLE_2.items():
        for budget, (paper_speedup, tau) in budgets.items():
            for context in sorted({c for c, b in costs if b == budget}):
                row = costs[context, budget]
                table.append(dict(benchmark=benchmark, budget=budget, context=context, paper_tau=tau,
                                  paper_speedup=paper_speedup, paper_step_over_ar=tau / paper_speedup,
                                  step_over_ar=row["step_over_ar"], speedup=tau / row["step_over_ar"],
                                  device=row["device"]))
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", help="a step_floor result file with batch-1 rows of the Qwen3-8B shape")
    p.add_argument("--out", default=None, help="write the table here (JSON)")
    args = p.parse_args()
    table = speedup_rows(step_costs(args.results))
    print_table(table, ["benchmark", "budget", "context", "paper_tau", "paper_speedup", "paper_step_over_ar",
                        "step_over_ar", "speedup"])
    if args.out:
        write_json_atomic(args.out, dict(benchmark="paper_speedup", environment=environment(), source=args.results,
                                         paper="JetSpec, Table 2: Qwen3-8B, H100, T=0, batch 1", rows=table))


if __name__ == "__main__":
    main()
