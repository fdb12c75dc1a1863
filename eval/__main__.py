"""python -m jetspec_jax.eval run [--benchmarks ...] [--methods ...] [--budgets ...] [--limit N] ...
python -m jetspec_jax.eval report RESULTS.jsonl [...] [--out DIR]

`run` times every prompt alone (or, with --batch N, N prompts at a time) through AR and the speculative
methods and appends one JSON line per prompt and run to the results file (a restart resumes); `report`
turns results files into report.md, report.json and plots."""

from __future__ import annotations

import argparse
import logging
import sys

from jetspec_jax import cache
from jetspec_jax.cli_loading import add_draft_vocab_flag
from jetspec_jax.errors import OneLineErrorParser, run_command
from jetspec_jax.speculative import ATTENTION_IMPLS, DRAFT_ATTENTION_IMPLS, GEMM_BACKENDS
from jetspec_jax.tokens import PROMPT_BUCKET
from jetspec_jax.train.config import DEFAULT_DATA_DIR

from .datasets import BENCHMARKS
from .heads import ATTENTION_OF_ROLE
from .report import write_report
from .runner import DEFAULT_BUDGETS, DEFAULT_METHODS, DEFAULT_RESULTS, METHODS, RESULTS_DIR, EvalConfig, run_eval


def parse_heads(values: list[str]) -> dict[str, str]:
    heads = {}
    for value in values:
        role, sep, path = value.partition("=")
        if not sep or role not in ATTENTION_OF_ROLE or not path:
            raise ValueError(f"--heads {value!r}: expected ROLE=DIR with ROLE one of "
                             f"{', '.join(ATTENTION_OF_ROLE)}")
        heads[role] = path
    return heads


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.eval", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    run = sub.add_parser("run", help="generate, time and score; appends to the results file")
    run.add_argument("--benchmarks", nargs="+", default=list(BENCHMARKS), metavar="NAME",
                     help=f"any of {', '.join(BENCHMARKS)} (default: all; the last four are held-out "
                          "training-mixture prompts with no reference: tau, speedup and the lossless check)")
    run.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), metavar="METHOD",
                     help=f"any of {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS)}; ar always runs, "
                          "as the baseline)")
    run.add_argument("--budgets", nargs="+", type=int, default=list(DEFAULT_BUDGETS), metavar="B",
                     help="tree nodes per verify pass for jetspec/jetspec-tc/ddtree (dflash runs one chain as "
                          "long as its head's block)")
    run.add_argument("--temperatures", nargs="+", type=float, default=[0.0], metavar="T",
                     help="0 = greedy (compared token by token with AR); 1 = sampling")
    run.add_argument("--limit", type=int, default=None,
                     help="first N prompts of each benchmark (the held-out ones come in a fixed mixed order)")
    run.add_argument("--max-new-tokens", type=int, default=512)
    run.add_argument("--width", type=int, default=7, help="candidates per depth for the tree methods")
    run.add_argument("--tree-temperature", type=float, default=1.0,
                     help="the tree methods divide the head's logits by this before scoring the tree "
                          "(1 = the published scoring)")
    run.add_argument("--gemm-backend", choices=list(GEMM_BACKENDS), default="xla",
                     help="GEMM library of the speculative methods on GPU (AR keeps XLA's): xla or cublas")
    run.add_argument("--prompt-bucket", type=int, default=PROMPT_BUCKET,
                     help="pad each prompt to its own multiple of this; larger means fewer shapes to "
                          "compile (prefill grows; decode time is reported apart); 512 for the long "
                          "summarise and doc_qa prompts")
    run.add_argument("--batch", type=int, default=1, metavar="N",
                     help="run up to N prompts of one padded width together (per method, budget and "
                          "temperature): tau, acceptance and the lossless check per prompt as at batch 1, and "
                          "a throughput speedup against AR at the same batch; the latency speedup needs the "
                          "default, 1. A short batch is filled up to N with copies of its last prompt (one compiled "
                          "program per width). One batch size per results file")
    run.add_argument("--draft-attention", choices=DRAFT_ATTENTION_IMPLS, default="auto",
                     help="the draft head's attention: xla (a dense mask over its context buffer), pallas (the "
                          "tree kernel on GPU, jetspec-tc's second pass too; pallas_interpret on CPU) or auto "
                          "(pallas on GPU, xla elsewhere; the results file records which ran)")
    run.add_argument("--attention", choices=ATTENTION_IMPLS, default="auto",
                     help="attention of AR decode steps and verify passes (auto: Pallas kernel on GPU)")
    add_draft_vocab_flag(run)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--data-dir", default=None,
                     help=f"folder with the benchmark files and train_mix/ (default: {DEFAULT_DATA_DIR})")
    run.add_argument("--results", default=DEFAULT_RESULTS,
                     help="JSONL file to append to and resume from (default: eval/results/results.jsonl)")
    run.add_argument("--heads", nargs="+", action="extend", default=[], metavar="ROLE=DIR",
                     help="jetspec=DIR (causal head: jetspec, jetspec-tc) and/or bidirectional=DIR (ddtree, "
                          "dflash); default: "
                          "the head shipped for the target")
    run.add_argument("--heads-label", default=None, metavar="NAME",
                     help="names this run's head set in the report, which shows results files of two head "
                          "sets side by side (default: \"shipped\" for the packaged heads, else the --heads "
                          "directories' names joined by +)")
    run.add_argument("--allow-untrained", action="store_true",
                     help="run methods that have no trained head with an untrained one instead of skipping")
    run.add_argument("--model", default=None,
                     help="target .gguf or HF directory (default: the embedded model)")
    run.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                     help="default: bf16 on GPU, fp32 on CPU")
    run.add_argument("--code-timeout", type=float, default=10.0, help="seconds per HumanEval/MBPP program")
    run.add_argument("--compile-workers", type=int, default=EvalConfig.compile_workers, metavar="N",
                     help="compile every program of the run before the first timed call, N at a time (XLA "
                          "compiles in parallel threads; default: min(8, CPUs)); 0 compiles each at its first call")
    run.add_argument("--no-progress", action="store_true")
    cache.add_cache_flags(run)
    report = sub.add_parser("report", help="report.md, report.json and plots from results files")
    report.add_argument("results", nargs="+", help="one or more results .jsonl files")
    report.add_argument("--out", default=RESULTS_DIR, help="output directory (default: eval/results)")
    return p


class CurrentStderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record (test capture swaps it between calls)."""

    def emit(self, record):
        self.stream = sys.stderr
        super().emit(record)


def show_eval_logs() -> None:
    """This package's info and warnings on stderr, without jax's own info chatter."""
    logger = logging.getLogger(__package__)
    if not logger.handlers:
        handler = CurrentStderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def eval_command(argv=None) -> int:
    args = build_parser().parse_args(argv)
    show_eval_logs()
    if args.command == "run":
        cache.configure(args.cache_dir, enabled=not args.no_cache)
        config = EvalConfig(
            benchmarks=tuple(args.benchmarks), methods=tuple(args.methods), budgets=tuple(args.budgets),
            temperatures=tuple(args.temperatures), limit=args.limit, max_new_tokens=args.max_new_tokens,
            width=args.width, tree_temperature=args.tree_temperature, gemm_backend=args.gemm_backend,
            draft_attention=args.draft_attention, draft_vocab=args.draft_vocab,
            attention=args.attention, prompt_bucket=args.prompt_bucket, batch=args.batch, seed=args.seed,
            data_dir=args.data_dir, results=args.results, head_dirs=parse_heads(args.heads),
            heads_label=args.heads_label, allow_untrained=args.allow_untrained, model=args.model,
            dtype=args.dtype, code_timeout=args.code_timeout,
            compile_workers=args.compile_workers, progress=not args.no_progress)
        summary = run_eval(config, command=["python", "-m", "jetspec_jax.eval",
                                            *(sys.argv[1:] if argv is None else argv)])
        print(f"{args.results}: {summary['written']} lines written, {summary['skipped']} already there")
    else:
        paths = write_report(args.results, args.out)
        print("\n".join(paths))
    return 0


def main(argv=None) -> int:
    """The CLI: bad input is one `error:` line and exit status 2."""
    return run_command(eval_command, argv)


if __name__ == "__main__":
    sys.exit(main())
