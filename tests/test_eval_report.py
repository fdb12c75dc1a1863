"""Eval report arithmetic on hand-made result lines: tau, speedups over paired prompts, accuracy
against AR, T=0 mismatch counts (an fp32 mismatch is flagged as a bug), histograms, failed runs, and
two head sets side by side, each against its own run's AR."""

from __future__ import annotations

import gzip
import json
import logging
import os
import sys

import pytest

from jetspec_jax.eval.records import label_heads, read_lines
from jetspec_jax.eval.report import group_metrics, write_report


def line(method, budget, id="0", *, generated=11, decode=1.0, total=1.5, forwards=None, accepts=None,
         correct=True, matches=None, dtype="float32", precision="highest", temperature=0.0,
         benchmark="gsm8k", head="heads/h", sha="abc", label=None):
    """A results line; `label` None is a line from before the head-set label was recorded."""
    speculative = method != "ar"
    return {"benchmark": benchmark, "id": id, "method": method, "budget": budget,
            "temperature": temperature, "num_generated": generated, "decode_seconds": decode,
            "total_seconds": total, "target_forwards": forwards, "accept_counts": accepts,
            "correct": correct, "matches_ar": matches, "dtype": dtype, "matmul_precision": precision,
            "head": head if speculative else None, "head_sha256": sha if speculative else None,
            "text": "", **({"heads_label": label} if label else {})}


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
    ("float32", "default", "float32", "rerun them")])
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
    for note in ("this is a bug", "rerun them"):
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


