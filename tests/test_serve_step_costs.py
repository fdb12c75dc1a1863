"""benchmarks/serve_step_costs.py end to end on the tiny model (a smoke run, not a measurement): it
writes its results and a cost table that the adaptive budget reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_serve_load import tiny_model_head_and_data

from jetspec_jax.serve.budget import PLAIN, CostTable

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "serve_step_costs.py")


@pytest.mark.slow
def test_serve_step_costs_writes_a_table_the_policy_reads(tmp_path):
    model, head_dir, data = tiny_model_head_and_data(tmp_path)
    out, table = tmp_path / "costs.json", tmp_path / "table.json"
    command = [sys.executable, SCRIPT, "--model", str(model), "--head", str(head_dir), "--data-dir", str(data),
               "--batches", "1", "2", "--budgets", "4", "--width", "3", "--chunk-steps", "2",
               "--new-tokens", "8", "--max-len", "384", "--seconds", "1", "--warmup-chunks", "0", "--no-cache",
               "--out", str(out), "--table", str(table)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["batch"], r["budget"]) for r in rows] == [
        (m, n, b) for n in (1, 2) for m, b in (("ar", None), ("jetspec", PLAIN), ("jetspec", 4))]
    assert all(r["chunks"] > 0 and r["step_ms"] > 0 and r["tau"] >= 1 for r in rows), rows
    assert all(r["tau"] == 1 for r in rows if r["budget"] in (None, PLAIN))
    assert all(r["step_over_ar"] > 0 for r in rows if r["method"] == "jetspec")
    costs = CostTable.read(str(table))
    assert all(costs.step_time(n, b) > 0 for n in (1, 2) for b in (PLAIN, 4))
