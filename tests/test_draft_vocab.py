"""A draft vocabulary (jetspec_jax/draft_vocab.py): the head scores only its N most frequent tokens. The
trees it drafts are exactly those of the whole-vocabulary logits with every other token masked out, the
output stays AR's, and the counts it is chosen from travel beside the head."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import TargetGreedyDrafter, random_head
from test_speculative import PROMPTS, run_ar, run_spec
from test_train import corpus, tiny_target  # noqa: F401  (fixtures)

from jetspec_jax import draft_vocab
from jetspec_jax.autoregressive import GenerationConfig, prefill
from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.loading.head_checkpoint import PACKAGED_HEADS_DIR, PACKAGED_INDEX, load_head, save_head
from jetspec_jax.models import draft_head
from jetspec_jax.speculative import SpecConfig, draft_tree
from jetspec_jax.train.token_counts import corpus_counts, write_counts

SUBSET_SEED = 7


def subset_of(vocab_size: int, size: int, seed: int = SUBSET_SEED) -> np.ndarray:
    return np.sort(np.random.default_rng(seed).choice(vocab_size, size, replace=False)).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class SubsetDrafter(TargetGreedyDrafter):
    """The target-greedy drafter scoring only `ids`: as a draft vocabulary (logits over ids alone, its
    params mapping them) or, with `masked`, over the whole vocabulary with every other token at -inf."""

    ids: tuple[int, ...] = ()
    masked: bool = False

    def restrict(self, logits):
        ids = jnp.asarray(self.ids)
        if self.masked:
            return jnp.full_like(logits, -jnp.inf).at[..., ids].set(logits[..., ids])
        return logits[..., ids]

    def propose(self, *args):
        return self.restrict(super().propose(*args))

    def propose_tree(self, *args):
        return self.restrict(super().propose_tree(*args))

    def params(self, vocab_size: int):
        if self.masked:
            return None
        ids = np.asarray(self.ids, np.int32)
        index = np.zeros(vocab_size, np.int32)
        index[ids] = np.arange(len(ids))
        return {"draft_vocab": jnp.asarray(ids), "draft_index": jnp.asarray(index)}


def test_the_most_frequent_tokens_ties_to_the_lower_id():
    counts = np.array([5, 0, 9, 5, 5, 1])
    np.testing.assert_array_equal(draft_vocab.most_frequent(counts, 3), [0, 2, 3])  # 9, then 5 at ids 0 and 3
    np.testing.assert_array_equal(draft_vocab.most_frequent(counts, 6), np.arange(6))
    assert draft_vocab.coverage(counts, np.array([0, 2, 3])) == pytest.approx(19 / 25)
    for size in (0, 7, 2.5, True):
        with pytest.raises(InputError, match=r"--draft-vocab must be a whole number of tokens in \[1, 6\]"):
            draft_vocab.most_frequent(counts, size)


def test_the_counts_file_round_trips_and_refuses_what_does_not_fit(tmp_path):
    counts = np.arange(10, dtype=np.int64)
    with pytest.raises(InputError, match="token_counts.npz does not exist.*token_counts --corpus"):
        draft_vocab.load_counts(str(tmp_path), 10)
    draft_vocab.save_counts(str(tmp_path), counts, "fp-a", "a test")
    np.testing.assert_array_equal(draft_vocab.load_counts(str(tmp_path), 10, "fp-a"), counts)
    with pytest.raises(InputError, match="counts 10 token ids but the target's vocabulary has 12"):
        draft_vocab.load_counts(str(tmp_path), 12)
    with pytest.raises(InputError, match="answers of target fp-a, not this target"):
        draft_vocab.load_counts(str(tmp_path), 10, "fp-b")
    (tmp_path / draft_vocab.COUNTS_FILE).write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DamagedFileError, match="not a readable token-counts file"):
        draft_vocab.load_counts(str(tmp_path), 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == [draft_vocab.COUNTS_FILE]  # no temporary left


def test_every_shipped_head_carries_the_token_counts_of_its_training_answers():
    """So --draft-vocab works with the packaged heads: counts of their target's vocabulary and fingerprint."""
    with open(PACKAGED_INDEX, encoding="utf-8") as f:
        index = json.load(f)
    vocab_sizes = {"9cef354d3fd320b9": 49152}  # the embedded SmolLM2-135M-Instruct
    for fingerprint, entry in index.items():
        for name in {v for k, v in entry.items() if k != "target"}:
            counts = draft_vocab.load_counts(os.path.join(PACKAGED_HEADS_DIR, name), vocab_sizes[fingerprint],
                                             fingerprint)
            assert counts.sum() > 1_000_000, name  # a corpus's answers, not a smoke run's