@pytest.mark.parametrize("label", [None, "new"])
def test_two_heads_under_one_label_are_refused(tmp_path, label):
    """An older head's archive given with a newer one's under one head-set label (the default one of
    the same head directory, or the same --heads-label) would blend both heads' prompts into one tau."""
    old = [line("ar", None, label=label), line("jetspec", 16, forwards=4, matches=True, label=label)]
    new = [line("ar", None, id="1", label=label),
           line("jetspec", 16, id="1", forwards=5, matches=True, sha="def", label=label)]
    write_lines(tmp_path / "old.jsonl", old)
    write_lines(tmp_path / "new.jsonl", new)
    with pytest.raises(ValueError, match=r"2 draft heads in one group \(gsm8k jetspec B=16 T=0.0 float32/highest, "
                                         rf"head set {label or 'h'}\): sha256 abc, def; run each head set with its "
                                         "own --heads-label"):
        write_report([str(tmp_path / "old.jsonl"), str(tmp_path / "new.jsonl")], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()  # nothing written before the refusal


def two_head_sets(tmp_path):
    """The shipped heads' run (written before the label was recorded) and a new head set's run of the
    same two prompts, each with its own AR: the new run's AR is twice as slow (another machine)."""
    shipped = dict(head="/elsewhere/jetspec_jax/heads/smollm2-135m-jetspec", sha="abc")
    new = dict(head="runs/h9000", sha="def", label="new")
    write_lines(tmp_path / "shipped.jsonl", [
        line("ar", None, id=i, decode=1.0, **shipped) for i in "01"] + [
        line("jetspec", 16, id=i, decode=0.5, forwards=4, accepts=[1, 3], matches=True, **shipped) for i in "01"])
    write_lines(tmp_path / "new.jsonl", [
        line("ar", None, id=i, decode=2.0, total=3.0, **new) for i in "01"] + [
        line("jetspec", 16, id=i, decode=0.5, forwards=2, accepts=[0, 2], matches=True, **new) for i in "01"] + [
        line("jetspec", 64, id=i, decode=0.4, forwards=2, matches=True, **new) for i in "01"])
    return [str(tmp_path / "shipped.jsonl"), str(tmp_path / "new.jsonl")]


def test_two_head_sets_report_side_by_side(tmp_path, caplog):
    """Each head set's groups are its own, and its speedup is against its own run's AR: the new heads'
    jetspec is timed like the shipped ones' but its AR is twice as slow, so its speedup is twice."""
    with caplog.at_level(logging.WARNING):
        paths = write_report(two_head_sets(tmp_path), str(tmp_path / "out"))
    assert "repeats" not in caplog.text  # the second run's AR lines replace none of the first's
    report = json.loads(open(paths[1]).read())
    assert report["head_sets"] == ["shipped", "new"]  # in the order the files were given: Δ is new - shipped
    groups = {(g["method"], g["budget"], g["heads_label"]): g for g in report["groups"]}
    assert sorted(groups) == [("ar", None, "new"), ("ar", None, "shipped"), ("jetspec", 16, "new"),
                              ("jetspec", 16, "shipped"), ("jetspec", 64, "new")]
    shipped, new = groups[("jetspec", 16, "shipped")], groups[("jetspec", 16, "new")]
    assert shipped["n"] == new["n"] == 2 and groups[("ar", None, "new")]["n"] == 2
    assert shipped["tau"] == pytest.approx(20 / 8) and new["tau"] == pytest.approx(20 / 4)
    assert shipped["speedup"] == pytest.approx(2.0) and new["speedup"] == pytest.approx(4.0)
    assert new["e2e_speedup"] == pytest.approx(2.0) and shipped["e2e_speedup"] == pytest.approx(1.0)
    assert new["heads"] == [["runs/h9000", "def"]]
    md = open(paths[0]).read()
    assert "| T | method | B | heads | gsm8k |" in md
    assert "| 0 | jetspec | 16 | shipped | 2.00/2.50 |" in md and "| 0 | jetspec | 16 | new | 4.00/5.00 |" in md
    assert "| jetspec B=16 | new | float32/highest | 0 | 2 | 5.00 |" in md  # per-benchmark table
    assert ("| method | T | tau shipped | tau new | Δ tau new | speedup shipped | speedup new | Δ speedup new |"
            in md)
    assert "| jetspec B=16 | 0 | 2.50 | 5.00 | +2.50 | 2.00 | 4.00 | +2.00 |" in md
    assert "| jetspec B=64 | 0 |" not in md  # run by one head set only: nothing to set beside it
    assert "- new: runs/h9000, `def`" in md and "- shipped: /elsewhere/jetspec_jax/heads/smollm2-135m-jetspec" in md


def test_one_head_set_has_no_side_by_side(tmp_path):
    paths = write_report(two_head_sets(tmp_path)[1:], str(tmp_path / "out"))
    md = open(paths[0]).read()
    assert "| T | method | B | gsm8k |" in md and "side by side" not in md and "| heads |" not in md


def test_lines_from_before_the_label_get_their_head_directories_name():
    """What `run` would name the head set now: "shipped" for packaged heads (on any machine), else the
    names of the other head directories; a recorded label stays."""
    def labels(*heads):
        return {x["heads_label"] for x in label_heads([line("ar", None)] + [
            line(m, 16, head=h) for m, h in zip(("jetspec", "ddtree"), heads)])}
    assert labels("/work/main/jetspec_jax/heads/smollm2-135m-jetspec",
                  "/work/main/jetspec_jax/heads/smollm2-135m-dflash") == {"shipped"}
    assert labels("runs/causal_9000/", "/abs/bidir_9000") == {"bidir_9000+causal_9000"}
    assert labels("runs/causal_9000", "jetspec_jax/heads/smollm2-135m-dflash") == {"causal_9000"}
    assert labels("untrained") == {"untrained"} and labels() == {"shipped"}  # AR alone: the default set
    recorded = [line("ar", None, label="mine"), line("jetspec", 16, label="mine")]
    assert label_heads(recorded) == recorded


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


def batched(line_, size=2, seconds=2.0, prefill=0.5):
    """A line of a --batch 2 run: the batch's timings instead of the prompt's own."""
    timing = {"batch": 2, "batch_size": size, "batch_seconds": seconds, "batch_prefill_seconds": prefill,
              "batch_decode_seconds": seconds - prefill}
    return {**{k: v for k, v in line_.items() if k not in ("decode_seconds", "total_seconds")}, **timing}


def test_batched_lines_report_throughput_against_ar_at_their_batch(tmp_path):
    """Each batch's seconds count once (shared among its lines); the speedup is throughput against AR's
    batches, kept apart from the batch-1 latency speedup of the same prompts."""
    prompts = [dict(), dict(id="1", generated=21)]
    spec_runs = [dict(forwards=4, accepts=[0, 4], matches=True), dict(forwards=5, accepts=[1, 4], matches=True)]
    write_lines(tmp_path / "alone.jsonl", [line("ar", None, **p) for p in prompts] + [
        line("jetspec", 16, decode=0.5, **p, **r) for p, r in zip(prompts, spec_runs)])
    spec_runs[1]["matches"] = False
    write_lines(tmp_path / "batched.jsonl", [batched(line("ar", None, **p), seconds=3.0, prefill=1.0)
                                             for p in prompts] + [
        batched(line("jetspec", 16, **p, **r)) for p, r in zip(prompts, spec_runs)] + [
        {**batched(line("jetspec", 16, id="2"), size=1), "error": "prompt too long"}])
    paths = write_report([str(tmp_path / "alone.jsonl"), str(tmp_path / "batched.jsonl")], str(tmp_path / "out"))
    groups = {(g["method"], g["batch"]): g for g in json.loads(open(paths[1]).read())["groups"]}
    spec, alone = groups[("jetspec", 2)], groups[("jetspec", 1)]
    assert spec["tau"] == alone["tau"] == pytest.approx(30 / 9)
    assert spec["accept_histogram"] == alone["accept_histogram"]
    assert spec["speedup"] is None and spec["throughput_speedup"] == pytest.approx((2.0 / 30) / (1.5 / 30))
    assert spec["e2e_throughput_speedup"] == pytest.approx((3.0 / 32) / (2.0 / 32))
    assert spec["decode_tokens_per_second"] == pytest.approx(30 / 1.5) and (spec["mismatches"], spec["n"]) == (1, 2)
    assert alone["speedup"] == pytest.approx(2.0) and alone["throughput_speedup"] is None
    md = open(paths[0]).read()
    assert "| 0 | jetspec | 16 | 2.00/3.33 |" in md  # batch 1: latency speedup
    assert "## Summary, batch 2: throughput speedup/tau (float32/highest; throughput against AR at batch 2" in md
    assert "| 0 | jetspec | 16 | 1.33/3.33 |" in md
    assert "| jetspec B=16 batch 2 | float32/highest | 0 | 2 | 3.33 | 20.0 | 1.33 | 1.50 | 1.000 | yes | 1/2 |" in md
    assert "- float32/highest: 0 mismatched" in md and "- float32/highest, batch 2: 1 mismatched" in md
    assert "1 runs failed" in md
