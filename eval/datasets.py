"""Benchmark loaders: each benchmark turns the data dir into `EvalItem`s (prompt text in the METHOD.md
section 7 format, plus what scoring needs) in a stable order. Six read an evaluation file; four gather
the held-out slices of the training mixture (train/mixture.py), which training never reads."""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any, Callable

from jetspec_jax.errors import DamagedFileError
from jetspec_jax.train.config import DEFAULT_DATA_DIR
from jetspec_jax.train.mixture import DATA_FIX, MATH_INSTRUCTION, SOURCES, load_prompts, read_jsonl, source_path

MBPP_TEST_IDS = range(11, 511)  # MBPP's test split; 1-10 are few-shot examples, 511+ validation/train
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")
MBPP_FORMAT = ("You are an expert Python programmer. Write a solution to the following task and make sure "
               "it passes the tests:\n{text}\nYour code should pass these tests:\n{tests}")
RECORD_ERRORS = (KeyError, TypeError, AttributeError, IndexError)


@dataclasses.dataclass(frozen=True)
class EvalItem:
    benchmark: str
    id: str
    prompt: str  # the user turn; the chat template is applied at generation
    reference: Any  # final answer (str), test material (dict) or None (no reference: nothing is scored)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    files: tuple[str, ...]  # what it reads, relative to the data dir (checked before loading)
    load: Callable[[str], list[EvalItem]]  # data dir -> every item, in the benchmark's order


def file_benchmark(name: str, file: str, to_item: Callable[[dict, int], EvalItem | None]) -> Benchmark:
    """One evaluation file in file order; `to_item` maps (record, line index) to an item, None to drop."""
    def load(data_dir: str) -> list[EvalItem]:
        path, items = os.path.join(data_dir, file), []
        for line, record in read_jsonl(path):
            try:
                item = to_item(record, line)
            except RECORD_ERRORS as e:
                raise DamagedFileError(f"{path}:{line + 1}", f"not a {name} record ({type(e).__name__}: {e})",
                                       DATA_FIX) from None
            if item is not None:
                items.append(item)
        return items
    return Benchmark((file,), load)


def gsm8k_item(r: dict, line: int) -> EvalItem:
    final = r["answer"].split("####")[-1].strip()
    return EvalItem("gsm8k", str(line), r["question"] + MATH_INSTRUCTION, final)


def math500_item(r: dict, line: int) -> EvalItem:
    return EvalItem("math500", r["unique_id"], r["problem"] + MATH_INSTRUCTION, r["answer"])


def aime25_item(r: dict, line: int) -> EvalItem:
    return EvalItem("aime25", r["id"], r["problem"] + MATH_INSTRUCTION, r["answer"])


def humaneval_item(r: dict, line: int) -> EvalItem:
    reference = {k: r[k] for k in ("prompt", "test", "entry_point")}
    return EvalItem("humaneval", r["task_id"], HUMANEVAL_FORMAT.format(prompt=r["prompt"]), reference)


def mbpp_item(r: dict, line: int) -> EvalItem | None:
    if r["task_id"] not in MBPP_TEST_IDS:
        return None
    prompt = MBPP_FORMAT.format(text=r["text"], tests="\n".join(r["test_list"]))
    reference = {"test_setup_code": r["test_setup_code"], "test_list": r["test_list"]}
    return EvalItem("mbpp", str(r["task_id"]), prompt, reference)


def mt_bench_item(r: dict, line: int) -> EvalItem:
    return EvalItem("mt_bench", str(r["question_id"]), r["turns"][0], None)  # first turn only


@dataclasses.dataclass(frozen=True)
class HeldoutSlice:
    """The held-out prompts of one training source (train/mixture.py SOURCES), narrowed to some prompt
    kinds and/or to the records of some upstream datasets (the record's `source` field, "P3/quoref")."""
    source: str
    kinds: tuple[str, ...] = ()  # empty: every kind
    datasets: tuple[str, ...] = ()  # empty: every record


def record_datasets(data_dir: str, source: str) -> dict[str, str]:
    """record id -> upstream dataset (the `source` field) of a train_mix file's records."""
    path, datasets = source_path(data_dir, source), {}
    for line, record in read_jsonl(path):
        try:
            datasets[record["id"]] = record["source"]
        except RECORD_ERRORS as e:
            raise DamagedFileError(f"{path}:{line + 1}", f"not a {source} record ({type(e).__name__}: {e})",
                                   DATA_FIX) from None
    return datasets


