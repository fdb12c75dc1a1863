"""A draft vocabulary: the head scores only the target's N most frequent tokens instead of its whole
vocabulary, so each head pass reads N rows of the LM-head matrix (a Qwen3 target's 151,936 rows are
1.2 GB in bf16 at width 4096, more than a third of a paper-sized head pass's bytes).

Only drafting changes: the tree holds tokens of the draft vocabulary, and the target verifies it over
its whole vocabulary as before, so the output is the target's exactly. A token outside the draft
vocabulary can only come as a step's bonus token. The frequencies are the target's own answers' token
counts (`token_counts.npz` beside a head, written from the corpus the head was trained on)."""

from __future__ import annotations

import io
import os
import zipfile
from typing import Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.provenance import write_bytes_atomic

COUNTS_FILE = "token_counts.npz"
COUNTS_FIX = ("write it with: python -m jetspec_jax.train.token_counts --corpus CORPUS_DIR --head HEAD_DIR "
              "(the regenerated corpus the head was trained on), or drop --draft-vocab")


def count_tokens(sequences: Iterable[np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each token id occurs in `sequences` (int64, one entry per id of the vocabulary)."""
    counts = np.zeros(vocab_size, np.int64)
    pending, size = [], 0

    def flush():
        if pending:
            ids = np.concatenate(pending).astype(np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(f"token ids outside [0, {vocab_size}) in a counted sequence")
            counts[:] += np.bincount(ids, minlength=vocab_size)
            pending.clear()

    for seq in sequences:  # one bincount per million tokens, not per sequence
        pending.append(np.asarray(seq).ravel())
        size += pending[-1].size
        if size >= 1 << 20:
            flush()
            size = 0
    flush()
    return counts


def save_counts(head_dir: str, counts: np.ndarray, target_fingerprint: str, source: str) -> str:
    """Writes `token_counts.npz` into a head directory atomically; returns its path."""
    counts = np.asarray(counts, np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("token counts must be one non-negative count per token id")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, counts=counts, target_fingerprint=np.asarray(target_fingerprint),
                        source=np.asarray(source))
    path = os.path.join(head_dir, COUNTS_FILE)
    write_bytes_atomic(path, buffer.getvalue())
    return path


def load_counts(head_dir: str, vocab_size: int, target_fingerprint: str | None = None) -> np.ndarray:
    """The token counts shipped beside a head, checked against the target's vocabulary (and, given its
    fingerprint, against the target the counts were taken from)."""
    path = os.path.join(head_dir, COUNTS_FILE)
    if not os.path.exists(path):
        raise InputError(f"--draft-vocab needs the target's token counts beside the head, and {path} does "
                         f"not exist; {COUNTS_FIX}")
    try:
        with np.load(path) as data:
            counts = np.asarray(data["counts"])
            fingerprint = str(data["target_fingerprint"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
        raise DamagedFileError(path, f"not a readable token-counts file ({e})", COUNTS_FIX) from None
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise DamagedFileError(path, "its counts are not one non-negative integer per token id", COUNTS_FIX)
    if counts.shape[0] != vocab_size:
        raise InputError(f"{path} counts {counts.shape[0]} token ids but the target's vocabulary has "
                         f"{vocab_size}: the counts belong to another target; {COUNTS_FIX}")
    if target_fingerprint is not None and fingerprint != target_fingerprint:
        raise InputError(f"{path} was counted on the answers of target {fingerprint}, not this target "
                         f"({target_fingerprint}); {COUNTS_FIX}")
    return counts


def check_size(size: int, vocab_size: int) -> None:
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or not 1 <= size <= vocab_size:
        raise InputError(f"--draft-vocab must be a whole number of tokens in [1, {vocab_size}] (the target's "
                         f"vocabulary), got {size!r}")


def most_frequent(counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties to the lower id), in increasing id order (int32)."""
    check_size(size, len(counts))
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts, np.int64)))  # count desc, then id asc
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts: np.ndarray, token_ids: np.ndarray) -> float:
    """The share of counted tokens that the draft vocabulary `token_ids` holds."""
    total = int(np.sum(counts))
    return float(np.sum(np.asarray(counts)[token_ids]) / total) if total else 0.0


def attach(head_params: Mapping[str, Any], target_params: Mapping[str, Any], tie_embeddings: bool,
           token_ids: np.ndarray) -> dict[str, Any]:
    """The head's params drafting over `token_ids` (increasing, distinct target ids): their rows of the
    target's LM head, their ids, and each target id's place among them (0 for ids outside: only
    drafted tokens are ever looked up)."""
    ids = np.asarray(token_ids)
    lm = target_params["embed"] if tie_embeddings else target_params["lm_head"].T  # (V, D)
    vocab_size = lm.shape[0]
    if (ids.ndim != 1 or not ids.size or ids.min() < 0 or ids.max() >= vocab_size
            or (ids.size > 1 and (np.diff(ids) <= 0).any())):
        raise ValueError(f"a draft vocabulary is increasing, distinct token ids in [0, {vocab_size})")
    index = np.zeros(vocab_size, np.int32)
    index[ids] = np.arange(ids.size, dtype=np.int32)
    ids = jnp.asarray(ids, jnp.int32)
    return {**head_params, "draft_vocab": ids, "draft_index": jnp.asarray(index), "draft_lm_head": lm[ids]}


def has_draft_vocab(params: Any) -> bool:
    return isinstance(params, Mapping) and "draft_vocab" in params


def size_of(params: Any) -> int | None:
    """The draft vocabulary's size, or None where the head drafts over the whole vocabulary."""
    return int(params["draft_vocab"].shape[0]) if has_draft_vocab(params) else None


def to_token_ids(params: Any, draft_ids: jax.Array) -> jax.Array:
    """Places in the head's vocabulary -> target token ids (unchanged without a draft vocabulary)."""
    return params["draft_vocab"][draft_ids] if has_draft_vocab(params) else draft_ids


def to_draft_ids(params: Any, token_ids: jax.Array) -> jax.Array:
    """Target token ids -> places in the head's vocabulary (unchanged without a draft vocabulary)."""
    return params["draft_index"][token_ids] if has_draft_vocab(params) else token_ids


def describe(head_dir: str, size: int, vocab_size: int) -> str:
    """One line for a command's stderr: the draft vocabulary's size and the share of counted tokens it holds."""
    counts = load_counts(head_dir, vocab_size)
    share = coverage(counts, most_frequent(counts, size))
    return (f"drafting over the {size} of {vocab_size} tokens the target's answers use most ({100 * share:.2f}% "
            f"of the {int(counts.sum())} counted)")


def for_head(head_dir: str, head_params: Mapping[str, Any], target, size: int) -> dict[str, Any]:
    """A loaded head's params drafting over the `size` tokens the target's answers use most (the counts
    beside the head)."""
    check_size(size, target.cfg.vocab_size)
    counts = load_counts(head_dir, target.cfg.vocab_size, target.fingerprint)
    return attach(head_params, target.params, target.cfg.tie_embeddings, most_frequent(counts, size))
