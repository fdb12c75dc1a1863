"""The training prompt mixture: every prompt source the data folder offers (math, code and chat prompts,
and `train_mix/`'s instructions, code, chat, long documents, translation and STEM questions), each
prompt's kind, and the stable held-out slice that training never reads and the eval builds on."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import random
from typing import Any, Callable, Iterator

from jetspec_jax.errors import DamagedFileError

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
MBPP_TRAIN_IDS = range(601, 975)  # MBPP's train split; every other task id is eval or few-shot
TRAIN_MIX_DIR = "train_mix"
# A prompt is held out when the hash of its source and id falls below this: the same prompts for
# every run, config and seed, so the eval's held-out benchmarks are never trained on.
HELDOUT_FRACTION = 0.03
DATA_FIX = "restore the file: one JSON object per line, as the data folder's README.md lists"


@dataclasses.dataclass(frozen=True)
class PromptSource:
    file: str  # relative to the data folder; .gz is read through gzip
    prompt: Callable[[dict], str]
    record_id: Callable[[dict, int], str]  # (record, line index) -> id stable across runs
    kind: Callable[[dict], str]  # the prompt's kind (math, code, chat, instruction, long_context, ...)
    keep: Callable[[dict], bool] = lambda record: True


def mbpp_prompt(r: dict) -> str:
    # The statement plus one test, so the answer uses the function name and signature the tests call.
    return (f"{r['text']}\nWrite a Python function that solves this. Your code should pass tests like:\n"
            f"{r['test_list'][0]}")


def chat_prompt(r: dict) -> str:
    # chat_prompts.jsonl holds single-turn instructions; the optional input follows on its own lines.
    return f"{r['instruction']}\n\n{r['context']}" if r.get("context") else r["instruction"]


def _const(value: str) -> Callable[[dict], str]:
    return lambda record: value


TRAIN_MIX_FILES = (
    "instruction_alpaca", "instruction_p3_summarization_rc", "summarization_bbc_news", "code_codealpaca_2k",
    "code_gpteacher_codegen", "chat_gpteacher_roleplay", "chat_sgd_multiturn", "long_context_qmsum",
    "long_context_europarl_debates", "long_context_scisummnet_papers", "long_context_wikitablequestions",
    "long_context_p3_wikihop_multinews", "long_context_us_presidential_speeches", "translation_wmt_de_en",
    "translation_multi30k", "translation_tanaka_ja_en", "stem_qa_p3", "stem_qa_strategyqa",
    "stem_qa_webquestions", "stem_qa_trec_questions", "stem_qa_pubmedqa")

SOURCES: dict[str, PromptSource] = {
    "gsm8k": PromptSource("gsm8k_train.jsonl", lambda r: r["question"] + MATH_INSTRUCTION,
                          lambda r, line: str(line), _const("math")),
    "math": PromptSource("math_train.jsonl", lambda r: r["problem"] + MATH_INSTRUCTION,
                         lambda r, line: r["unique_id"], _const("math")),
    "mbpp": PromptSource("mbpp.jsonl", mbpp_prompt, lambda r, line: str(r["task_id"]), _const("code"),
                         keep=lambda r: r["task_id"] in MBPP_TRAIN_IDS),
    "chat": PromptSource("chat_prompts.jsonl", chat_prompt, lambda r, line: r["id"], _const("chat")),
    **{name: PromptSource(f"{TRAIN_MIX_DIR}/{name}.jsonl.gz", lambda r: r["prompt"], lambda r, line: r["id"],
                          lambda r: r["category"]) for name in TRAIN_MIX_FILES},
}
SPLITS = ("train", "heldout")
KINDS = ("math", "code", "chat", "instruction", "long_context", "translation", "stem_qa")


def hashed_share(key: str) -> float:
    """A uniform number in [0, 1) fixed by `key`: a record falls in a share F of a set where it is below F."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "little") / 2**64


def is_heldout(source: str, record_id: str) -> bool:
    return hashed_share(f"heldout:{source}:{record_id}") < HELDOUT_FRACTION


def read_jsonl(path: str, fix: str = DATA_FIX) -> Iterator[tuple[int, Any]]:
    """(0-based line index, record) of each non-blank line of a JSONL file (gzip-compressed when its
    name ends in .gz); a line that is not JSON is a DamagedFileError naming the file and line."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            for line, raw in enumerate(f):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise DamagedFileError(f"{path}:{line + 1}", f"not valid JSON ({e})", fix) from None
                yield line, record
    except (gzip.BadGzipFile, EOFError) as e:
        raise DamagedFileError(path, f"not a complete gzip file ({e})", fix) from None


def source_path(data_dir: str, name: str) -> str:
    if name not in SOURCES:
        raise ValueError(f"unknown training source {name!r}; known: {', '.join(SOURCES)}")
    path = os.path.join(data_dir, SOURCES[name].file)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"training source {name!r} needs {path}, which does not exist; point "
                                f"--data-dir (or data.data_dir in the config) at the folder holding "
                                f"{SOURCES[name].file}")
    return path


def read_source(data_dir: str, name: str) -> list[dict]:
    """[{"source", "id", "kind", "prompt"}] of every record the source keeps, in file order."""
    spec, path = SOURCES[name], source_path(data_dir, name)
    rows = []
    for i, r in read_jsonl(path):
        try:
            if spec.keep(r):
                rows.append({"source": name, "id": spec.record_id(r, i), "kind": spec.kind(r),
                             "prompt": spec.prompt(r)})
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise DamagedFileError(f"{path}:{i + 1}", f"not a {name} record ({type(e).__name__}: {e})",
                                   DATA_FIX) from None
    return rows


def load_prompts(data_dir: str, sources: dict[str, int | None], seed: int, split: str = "train") -> list[dict]:
    """The `split` ("train" or "heldout") of each source: shuffled by seed, then capped (None = all).
    Training prompts never include a held-out one, whatever the cap or seed."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    unknown = sorted(set(sources) - set(SOURCES))
    if unknown:
        raise ValueError(f"unknown training source(s) {unknown}; known: {', '.join(SOURCES)}")
    prompts = []
    for name, cap in sources.items():
        if cap is not None and cap < 0:
            raise ValueError(f"cap for source {name!r} must be >= 0 or None (all), got {cap}")
        want_heldout = split == "heldout"
        rows = [r for r in read_source(data_dir, name) if is_heldout(name, r["id"]) == want_heldout]
        random.Random(f"{name}:{seed}").shuffle(rows)  # per source, so adding a source changes no other
        prompts.extend(rows if cap is None else rows[:cap])
    return prompts
