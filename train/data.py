"""Training examples from regenerated sequences, through grain: records -> fixed-length token
sequences -> random anchor positions per sequence. Deterministic given the seed; the iterator's
state goes into every checkpoint."""

from __future__ import annotations

import hashlib
from typing import Any, Iterator

import grain
import numpy as np


def split_heldout(records: list[dict], fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A stable held-out split keyed by each record's source and id (independent of order)."""
    def bucket(r):
        digest = hashlib.sha256(f"{seed}:{r['source']}:{r['id']}".encode()).digest()
        return int.from_bytes(digest[:8], "little") / 2**64

    train = [r for r in records if bucket(r) >= fraction]
    heldout = [r for r in records if bucket(r) < fraction]
    return train, heldout


class ToSequence(grain.transforms.Map):
    """prompt + completion, cut or padded to seq_len; remembers where the completion starts."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len

    def map(self, record: dict) -> dict:
        ids = (list(record["prompt_ids"]) + list(record["completion_ids"]))[: self.seq_len]
        tokens = np.zeros((self.seq_len,), np.int32)
        tokens[: len(ids)] = ids
        return {"tokens": tokens, "length": np.int32(len(ids)),
                "prompt_len": np.int32(min(len(record["prompt_ids"]), self.seq_len))}


class SampleAnchors(grain.transforms.RandomMap):
    """K distinct anchors among the positions whose next token is a generated one (the last prompt
    token up to the second-to-last token); missing anchors are marked invalid."""

    def __init__(self, anchors_per_seq: int):
        self.k = anchors_per_seq

    def random_map(self, example: dict, rng: np.random.Generator) -> dict:
        first = max(int(example["prompt_len"]) - 1, 0)
        last = int(example["length"]) - 2
        candidates = np.arange(first, last + 1, dtype=np.int32) if last >= first else np.zeros((0,), np.int32)
        chosen = np.sort(rng.permutation(candidates)[: self.k])
        anchors = np.zeros((self.k,), np.int32)
        anchors[: len(chosen)] = chosen
        valid = np.arange(self.k) < len(chosen)
        return {**example, "anchors": anchors, "anchor_valid": valid}


def training_dataset(records: list[dict], *, seq_len: int, anchors_per_seq: int, batch_size: int, seed: int,
                     process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """An endless, shuffled-per-epoch dataset of batches for this process (its own slice of the data)."""
    if not records:
        raise ValueError("no training records; regenerate data first (python -m jetspec_jax.train "
                         "--stage regenerate --config ...)")
    ds = grain.MapDataset.source(records)[process_index::process_count]
    ds = ds.shuffle(seed=seed).repeat(None)
    ds = ds.map(ToSequence(seq_len)).random_map(SampleAnchors(anchors_per_seq), seed=seed + 1)
    return ds.batch(batch_size, drop_remainder=True)


def heldout_batches(records: list[dict], *, seq_len: int, anchors_per_seq: int, batch_size: int,
                    num_sequences: int, seed: int) -> list[dict[str, Any]]:
    """Fixed evaluation batches (same anchors every time)."""
    records = records[:num_sequences]
    if not records:
        return []
    ds = grain.MapDataset.source(records).map(ToSequence(seq_len))
    ds = ds.random_map(SampleAnchors(anchors_per_seq), seed=seed + 2).batch(batch_size, drop_remainder=False)
    return [ds[i] for i in range(len(ds))]


def batch_iterator(ds: grain.MapDataset, state: dict | None = None) -> Iterator[dict]:
    it = iter(ds.to_iter_dataset())
    if state is not None:
        it.set_state(state)
    return it
