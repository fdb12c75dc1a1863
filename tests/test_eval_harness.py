"""The eval harness end to end on the embedded model: `run` writes one line per run with AR-identical
tokens in fp32, resumes without regenerating, `report` writes the tables and plots; bad input exits 2."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from jetspec_jax import api, compilation
from jetspec_jax.eval import runner
from jetspec_jax.eval.__main__ import main
from jetspec_jax.eval.heads import resolve_heads
from jetspec_jax.eval.records import check_compatible, line_key, meta_path, read_lines
from jetspec_jax.loading.head_checkpoint import packaged_head_path, verify_head_files
from jetspec_jax.train.config import DEFAULT_DATA_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir(DEFAULT_DATA_DIR), reason=f"no data at {DEFAULT_DATA_DIR}")

RUN_ARGS = ["run", "--benchmarks", "gsm8k", "humaneval", "--methods", "ar", "jetspec", "--budgets", "16",
            "--temperatures", "0", "--limit", "2", "--max-new-tokens", "12", "--no-progress"]


def run_cli(results) -> int:
    return main(RUN_ARGS + ["--results", str(results)])


def exit_code(argv) -> int:
    """main's return code, or argparse's exit code for usage errors."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


@pytest.fixture(scope="module")
def finished_run(embedded_target, tmp_path_factory):
    """The CLI with the session's embedded target standing in for a fresh load."""
    results = tmp_path_factory.mktemp("eval") / "results.jsonl"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "load_target", lambda *args, **kwargs: embedded_target)
        assert run_cli(results) == 0
    return results, embedded_target


def test_run_writes_one_line_per_run(finished_run):
    results, target = finished_run
    lines = read_lines(str(results))
    keys = [line_key(line) for line in lines]
    assert keys == [(b, i, m, budget, 0.0) for b, ids in (("gsm8k", ("0", "1")),
                                                          ("humaneval", ("HumanEval/0", "HumanEval/1")))
                    for i in ids for m, budget in (("ar", None), ("jetspec", 16))]
    head_sha = verify_head_files(packaged_head_path(target, "jetspec")).weights_digest()  # one file or shards
    for line in lines:
        assert line["dtype"] == "float32" and line["matmul_precision"] == "highest"
        assert 1 <= line["num_generated"] <= 12
        assert line["decode_seconds"] >= 0 and line["prefill_seconds"] > 0
        assert line["correct"] in (True, False) and isinstance(line["text"], str)
        assert line["heads_label"] == "shipped"  # the default name of the packaged heads
        if line["method"] == "ar":
            assert line["head_sha256"] is None and len(line["token_ids"]) == line["num_generated"]
        else:
            assert line["head_sha256"] == head_sha and line["tau"] >= 1
            assert sum(line["accept_counts"]) == line["target_forwards"]
    meta = json.loads(open(meta_path(str(results))).read())
    assert meta["settings"]["max_new_tokens"] == 12 and "--limit 2" in meta["runs"][0]["command"]
    assert meta["heads"] == {"jetspec": head_sha} and meta["settings"]["heads_label"] == "shipped"


def test_jetspec_tokens_equal_ar_in_fp32(finished_run):
    lines = read_lines(str(finished_run[0]))
    spec = [r for r in lines if r["method"] == "jetspec"]
    assert len(spec) == 4 and all(r["matches_ar"] is True and "token_ids" not in r for r in spec)
    ar_text = {(r["benchmark"], r["id"]): r["text"] for r in lines if r["method"] == "ar"}
    assert all(r["text"] == ar_text[(r["benchmark"], r["id"])] for r in spec)


def test_report_writes_markdown_json_and_plots(finished_run, tmp_path):
    results, _ = finished_run
    assert main(["report", str(results), "--out", str(tmp_path)]) == 0
    names = {"report.md", "report.json", "speedup_vs_budget.png", "tau_vs_budget.png"}
    assert names <= set(os.listdir(tmp_path))
    assert all(os.path.getsize(tmp_path / n) > 0 for n in names)
    md = (tmp_path / "report.md").read_text()
    assert "fp32 the count must be 0" in md
    assert re.search(r"- float32\S*: 0 mismatched prompts at T=0 \(of 4 compared\)", md)
    assert "### gsm8k" in md and "### humaneval" in md and "jetspec B=16" in md
    groups = json.loads((tmp_path / "report.json").read_text())["groups"]
    spec = [g for g in groups if g["method"] == "jetspec"]
    assert len(spec) == 2 and all(g["n"] == 2 and g["mismatches"] == 0 and g["tau"] >= 1 for g in spec)
    assert all(g["accuracy_same_as_ar"] is True and g["speedup"] > 0 for g in spec)


