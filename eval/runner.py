"""Timed evaluation runs: every prompt alone (batch 1), or with `batch` > 1 prompts of one padded width
together, through AR and the speculative methods at each budget and temperature, scored and compared
with AR, one JSON line per prompt and run; restarts resume."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from typing import Any

import jax.numpy as jnp
from tqdm import tqdm

from jetspec_jax.api import GenerateCall, generate, prepare_generate
from jetspec_jax.compilation import compile_ahead, default_workers
from jetspec_jax.kernels.precision import run_matmul_precision
from jetspec_jax.models import draft_head
from jetspec_jax.speculative import (ATTENTION_IMPLS, SpecConfig, check_draft_attention, check_gemm_backend,
                                     check_tree_temperature, resolve_draft_attention, speculative_cache_rows)
from jetspec_jax.target import Target, default_dtype, load_target, target_identity
from jetspec_jax.tokens import PROMPT_BUCKET, encode_prompts, pad_prompts, plan_cache_len, stop_tokens

from .datasets import BENCHMARKS, EvalItem, load_benchmark
from .heads import ROLE_OF_METHOD, HeadSource, resolve_heads
from .records import (ResultsWriter, check_compatible, heads_label, line_key, read_lines, read_meta,
                      record_run)
from .scoring import Score, score_completion

log = logging.getLogger(__name__)

METHODS = ("ar", "dflash", "ddtree", "jetspec", "jetspec-tc")
# run unless --methods says otherwise: the published methods (jetspec-tc is opt-in until a head is trained
# for tree-causal drafting)
DEFAULT_METHODS = ("ar", "dflash", "ddtree", "jetspec")
TREE_METHODS = ("jetspec", "ddtree", "jetspec-tc")  # the methods that take a width and a tree temperature
DEFAULT_BUDGETS = (16, 32, 64, 128, 256)
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DEFAULT_RESULTS = os.path.join(RESULTS_DIR, "results.jsonl")
NO_SCORE = Score(None, None)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    benchmarks: tuple[str, ...] = tuple(BENCHMARKS)
    methods: tuple[str, ...] = DEFAULT_METHODS
    budgets: tuple[int, ...] = DEFAULT_BUDGETS
    temperatures: tuple[float, ...] = (0.0,)
    limit: int | None = None
    max_new_tokens: int = 512
    width: int = 7
    tree_temperature: float = 1.0  # the tree methods' scoring temperature (SpecConfig)
    gemm_backend: str = "xla"  # the speculative methods' GEMM library on GPU (SpecConfig); AR keeps XLA's
    draft_attention: str = "auto"  # the head's attention (speculative.DRAFT_ATTENTION_IMPLS), held resolved
    draft_vocab: int | None = None  # the heads draft over this many most frequent tokens (jetspec_jax/draft_vocab.py)
    attention: str = "auto"  # AR/verify attention path (kernels.attention.IMPLEMENTATIONS); auto = Pallas kernel on GPU
    prompt_bucket: int = PROMPT_BUCKET  # each prompt pads to its own multiple of this: larger, fewer compiles
    batch: int = 1  # > 1: up to this many prompts of one padded width per generation call (throughput)
    seed: int = 0
    data_dir: str | None = None
    results: str = DEFAULT_RESULTS
    head_dirs: dict = dataclasses.field(default_factory=dict)  # role ("jetspec"/"bidirectional") -> dir
    heads_label: str | None = None  # names the head set in reports; None: records.heads_label of the dirs
    allow_untrained: bool = False
    model: str | None = None
    dtype: str | None = None
    code_timeout: float = 10.0
    compile_workers: int = default_workers()  # programs compiled at once before the timed calls; 0: at first call
    progress: bool = True

    def __post_init__(self):
        problems = [f"unknown benchmark {b!r} (known: {', '.join(BENCHMARKS)})"
                    for b in self.benchmarks if b not in BENCHMARKS]
        problems += [f"unknown method {m!r} (known: {', '.join(METHODS)})" for m in self.methods
                     if m not in METHODS]
        problems += [f"budget must be >= 2, got {b}" for b in self.budgets if b < 2]
        if self.prompt_bucket < 1:
            problems.append(f"prompt_bucket must be >= 1, got {self.prompt_bucket}")
        if self.batch < 1:
            problems.append(f"batch must be >= 1, got {self.batch}")
        if self.attention not in ATTENTION_IMPLS:
            problems.append(f"attention must be one of {', '.join(ATTENTION_IMPLS)}, got {self.attention!r}")
        problems += [f"temperature must be >= 0, got {t}" for t in self.temperatures
                     if not (math.isfinite(t) and t >= 0)]
        if self.limit is not None and self.limit < 0:
            problems.append(f"limit must be >= 0 (or left out for all prompts), got {self.limit}")
        if self.heads_label is not None and not re.fullmatch(r"[\w.+-]+", self.heads_label):
            problems.append(f"heads_label must be letters, digits and . _ + - (it names the head set in the "
                            f"report's tables), got {self.heads_label!r}")
        if self.width < 1:
            problems.append(f"width must be >= 1, got {self.width}")
        if self.draft_vocab is not None and not (isinstance(self.draft_vocab, int) and self.draft_vocab >= 1):
            problems.append(f"draft_vocab must be a whole number of tokens >= 1, got {self.draft_vocab!r}")
        if self.compile_workers < 0:
            problems.append(f"compile_workers must be >= 0 (0 compiles each program at its first call), got "
                            f"{self.compile_workers}")
        if not (math.isfinite(self.code_timeout) and self.code_timeout > 0):
            problems.append(f"code_timeout must be a positive number of seconds, got {self.code_timeout}")
        for check, value in ((check_tree_temperature, self.tree_temperature),
                             (check_gemm_backend, self.gemm_backend),
                             (check_draft_attention, self.draft_attention)):
            try:
                check(value)
            except ValueError as e:
                problems.append(str(e))
        if self.results.endswith(".gz"):
            problems.append(f"results {self.results!r} is gzipped (an archived run, read-only): gunzip it to "
                            "resume, or name a new .jsonl file")
        if self.max_new_tokens < 2:
            problems.append(f"max_new_tokens must be >= 2 (1 is the prefill-only call), got "
                            f"{self.max_new_tokens}")
        if problems:
            raise ValueError("; ".join(problems))
        # recorded as the implementation that runs, so files of "auto" runs on two backends stay apart
        object.__setattr__(self, "draft_attention", resolve_draft_attention(self.draft_attention))


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One line of the results file: a prompt through one method at one budget and temperature."""
    item: EvalItem
    method: str
    budget: int | None  # None for ar
    temperature: float

    @property
    def key(self) -> tuple:
        return (self.item.benchmark, self.item.id, self.method, self.budget, self.temperature)


