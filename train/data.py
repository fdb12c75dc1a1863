"""Training batches from the regenerated corpus, through grain: answers drawn by mixture weight, each whole
in the smallest length bucket that holds it, one bucket per batch (rows = token budget // bucket length),
random anchors among the answer positions. A step's batch is a pure function of the seed, the corpus and
the step, so the iterator's state (in every checkpoint) is just the next step."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any, Iterator, Mapping, Sequence

import grain
import numpy as np

from .config import Bucket
from .heldout import answer_key, pick_heldout

# The arrays a batch gives the model; a held-out batch also carries each row's kind ("" for padding rows).
MODEL_INPUTS = ("tokens", "length", "prompt_len", "anchors", "anchor_valid")
# Batches prepared ahead in threads while the device runs a step (each holds ~tokens_per_batch tokens).
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def stable_seed(*parts: Any) -> int:
    """A 32-bit seed from any values, the same in every process and run (unlike hash())."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def mixture_weight(mixture: Mapping[str, float], source: str, kind: str) -> float:
    """An answer's draw weight: its source's entry, else its kind's, else 1."""
    return float(mixture.get(source, mixture.get(kind, 1.0)))


def bucket_of(lengths: np.ndarray, buckets: Sequence[Bucket]) -> np.ndarray:
    """Index of the smallest bucket holding each length; longer ones go to the largest (and are cut there)."""
    edges = np.asarray([b.length for b in buckets])
    return np.minimum(np.searchsorted(edges, lengths, side="left"), len(edges) - 1)