def test_rerun_resumes_without_generating(finished_run, monkeypatch):
    results, _ = finished_run
    before = results.read_text()

    def fail(*args, **kwargs):
        raise AssertionError("a finished run must not generate or load the model again")
    monkeypatch.setattr(runner, "generate", fail)
    monkeypatch.setattr(runner, "load_target", fail)
    assert run_cli(results) == 0
    assert results.read_text() == before


def test_interrupted_run_completes_the_missing_lines(finished_run, tmp_path, monkeypatch):
    """A crash mid-write leaves a torn line: it is dropped and only the missing run is redone, compared
    with the AR tokens already on disk."""
    results, target = finished_run
    lines = results.read_text().splitlines(keepends=True)
    partial = tmp_path / "results.jsonl"
    partial.write_text("".join(lines[:-1]) + lines[-1][:40])
    (tmp_path / "results.jsonl.meta.json").write_text(open(meta_path(str(results))).read())
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: target)
    assert run_cli(partial) == 0
    redone = read_lines(str(partial))
    assert len(redone) == 8 and redone[:7] == read_lines(str(results))[:7]
    assert redone[-1]["id"] == "HumanEval/1" and redone[-1]["method"] == "jetspec"
    assert redone[-1]["matches_ar"] is True and redone[-1]["run"] == 1


def test_changed_settings_are_refused(finished_run, capsys):
    results, _ = finished_run
    assert main(RUN_ARGS[:-3] + ["--max-new-tokens", "13", "--no-progress", "--results", str(results)]) == 2
    assert "different settings (max_new_tokens)" in capsys.readouterr().err


def test_tree_temperature_is_a_setting_that_older_files_ran_at_one(finished_run, capsys, tmp_path):
    results, _ = finished_run
    assert main(RUN_ARGS + ["--tree-temperature", "0.6", "--results", str(results)]) == 2
    assert "different settings (tree_temperature)" in capsys.readouterr().err
    assert {line["tree_temperature"] for line in read_lines(str(results))} == {None, 1.0}  # ar: None
    older = tmp_path / "older.jsonl"  # the same file as written before the setting was recorded
    older.write_text(results.read_text())
    meta = json.loads(open(meta_path(str(results))).read())
    del meta["settings"]["tree_temperature"]
    open(meta_path(str(older)), "w").write(json.dumps(meta))
    assert run_cli(older) == 0  # resumes at the default: every line is there, nothing runs
    assert main(RUN_ARGS + ["--tree-temperature", "0.6", "--results", str(older)]) == 2


def test_gemm_backend_is_a_setting_that_older_files_ran_at_xla(finished_run, capsys, tmp_path):
    results, _ = finished_run
    assert main(RUN_ARGS + ["--gemm-backend", "cublas", "--results", str(results)]) == 2
    assert "different settings (gemm_backend)" in capsys.readouterr().err
    assert {line["method"]: line["gemm_backend"] for line in read_lines(str(results))} == {"ar": None,
                                                                                          "jetspec": "xla"}
    older = tmp_path / "older.jsonl"
    older.write_text(results.read_text())
    meta = json.loads(open(meta_path(str(results))).read())
    del meta["settings"]["gemm_backend"]
    open(meta_path(str(older)), "w").write(json.dumps(meta))
    assert run_cli(older) == 0
    assert main(RUN_ARGS + ["--gemm-backend", "cublas", "--results", str(older)]) == 2


