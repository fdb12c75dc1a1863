"""What the two command lines (`generate` and `serve`) share: the target, method and head their flags name.
Below both, so neither imports the other."""

from __future__ import annotations

import sys

from jetspec_jax.api import random_head
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
    if method == "ar":
        return method, None
    path = args.head or packaged_head_path(target, method)
    if path:
        return method, load_head(path, target.params["embed"].dtype, target=target)
    attention = ATTENTION_OF_METHOD[method]
    print(f"warning: {no_head_message(target, method)}; using an untrained head (output is still exact, "
          "but tau ~ 1 and nothing is faster)", file=sys.stderr)
    return method, random_head(target, attention, args.seed)


def load_for_cli(args) -> tuple[Target, str, tuple | None]:
    """(target, method, head) from a command line's --model, --dtype, --method and --head; a damaged
    --head fails before the target loads. Shared by generate and serve."""
    if args.head:
        verify_head_files(args.head)
    target = load_target(args.model, dtype=args.dtype)
    return (target, *resolve_method_and_head(args, target))
