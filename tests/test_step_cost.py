"""benchmarks/step_cost.py: the step cost model recovers the coefficients that made its rows, predicts held-back
rows within its noise, and refuses files it cannot fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
from step_cost import COEFFICIENTS, Point, pass_features, with_predictions  # noqa: E402

CEILINGS = {"copy_bytes_per_s": 4.0e12, "matmul_bf16_flops_per_s": 7.5e14}
TRUTH = np.array([1.15, 3.0, 0.012, 0.09, 0.0004])  # floor x1.15, attention at a third of the GEMM rate, ...


def grid_rows(noise: float = 0.0, seed: int = 0) -> list[dict]:
    """step_floor rows of three shapes at two batches, timed by TRUTH's model times (1 + noise)."""
    rng = np.random.default_rng(seed)
    rows = []
    for model in ("qwen3-8b-shaped", "qwen3-30b-a3b-shaped", "embedded"):
        for batch in (1, 8):
            ar = Point(model, batch, 1024, None)
            ar_ms = float(pass_features(ar, CEILINGS) @ TRUTH) * (1 + noise * rng.standard_normal())
            for budget in (16, 64, 256):
                step = Point(model, batch, 1024, budget)
                step_ms = float(pass_features(step, CEILINGS) @ TRUTH) * (1 + noise * rng.standard_normal())
                rows.append(dict(model=model, device="test", run=0, batch=batch, context=1024, budget=budget,
                                 draft_vocab=None, ar_step_ms=ar_ms, loop_step_ms=step_ms,
                                 step_over_ar=step_ms / ar_ms))
    return rows


def test_rows_made_by_the_model_are_predicted_exactly_when_held_back():
    table, coefficients = with_predictions(grid_rows(), CEILINGS)
    assert [coefficients[k] for k in COEFFICIENTS] == pytest.approx(TRUTH, rel=1e-6)
    for row in table:
        assert row["model_step_ms"] == pytest.approx(row["loop_step_ms"], rel=1e-6)
        assert row["model_ar_ms"] == pytest.approx(row["ar_step_ms"], rel=1e-6)


def test_held_back_error_stays_near_the_measurement_noise():
    table, _ = with_predictions(grid_rows(noise=0.02, seed=1), CEILINGS)
    errors = np.abs([r["model_step_error"] for r in table])
    assert errors.max() < 0.10 and np.median(errors) < 0.04


def test_the_features_follow_the_pass_they_cost():
    ar = pass_features(Point("qwen3-8b-shaped", 1, 1024, None), CEILINGS)
    step = pass_features(Point("qwen3-8b-shaped", 1, 1024, 64), CEILINGS)
    wide = pass_features(Point("qwen3-8b-shaped", 8, 1024, 64), CEILINGS)
    narrow = pass_features(Point("qwen3-8b-shaped", 1, 1024, 64, draft_vocab=32768), CEILINGS)
    assert ar[3] == 0 and ar[4] == 0 and step[3] == 1 and step[4] == 64 and wide[4] == 512
    assert step[2] == 36 + 5  # the target's layers and the paper-sized head's
    assert narrow[0] < step[0]  # the head reads 32,768 rows of the LM head, not 151,936
    # the 8B AR step streams its weights less the embedding table (a row gathered): 15.2 GB, 3.8 ms at 4 TB/s
    assert 3.7 < ar[0] < 3.95


def test_the_command_fits_a_file_and_refuses_what_it_cannot(tmp_path):
    floor = tmp_path / "floor.json"
    floor.write_text(json.dumps(dict(benchmark="step_floor", runs=[dict(ceilings=CEILINGS)], rows=grid_rows())))
    out = tmp_path / "cost.json"
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "step_cost.py"), str(floor), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["summary"]["rows"] == 18 and result["summary"]["max_abs_step_error"] < 1e-6
    assert "held-back step error" in done.stdout

    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(benchmark="serve_load", rows=[])))
    done = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "step_cost.py"), str(other)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "not a step_floor result" in done.stderr