def test_heads_label_is_a_setting_that_older_files_derive_from_their_heads(finished_run, capsys, tmp_path):
    """A file resumes under its own head-set label only; one written before the label was recorded
    resumes under the label `report` gives its lines (here "shipped")."""
    results, _ = finished_run
    assert main(RUN_ARGS + ["--heads-label", "other", "--results", str(results)]) == 2
    assert "different settings (heads_label)" in capsys.readouterr().err
    older = tmp_path / "older.jsonl"
    older.write_text("".join(json.dumps({k: v for k, v in line.items() if k != "heads_label"}) + "\n"
                             for line in read_lines(str(results))))
    meta = json.loads(open(meta_path(str(results))).read())
    del meta["settings"]["heads_label"]
    open(meta_path(str(older)), "w").write(json.dumps(meta))
    assert run_cli(older) == 0  # nothing runs
    assert main(RUN_ARGS + ["--heads-label", "shipped", "--results", str(older)]) == 0
    assert main(RUN_ARGS + ["--heads-label", "other", "--results", str(older)]) == 2


def test_shipped_heads_serve_every_method(finished_run):
    _, target = finished_run
    heads = resolve_heads(("ar", "dflash", "ddtree", "jetspec"), {}, target, allow_untrained=False)
    assert set(heads) == {"jetspec", "bidirectional"}
    assert heads["bidirectional"].sha256 is not None and heads["bidirectional"].block_size == 16


def test_methods_without_a_head_are_skipped_with_a_warning(finished_run, caplog, monkeypatch):
    _, target = finished_run
    methods = ("ar", "dflash", "ddtree", "jetspec")
    def only_jetspec(target, method):
        return packaged_head_path(target, method) if method == "jetspec" else None

    monkeypatch.setattr("jetspec_jax.eval.heads.packaged_head_path", only_jetspec)
    with caplog.at_level(logging.WARNING):
        heads = resolve_heads(methods, {}, target, allow_untrained=False)
    assert set(heads) == {"jetspec"}
    assert "skipping ddtree" in caplog.text and "skipping dflash" in caplog.text
    heads = resolve_heads(methods, {}, target, allow_untrained=True)
    assert heads["bidirectional"].path is None and heads["bidirectional"].sha256 is None
    plan = runner.method_budgets(methods, (64, 16), heads)
    assert plan == [("ar", None), ("dflash", 16), ("ddtree", 16), ("ddtree", 64), ("jetspec", 16),
                    ("jetspec", 64)]


