"""benchmarks/serve_accuracy.py end to end on the tiny model (a smoke run: its answers are noise): every
server variant's greedy answers at a concurrency equal offline AR's, text for text, and are scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_serve_load import tiny_model_head_and_data, write_jsonl

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "serve_accuracy.py")


@pytest.mark.slow
def test_server_answers_equal_offline_ar_and_are_scored(tmp_path):
    model, head_dir, data = tiny_model_head_and_data(tmp_path)
    write_jsonl(data / "gsm8k_test.jsonl", [dict(question=f"Tom has {i} apples and buys {i}. How many?",
                                                 answer=f"He has {i}+{i}={2 * i}.\n#### {2 * i}") for i in range(5)])
    out = tmp_path / "serve_accuracy.json"
    command = [sys.executable, SCRIPT, "--model", str(model), "--head", str(head_dir), "--data-dir", str(data),
               "--variants", "8/paged=16", "--concurrency", "2", "--limit", "4", "--max-tokens", "10",
               "--slots", "2", "--max-len", "192", "--width", "3", "--chunk-steps", "2", "--no-cache",
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["offline ar", "8/paged=16"]
    for row in rows:
        assert row["questions"] == 4 and 0 <= row["correct"] <= 4 and row["accuracy"] == row["correct"] / 4
        assert row["same_as_offline_ar"] == 1.0  # fp32 on the CPU: the same text, request for request
