"""Pinned held-out answers (train/heldout.py): measured on a corpus that decoded other completions, the pinned
file gives back the answers it was pinned from, and a file that does not fit the corpus is one clear error."""

from __future__ import annotations

import numpy as np
import pytest
from test_train import corpus, tiny_target  # noqa: F401  (fixtures)

from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.train.config import load_config
from jetspec_jax.train.corpus import Answers, Corpus, CorpusWriter
from jetspec_jax.train.data import heldout_batches
from jetspec_jax.train.heldout import pick_heldout, read_pinned, write_pinned

FIELDS = ("source", "id", "kind", "sample", "prompt_ids", "completion_ids", "finished")


def rewritten(corpus: Corpus, out_dir, vocab: int, *, seed: int = 1, keep=lambda prompt: True,
              target: str | None = None, prompt_ids=lambda i, ids: ids) -> Corpus:
    """`corpus`'s prompts (those `keep` allows, their token ids through `prompt_ids`) with other completions
    of the same lengths: the same prompts decoded again, as another draw on another GPU would."""
    rng = np.random.default_rng(seed)
    kept = [i for i, p in enumerate(corpus.prompts) if keep(p)]
    new_index = {old: new for new, old in enumerate(kept)}
    answers = Answers()
    for position in range(len(corpus.answer_prompt)):
        old = int(corpus.answer_prompt[position])
        if old in new_index:
            record = corpus.record(position)
            tokens = rng.integers(3, vocab, len(record["completion_ids"])).tolist()
            answers.add(new_index[old], record["sample"], tokens, finished=record["finished"])
    settings = {"test": True, **({"target_fingerprint": target} if target else {})}
    writer = CorpusWriter.create(str(out_dir), settings, [corpus.prompts[i] for i in kept],
                                 [prompt_ids(i, corpus.prompt_ids(i).tolist()) for i in kept], vocab,
                                 {"by": "test_heldout"})
    sources = [corpus.prompts[i]["source"] for i in kept]
    while len(answers):
        writer.write_shard(answers.take(50), sources, seconds=0.0)
    writer.finish({})
    return Corpus(str(out_dir))


def as_tuples(records):
    return [tuple(np.asarray(r[f]).tolist() if f.endswith("_ids") else r[f] for f in FIELDS) for r in records]


def test_the_pinned_answers_come_back_from_a_corpus_that_decoded_others(corpus, tiny_target, tmp_path):
    path = str(tmp_path / "heldout.npz")
    digest = write_pinned(path, corpus, per_kind=3)
    other = rewritten(corpus, tmp_path / "other", tiny_target.cfg.vocab_size)
    pinned = pick_heldout(corpus.answers("heldout"), 3)
    # 4 kinds, up to 3 answers each: 2 held-out prompts a source, chat's with 2 answers each
    assert len(pinned) == 9 and len(digest) == 64
    assert as_tuples(read_pinned(path, other)) == as_tuples(pinned)
    # measured on the other corpus's own answers, the numbers would read other completions
    assert as_tuples(pick_heldout(other.answers("heldout"), 3)) != as_tuples(pinned)
    buckets = load_config("tiny-cpu", ["data.length_buckets=[32, 128, 512]"]).buckets()
    for got, want in zip(heldout_batches(read_pinned(path, other), buckets, per_kind=3, seed=0),
                         heldout_batches(corpus.answers("heldout"), buckets, per_kind=3, seed=0), strict=True):
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_a_pinned_file_that_does_not_fit_the_corpus_is_one_clear_error(corpus, tiny_target, tmp_path):
    vocab = tiny_target.cfg.vocab_size
    path = str(tmp_path / "heldout.npz")
    write_pinned(path, corpus, per_kind=3)
    pinned_ids = {r["id"] for r in pick_heldout(corpus.answers("heldout"), 3)}
    without = rewritten(corpus, tmp_path / "without", vocab, keep=lambda p: p["id"] not in pinned_ids)
    with pytest.raises(InputError, match=r"8 pinned prompts are not in the corpus.*or delete it"):
        read_pinned(path, without)
    retokenized = rewritten(corpus, tmp_path / "retokenized", vocab, prompt_ids=lambda i, ids: ids[:-1])
    with pytest.raises(InputError, match="8 pinned prompts tokenize differently now"):
        read_pinned(path, retokenized)
    other_target = rewritten(corpus, tmp_path / "other-target", vocab, target="0123abcd")
    with pytest.raises(InputError, match="answers of another target"):
        read_pinned(path, other_target)
    with pytest.raises(InputError, match="no file at"):
        read_pinned(str(tmp_path / "missing.npz"), corpus)
    with open(path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(DamagedFileError, match="not a pinned held-out file"):
        read_pinned(path, corpus)
