"""Eval report arithmetic on hand-made result lines: tau, speedups over paired prompts, accuracy
against AR, T=0 mismatch counts (an fp32 mismatch is flagged as a bug), histograms, failed runs."""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys

import pytest

from jetspec_jax.eval.records import read_lines
from jetspec_jax.eval.report import group_metrics, write_report


def line(method, budget, id="0", *, generated=11, decode=1.0, total=1.5, forwards=None, accepts=None,
         correct=True, matches=None, dtype="float32", precision="highest", temperature=0.0,
         benchmark="gsm8k"):
    speculative = method != "ar"
    return {"benchmark": benchmark, "id": id, "method": method, "budget": budget,
            "temperature": temperature, "num_generated": generated, "decode_seconds": decode,
            "total_seconds": total, "target_forwards": forwards, "accept_counts": accepts,
            "correct": correct, "matches_ar": matches, "dtype": dtype, "matmul_precision": precision,
            "head": "heads/h" if speculative else None, "head_sha256": "abc" if speculative else None,
            "text": ""}


def write_lines(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_group_metrics():
    lines = [line("ar", None), line("ar", None, id="1", generated=21, decode=2.0, total=2.5, correct=False),
             line("jetspec", 16, decode=0.5, total=1.0, forwards=4, accepts=[0, 1, 2, 1], matches=True),
             line("jetspec", 16, id="1", generated=21, decode=0.5, total=1.0, forwards=6,
                  accepts=[1, 2, 3, 0], matches=True),
             {**line("jetspec", 16, id="2"), "error": "prompt too long"}]
    groups = {(g["method"], g["budget"]): g for g in group_metrics(lines)}
    spec = groups[("jetspec", 16)]
    assert spec["n"] == 2 and spec["tau"] == pytest.approx(30 / 10)
    assert spec["speedup"] == pytest.approx((3.0 / 30) / (1.0 / 30))
    assert spec["e2e_speedup"] == pytest.approx((4.0 / 32) / (2.0 / 32))
    assert spec["accuracy"] == 1.0 and groups[("ar", None)]["accuracy"] == 0.5
    assert spec["accuracy_same_as_ar"] is False  # prompt 1: right here, wrong for AR
    assert spec["mismatches"] == 0 and spec["compared"] == 2
    assert spec["accept_histogram"] == pytest.approx([1 / 10, 3 / 10, 5 / 10, 1 / 10])
    assert groups[("ar", None)]["tau"] is None and groups[("ar", None)]["speedup"] == pytest.approx(1.0)


@pytest.mark.parametrize("dtype, precision, label, verdict", [
    ("bfloat16", "default", "bfloat16", None), ("float32", "highest", "float32/highest", "this is a bug"),
    ("float32", "default", "float32", "rerun with --matmul-precision highest")])
def test_report_counts_mismatches_and_flags_exact_fp32(tmp_path, dtype, precision, label, verdict):
    results = tmp_path / "r.jsonl"
    kw = dict(dtype=dtype, precision=precision)
    write_lines(results, [line("ar", None, **kw),
                          line("jetspec", 32, forwards=5, accepts=[1, 4], matches=False, **kw),
                          line("ar", None, temperature=1.0, **kw),
                          line("jetspec", 32, temperature=1.0, forwards=5, accepts=[2, 3], **kw),
                          {**line("jetspec", 64), "error": "prompt too long"}])
    paths = write_report([str(results)], str(tmp_path / "out"))
    md = open(paths[0]).read()
    assert f"- {label}: 1 mismatched prompts at T=0 (of 1 compared)." in md
    for note in ("this is a bug", "rerun with --matmul-precision highest"):
        assert (note in md) is (note == verdict)
    assert "1 runs failed" in md and "| 0 | jetspec | 32 |" in md and "| 1 | jetspec | 32 |" in md
    report = json.loads(open(paths[1]).read())
    assert report["failed_runs"] == 1 and len(report["groups"]) == 4


def test_precisions_stay_apart(tmp_path):
    """An fp32 check of the same prompts as a bf16 run is its own group, never a replacement."""
    bf16 = dict(dtype="bfloat16", precision="default")
    write_lines(tmp_path / "bf16.jsonl", [line("ar", None, id=i, **bf16) for i in "01"] + [
        line("jetspec", 16, id=i, decode=0.5, forwards=4, matches=False, **bf16) for i in "01"])
    write_lines(tmp_path / "fp32.jsonl", [line("ar", None, decode=4.0), line("jetspec", 16, forwards=5, matches=True)])
    paths = write_report([str(tmp_path / "bf16.jsonl"), str(tmp_path / "fp32.jsonl")], str(tmp_path / "out"))
    groups = {(g["method"], g["precision"]): g for g in json.loads(open(paths[1]).read())["groups"]}
    assert groups[("jetspec", "bfloat16")]["n"] == 2 and groups[("jetspec", "bfloat16")]["mismatches"] == 2
    assert groups[("jetspec", "bfloat16")]["speedup"] == pytest.approx(2.0)  # paired with bf16 AR only
    assert groups[("jetspec", "float32/highest")]["n"] == 1 and groups[("jetspec", "float32/highest")]["tau"] == 2
    md = open(paths[0]).read()
    assert "## Summary: speedup/tau (bfloat16; float32/highest in the per-benchmark tables)" in md
    assert "| 0 | jetspec | 16 | 2.00/2.50 |" in md  # the summary shows the bf16 run
    assert "- bfloat16: 2 mismatched" in md and "- float32/highest: 0 mismatched" in md


def test_gzipped_results_read_like_plain_ones(tmp_path):
    """Archived runs are kept gzipped in the repository; the report reads them as they are."""
    lines = [line("ar", None), line("jetspec", 16, decode=0.5, forwards=4, accepts=[0, 1, 2, 1], matches=True)]
    write_lines(tmp_path / "r.jsonl", lines)
    with gzip.open(tmp_path / "r.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write((tmp_path / "r.jsonl").read_text() + '{"torn": ')  # a crash's partial last line is skipped
    assert read_lines(str(tmp_path / "r.jsonl.gz")) == read_lines(str(tmp_path / "r.jsonl")) == lines
    write_report([str(tmp_path / "r.jsonl.gz")], str(tmp_path / "gz"))
    write_report([str(tmp_path / "r.jsonl")], str(tmp_path / "plain"))
    groups = [json.loads((tmp_path / d / "report.json").read_text())["groups"] for d in ("gz", "plain")]
    assert groups[0] == groups[1] and len(groups[0]) == 2


def test_two_heads_in_one_group_are_refused(tmp_path):
    """An older head's archive given with a newer one's would blend both heads' prompts into one tau."""
    old = [line("ar", None), line("jetspec", 16, forwards=4, matches=True)]
    new = [line("ar", None, id="1"), {**line("jetspec", 16, id="1", forwards=5, matches=True), "head_sha256": "def"}]
    write_lines(tmp_path / "old.jsonl", old)
    write_lines(tmp_path / "new.jsonl", new)
    with pytest.raises(ValueError, match=r"2 draft heads in one group \(gsm8k jetspec B=16 T=0.0 float32/highest\)"):
        write_report([str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl")], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing written before the refusal


def test_two_tree_temperatures_in_one_group_are_refused(tmp_path):
    lines = [line("ar", None), {**line("jetspec", 16, forwards=4, matches=True), "tree_temperature": 1.0},
             line("ar", None, id="1"),
             {**line("jetspec", 16, id="1", forwards=5, matches=True), "tree_temperature": 0.6}]
    write_lines(tmp_path / "r.jsonl", lines)
    with pytest.raises(ValueError, match=r"tree temperatures 0.6, 1.0 in one group \(gsm8k jetspec B=16"):
        write_report([str(tmp_path / "r.jsonl")], str(tmp_path / "out"))


def test_two_gemm_backends_in_one_group_are_refused(tmp_path):
    """Lines from before the setting was recorded count as XLA's backend."""
    lines = [line("ar", None), line("jetspec", 16, forwards=4, matches=True), line("ar", None, id="1"),
             {**line("jetspec", 16, id="1", forwards=5, matches=True), "gemm_backend": "cublas"}]
    write_lines(tmp_path / "r.jsonl", lines)
    with pytest.raises(ValueError, match=r"GEMM backends cublas, xla in one group \(gsm8k jetspec B=16"):
        write_report([str(tmp_path / "r.jsonl")], str(tmp_path / "out"))


def test_benchmarks_without_a_reference_report_speed_and_lossless_check(tmp_path):
    """Held-out benchmarks score nothing: accuracy and = AR are "-", tau, speedup and mismatches stand;
    the prompt lengths and the prompts too long to run are shown per benchmark."""
    kw = dict(benchmark="summarise", correct=None)
    lines = [{**line("ar", None, **kw), "prompt_tokens": 900},
             {**line("jetspec", 64, decode=0.5, forwards=4, accepts=[0, 2, 2], matches=True, **kw),
              "prompt_tokens": 900},
             {**line("ar", None, id="1", **kw), "prompt_tokens": 7700, "error": "skipped for every method"},
             line("ar", None), line("jetspec", 64, decode=0.5, forwards=5, accepts=[1, 4], matches=True)]
    write_lines(tmp_path / "r.jsonl", lines)
    paths = write_report([str(tmp_path / "r.jsonl")], str(tmp_path / "out"))
    groups = {(g["benchmark"], g["method"]): g for g in json.loads(open(paths[1]).read())["groups"]}
    spec = groups[("summarise", "jetspec")]
    assert spec["accuracy"] is None and spec["accuracy_same_as_ar"] is None and spec["tau"] == 2.5
    assert spec["speedup"] == pytest.approx(2.0) and (spec["mismatches"], spec["compared"]) == (0, 1)
    assert groups[("gsm8k", "jetspec")]["accuracy_same_as_ar"] is True
    md = open(paths[0]).read()
    assert "| jetspec B=64 | float32/highest | 0 | 1 | 2.50 | 20.0 | 2.00 | 1.00 | - | - | 0/1 |" in md
    assert "| 0 | jetspec | 64 | 2.00/2.00 | 2.00/2.50 |" in md  # summary: gsm8k, then summarise
    assert "Prompt tokens: mean 900, max 900 (ar, n=1)." in md
    assert "- summarise: 1 runs of 1 prompts (1); e.g. skipped for every method" in md


def test_report_without_matplotlib_writes_the_tables(tmp_path, monkeypatch, caplog):
    write_lines(tmp_path / "r.jsonl", [line("ar", None), line("jetspec", 16, decode=0.5, forwards=4,
                                                              accepts=[0, 1, 2, 1], matches=True)])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with caplog.at_level(logging.WARNING):
        paths = write_report([str(tmp_path / "r.jsonl")], str(tmp_path / "out"))
    assert [os.path.basename(p) for p in paths] == ["report.md", "report.json"]
    assert sorted(os.listdir(tmp_path / "out")) == ["report.json", "report.md"]
    assert "## Plots" not in (tmp_path / "out" / "report.md").read_text()
    assert 'pip install -e ".[eval]"' in caplog.text