@pytest.mark.parametrize("args, message", [
    (["--benchmarks", "gsm9k"], "unknown benchmark 'gsm9k'"),
    (["--methods", "eagle"], "unknown method 'eagle'"),
    (["--budgets", "1"], "budget must be >= 2"),
    (["--prompt-bucket", "0"], "prompt_bucket must be >= 1"),
    (["--batch", "0"], "batch must be >= 1"),
    (["--compile-workers", "-1"], "compile_workers must be >= 0"),
    (["--draft-attention", "pallas"], "draft_attention 'pallas' runs only on a GPU"),
    (["--tree-temperature", "0"], "tree_temperature must be a positive number, got 0"),
    (["--gemm-backend", "cudnn"], "invalid choice: 'cudnn'"),
    (["--heads", "jetspec=/no/such/head"], "no draft head at /no/such/head"),
    (["--heads", "causal=/tmp"], "expected ROLE=DIR"),
    (["--heads-label", "new heads"], "heads_label must be letters, digits and . _ + -"),
    (["--data-dir", "/no/such/data"], "does not exist; point --data-dir"),
    (["--limit"], "expected one argument"),
    (["--results", "/tmp/archived.jsonl.gz"], "is gzipped (an archived run, read-only)"),
])
def test_bad_input_is_one_error_line_and_exit_2(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("bad input loaded the model"))
    code = exit_code(["run", "--results", str(tmp_path / "r.jsonl"), "--no-progress", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error:") and message in err and "\n" not in err
    assert not os.path.exists(tmp_path / "r.jsonl")


def test_report_of_missing_file_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 2
    assert "no results file" in capsys.readouterr().err


BATCH_ARGS = ["run", "--benchmarks", "gsm8k", "--methods", "ar", "jetspec", "--budgets", "16", "--temperatures",
              "0", "--limit", "3", "--max-new-tokens", "12", "--no-progress", "--batch", "2"]


def spy_generate(monkeypatch, calls: list) -> None:
    """Records (method, prompts per call, max_new_tokens) of every generation call the runner makes."""
    real = runner.generate

    def spy(prompts, *args, **kwargs):
        calls.append((kwargs["method"], 1 if isinstance(prompts, str) else len(prompts), kwargs["max_new_tokens"]))
        return real(prompts, *args, **kwargs)
    monkeypatch.setattr(runner, "generate", spy)


def spy_compiles(monkeypatch, events: list) -> None:
    """Records ("ahead", programs compiled) for each compile_ahead and, for each generation call, ("call",
    whether its program was compiled before the call)."""
    real_ahead, real_call = runner.compile_ahead, api.compiled_call

    def ahead(calls, workers):
        compiled = real_ahead(calls, workers)
        events.append(("ahead", compiled))
        return compiled

    def call(fn, args, static):
        signature = compilation.call_signature(fn, args, static)
        events.append(("call", signature in compilation._COMPILED or signature in compilation._AHEAD))
        return real_call(fn, args, static)
    monkeypatch.setattr(runner, "compile_ahead", ahead)
    monkeypatch.setattr(api, "compiled_call", call)


@pytest.fixture(scope="module")
def batched_run(finished_run, tmp_path_factory):
    """gsm8k's first three prompts (one padded width) at --batch 2: a batch of prompts 0 and 1, then 2 and a
    copy of it that fills the batch; prompts 0 and 1 also ran alone in finished_run."""
    results = tmp_path_factory.mktemp("eval-batched") / "results.jsonl"
    calls, compiles = [], []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runner, "load_target", lambda *args, **kwargs: finished_run[1])
        spy_generate(mp, calls)
        spy_compiles(mp, compiles)
        assert main(BATCH_ARGS + ["--results", str(results)]) == 0
    return results, calls, compiles


def test_programs_compile_before_the_timed_calls(batched_run):
    """Four programs at batch 2 (AR and jetspec, each with its prefill-only call), compiled ahead in
    parallel; no generation call compiles its own."""
    _, calls, compiles = batched_run
    assert compiles[0] == ("ahead", 4)
    assert [e for e in compiles if e[0] == "call"] == [("call", True)] * len(calls)


def test_batched_lines_equal_batch_one_lines_in_fp32(finished_run, batched_run):
    """Per-sequence tokens, tau and acceptance do not depend on the batch; timings are the batch's."""
    results, calls, _ = batched_run
    assert ("ar", 2, 12) in calls and ("jetspec", 2, 12) in calls and ("jetspec", 2, 1) in calls
    assert {size for _, size, _ in calls} == {2}  # the short batch is filled: one program per width
    alone = {line_key(line): line for line in read_lines(str(finished_run[0]))}
    lines = read_lines(str(results))
    runs = (("ar", None), ("jetspec", 16))
    assert [line_key(line) for line in lines] == [("gsm8k", i, m, b, 0.0) for m, b in runs for i in "012"]
    for line in lines:
        assert line["batch"] == 2 and line["batch_size"] == (1 if line["id"] == "2" else 2)
        assert line["batch_filled"] == 2 - line["batch_size"]
        assert line["batch_seconds"] >= line["batch_decode_seconds"] >= 0 and line["batch_prefill_seconds"] > 0
        assert "decode_seconds" not in line and "total_seconds" not in line
        if line["method"] == "jetspec":
            assert line["matches_ar"] is True and sum(line["accept_counts"]) == line["target_forwards"]
        if line_key(line) in alone:
            single = alone[line_key(line)]
            for field in ("text", "token_ids", "num_generated", "stopped", "target_forwards", "tau",
                          "accept_counts"):
                assert line.get(field) == single.get(field), field
    assert any(line["tau"] > 1 for line in lines if line["method"] == "jetspec")


def test_batched_rerun_writes_nothing(batched_run, monkeypatch):
    results = batched_run[0]
    before = results.read_text()
    monkeypatch.setattr(runner, "generate", lambda *a, **k: pytest.fail("a finished run generated again"))
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a finished run loaded the model"))
    assert main(BATCH_ARGS + ["--results", str(results)]) == 0
    assert results.read_text() == before


def test_interrupted_batched_run_completes_without_duplicates(finished_run, batched_run, tmp_path, monkeypatch):
    """Lost: jetspec's prompt 1 (its batch with prompt 0 reruns whole, writing only prompt 1's line) and a
    torn prompt 2."""
    results = batched_run[0]
    lines = results.read_text().splitlines(keepends=True)
    partial = tmp_path / "results.jsonl"
    partial.write_text("".join(lines[:4]) + lines[5][:40])
    (tmp_path / "results.jsonl.meta.json").write_text(open(meta_path(str(results))).read())
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: finished_run[1])
    calls = []
    spy_generate(monkeypatch, calls)
    assert main(BATCH_ARGS + ["--results", str(partial)]) == 0
    assert [c for c in calls if c[2] == 12] == [("jetspec", 2, 12), ("jetspec", 2, 12)]  # prompt 2 filled up to 2
    redone = read_lines(str(partial))
    assert redone[:4] == read_lines(str(results))[:4]
    assert sorted(map(line_key, redone)) == sorted(map(line_key, read_lines(str(results))))
    assert [(r["id"], r["run"], r["matches_ar"]) for r in redone[4:]] == [("1", 1, True), ("2", 1, True)]


