"""benchmarks/step_floor.py: its floor model's counts, and a smoke run on a four-layer shape (not a
measurement) that resumes a grid from its --out file; paper_speedup.py's pricing of the paper's tau."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
from shapes import QWEN3_8B, QWEN3_30B_A3B, distinct_experts, pass_cost  # noqa: E402

from jetspec_jax.models import qwen3  # noqa: E402
from jetspec_jax.models.params import flatten_specs  # noqa: E402


def test_a_dense_pass_reads_every_weight_once_and_the_cache():
    specs = flatten_specs(qwen3.param_specs(QWEN3_8B))
    weights = sum(math.prod(s.shape) for path, s in specs.items() if path != "embed")
    kv_row = 2 * 8 * 128 * 2 * 36  # K and V, 8 KV heads of 128, bf16, 36 layers
    nbytes, flops = pass_cost(QWEN3_8B, 1, 1, 1024)
    assert nbytes == 2 * weights + 4096 * 2 + 1025 * kv_row + 151936 * 4
    assert flops == pytest.approx(2 * weights + 4 * 1025 * 32 * 128 * 36, rel=1e-3)  # norms are not dots
    # 64 tree tokens read the same weights: the verify pass stays bound by bytes, not FLOPs
    assert pass_cost(QWEN3_8B, 64, 1, 1024)[0] < 1.01 * nbytes


def test_an_moe_pass_reads_the_experts_its_tokens_reach():
    assert distinct_experts(128, 8, 1) == pytest.approx(8)
    assert distinct_experts(128, 8, 256) == pytest.approx(128, rel=1e-6)
    one, tree = pass_cost(QWEN3_30B_A3B, 1, 1, 1024)[0], pass_cost(QWEN3_30B_A3B, 256, 1, 1024)[0]
    experts = 48 * 128 * 3 * 2048 * 768 * 2  # bytes of every expert of every layer
    assert tree - one == pytest.approx(experts * (1 - 8 / 128), rel=0.02)


@pytest.mark.slow
def test_a_grid_is_measured_and_resumed(tmp_path):
    out = tmp_path / "floor.json"
    base = [sys.executable, os.path.join(BENCHMARKS, "step_floor.py"), "--models", "smollm2-135m-shaped",
            "--target-layers", "4", "--head-layers", "1", "--contexts", "16", "--new-tokens", "3", "--quick",
            "--out", str(out)]
    for _ in range(2):
        done = subprocess.run(base + ["--budgets", "4", "--draft-vocabs", "0", "64"], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    # kept by the second run, not measured again
    assert [(r["budget"], r["draft_vocab"], r["run"]) for r in result["rows"]] == [(4, None, 0), (4, 64, 0)]
    whole, narrow = result["rows"]
    assert narrow["floor_step_ms"] < whole["floor_step_ms"] and narrow["floor_ar_ms"] == whole["floor_ar_ms"]
    assert len(result["runs"]) == 2 and all(r["ceilings"]["copy_bytes_per_s"] > 0 for r in result["runs"])
    for row in result["rows"]:
        assert row["loop_step_ms"] > 0 and row["ar_step_ms"] > 0 and row["floor_step_ms"] > row["floor_ar_ms"]


def test_the_papers_tau_is_priced_at_our_step_cost():
    from paper_speedup import PAPER_TABLE_2, speedup_rows

    costs = {(1024, b): dict(step_over_ar=r, device="test") for b, r in ((64, 1.25), (128, 1.5), (256, 2.0))}
    rows = speedup_rows(costs)
    assert len(rows) == 3 * len(PAPER_TABLE_2)
    gsm8k_256 = next(r for r in rows if r["benchmark"] == "GSM8K" and r["budget"] == 256)
    assert gsm8k_256["speedup"] == pytest.approx(8.62 / 2.0)
    assert gsm8k_256["paper_step_over_ar"] == pytest.approx(8.62 / 7.82)