def method_budgets(methods, budgets, heads: dict[str, HeadSource]) -> list[tuple[str, int | None]]:
    """(method, budget) in run order: ar first (the others are compared with it), dflash once as a
    chain as long as its head's block, tree methods at every budget; methods without a head drop."""
    plan = [("ar", None)]
    for method in methods:
        if method == "ar" or ROLE_OF_METHOD[method] not in heads:
            continue
        if method == "dflash":
            plan.append((method, heads[ROLE_OF_METHOD[method]].block_size))
        else:
            plan.extend((method, b) for b in sorted(set(budgets)))
    return plan


def plan_runs(config: EvalConfig, heads: dict[str, HeadSource],
              items: dict[str, list[EvalItem]]) -> list[RunSpec]:
    """Every run, benchmark by benchmark; `items` holds each benchmark's items (check_inputs)."""
    plan = method_budgets(config.methods, config.budgets, heads)
    return [RunSpec(item, method, budget, float(t))
            for name in config.benchmarks for item in items[name]
            for t in config.temperatures for method, budget in plan]


def plan_batches(specs: list[RunSpec], size: int, width_of) -> list[list[RunSpec]]:
    """The runs in generation calls of up to `size` prompts that share a method, budget, temperature and
    padded width (`width_of(item)`; None for prompts that do not fit, which get error lines and no
    call). Chunks depend on the whole plan, not on what a results file already holds, so a resumed run
    re-forms the same batches. Each group comes where its first prompt's run is in `specs`, so AR's
    batches precede the methods' batches of the same prompts, which are compared with them."""
    groups = defaultdict(list)
    for spec in specs:
        groups[(spec.item.benchmark, spec.temperature, spec.method, spec.budget, width_of(spec.item))].append(spec)
    return [group[i:i + size] for group in groups.values() for i in range(0, len(group), size)]


