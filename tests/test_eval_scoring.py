"""Eval answer checking: \\boxed extraction, GSM8K numbers, MATH-500 LaTeX normalisation, AIME
integers, code-block extraction, and the benchmark loaders that feed them."""

from __future__ import annotations

import json
import os

import pytest

from jetspec_jax.eval.datasets import BENCHMARKS, benchmark_paths, load_benchmark
from jetspec_jax.eval.scoring import (aime_correct, extract_code, extract_final_answer, gsm8k_correct,
                                      last_boxed, math_correct, math_equivalent, score_completion)
from jetspec_jax.train.config import DEFAULT_DATA_DIR
from jetspec_jax.train.mixture import MATH_INSTRUCTION

needs_data = pytest.mark.skipif(not os.path.isdir(DEFAULT_DATA_DIR), reason=f"no data at {DEFAULT_DATA_DIR}")


@pytest.mark.parametrize("text, expected", [
    (r"so the answer is $\boxed{\frac{1}{\sqrt{2}}}$.", r"\frac{1}{\sqrt{2}}"),
    (r"first \boxed{3}, then \boxed{x^{2}+\{1\}}", r"x^{2}+\{1\}"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\boxed 7$ done", "7"),
    (r"\fbox{12}", "12"),
    (r"cut off inside \boxed{\frac{1}{2", None),
    (r"\boxed{5}, or rather \boxed{6", "5"),  # an unclosed last box is passed over
    ("no box here", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("completion, reference, correct", [
    (r"She makes 9 * 2 = $18.  \boxed{18}", "18", True),
    (r"\boxed{\$1,234}", "1234", True),
    (r"\boxed{18 \text{ dollars}}", "18", True),
    (r"\boxed{18.00}", "18", True),
    ("The total is 5 + 13 = 18.\n#### 18", "18", True),
    ("So she earns $1,234 per week.", "1234", True),  # no box and no ####: the last number
    (r"\boxed{17}", "18", False),
    ("I do not know.", "18", False),
])
def test_gsm8k_numeric(completion, reference, correct):
    assert gsm8k_correct(completion, reference)[0] is correct


def test_final_answer_precedence():
    assert extract_final_answer(r"#### 5 and later \boxed{6}") == "6"
    assert extract_final_answer("work 3 then 4\n#### 72\nmore 9") == "72"
    assert extract_final_answer("numbers 3 and 4.5 end") == "4.5"


@pytest.mark.parametrize("answer, reference", [
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"(3,\frac{\pi}{2})", r"\left( 3, \frac{\pi}{2} \right)"),
    (r"\dfrac{3}{4}", r"\frac34"),
    (r"\tfrac{9}{19}", r"\frac9{19}"),
    ("3/4", r"\frac{3}{4}"),
    ("0.5", r"\frac{1}{2}"),
    (".35625", "0.35625"),
    ("10", r"10\text{ inches}"),
    ("864", r"864 \mbox{ inches}^2"),
    ("90", r"90^\circ"),
    ("90^{\\circ}", r"90^\circ"),
    ("10080", r"10,\!080"),
    ("32348", r"\$32,\!348"),
    ("(C)", r"\text{(C)}"),
    ("Evelyn", r"\text{Evelyn}"),
    ("5", "x=5"),
    ("2x+3", "y = 2x + 3"),
    (r"11\sqrt{2}", r"11\sqrt2"),
    (r"\begin{pmatrix} -2 \\ -14 \\ -7 \end{pmatrix}", r"\begin{pmatrix}-2\\-14\\-7\end{pmatrix}"),
    ("5.", "5"),
])
def test_math_equivalent(answer, reference):
    assert math_equivalent(answer, reference)


@pytest.mark.parametrize("answer, reference", [
    (r"\frac{1}{3}", r"\frac{1}{2}"),
    (r"(3,\frac{\pi}{3})", r"\left( 3, \frac{\pi}{2} \right)"),
    ("(B)", r"\text{(C)}"),
    (r"\sqrt{3}", r"\sqrt2"),
    ("2x+4", "y = 2x + 3"),
])
def test_math_not_equivalent(answer, reference):
    assert not math_equivalent(answer, reference)


@needs_data
def test_math500_solutions_score_as_their_own_answers():
    """The normaliser reads every reference solution's last box as equal to the `answer` field."""
    with open(benchmark_paths("math500")[0], encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    wrong = [r["unique_id"] for r in records if not math_correct(r["solution"], r["answer"])[0]]
    assert wrong == []


@pytest.mark.parametrize("completion, reference, correct", [
    (r"\boxed{70}", "70", True),
    (r"\boxed{070}", "70", True),
    (r"\boxed{x = 70}", "70", True),
    (r"\boxed{70.5}", "70", False),
    (r"\boxed{\frac{140}{3}}", "70", False),
    ("so the answer is 70", "70", True),
    ("no idea", "70", False),
])
def test_aime_integer(completion, reference, correct):
    assert aime_correct(completion, reference)[0] is correct


def test_extract_code_prefers_the_block_defining_the_function():
    completion = ("Example:\n```python\nprint(f(2))\n```\nSolution:\n"
                  "```python\ndef f(x):\n    return x\n```\nUsage:\n```\nf(3)\n```")
    assert extract_code(completion, ["f"]) == "def f(x):\n    return x\n"
    assert extract_code(completion) == "print(f(2))\n"  # nothing wanted: the first block
    assert extract_code("```py\ndef g():\n    return 1", ["g"]) == "def g():\n    return 1"  # cut off
    assert extract_code("def g():\n    return 1\n", ["g"]) == "def g():\n    return 1\n"  # no fence: raw
    assert extract_code("```bash\nls\n```\nplain", ["g"]) == "```bash\nls\n```\nplain"  # not python


@needs_data
def test_benchmark_loaders():
    counts = {"gsm8k": 1319, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 500, "mt_bench": 80}
    heldout = {"summarise", "doc_qa", "translate", "open_qa"}  # test_eval_heldout.py
    assert set(counts) | heldout == set(BENCHMARKS)
    for name, count in counts.items():
        items = load_benchmark(name)
        assert len(items) == count and len({i.id for i in items}) == count
        assert [i.id for i in load_benchmark(name, limit=3)] == [i.id for i in items[:3]]  # file order
        assert all(i.benchmark == name and i.prompt.strip() for i in items)
    gsm8k = load_benchmark("gsm8k", limit=1)[0]
    assert gsm8k.id == "0" and gsm8k.reference == "18" and gsm8k.prompt.endswith(MATH_INSTRUCTION)
    mbpp = load_benchmark("mbpp")
    assert (mbpp[0].id, mbpp[-1].id) == ("11", "510")  # the test split only
    assert all(t in mbpp[0].prompt for t in mbpp[0].reference["test_list"])
    humaneval = load_benchmark("humaneval", limit=1)[0]
    assert humaneval.reference["prompt"] in humaneval.prompt and "```python" in humaneval.prompt
    mt_bench = load_benchmark("mt_bench", limit=1)[0]
    assert mt_bench.prompt.startswith("Compose an engaging travel blog post") and mt_bench.reference is None
    assert load_benchmark("aime25", limit=0) == []


def test_benchmark_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        load_benchmark("gsm8k", str(tmp_path))
    with pytest.raises(ValueError, match="unknown benchmark 'gsm9k'"):
        load_benchmark("gsm9k")


@needs_data
def test_score_completion_dispatch():
    gsm8k = load_benchmark("gsm8k", limit=1)[0]
    assert score_completion(gsm8k, r"9 eggs at \$2 is \boxed{18}").correct is True
    assert score_completion(gsm8k, r"\boxed{16}").correct is False
    mt_bench = load_benchmark("mt_bench", limit=1)[0]
    assert score_completion(mt_bench, "A blog post.").correct is None
