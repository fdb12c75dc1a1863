"""benchmarks/serve_chunk_profile.py end to end on the tiny model (a smoke run, not a measurement): the
offline AR step and the engine's chunks at each batch and budget, every slot live through the run. The
offline run is 400 tokens long so its step time outgrows the timing noise of a busy machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_serve_load import tiny_model_head_and_data

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                      "serve_chunk_profile.py")


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True])
def test_serve_chunk_profile_times_each_configuration(tmp_path, overlap):
    model, head_dir, data = tiny_model_head_and_data(tmp_path)
    out = tmp_path / "profile.json"
    batches = (1,) if overlap else (1, 2)
    command = [sys.executable, SCRIPT, "--model", str(model), "--head", str(head_dir), "--data-dir", str(data),
               "--batches", *map(str, batches), "--budgets", "8", "--width", "3", "--chunk-steps", "2",
               "--chunks", "2", "--warmup-chunks", "1", "--new-tokens", "400", "--max-len", "1024", "--no-cache",
               "--out", str(out)] + (["--overlap"] if overlap else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["source"], r["batch"], r["budget"]) for r in rows] == [
        (s, n, b) for n in batches for s, b in (("offline", None), ("serve", None), ("serve", 8))]
    assert all(r["wall_ms_per_step"] > 0 for r in rows)
    served = [r for r in rows if r["source"] == "serve"]
    assert all(r["steps"] == 2 for r in served)  # a whole chunk, no slot finished
    assert all(r["overlap"] == overlap and r["launch_ms"] > 0 and r["pipelined_ms_per_step"] > 0 for r in served)