class Evaluator:
    """Holds the target and heads, times generations, and turns each RunSpec into a results line."""

    def __init__(self, config: EvalConfig, target: Target, heads: dict[str, HeadSource], run_index: int,
                 ar_tokens: dict[tuple, list[int]], matmul_precision: str):
        self.config, self.target, self.run_index = config, target, run_index
        self.matmul_precision, self.heads_label = matmul_precision, run_heads_label(config, heads)
        self.heads = heads
        self.head_params = {role: h.load(target, config.seed, config.draft_vocab) for role, h in heads.items()}
        for head_cfg, _ in self.head_params.values():
            draft_head.check_pairing(head_cfg, target.cfg)  # a head for another target fails here, once
        self.ar_tokens = ar_tokens  # (benchmark, id, temperature) -> AR tokens, for the T=0 comparison
        self.prefill_seconds: dict[tuple, float] = {}  # (method, (benchmark, id) of each prompt of the call)
        self.scores: dict[tuple, Score] = {}  # (benchmark, id, text): identical outputs score once
        self.prefill_budget: dict[str, int | None] = {}  # each method's smallest budget
        self.scratch: dict[tuple, int] = {}  # (method, budget) -> cache rows its draft tree needs
        for method, budget in method_budgets(config.methods, config.budgets, heads):
            self.prefill_budget.setdefault(method, budget)
            self.scratch[(method, budget)] = self.scratch_rows(method, budget)
        self.prompt_ids: dict[tuple, list[int]] = {}  # (benchmark, id) -> prompt tokens, chat template applied
        self.skipped: set[tuple] = set()  # (benchmark, id) of prompts that do not fit, warned about once
        self.target_name = target.name
        self.dtype = str(target.params["embed"].dtype)

    def head(self, method: str):
        return None if method == "ar" else self.head_params[ROLE_OF_METHOD[method]]

    def scratch_rows(self, method: str, budget: int | None) -> int:
        """Cache rows a step of the method writes past the committed tokens (its tree); 0 for AR."""
        if method == "ar":
            return 0
        depth = SpecConfig(method, budget, self.config.width).depth(self.head(method)[0].max_depth)
        return speculative_cache_rows(budget, depth)

    def prompt_tokens(self, item: EvalItem) -> list[int]:
        key = (item.benchmark, item.id)
        if key not in self.prompt_ids:
            self.prompt_ids[key] = encode_prompts(self.target.tokenizer, [item.prompt])[0]
        return self.prompt_ids[key]

    def does_not_fit(self, item: EvalItem) -> str | None:
        """Why the prompt cannot run, or None. One rule for all its runs: the prompt, max_new_tokens and
        the largest draft tree of this run's plan must fit the target's positions, so that every method
        and budget is measured on the same prompts."""
        try:
            plan_cache_len(0, len(self.prompt_tokens(item)), self.config.max_new_tokens,
                           self.target.cfg.max_position_embeddings, None, max(self.scratch.values()))
        except ValueError as e:
            return f"skipped for every method and budget of the run: {e}"
        return None

    def padded_width(self, item: EvalItem) -> int:
        """The prompt's own multiple of prompt_bucket."""
        return pad_prompts([self.prompt_tokens(item)], 0, self.config.prompt_bucket)[0].shape[1]

    def batch_width(self, item: EvalItem) -> int | None:
        """What a prompt's batch shares (plan_batches): its padded width; None if it does not fit."""
        return None if self.does_not_fit(item) is not None else self.padded_width(item)

    def cache_len(self, item: EvalItem, method: str, budget: int | None) -> int:
        """Cache rows for this prompt's padded width, a multiple of prompt_bucket (a long prompt never
        widens a short one; a batch holds prompts of one width), the new tokens and the method's tree,
        rounded up to 64. Prompts of one bucket share compiled programs (at most max positions /
        prompt_bucket widths per method, budget and batch size); the prefill-only call gets the same
        shapes."""
        width = self.padded_width(item)
        return -(-(width + self.config.max_new_tokens + self.scratch[(method, budget)]) // 64) * 64

    def call_options(self, specs: list[RunSpec], prefill: bool = False) -> dict[str, Any]:
        """The options (generate / prepare_generate) of the generation call of these runs (one, or a batch of
        plan_batches), or with `prefill` of their prefill-only call: max_new_tokens=1 and the cache of the
        method's smallest budget (the closest to AR's, so decode time is not flattered)."""
        first, config = specs[0], self.config
        budget = self.prefill_budget[first.method] if prefill else first.budget
        tree = {} if budget is None else {"budget": budget, "width": config.width,
                                          "tree_temperature": config.tree_temperature,
                                          "gemm_backend": config.gemm_backend,
                                          "draft_attention": config.draft_attention}
        return dict(method=first.method, head=self.head(first.method), **tree, attention=config.attention,
                    prompt_bucket=config.prompt_bucket, max_new_tokens=1 if prefill else config.max_new_tokens,
                    temperature=first.temperature, seed=config.seed,
                    max_cache_len=self.cache_len(first.item, first.method, budget))

    def timed_generate(self, prompt: str | list[str], options: dict[str, Any]):
        result = generate(prompt, self.target, **options)
        # the first run of a freshly compiled executable pays one-time costs; time a warm one
        return generate(prompt, self.target, **options) if result.compile_seconds > 0 else result

    def planned_calls(self, batches: list[list[RunSpec]]) -> list[GenerateCall]:
        """The generation and prefill-only calls that these batches (of plan_batches, or one run each at
        batch 1) will make, for compile_ahead; prompts that do not fit make none."""
        return [prepare_generate(self.call_prompts(specs), self.target, **self.call_options(specs, prefill))
                for specs in batches if self.batch_width(specs[0].item) is not None for prefill in (False, True)]

    def compile_plan(self, batches: list[list[RunSpec]]) -> None:
        """Compiles every program the batches will call before the first timed call, compile_workers at
        once (an eval plan has one per method, budget, temperature, padded width and batch size: seconds
        each on a GPU, most of a run's time when compiled one by one)."""
        if self.config.compile_workers == 0:
            return
        t0 = time.perf_counter()
        compiled = compile_ahead(self.planned_calls(batches), self.config.compile_workers)
        if compiled:
            log.info("compiled %d programs in %.1f s, %d at a time", compiled, time.perf_counter() - t0,
                     self.config.compile_workers)

    def prefill_time(self, specs: list[RunSpec]) -> float:
        """Prefill-only call (max_new_tokens=1) of these runs' prompts together (one, or a batch of
        plan_batches), once per prompts and method, with the cache of the method's smallest budget (the
        closest to AR's, so decode time is not flattered)."""
        key = (specs[0].method, tuple((s.item.benchmark, s.item.id) for s in specs))
        if key not in self.prefill_seconds:
            result = self.timed_generate(self.call_prompts(specs), self.call_options(specs, prefill=True))
            self.prefill_seconds[key] = result.generate_seconds
        return self.prefill_seconds[key]

    def call_prompts(self, specs: list[RunSpec]) -> list[str]:
        """A call's prompts: a short batch is filled up to --batch with copies of its last prompt (whose
        outputs are dropped), so that all the calls of one padded width share one compiled program."""
        prompts = [s.item.prompt for s in specs]
        return prompts + prompts[-1:] * (self.config.batch - len(prompts))

    def score(self, item: EvalItem, text: str) -> Score:
        if item.reference is None:  # nothing to score against (MT-Bench, the held-out benchmarks)
            return NO_SCORE
        key = (item.benchmark, item.id, text)
        if key not in self.scores:
            self.scores[key] = score_completion(item, text, self.config.code_timeout)
        return self.scores[key]

    def settings_fields(self, spec: RunSpec) -> dict[str, Any]:
        """What a line records of how it ran."""
        item, method, config = spec.item, spec.method, self.config
        role = ROLE_OF_METHOD.get(method)
        head = self.heads[role] if role else None
        tree_method = method in TREE_METHODS
        return {"benchmark": item.benchmark, "id": item.id, "method": method, "budget": spec.budget,
                "temperature": spec.temperature,
                "width": config.width if tree_method else None,
                "tree_temperature": config.tree_temperature if tree_method else None,
                "gemm_backend": config.gemm_backend if method != "ar" else None,
                "draft_attention": config.draft_attention if method != "ar" else None,
                "draft_vocab": config.draft_vocab if method != "ar" else None,
                "attention": config.attention,
                "max_new_tokens": config.max_new_tokens, "seed": config.seed, "target": self.target_name,
                "dtype": self.dtype, "matmul_precision": self.matmul_precision,
                "head": head.name if head else None,
                "head_sha256": head.sha256 if head else None,
                "heads_label": self.heads_label, "run": self.run_index}

    def run(self, spec: RunSpec) -> dict[str, Any]:
        item = spec.item
        line = self.settings_fields(spec)
        reason = self.does_not_fit(item)
        if reason is not None:  # an error line for each of its runs: recorded, and resumes skip it
            if (item.benchmark, item.id) not in self.skipped:
                self.skipped.add((item.benchmark, item.id))
                log.warning("%s %s: %s", item.benchmark, item.id, reason)
            return {**line, "prompt_tokens": len(self.prompt_tokens(item)), "error": reason}
        result = self.timed_generate(item.prompt, self.call_options([spec]))
        prefill = self.prefill_time([spec])
        timing = {"total_seconds": result.generate_seconds, "prefill_seconds": prefill,
                  "decode_seconds": max(result.generate_seconds - prefill, 0.0)}
        return {**line, **self.sequence_fields(spec, result, 0, timing)}

    def run_batch(self, specs: list[RunSpec], wanted: set[tuple]) -> list[dict[str, Any]]:
        """One generation call for a batch of plan_batches; lines for the runs whose key is in `wanted`.
        A partly recorded batch runs whole, so that its timing is a whole batch's, and writes only the
        lines the results file lacks. Timings are the batch's: each line carries them with its size."""
        first = specs[0]
        if self.batch_width(first.item) is None:  # prompts that do not fit: their error lines, no call
            return [{**self.run(s), "batch": self.config.batch} for s in specs if s.key in wanted]
        result = self.timed_generate(self.call_prompts(specs), self.call_options(specs))
        prefill = self.prefill_time(specs)
        timing = {"batch": self.config.batch, "batch_size": len(specs), "batch_filled": self.config.batch - len(specs),
                  "batch_seconds": result.generate_seconds,
                  "batch_prefill_seconds": prefill,
                  "batch_decode_seconds": max(result.generate_seconds - prefill, 0.0)}
        return [{**self.settings_fields(spec), **self.sequence_fields(spec, result, i, timing)}
                for i, spec in enumerate(specs) if spec.key in wanted]

    def sequence_fields(self, spec: RunSpec, result, index: int, timing: dict[str, Any]) -> dict[str, Any]:
        """What sequence `index` of a generation call gave: its tokens, tau and acceptance (its own, not
        the batch's), score and comparison with AR, with the call's `timing`."""
        tokens, text = result.token_ids[index], result.texts[index]
        forwards = result.sequence_forwards[index] if result.sequence_forwards else None
        score = self.score(spec.item, text)
        fields = {
            "prompt_tokens": len(result.prompt_token_ids[index]), "num_generated": len(tokens),
            "stopped": bool(tokens) and tokens[-1] in stop_tokens(self.target), **timing,
            "target_forwards": forwards, "tau": (len(tokens) - 1) / forwards if forwards else None,
            "accept_counts": result.sequence_accept_counts[index] if result.sequence_accept_counts else None,
            "correct": score.correct, "extracted": score.extracted,
        }
        fields.update(self.compare_with_ar(spec, tokens))
        fields["text"] = text
        return fields

    def compare_with_ar(self, spec: RunSpec, tokens: list[int]) -> dict[str, Any]:
        """AR lines keep their tokens (later comparisons and resumes read them); at T=0 other methods
        record whether they match, and their tokens only when they do not."""
        key = (spec.item.benchmark, spec.item.id, spec.temperature)
        if spec.method == "ar":
            self.ar_tokens[key] = tokens
            return {"matches_ar": None, "first_mismatch": None, "token_ids": tokens}
        reference = self.ar_tokens.get(key)
        if spec.temperature != 0 or reference is None:
            return {"matches_ar": None, "first_mismatch": None}
        if tokens == reference:
            return {"matches_ar": True, "first_mismatch": None}
        first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                     min(len(tokens), len(reference)))
        return {"matches_ar": False, "first_mismatch": first, "token_ids": tokens}


