"""Answer checking: final-answer extraction and normalisation for GSM8K, MATH-500 and AIME, and code
extraction plus test execution (in the sandbox) for HumanEval and MBPP."""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction
from typing import Iterable

from .datasets import EvalItem
from .sandbox import run_program


@dataclasses.dataclass(frozen=True)
class Score:
    correct: bool | None  # None: the benchmark has no reference (MT-Bench)
    extracted: str | None  # the final answer read from the completion, or the code's status


# ---- final answers --------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), nested braces included; also `\\boxed 5`.
    A box left unclosed by a cut-off output is passed over."""
    for match in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*(\{|\s)", text))):
        if match.group(1) != "{":
            rest = re.match(r"\s*([^\s$]+)", text[match.end():])
            if rest:
                return rest.group(1)
            continue
        depth, begin = 1, match.end()
        for i in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[begin:i].strip()
    return None


NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"


def last_number(text: str) -> str | None:
    numbers = re.findall(NUMBER, text)
    return numbers[-1] if numbers else None


def extract_final_answer(text: str) -> str | None:
    """The last \\boxed{} answer, else the text after the last `####`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    return last_number(text)


def parse_number(text: str) -> Fraction | None:
    """A plain number, a/b or \\frac{a}{b} (after normalisation) as an exact fraction, else None."""
    s = normalize_math_answer(text)
    s = s.replace(",", "") if re.fullmatch(NUMBER, s) else s
    frac = re.fullmatch(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}", s)
    try:
        if frac:
            value = Fraction(frac.group(2)) / Fraction(frac.group(3))
            return -value if frac.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?|-?\.\d+", s):
            return Fraction(s)
    except ZeroDivisionError:
        return None
    return None


def gsm8k_correct(completion: str, reference: str) -> tuple[bool, str | None]:
    """Numeric: the last number inside the extracted answer ($, commas and units ignored)."""
    answer = extract_final_answer(completion)
    if answer is None:
        return False, None
    value = parse_number(answer)
    if value is None:
        number = last_number(normalize_math_answer(answer))
        value = None if number is None else Fraction(number.replace(",", ""))
    return value is not None and value == Fraction(reference.replace(",", "")), answer


def aime_correct(completion: str, reference: str) -> tuple[bool, str | None]:
    """An integer answer (leading zeros allowed, e.g. 070), compared as an integer."""
    answer = extract_final_answer(completion)
    value = None if answer is None else parse_number(answer)
    correct = value is not None and value.denominator == 1 and int(value) == int(reference)
    return correct, answer


def math_correct(completion: str, reference: str) -> tuple[bool, str | None]:
    answer = last_boxed(completion)
    return answer is not None and math_equivalent(answer, reference), answer


def math_equivalent(answer: str, reference: str) -> bool:
    """Equal after `normalize_math_answer`, or equal as numbers (so 0.5 == \\frac{1}{2})."""
    if normalize_math_answer(answer) == normalize_math_answer(reference):
        return True
    a, b = parse_number(answer), parse_number(reference)
    return a is not None and a == b


UNIT_COMMANDS = r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf|operatorname)"


def normalize_math_answer(text: str) -> str:
    """A canonical string for MATH-style answers. In order: drop spacing commands (\\! \\, \\; \\: \\ ~),
    \\left/\\right, \\displaystyle, degree marks, $ and %; dfrac/tfrac -> frac; a trailing
    \\text{unit} after a number is dropped and other \\text{X} become X; thousands separators
    (1{,}000, 1,000) go; then all whitespace and trailing periods; .5 -> 0.5; \\frac12 -> \\frac{1}{2},
    \\sqrt2 -> \\sqrt{2}; a/b of integers -> \\frac{a}{b}; a leading short `x=` is dropped; one pair
    of braces around everything is dropped."""
    s = text.strip()
    s = re.sub(r"(?<!\\)\\[!,;: ]|~", "", s)  # lookbehind: a LaTeX row break "\\ " stays
    s = re.sub(r"\\(?:left|right)\.", "", s)
    s = re.sub(r"\\(?:left|right)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\(?:displaystyle|textstyle)(?![a-zA-Z])", "", s)
    s = re.sub(r"\\[dt]frac(?![a-zA-Z])", r"\\frac", s)
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree|°", "", s)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"^(.*\d.*?)\s*" + UNIT_COMMANDS + r"\{\s*[a-zA-Z][a-zA-Z\s.]*\}(\^\{?\d\}?)?$", r"\1", s)
    s = re.sub(UNIT_COMMANDS + r"\{([^{}]*)\}", r"\1", s)
    s = s.replace("{,}", "")
    s = re.sub(r"\s+", "", s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.rstrip(".")
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d|[a-zA-Z](?![a-zA-Z]))", r"\\sqrt{\1}", s)
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)
    s = re.sub(r"^[a-zA-Z]\w?=(?!=)", "", s)
    if s.startswith("{") and s.endswith("}") and balanced(s[1:-1]):
        s = s[1:-1]
    return s


def balanced(s: str) -> bool:
    depth = 0
    for c in s:
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


# ---- code -----------------------------------------------------------------------------------------

FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", code, re.MULTILINE) is not None


def extract_code(completion: str, wanted_names: Iterable[str] = ()) -> str:
    """The first fenced Python block that defines one of `wanted_names`, else the first Python block,
    else the raw text. An unclosed final fence (output cut off) counts as a block."""
    blocks = [body for lang, body in FENCE.findall(completion)
              if lang.lower() in ("", "python", "py", "python3")]
    wanted = list(wanted_names)
    for block in blocks:
        if any(defines(block, name) for name in wanted):
            return block
    return blocks[0] if blocks else completion


def humaneval_program(completion: str, reference: dict) -> str:
    """A chat answer restates the function: the prompt's preamble (imports, helpers) + the model's
    code. A bare body (no `def entry_point`) continues the prompt instead."""
    entry, prompt = reference["entry_point"], reference["prompt"]
    code = extract_code(completion, [entry])
    if defines(code, entry):
        signature = re.search(rf"^(?:async\s+)?def\s+{re.escape(entry)}\b", prompt, re.MULTILINE)
        preamble = prompt[: signature.start()] if signature else ""
        program = f"{preamble}\n{code}"
    else:
        program = prompt + code
    return f"{program}\n\n{reference['test']}\n\ncheck({entry})\n"


def mbpp_program(completion: str, reference: dict) -> str:
    """Solution, then the setup (MBPP's only setup, task 367, builds trees with the solution's Node
    class, so it must come after), then the asserts."""
    called = re.findall(r"([A-Za-z_]\w*)\s*\(", "\n".join(reference["test_list"]))
    code = extract_code(completion, called)
    return "\n".join([code, reference["test_setup_code"], *reference["test_list"]]) + "\n"


# ---- per benchmark --------------------------------------------------------------------------------

def score_completion(item: EvalItem, completion: str, code_timeout: float = 10.0) -> Score:
    if item.benchmark == "gsm8k":
        return Score(*gsm8k_correct(completion, item.reference))
    if item.benchmark == "math500":
        return Score(*math_correct(completion, item.reference))
    if item.benchmark == "aime25":
        return Score(*aime_correct(completion, item.reference))
    if item.benchmark == "humaneval":
        result = run_program(humaneval_program(completion, item.reference), code_timeout)
        return Score(result.passed, result.status)
    if item.benchmark == "mbpp":
        result = run_program(mbpp_program(completion, item.reference), code_timeout)
        return Score(result.passed, result.status)
    if item.benchmark == "mt_bench":
        return Score(None, None)
    raise ValueError(f"no scorer for benchmark {item.benchmark!r}")
