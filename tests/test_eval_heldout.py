"""The held-out benchmarks (summarise, doc_qa, translate, open_qa): prompts of the training mixture's
held-out slice only, never training prompts, in a stable mixed order; and the runner pads and sizes the
cache per prompt, recording prompts too long for the target instead of dropping them."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from conftest import make_tiny_gguf
from jetspec_jax import api as api_module
from jetspec_jax.errors import DamagedFileError
from jetspec_jax.eval import runner
from jetspec_jax.eval.__main__ import main
from jetspec_jax.eval.datasets import BENCHMARKS, EvalItem, load_benchmark, record_datasets
from jetspec_jax.eval.heads import resolve_heads
from jetspec_jax.eval.records import read_lines
from jetspec_jax.target import load_target
from jetspec_jax.tokens import encode_prompts
from jetspec_jax.train.config import DEFAULT_DATA_DIR
from jetspec_jax.train.mixture import SOURCES, TRAIN_MIX_DIR, is_heldout, load_prompts

HELDOUT = ("summarise", "doc_qa", "translate", "open_qa")
needs_data = pytest.mark.skipif(not os.path.isdir(os.path.join(DEFAULT_DATA_DIR, TRAIN_MIX_DIR)),
                                reason=f"no {TRAIN_MIX_DIR}/ in {DEFAULT_DATA_DIR}")


def source_and_id(item: EvalItem) -> tuple[str, str]:
    source, _, record_id = item.id.partition("/")
    return source, record_id


@needs_data
@pytest.mark.parametrize("name", HELDOUT)
def test_heldout_benchmark_is_heldout_and_stable(name):
    items = load_benchmark(name)
    assert len(items) >= 48 and len({i.id for i in items}) == len(items)
    assert all(i.benchmark == name and i.reference is None and i.prompt.strip() for i in items)
    keys = {source_and_id(i) for i in items}
    sources = {source for source, _ in keys}
    assert sources <= set(SOURCES) and all(is_heldout(source, record_id) for source, record_id in keys)
    training = load_prompts(DEFAULT_DATA_DIR, {source: None for source in sources}, seed=0, split="train")
    assert not keys & {(r["source"], r["id"]) for r in training}
    assert not {i.prompt for i in items} & {r["prompt"] for r in training}
    assert load_benchmark(name) == items and load_benchmark(name, limit=16) == items[:16]
    assert len({source_and_id(i)[0] for i in items[:16]}) >= 2  # --limit takes a mix of the sources


@needs_data
def test_heldout_benchmarks_take_the_named_kinds_and_datasets():
    bbc = {r["id"]: r["kind"] for r in load_prompts(DEFAULT_DATA_DIR, {"summarization_bbc_news": None}, seed=0,
                                                    split="heldout")}
    summarise = [source_and_id(i) for i in load_benchmark("summarise")]
    assert {bbc[rid] for source, rid in summarise if source == "summarization_bbc_news"} == {"long_context"}
    datasets = {**record_datasets(DEFAULT_DATA_DIR, "long_context_p3_wikihop_multinews"),
                **record_datasets(DEFAULT_DATA_DIR, "instruction_p3_summarization_rc")}
    assert {datasets[rid] for _, rid in summarise if rid in datasets} == {"P3/multi_news"}
    doc_qa = {datasets[rid] for _, rid in map(source_and_id, load_benchmark("doc_qa")) if rid in datasets}
    assert doc_qa == {"P3/wiki_hop", "P3/duorc_SelfRC", "P3/duorc_ParaphraseRC", "P3/quoref"}
    every = [i.id for name in HELDOUT for i in load_benchmark(name)]
    assert len(every) == len(set(every))  # no prompt in two benchmarks


def heldout_ids(source: str, count: int, heldout: bool = True) -> list[str]:
    ids = (f"{source}-{i}" for i in range(100_000))
    return [rid for rid, _ in zip((rid for rid in ids if is_heldout(source, rid) == heldout), range(count))]


def write_train_mix(data_dir, records: dict[str, list[dict]]) -> str:
    """A data dir whose train_mix/ holds one small gzip file per source (the fields of the real ones)."""
    os.makedirs(os.path.join(data_dir, TRAIN_MIX_DIR), exist_ok=True)
    for source, rows in records.items():
        with gzip.open(os.path.join(data_dir, SOURCES[source].file), "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(data_dir)


def record(rid: str, prompt: str, category: str = "translation", dataset: str = "WMT") -> dict:
    return {"id": rid, "source": dataset, "category": category, "prompt": prompt}


def test_loader_reads_only_heldout_records_of_the_named_slices(tmp_path):
    files = {}
    for source in ("translation_wmt_de_en", "translation_multi30k", "translation_tanaka_ja_en"):
        files[source] = [record(rid, f"Translate {rid}.") for rid in
                         heldout_ids(source, 3) + heldout_ids(source, 3, heldout=False)]
    rc = "instruction_p3_summarization_rc"
    files[rc] = [record(rid, f"Answer from {rid}.", "instruction", dataset)
                 for rid, dataset in zip(heldout_ids(rc, 3), ("P3/quoref", "P3/xsum", "P3/duorc_SelfRC"))]
    for source in ("long_context_wikitablequestions", "long_context_p3_wikihop_multinews", "stem_qa_pubmedqa"):
        files[source] = []
    data_dir = write_train_mix(tmp_path / "a", files)

    translate = load_benchmark("translate", data_dir)
    expected = {f"{source}/{rid}" for source in files if source.startswith("translation")
                for rid in heldout_ids(source, 3)}
    assert {i.id for i in translate} == expected and all(i.reference is None for i in translate)
    assert [i.prompt for i in translate] == [f"Translate {i.id.partition('/')[2]}." for i in translate]
    reversed_files = write_train_mix(tmp_path / "b", {source: rows[::-1] for source, rows in files.items()})
    assert load_benchmark("translate", reversed_files) == translate  # the order is not the files' order
    assert load_benchmark("translate", data_dir, limit=4) == translate[:4]

    doc_qa = load_benchmark("doc_qa", data_dir)  # only duorc/quoref rows of the P3 summarisation file
    assert sorted(i.id for i in doc_qa) == sorted(f"{rc}/{rid}" for rid in heldout_ids(rc, 3)[::2])

    with pytest.raises(FileNotFoundError, match="point --data-dir"):
        load_benchmark("open_qa", data_dir)
    with gzip.open(os.path.join(data_dir, SOURCES["translation_multi30k"].file), "at") as f:
        f.write("{not json\n")
    with pytest.raises(DamagedFileError, match="translation_multi30k"):
        load_benchmark("translate", data_dir)
    assert set(HELDOUT) <= set(BENCHMARKS)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """A 2-layer model with a byte-level tokenizer (a token per byte) and 512 positions."""
    return make_tiny_gguf(str(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def tiny_target(tiny_gguf):
    return load_target(tiny_gguf, dtype="float32")


def open_qa_dir(data_dir, prompts: list[str]) -> tuple[str, list[str]]:
    """A data dir whose open_qa holds `prompts`, with their item ids."""
    source = "stem_qa_webquestions"
    ids = heldout_ids(source, len(prompts))
    files = {source: [record(rid, p, "stem_qa") for rid, p in zip(ids, prompts)],
             "stem_qa_trec_questions": [], "stem_qa_strategyqa": []}
    return write_train_mix(data_dir, files), [f"{source}/{rid}" for rid in ids]


def test_runner_pads_each_prompt_alone_and_records_prompts_that_do_not_fit(tiny_gguf, tiny_target, tmp_path,
                                                                            monkeypatch):
    """A long and a short prompt in one run each get their own padded width and cache; one too long for
    the model's positions gets an error line, and the report lists it."""
    short, long, too_long = "Why?", "Why " + "so " * 100 + "?", "Why " + "very " * 120 + "?"
    data_dir, ids = open_qa_dir(tmp_path / "data", [short, long, too_long])
    compiled = []  # (padded prompt width, cache rows, max_new_tokens) of every generation call
    real_compiled_call = api_module.compiled_call

    def spy(fn, args, static):
        compiled.append((args[1].shape[1], static["cache_len"], static["gen"].max_new_tokens))
        return real_compiled_call(fn, args, static)

    monkeypatch.setattr(api_module, "compiled_call", spy)
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: tiny_target)
    results = tmp_path / "r.jsonl"
    assert main(["run", "--benchmarks", "open_qa", "--data-dir", data_dir, "--model", tiny_gguf,
                 "--methods", "ar", "--max-new-tokens", "4", "--prompt-bucket", "64", "--results", str(results),
                 "--no-progress", "--no-cache"]) == 0

    lengths = [len(ids_) for ids_ in encode_prompts(tiny_target.tokenizer, [short, long, too_long])]
    assert lengths[0] <= 64 < lengths[1] <= 512 - 4 < lengths[2]
    widths = [-(-n // 64) * 64 for n in lengths[:2]]  # each prompt's own multiple of the bucket
    assert sorted(set(compiled)) == sorted({(w, -(-(w + 4) // 64) * 64, new) for w in widths for new in (1, 4)})
    lines = {line["id"]: line for line in read_lines(str(results))}
    assert [lines[i]["prompt_tokens"] for i in ids] == lengths and "error" not in lines[ids[0]]
    assert "skipped for every method" in lines[ids[2]]["error"] and "512 positions" in lines[ids[2]]["error"]
    assert lines[ids[0]]["correct"] is None  # no reference: nothing scored

    out = tmp_path / "report"
    assert main(["report", str(results), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    assert "### open_qa" in md and "1 runs failed" in md and ids[2] in md
    assert json.loads((out / "report.json").read_text())["failed_prompts"] == {"open_qa": [ids[2]]}


def test_batches_hold_prompts_of_one_padded_width(tiny_gguf, tiny_target, tmp_path, monkeypatch):
    """--batch 2: the two short prompts share a call, the long one (another width) runs in its own, filled up
    to 2 with a copy, and the one too long for the model gets its error line and no call."""
    short, other, long, too_long = "Why?", "How?", "Why " + "so " * 100 + "?", "Why " + "very " * 120 + "?"
    data_dir, ids = open_qa_dir(tmp_path / "data", [short, long, other, too_long])
    compiled = []  # (batch, padded prompt width, max_new_tokens) of every generation call
    real_compiled_call = api_module.compiled_call

    def spy(fn, args, static):
        compiled.append((*args[1].shape[:2], static["gen"].max_new_tokens))
        return real_compiled_call(fn, args, static)

    monkeypatch.setattr(api_module, "compiled_call", spy)
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: tiny_target)
    results = tmp_path / "r.jsonl"
    assert main(["run", "--benchmarks", "open_qa", "--data-dir", data_dir, "--model", tiny_gguf, "--methods", "ar",
                 "--max-new-tokens", "4", "--batch", "2", "--results", str(results), "--no-progress",
                 "--no-cache"]) == 0
    assert sorted(set(compiled)) == [(2, 64, 1), (2, 64, 4), (2, 384, 1), (2, 384, 4)]
    lines = {line["id"]: line for line in read_lines(str(results))}
    assert [lines[i]["batch_size"] for i in ids[:3]] == [2, 1, 2] and lines[ids[3]]["batch"] == 2
    assert "skipped for every method" in lines[ids[3]]["error"] and "batch_size" not in lines[ids[3]]


def test_a_prompt_runs_for_every_method_or_for_none(tiny_target):
    """The fit rule takes the run's largest tree, so every method and budget sees the same prompts."""
    config = runner.EvalConfig(benchmarks=("open_qa",), methods=("ar", "jetspec"), budgets=(16, 256),
                               max_new_tokens=4, allow_untrained=True, progress=False)
    heads = resolve_heads(config.methods, {}, tiny_target, allow_untrained=True)
    evaluator = runner.Evaluator(config, tiny_target, heads, 0, {}, "highest")
    fits_ar_alone = EvalItem("open_qa", "a", "Why " + "so " * 100 + "?", None)  # ~320 tokens + 256-row tree
    assert evaluator.does_not_fit(EvalItem("open_qa", "b", "Why?", None)) is None
    reason = evaluator.does_not_fit(fits_ar_alone)
    assert reason.startswith("skipped for every method and budget") and "256 scratch" in reason
    lines = [evaluator.run(runner.RunSpec(fits_ar_alone, method, budget, 0.0))
             for method, budget in (("ar", None), ("jetspec", 16), ("jetspec", 256))]
    assert all(line["error"] == reason and line["prompt_tokens"] > 64 for line in lines)