def run_heads_label(config: EvalConfig, heads: dict[str, HeadSource]) -> str:
    """The name of the run's head set in reports: --heads-label, else one made from the heads' dirs."""
    return config.heads_label or heads_label(h.name for h in heads.values())


def run_settings(config: EvalConfig, target_name: str, dtype: str, precision: str,
                 heads: dict[str, HeadSource]) -> dict[str, Any]:
    """What must not change between runs appending to one results file."""
    return {"target": target_name, "dtype": dtype, "matmul_precision": precision,
            "heads_label": run_heads_label(config, heads),
            "max_new_tokens": config.max_new_tokens, "width": config.width,
            "tree_temperature": config.tree_temperature, "gemm_backend": config.gemm_backend,
            "draft_attention": config.draft_attention, "draft_vocab": config.draft_vocab, "seed": config.seed,
            "attention": config.attention, "prompt_bucket": config.prompt_bucket, "batch": config.batch}


def check_inputs(config: EvalConfig) -> dict[str, list[EvalItem]]:
    """Reads every benchmark the run needs (returns their items) and checks the results file can be
    written."""
    items = {name: load_benchmark(name, config.data_dir, config.limit) for name in config.benchmarks}
    results = os.path.abspath(config.results)
    if os.path.isdir(results):
        raise IsADirectoryError(f"--results {config.results} is a directory; name a .jsonl file")
    folder = os.path.dirname(results)
    while not os.path.isdir(folder):  # the writer creates missing folders under the nearest existing one
        folder = os.path.dirname(folder)
    if (os.path.exists(results) and not os.access(results, os.W_OK)) or not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write the results file {results} ({folder} or the file is not "
                              "writable); pick another --results")
    read_meta(config.results)  # a damaged sidecar fails here, not after the model loads
    return items