def test_one_batch_size_per_results_file(finished_run, batched_run, capsys, monkeypatch):
    """Batch-1 and batched timings never share a file; one from before --batch existed ran at batch 1."""
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("a refused run loaded the model"))
    assert main(BATCH_ARGS[:-1] + ["4", "--results", str(batched_run[0])]) == 2
    err = capsys.readouterr().err
    assert "holds --batch 2 runs and this run is --batch 4" in err and "write this run to a new --results" in err
    meta = json.loads(open(meta_path(str(finished_run[0]))).read())
    del meta["settings"]["batch"]
    older = str(batched_run[0].parent / "older.jsonl")
    open(meta_path(older), "w").write(json.dumps(meta))
    check_compatible(older, {**meta["settings"], "batch": 1}, meta["heads"])
    with pytest.raises(ValueError, match="holds --batch 1 runs and this run is --batch 2"):
        check_compatible(older, {**meta["settings"], "batch": 2}, meta["heads"])


def test_a_draft_vocabulary_run_gets_its_own_results_file(finished_run, tmp_path):
    """A file from before --draft-vocab drafted over the whole vocabulary: a run with one goes elsewhere."""
    meta = json.loads(open(meta_path(str(finished_run[0]))).read())
    assert meta["settings"]["draft_vocab"] is None
    del meta["settings"]["draft_vocab"]
    older = str(tmp_path / "older.jsonl")
    open(meta_path(older), "w").write(json.dumps(meta))
    check_compatible(older, {**meta["settings"], "draft_vocab": None}, meta["heads"])
    with pytest.raises(ValueError, match=r"different settings \(draft_vocab\)"):
        check_compatible(older, {**meta["settings"], "draft_vocab": 4096}, meta["heads"])


def test_report_keeps_batch_sizes_apart(finished_run, batched_run, tmp_path):
    assert main(["report", str(finished_run[0]), str(batched_run[0]), "--out", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "## Summary, batch 2: throughput speedup/tau" in md and "## Summary: speedup/tau" in md
    assert re.search(r"- float32\S*: 0 mismatched prompts at T=0 \(of 4 compared\)", md)
    assert re.search(r"- float32\S*, batch 2: 0 mismatched prompts at T=0 \(of 3 compared\)", md)
    assert "| throughput speedup (batch 2) |" in md and "| jetspec B=16 batch 2 |" in md
    groups = {(g["benchmark"], g["method"], g["batch"]): g
              for g in json.loads((tmp_path / "report.json").read_text())["groups"]}
    batched, alone = groups[("gsm8k", "jetspec", 2)], groups[("gsm8k", "jetspec", 1)]
    assert batched["n"] == 3 and batched["mismatches"] == 0 and batched["accept_histogram"]
    assert batched["speedup"] is None and batched["throughput_speedup"] > 0
    assert alone["n"] == 2 and alone["throughput_speedup"] is None and alone["speedup"] > 0