def heldout_benchmark(name: str, slices: tuple[HeldoutSlice, ...]) -> Benchmark:
    """Held-out training-mixture prompts without a reference (tau, speedup and the lossless check are the
    point), ids "source/record id", sorted and then shuffled by a seed fixed per benchmark, so the order
    is stable and the first N prompts (--limit) mix the sources."""
    def load(data_dir: str) -> list[EvalItem]:
        items = []
        for part in slices:
            datasets = record_datasets(data_dir, part.source) if part.datasets else {}
            items += [EvalItem(name, f"{part.source}/{row['id']}", row["prompt"], None)
                      for row in load_prompts(data_dir, {part.source: None}, seed=0, split="heldout")
                      if (not part.kinds or row["kind"] in part.kinds)
                      and (not part.datasets or datasets.get(row["id"]) in part.datasets)]
        items.sort(key=lambda item: item.id)
        random.Random(f"heldout-benchmark:{name}").shuffle(items)
        return items
    return Benchmark(tuple(dict.fromkeys(SOURCES[part.source].file for part in slices)), load)


# The general kinds of prompt a head meets outside math and code, from the training mixture's held-out
# slice (about 3% of every source; train/mixture.py is_heldout).
SUMMARISE = (  # long documents: news, meetings, papers, debates, speeches
    HeldoutSlice("summarization_bbc_news", kinds=("long_context",)), HeldoutSlice("long_context_qmsum"),
    HeldoutSlice("long_context_scisummnet_papers"), HeldoutSlice("long_context_europarl_debates"),
    HeldoutSlice("long_context_us_presidential_speeches"),
    HeldoutSlice("long_context_p3_wikihop_multinews", datasets=("P3/multi_news",)))
DOC_QA = (  # answers read from tables, passages and abstracts
    HeldoutSlice("long_context_wikitablequestions"),
    HeldoutSlice("long_context_p3_wikihop_multinews", datasets=("P3/wiki_hop",)),
    HeldoutSlice("stem_qa_pubmedqa"),
    HeldoutSlice("instruction_p3_summarization_rc",
                 datasets=("P3/duorc_SelfRC", "P3/duorc_ParaphraseRC", "P3/quoref")))
TRANSLATE = (HeldoutSlice("translation_wmt_de_en"), HeldoutSlice("translation_multi30k"),
             HeldoutSlice("translation_tanaka_ja_en"))
OPEN_QA = (  # one-line factoid and yes/no questions (Alpaca's instructions are tasks, not questions)
    HeldoutSlice("stem_qa_webquestions"), HeldoutSlice("stem_qa_trec_questions"),
    HeldoutSlice("stem_qa_strategyqa"))

BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": file_benchmark("gsm8k", "gsm8k_test.jsonl", gsm8k_item),
    "math500": file_benchmark("math500", "math500_test.jsonl", math500_item),
    "aime25": file_benchmark("aime25", "aime25.jsonl", aime25_item),
    "humaneval": file_benchmark("humaneval", "humaneval.jsonl", humaneval_item),
    "mbpp": file_benchmark("mbpp", "mbpp.jsonl", mbpp_item),
    "mt_bench": file_benchmark("mt_bench", "mt_bench.jsonl", mt_bench_item),
    "summarise": heldout_benchmark("summarise", SUMMARISE),
    "doc_qa": heldout_benchmark("doc_qa", DOC_QA),
    "translate": heldout_benchmark("translate", TRANSLATE),
    "open_qa": heldout_benchmark("open_qa", OPEN_QA),
}


def benchmark_paths(name: str, data_dir: str | None = None) -> list[str]:
    """The files the benchmark reads; raises if one is missing."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    data_dir = DEFAULT_DATA_DIR if data_dir is None else data_dir
    paths = []
    for file in BENCHMARKS[name].files:
        path = os.path.join(data_dir, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"benchmark {name!r} needs {path}, which does not exist; point --data-dir "
                                    f"at the folder holding {file}")
        paths.append(path)
    return paths


def load_benchmark(name: str, data_dir: str | None = None, limit: int | None = None) -> list[EvalItem]:
    """The benchmark's items in its order (file order, or the held-out benchmarks' seeded mix);
    `limit` keeps the first N."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None (all), got {limit}")
    data_dir = DEFAULT_DATA_DIR if data_dir is None else data_dir
    benchmark_paths(name, data_dir)
    items = BENCHMARKS[name].load(data_dir)
    return items if limit is None else items[:limit]