def run_eval(config: EvalConfig, target: Target | None = None, command=None) -> dict[str, int]:
    """Runs what the results file lacks; returns {"written", "skipped"}. Loads the target only when
    something is left to run (its shipped heads are found by the fingerprint read from its files)."""
    items = check_inputs(config)  # first: a bad --data-dir or benchmark file is one error line, no model loaded
    identity = target.identity if target is not None else target_identity(config.model)
    heads = resolve_heads(config.methods, config.head_dirs, identity, config.allow_untrained)
    if "ar" not in config.methods:
        log.info("adding ar: every method is timed and checked against it")
    dtype = str(jnp.dtype(target.params["embed"].dtype if target is not None
                          else config.dtype or default_dtype()))
    settings = run_settings(config, identity.name, dtype, run_matmul_precision(dtype), heads)
    head_ids = {role: h.sha256 or h.name for role, h in heads.items()}
    check_compatible(config.results, settings, head_ids)
    specs = plan_runs(config, heads, items)
    existing = read_lines(config.results)
    done = {line_key(line) for line in existing}
    todo = [s for s in specs if s.key not in done]
    if not todo:
        log.info("%s already holds all %d runs; nothing to do", config.results, len(specs))
        return {"written": 0, "skipped": len(specs)}
    run_index = record_run(config.results, settings, head_ids, sys.argv if command is None else command)
    if target is None:
        target = load_target(config.model, dtype=config.dtype)
    ar_tokens = {(line["benchmark"], line["id"], line["temperature"]): line["token_ids"]
                 for line in existing if line["method"] == "ar" and "token_ids" in line}
    evaluator = Evaluator(config, target, heads, run_index, ar_tokens, settings["matmul_precision"])
    wanted = {s.key for s in todo}
    with ResultsWriter(config.results) as writer, tqdm(total=len(specs), initial=len(specs) - len(todo),
                                                       disable=not config.progress, desc="eval") as bar:
        batches = ([[s] for s in todo] if config.batch == 1 else
                   [b for b in plan_batches(specs, config.batch, evaluator.batch_width)
                    if any(s.key in wanted for s in b)])
        evaluator.compile_plan(batches)
        if config.batch == 1:
            for spec in todo:
                bar.set_postfix_str(f"{spec.item.benchmark} {spec.item.id} {spec.method} {spec.budget or ''}")
                writer.write(evaluator.run(spec))
                bar.update()
        else:
            run_batches(evaluator, batches, wanted, writer, bar)
    return {"written": len(todo), "skipped": len(specs) - len(todo)}


def run_batches(evaluator: Evaluator, batches: list[list[RunSpec]], wanted: set[tuple], writer: ResultsWriter,
                bar) -> None:
    """Runs the batches (of plan_batches, each holding a run the results file lacks), writing only the
    lacking lines."""
    for batch in batches:
        first = batch[0]
        bar.set_postfix_str(f"{first.item.benchmark} {first.method} {first.budget or ''} "
                            f"batch of {len(batch)}")
        lines = evaluator.run_batch(batch, wanted)
        for line in lines:
            writer.write(line)
        bar.update(len(lines))
