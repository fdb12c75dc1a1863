"""benchmarks/serve_load.py end to end on the tiny model (a smoke run, not a measurement): every variant
warms up fully first, and no timed window compiles anything."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_serve_http import char_tokenizer

from conftest import make_tiny_checkpoint
from jetspec_jax.api import random_head
from jetspec_jax.loading.head_checkpoint import save_head
from jetspec_jax.target import load_target

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "serve_load.py")


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def tiny_model_head_and_data(tmp_path):
    """A tiny Qwen3 checkpoint with a tokenizer, a random JetSpec head, and a data folder of two MATH-500
    and two MT-Bench prompts: what the serving benchmarks read, as (model, head, data) folders."""
    model, head_dir, data = tmp_path / "model", tmp_path / "head", tmp_path / "data"
    make_tiny_checkpoint("qwen3", str(model), seed=1)
    char_tokenizer().save_pretrained(str(model))
    target = load_target(str(model), dtype="float32")
    save_head(str(head_dir), *random_head(target, "causal"), target=target)
    data.mkdir()
    write_jsonl(data / "math500_test.jsonl",
                [dict(problem=f"What is {i}+{i}?", answer=str(2 * i), unique_id=str(i)) for i in range(2)])
    write_jsonl(data / "mt_bench.jsonl", [dict(question_id=i, turns=[f"Say hi {i} times."]) for i in range(2)])
    return model, head_dir, data


# the engine suffixes: chunks of one step, launched ahead, a 0.5 ms switch, a paged cache of 16-row pages
VARIED = "8/overlap/steps=1/switch=0.5/paged=16"


@pytest.mark.slow
def test_serve_load_times_no_compilation(tmp_path):
    model, head_dir, data = tiny_model_head_and_data(tmp_path)
    out = tmp_path / "serve_load.json"
    command = [sys.executable, SCRIPT, "--model", str(model), "--head", str(head_dir), "--data-dir", str(data),
               "--variants", "ar", VARIED, "--concurrency", "1", "2", "--requests-per-level", "1",
               "--max-tokens", "8", "--slots", "2", "--max-len", "192", "--width", "3", "--chunk-steps", "2",
               "--offline-ar", "--no-cache", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["complete"] is True  # written after each variant; the last write marks the run whole
    assert [(r["variant"], r["concurrency"]) for r in result["rows"]] == [
        (v, c) for v in ("ar", VARIED) for c in (1, 2)]
    assert all(r["throughput_over_ar"] > 0 for r in result["rows"])
    for row in result["rows"]:  # offline AR at each concurrency as the batch, beside the server's AR
        if row["variant"] == "ar":
            assert row["offline_throughput"] > 0
            assert row["server_over_offline"] == pytest.approx(row["throughput"] / row["offline_throughput"])
        else:
            assert "offline_throughput" not in row
    for row in result["rows"]:
        assert row["compilations"] == 0 and row["compile_s"] == 0 and row["warning"] is None, row
        assert row["completion_tokens"] == 8 * row["requests"] and row["throughput"] > 0
        # the engine's side of the window: chunks ran, at the variant's budget, within the wall time
        steps = 1 if row["variant"] == VARIED else 2
        # with overlap a chunk launched before the last was read runs no step if that one ended its slots
        overlap = "/overlap" in row["variant"]
        assert row["chunks"] > 0 and row["steps_per_chunk"] <= steps and row["ms_per_step"] > 0
        assert row["steps_per_chunk"] > 0 if overlap else row["steps_per_chunk"] >= 1
        assert 1 <= row["requests_per_admission"] <= 2 and 1 <= row["mean_live"] <= row["concurrency"]
        if overlap:  # its admissions count in the chunk after them
            assert 0 < row["chunk_share"] <= 1 and row["prefill_share"] is None
        else:
            assert 0 < row["chunk_share"] + row["prefill_share"] <= 1
        budget = row["variant"].split("/")[0]
        assert row["budgets_used"] == {"None" if budget == "ar" else budget: row["chunks"]}
        log = row["chunk_log"]  # budget, live, rows, steps, ms, accepted: one entry per chunk of the window
        assert len(log) == row["chunks"] and all(str(c[0]) == str(log[0][0]) and 0 <= c[3] <= steps for c in log)
        assert sum(c[3] for c in log) == pytest.approx(row["steps_per_chunk"] * row["chunks"])
        assert row["policy_estimates"] is None  # a fixed budget has no estimates
        assert 0 < row["ttft_median_s"] <= row["ttft_p99_s"] and 0 <= row["stall_median_s"] <= row["stall_p99_s"]
    # chunks of 1 and 2 rows, and admissions of 1 and of 2 prompts in buckets of 64, 128 and 192 columns
    assert {v: w["programs"] for v, w in result["warm_up"].items()} == {"ar": 8, VARIED: 8}
    assert all(w["seconds"] > 0 for w in result["warm_up"].values())
    assert "COMPILED IN TIMED WINDOW" not in done.stdout


def test_percentiles_interpolate_as_numpy_does():
    percentile, values = serve_load_module().percentile, [0.3, 0.1, 2.0, 0.7, 0.2]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([0.4], 99) == 0.4


def test_variants_name_a_budget_and_the_engine_settings_to_change():
    parse = serve_load_module().parse_variant
    assert parse("auto") == dict(name="auto", overlap=False, chunk_steps=None, switch_ms=None, max_len=None,
                                 page_size=None)
    assert parse("32/overlap/steps=16/switch=0.5") == dict(name="32", overlap=True, chunk_steps=16, switch_ms=0.5,
                                                           max_len=None, page_size=None)
    assert parse("ar/len=8192/paged=64") == dict(name="ar", overlap=False, chunk_steps=None, switch_ms=None,
                                                 max_len=8192, page_size=64)
    for bad, named in [("32/fast", "'fast'"), ("32/steps=0", "'steps=0'"), ("32/switch=x", "'switch=x'"),
                       ("big", "'big'"), ("1", "'1'"), ("ar/paged=48", "'paged=48'"), ("ar/len=10", "'len=10'")]:
        with pytest.raises(SystemExit, match=named):
            parse(bad)


def serve_load_module():
    spec = importlib.util.spec_from_file_location("serve_load", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
