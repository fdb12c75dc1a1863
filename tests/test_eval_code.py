"""HumanEval and MBPP scoring on real dataset records: reference solutions pass, wrong ones fail, and
the sandbox stops infinite loops, blocks sockets, early exits and inherited environment."""

from __future__ import annotations

import json
import os
import time

import pytest

from jetspec_jax.eval.datasets import load_benchmark
from jetspec_jax.eval.sandbox import run_program
from jetspec_jax.eval.scoring import humaneval_program, score_completion
from jetspec_jax.train.config import DEFAULT_DATA_DIR

pytestmark = pytest.mark.skipif(not os.path.isdir(DEFAULT_DATA_DIR), reason=f"no data at {DEFAULT_DATA_DIR}")


def raw_records(file: str, key: str) -> dict:
    with open(os.path.join(DEFAULT_DATA_DIR, file), encoding="utf-8") as f:
        return {str(r[key]): r for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def humaneval():
    items = {i.id: i for i in load_benchmark("humaneval")}
    return items, raw_records("humaneval.jsonl", "task_id")


@pytest.fixture(scope="module")
def mbpp():
    items = {i.id: i for i in load_benchmark("mbpp")}
    return items, raw_records("mbpp.jsonl", "task_id")


def fenced(code: str) -> str:
    return f"Here is a solution:\n```python\n{code}\n```\nIt loops over the pairs."


@pytest.mark.parametrize("task_id", ["HumanEval/0", "HumanEval/10", "HumanEval/38"])
def test_humaneval_canonical_solution_passes(humaneval, task_id):
    """As a chat answer restating the function (10 and 38 rely on helpers defined in the prompt), and
    as a bare body continuing the prompt."""
    items, records = humaneval
    record = records[task_id]
    entry = record["entry_point"]
    signature = record["prompt"][record["prompt"].index(f"def {entry}"):]
    assert score_completion(items[task_id], fenced(signature + record["canonical_solution"])).correct is True
    assert score_completion(items[task_id], record["canonical_solution"]).correct is True


def test_humaneval_wrong_solution_fails(humaneval):
    items, _ = humaneval
    wrong = "def has_close_elements(numbers, threshold):\n    return False\n"
    score = score_completion(items["HumanEval/0"], fenced(wrong))
    assert score.correct is False and score.extracted == "failed"
    assert score_completion(items["HumanEval/0"], "I cannot solve this.").correct is False


def test_humaneval_infinite_loop_times_out(humaneval):
    items, _ = humaneval
    looping = "def has_close_elements(numbers, threshold):\n    while True:\n        pass\n"
    start = time.perf_counter()
    score = score_completion(items["HumanEval/0"], fenced(looping), code_timeout=1.0)
    assert score.correct is False and score.extracted == "timeout"
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("network_call", [
    "socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', 9))",
    "socket.create_connection(('example.com', 80), timeout=1)",
    "urllib.request.urlopen('http://127.0.0.1:9/', timeout=1)",
])
def test_humaneval_network_is_blocked(humaneval, network_call):
    """A solution that is right but opens a socket first fails, with the sandbox's error."""
    items, records = humaneval
    record = records["HumanEval/0"]
    body = record["canonical_solution"]
    code = (f"import socket, urllib.request\n\ndef has_close_elements(numbers, threshold):\n"
            f"    {network_call}\n{body}")
    program = humaneval_program(fenced(code), items["HumanEval/0"].reference)
    result = run_program(program, timeout=10)
    assert not result.passed and "network access is disabled" in result.detail


def test_sandbox_exit_isolation_and_environment(monkeypatch):
    assert run_program("x = 1\n").passed
    assert not run_program("import sys\nsys.exit(0)\nassert False\n").passed  # leaving early is no pass
    assert not run_program("import os\nos._exit(0)\n").passed
    monkeypatch.setenv("JETSPEC_EVAL_SECRET", "1")
    program = ("import os, sys\nassert 'JETSPEC_EVAL_SECRET' not in os.environ, os.environ\n"
               "assert 'PATH' in os.environ\nassert os.getcwd() not in sys.path\n"
               "assert set(os.listdir('.')) <= {'program.py', '.stdout', '.stderr'}\n"
               "if __name__ == '__main__':\n    raise SystemExit(1)\n")
    result = run_program(program)
    assert result.passed, result.detail


def test_mbpp_reference_passes_and_wrong_fails(mbpp):
    items, records = mbpp
    record = records["11"]  # remove_Occ: the first test-split task
    assert score_completion(items["11"], fenced(record["code"])).correct is True
    wrong = "def remove_Occ(s, ch):\n    return s\n"
    assert score_completion(items["11"], fenced(wrong)).correct is False
    # task 367's setup code builds trees from the solution's Node class, so it runs after the solution
    assert records["367"]["test_setup_code"]
    assert score_completion(items["367"], fenced(records["367"]["code"])).correct is True
