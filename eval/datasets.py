"""Benchmark loaders: each evaluation file in the data dir becomes `EvalItem`s (prompt text in the
METHOD.md section 7 format, plus what scoring needs), in file order."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

from jetspec_jax.errors import DamagedFileError
from jetspec_jax.train.regenerate import DATA_FIX, DEFAULT_DATA_DIR, MATH_INSTRUCTION, read_jsonl

MBPP_TEST_IDS = range(11, 511)  # MBPP's test split; 1-10 are few-shot examples, 511+ validation/train
HUMANEVAL_FORMAT = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n{prompt}\n```")
MBPP_FORMAT = ("You are an expert Python programmer. Write a solution to the following task and make sure "
               "it passes the tests:\n{text}\nYour code should pass these tests:\n{tests}")


@dataclasses.dataclass(frozen=True)
class EvalItem:
    benchmark: str
    id: str
    prompt: str  # the user turn; the chat template is applied at generation
    reference: Any  # final answer (str), test material (dict) or None (MT-Bench: no reference)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    file: str
    to_item: Callable[[dict, int], EvalItem | None]  # (record, line index) -> item, None to drop


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


BENCHMARKS: dict[str, Benchmark] = {
    "gsm8k": Benchmark("gsm8k_test.jsonl", gsm8k_item),
    "math500": Benchmark("math500_test.jsonl", math500_item),
    "aime25": Benchmark("aime25.jsonl", aime25_item),
    "humaneval": Benchmark("humaneval.jsonl", humaneval_item),
    "mbpp": Benchmark("mbpp.jsonl", mbpp_item),
    "mt_bench": Benchmark("mt_bench.jsonl", mt_bench_item),
}


def benchmark_path(name: str, data_dir: str | None = None) -> str:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}")
    path = os.path.join(DEFAULT_DATA_DIR if data_dir is None else data_dir, BENCHMARKS[name].file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"benchmark {name!r} needs {path}, which does not exist; point --data-dir "
                                f"at the folder holding {BENCHMARKS[name].file}")
    return path


def load_benchmark(name: str, data_dir: str | None = None, limit: int | None = None) -> list[EvalItem]:
    """The benchmark's items in file order; `limit` keeps the first N."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None (all), got {limit}")
    items = []
    path = benchmark_path(name, data_dir)
    for line, record in read_jsonl(path):
        if limit is not None and len(items) >= limit:
            break
        try:
            item = BENCHMARKS[name].to_item(record, line)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise DamagedFileError(f"{path}:{line + 1}", f"not a {name} record ({type(e).__name__}: {e})",
                                   DATA_FIX) from None
        if item is not None:
            items.append(item)
    return items