def prefilled(target, prompts, cache_len: int = 48):
    tokens = np.zeros((len(prompts), 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    lengths = jnp.asarray([len(p) for p in prompts])
    logits, _, cache = prefill(target.params, jnp.asarray(tokens), lengths, target.cfg, cache_len)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@pytest.mark.parametrize("method,budget,width,settings", [
    ("jetspec", 24, 4, {}), ("jetspec-tc", 16, 3, dict(candidate_budget=48, conditioned_width=4))])
def test_trees_over_a_draft_vocabulary_are_those_of_the_masked_vocabulary(tiny_qwen3, method, budget, width,
                                                                          settings):
    target, _ = tiny_qwen3
    v = target.cfg.vocab_size
    ids = tuple(subset_of(v, v // 2).tolist())
    anchor, cache = prefilled(target, PROMPTS)
    spec = SpecConfig(method, budget, width, **settings)
    trees = {}
    for masked in (False, True):
        drafter = SubsetDrafter(target.cfg, 4, sharpness=1.0, ids=ids, masked=masked)
        trees[masked] = draft_tree(target.params, drafter.params(v), anchor, cache, None, drafter=drafter, spec=spec,
                                   depth=4)
    for got, want in zip(trees[False], trees[True]):  # scores: log-softmax sums fewer terms, to rounding
        got, want = np.asarray(got), np.asarray(want)
        if got.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    tree = trees[False]
    drafted = np.asarray(tree.tokens)[np.asarray(tree.valid) & (np.asarray(tree.depths) > 0)]
    assert drafted.size == len(PROMPTS) * (budget - 1)  # full trees, every drafted token of the draft vocabulary
    assert np.isin(drafted, ids).all()


@pytest.mark.parametrize("method", ["jetspec", "jetspec-tc"])
def test_drafting_over_a_draft_vocabulary_is_lossless_and_accepts(tiny_qwen3, method):
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=20)
    want, want_n = run_ar(target, PROMPTS, gen)
    # the greedy answers' own tokens and as many others: drafts along the target's path get accepted
    ids = np.union1d(np.unique(want), subset_of(target.cfg.vocab_size, 40)).astype(np.int32)
    assert len(ids) < target.cfg.vocab_size
    drafter = SubsetDrafter(target.cfg, 4, ids=tuple(ids.tolist()))
    out = run_spec(target, drafter, drafter.params(target.cfg.vocab_size), PROMPTS, gen, SpecConfig(method, 16, 3))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
    accepted = np.asarray(out.accept_counts)[:, 1:].sum()
    assert accepted > 0


def test_a_draft_vocabulary_narrower_than_the_tree_is_refused(tiny_qwen3):
    target, _ = tiny_qwen3
    drafter = SubsetDrafter(target.cfg, 4, ids=(3, 5, 9))
    anchor, cache = prefilled(target, PROMPTS[:1])
    with pytest.raises(ValueError, match="drafts over 3 tokens.*fewer than the 4 candidates"):
        draft_tree(target.params, drafter.params(target.cfg.vocab_size), anchor, cache, None, drafter=drafter,
                   spec=SpecConfig("jetspec", 8, 4), depth=4)


def test_the_head_s_logits_over_a_draft_vocabulary_are_its_columns(tiny_qwen3):
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(2), attention="causal")
    ids = subset_of(target.cfg.vocab_size, 50)
    narrow = draft_vocab.attach(head, target.params, target.cfg.tie_embeddings, ids)
    assert draft_vocab.size_of(narrow) == 50 and draft_vocab.size_of(head) is None
    hidden = jax.random.normal(jax.random.key(3), (2, 5, target.cfg.hidden_size))
    full = draft_head.slot_logits(head, target.params, target.cfg, hidden, drafter.cfg)
    got = draft_head.slot_logits(narrow, target.params, target.cfg, hidden, drafter.cfg)
    np.testing.assert_allclose(np.asarray(got), np.asarray(full)[..., ids], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="increasing, distinct token ids"):
        draft_vocab.attach(head, target.params, target.cfg.tie_embeddings, ids[::-1])


@pytest.mark.parametrize("method", ["jetspec", "jetspec-tc"])
def test_a_head_loaded_with_a_draft_vocabulary_is_lossless(tiny_qwen3, corpus, tmp_path, method):  # noqa: F811
    """The whole path a user takes: counts written from a corpus beside a saved head, the head loaded with
    --draft-vocab's N, generation equal to AR's."""
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(5), attention="causal")
    path = str(tmp_path / "head")
    save_head(path, drafter.cfg, head, target=target)
    summary = write_counts(corpus, [path], target.fingerprint)
    counts = corpus_counts(corpus, target.cfg.vocab_size)
    assert summary["tokens"] == counts.sum() > 0
    np.testing.assert_array_equal(draft_vocab.load_counts(path, target.cfg.vocab_size, target.fingerprint), counts)

    _, narrow = load_head(path, jnp.float32, target=target, draft_vocab=64)
    np.testing.assert_array_equal(np.asarray(narrow["draft_vocab"]), draft_vocab.most_frequent(counts, 64))
    gen = GenerationConfig(max_new_tokens=16)
    want, want_n = run_ar(target, PROMPTS, gen)
    out = run_spec(target, drafter, narrow, PROMPTS, gen, SpecConfig(method, 12, 3))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
    with pytest.raises(ValueError, match="pass target="):
        load_head(path, jnp.float32, draft_vocab=64)
    with pytest.raises(InputError, match="--draft-vocab must be a whole number"):
        load_head(path, jnp.float32, target=target, draft_vocab=target.cfg.vocab_size + 1)


def test_the_command_line_drafts_over_a_draft_vocabulary(tmp_path, capsys):
    """generate --draft-vocab N with a head whose counts lie beside it prints what AR prints; with method ar
    the flag is one error line."""
    from conftest import make_tiny_gguf

    from jetspec_jax.generate import main
    from jetspec_jax.target import load_target

    model = make_tiny_gguf(str(tmp_path / "tiny.gguf"))
    target = load_target(model, dtype="float32")
    drafter, head = random_head(target.cfg, jax.random.key(6), attention="causal")
    path = str(tmp_path / "head")
    save_head(path, drafter.cfg, head, target=target)
    counts = np.random.default_rng(0).integers(0, 50, target.cfg.vocab_size)
    draft_vocab.save_counts(path, counts, target.fingerprint, "a test")
    argv = ["Hello there", "--model", model, "--max-new-tokens", "12", "--no-stream", "--no-cache"]
    assert main(argv + ["--method", "ar"]) == 0
    ar = capsys.readouterr().out
    assert main(argv + ["--method", "jetspec", "--head", path, "--draft-vocab", "40", "--budget", "8"]) == 0
    spec = capsys.readouterr()
    assert spec.out == ar
    share = draft_vocab.coverage(counts, draft_vocab.most_frequent(counts, 40))
    assert f"drafting over the 40 of {target.cfg.vocab_size} tokens" in spec.err and f"{100 * share:.2f}%" in spec.err
    assert main(argv + ["--method", "ar", "--draft-vocab", "40"]) == 2
    assert "method ar drafts nothing" in capsys.readouterr().err
