"""What the two command lines (`generate` and `serve`) share: the target, method and head their flags name.
Below both, so neither imports the other."""

from __future__ import annotations

import argparse
import sys

from jetspec_jax.api import random_head
from jetspec_jax.draft_vocab import describe as describe_draft_vocab
from jetspec_jax.errors import InputError
from jetspec_jax.loading.head_checkpoint import load_head, no_head_message, packaged_head_path, verify_head_files
from jetspec_jax.speculative import ATTENTION_OF_METHOD
from jetspec_jax.target import Target, load_target


def resolve_method_and_head(args, target: Target):
    """(method, head) for the CLI: an explicit --head, else the head shipped for this target (matched by
    its fingerprint, whatever the file is called)."""
    method = args.method
    if method == "auto":
        if args.head or packaged_head_path(target, "jetspec"):
            method = "jetspec"
        else:
            print(f"note: {no_head_message(target, 'jetspec')}; decoding token by token", file=sys.stderr)
            method = "ar"
    draft_vocab = getattr(args, "draft_vocab", None)
    if method == "ar":
        if draft_vocab is not None:
            raise InputError("--draft-vocab sizes a draft head's vocabulary; method ar drafts nothing")
        return method, None
    path = args.head or packaged_head_path(target, method)
    if path:
        head = load_head(path, target.params["embed"].dtype, target=target, draft_vocab=draft_vocab)
        if draft_vocab is not None:
            print(f"note: {describe_draft_vocab(path, draft_vocab, target.cfg.vocab_size)}", file=sys.stderr)
        return method, head
    if draft_vocab is not None:
        raise InputError(f"--draft-vocab needs a trained head and its token counts; {no_head_message(target, method)}")
    attention = ATTENTION_OF_METHOD[method]
    print(f"warning: {no_head_message(target, method)}; using an untrained head (output is still exact, "
          "but tau ~ 1 and nothing is faster)", file=sys.stderr)
    return method, random_head(target, attention, args.seed)


def add_draft_vocab_flag(parser) -> None:
    parser.add_argument("--draft-vocab", type=positive_int, default=None, metavar="N",
                        help="draft over the N tokens the target's answers use most (their counts ship beside "
                             "the head) instead of the whole vocabulary: each head pass reads N rows of the LM "
                             "head; output is unchanged (the target verifies over its whole vocabulary)")


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {value!r}")
    return number


def load_for_cli(args) -> tuple[Target, str, tuple | None]:
    """(target, method, head) from a command line's --model, --dtype, --method and --head; a damaged
    --head fails before the target loads. Shared by generate and serve."""
    if args.head:
        verify_head_files(args.head)
    target = load_target(args.model, dtype=args.dtype)
    return (target, *resolve_method_and_head(args, target))
