"""python -m jetspec_jax.train.token_counts --corpus CORPUS_DIR --head HEAD_DIR [--head ...]

Counts the tokens of a regenerated corpus's training answers (the target's own words, held-out answers
left out) and writes them beside each head as `token_counts.npz`, which `--draft-vocab N` reads to pick
the N tokens a head drafts over (jetspec_jax/draft_vocab.py)."""

from __future__ import annotations

import argparse
import os

from jetspec_jax import draft_vocab
from jetspec_jax.errors import InputError, OneLineErrorParser, run_command
from jetspec_jax.loading.head_checkpoint import read_head_record

from .corpus import Corpus
from .heldout import target_fingerprint


def corpus_counts(corpus: Corpus, vocab_size: int):
    """Token counts of the corpus's training answers' completions (int64, one per token id)."""
    source = corpus.answers("train")
    return draft_vocab.count_tokens((source[i]["completion_ids"] for i in range(len(source))), vocab_size)


def write_counts(corpus: Corpus, head_dirs: list[str], fingerprint: str | None = None) -> dict:
    """Counts once, writes beside every head (each must pair with the corpus's target, whose `fingerprint`
    the caller may know where the corpus does not record it); returns a summary."""
    records = [read_head_record(d) for d in head_dirs]
    corpus_dir = corpus.out_dir
    recorded = target_fingerprint(corpus)
    if recorded and fingerprint and recorded != fingerprint:
        raise InputError(f"the corpus in {corpus_dir} was made by target {recorded}, not {fingerprint}")
    fingerprint = recorded or fingerprint
    if not fingerprint:
        raise InputError(f"the corpus in {corpus_dir} does not record its target's fingerprint; regenerate it")
    for record in records:
        if record.target_fingerprint not in (None, fingerprint):
            raise InputError(f"the head at {record.path} was trained for target {record.target_fingerprint}, "
                             f"and the corpus in {corpus_dir} was made by {fingerprint}")
    vocab_sizes = {r.cfg.vocab_size for r in records}
    if len(vocab_sizes) != 1:
        raise InputError(f"the heads have different vocabularies ({sorted(vocab_sizes)}): count for each apart")
    counts = corpus_counts(corpus, vocab_sizes.pop())
    if not counts.sum():
        raise InputError(f"the corpus in {corpus_dir} has no training answers to count")
    source = (f"completion tokens of the {len(corpus.answers('train'))} training answers of the corpus in "
              f"{os.path.basename(os.path.normpath(corpus_dir))}"
              + ("" if corpus.manifest.get("complete") else " (a regeneration stopped part way)"))
    paths = [draft_vocab.save_counts(r.path, counts, fingerprint, source) for r in records]
    return {"tokens": int(counts.sum()), "distinct": int((counts > 0).sum()), "files": paths, "source": source}


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.train.token_counts", description=__doc__.split("\n\n")[1])
    p.add_argument("--corpus", required=True, help="a regenerated corpus directory (its manifest.json)")
    p.add_argument("--head", nargs="+", required=True, help="head directories trained on that corpus")
    p.add_argument("--partial", action="store_true", help="count a regeneration that stopped part way")
    return p


def count_command(argv=None) -> int:
    args = build_parser().parse_args(argv)
    summary = write_counts(Corpus(args.corpus, require_complete=not args.partial), args.head)
    print(f"{summary['tokens']} tokens, {summary['distinct']} distinct: " + ", ".join(summary["files"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_command(count_command))