def fit_to_row(prompt_ids: np.ndarray, completion_ids: np.ndarray, max_len: int) -> tuple[np.ndarray, int]:
    """(tokens, prompt tokens kept): prompt + completion whole when they fit in max_len. Beyond it the
    completion keeps its start, up to max(max_len - prompt, max_len // 2) tokens, and the prompt its end
    for the rest: the answer positions are what is trained on, and the prompt's end (the question and
    the chat template's assistant header) is the context nearest them; teacher and head both read the
    same cut sequence, so the targets stay consistent."""
    p, c = len(prompt_ids), len(completion_ids)
    if p + c <= max_len:
        return np.concatenate([prompt_ids, completion_ids]).astype(np.int32), p
    keep_c = min(c, max(max_len - p, max_len // 2))
    keep_p = max_len - keep_c
    return np.concatenate([prompt_ids[p - keep_p:], completion_ids[:keep_c]]).astype(np.int32), keep_p


def sample_anchors(prompt_len: int, length: int, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Up to k distinct sorted anchors among the positions whose next token is an answer token (the last
    prompt token up to the second-to-last token), and which of the k slots hold one."""
    first, last = max(prompt_len - 1, 0), length - 2
    n = max(last - first + 1, 0)
    chosen = np.sort(first + rng.choice(n, size=min(k, n), replace=False)) if n else np.zeros((0,), np.int64)
    anchors = np.zeros((k,), np.int32)
    anchors[: len(chosen)] = chosen
    return anchors, np.arange(k) < len(chosen)


def make_rows(records: Sequence[dict | None], bucket: Bucket, rngs: Sequence[np.random.Generator]) -> dict:
    """One batch of a bucket: the records fitted and padded to its length, with anchors; None is a
    padding row (no tokens, no valid anchor)."""
    r, n = len(records), bucket.length
    out = {"tokens": np.zeros((r, n), np.int32), "length": np.zeros((r,), np.int32),
           "prompt_len": np.zeros((r,), np.int32), "anchors": np.zeros((r, bucket.anchors), np.int32),
           "anchor_valid": np.zeros((r, bucket.anchors), bool)}
    for i, (record, rng) in enumerate(zip(records, rngs)):
        if record is None:
            continue
        ids, prompt_len = fit_to_row(record["prompt_ids"], record["completion_ids"], n)
        out["tokens"][i, : len(ids)] = ids
        out["length"][i], out["prompt_len"][i] = len(ids), prompt_len
        out["anchors"][i], out["anchor_valid"][i] = sample_anchors(prompt_len, len(ids), bucket.anchors, rng)
    return out


class RowsOfStep(grain.transforms.MapWithIndex):
    """(step, (bucket index, global answer indices)) -> this process's rows of that step's batch. Anchors
    are drawn from (seed, step, global row), so a batch does not depend on how many processes share it."""

    def __init__(self, answers, buckets: Sequence[Bucket], seed: int, process_index: int, process_count: int):
        self.answers, self.buckets, self.seed = answers, buckets, seed
        self.process_index, self.process_count = process_index, process_count

    def map_with_index(self, step: int, element: tuple[int, np.ndarray]) -> dict:
        b, indices = element
        per_process = len(indices) // self.process_count
        rows = range(self.process_index * per_process, (self.process_index + 1) * per_process)
        return make_rows([self.answers[int(indices[j])] for j in rows], self.buckets[b],
                         [np.random.default_rng([self.seed, step, j]) for j in rows])


@dataclasses.dataclass
class TrainingStream:
    """The endless training batches of one process and what they are drawn from."""

    dataset: grain.MapDataset  # step -> this process's batch
    indices: grain.MapDataset  # step -> (bucket index, the batch's answers as indices into the train split)
    plan: dict[str, Any]  # answers per bucket, cut answers, expected draw share per source and kind


# Draws per group before the stream would end: finite, because grain takes len() of every mixed parent and
# an endless repeat batched by a bucket of one row has a length past sys.maxsize.
ENDLESS_DRAWS = 2**48


def training_stream(answers, buckets: Sequence[Bucket], *, mixture: Mapping[str, float], seed: int,
                    process_index: int = 0, process_count: int = 1) -> TrainingStream:
    """Batches from `answers` (a corpus's train split): within each bucket, every (source, kind) group of
    answers is shuffled anew each pass and the groups are interleaved in proportion to weight x size;
    the buckets are interleaved in proportion to their total weight / rows, so an answer is drawn at a
    rate proportional to its weight (mixture_weight), whatever its length. Weight 0 is never drawn."""
    if not len(answers):
        raise ValueError("the corpus has no training answers; regenerate data first (python -m jetspec_jax.train "
                         "--stage regenerate --config ...)")
    lengths, sources, kinds = np.asarray(answers.lengths()), answers.sources(), answers.kinds()
    where = bucket_of(lengths, buckets)
    groups: dict[tuple[int, str, str], list[int]] = collections.defaultdict(list)
    for i, (b, source, kind) in enumerate(zip(where.tolist(), sources, kinds)):
        groups[(b, source, kind)].append(i)
    per_bucket, bucket_weights, drawn = [], [], collections.Counter()
    for b, bucket in enumerate(buckets):
        parts, weights = [], []
        for (gb, source, kind), members in sorted(groups.items()):
            w = mixture_weight(mixture, source, kind)
            if gb != b or w <= 0:
                continue
            members_ds = grain.MapDataset.source(np.asarray(members, np.int64))
            passes = max(1, ENDLESS_DRAWS // len(members))
            parts.append(members_ds.shuffle(seed=stable_seed(seed, bucket.length, source, kind)).repeat(passes))
            weights.append(w * len(members))
            drawn[(source, kind)] += w * len(members)
        if parts:
            batches = grain.MapDataset.mix(parts, weights).batch(bucket.rows).map(lambda x, b=b: (b, x))
            per_bucket.append(batches)
            bucket_weights.append(sum(weights) / bucket.rows)
    if not per_bucket:
        raise ValueError(f"data.mixture {dict(mixture)} gives weight 0 to every training answer; give some "
                         "source or kind a weight > 0")
    steps = per_bucket[0] if len(per_bucket) == 1 else grain.MapDataset.mix(per_bucket, bucket_weights)
    dataset = steps.map_with_index(RowsOfStep(answers, buckets, seed, process_index, process_count))
    by_source, by_kind = collections.Counter(), collections.Counter()
    for (source, kind), w in drawn.items():
        by_source[source] += w
        by_kind[kind] += w
    total = sum(drawn.values())
    plan = {"answers": len(answers),
            "answers_per_bucket": {str(b.length): int(np.sum(where == i)) for i, b in enumerate(buckets)},
            "cut_answers": int(np.sum(lengths > buckets[-1].length)),
            "real_token_fill": bucket_fill(lengths, buckets),
            "draw_share_by_source": {k: round(v / total, 6) for k, v in sorted(by_source.items())},
            "draw_share_by_kind": {k: round(v / total, 6) for k, v in sorted(by_kind.items())}}
    return TrainingStream(dataset, steps, plan)


def bucket_fill(lengths: np.ndarray, buckets: Sequence[Bucket]) -> float:
    """Real tokens over row tokens, every answer once in its bucket (pad included; cut ones count full)."""
    edges = np.asarray([b.length for b in buckets])
    row = edges[bucket_of(lengths, buckets)]
    return round(float(np.minimum(lengths, row).sum() / max(row.sum(), 1)), 4)


def heldout_batches(answers, buckets: Sequence[Bucket], *, per_kind: int, seed: int) -> list[dict]:
    """Fixed held-out batches: up to `per_kind` answers of every kind (`heldout.pick_heldout`), in their
    buckets' shapes, padding rows filling the last batch of each; the same anchors every time. Each batch
    holds all rows (every process builds them)."""
    if per_kind <= 0 or not len(answers):
        return []
    chosen = [(answer_key(r), r) for r in pick_heldout(answers, per_kind)]
    lengths = np.asarray([len(r["prompt_ids"]) + len(r["completion_ids"]) for _, r in chosen])
    where = bucket_of(lengths, buckets)
    batches = []
    for b, bucket in enumerate(buckets):
        mine = [chosen[i] for i in np.flatnonzero(where == b)]
        for start in range(0, len(mine), bucket.rows):
            part = mine[start: start + bucket.rows]
            records = [r for _, r in part] + [None] * (bucket.rows - len(part))
            rngs = [np.random.default_rng([seed, stable_seed(key)]) for key, _ in part] + [None] * (
                bucket.rows - len(part))
            batch = make_rows(records, bucket, rngs)
            batch["kind"] = np.asarray([r["kind"] if r else "" for r in records])
            batches.append(batch)
    return batches


def batch_iterator(ds: grain.MapDataset, state: dict | None = None) -> Iterator[dict]:
    it = iter(ds.to_iter_dataset(READ_OPTIONS))
    if state is not None:
        it.set_state(state)
    return it
