"""Training: loss values, the bucketed and weighted data stream over a regenerated corpus, frozen target,
a tiny run that learns, exact kill-and-resume, per-kind held-out metrics, sharding, programs compiled ahead,
config errors, and a pair of heads on one teacher that trains each exactly as it would train alone."""

from __future__ import annotations

import collections
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax import sharding
from jetspec_jax.models import draft_head
from jetspec_jax.train.config import check_data_parallel, load_config
from jetspec_jax.train.corpus import Answers, Corpus, CorpusWriter
from jetspec_jax.train.data import MODEL_INPUTS, batch_iterator, fit_to_row, heldout_batches, training_stream
from jetspec_jax.train.loss import acceptance_stats, depth_weights, draft_loss, per_row_stats, pooled_stats
from jetspec_jax.train.mixture import is_heldout
from jetspec_jax.train.trainer import Trainer, forward_and_loss, teacher_targets, train

# source, kind, prompts kept for training, (min, max) prompt tokens, (min, max) answer tokens, answers per prompt
CORPUS = [("gsm8k", "math", 40, (8, 24), (4, 30), 1),
          ("chat", "chat", 30, (8, 80), (4, 30), 2),
          ("translation_wmt_de_en", "translation", 30, (8, 20), (4, 16), 1),
          ("long_context_qmsum", "long_context", 12, (300, 450), (8, 40), 1)]
HELDOUT_PER_SOURCE = 2
# rows of 32, 8 and 2 at 1,024 tokens; anchors 2, 6 and 26. The 512 bucket holds every long answer whole
# (the old tiny-cpu layout cut everything at 192 tokens).
OLD_SEQ_LEN = 192
TEST_SETTINGS = ["data.length_buckets=[32, 128, 512]", "optim.tokens_per_batch=1024",
                 "data.anchors_per_1k_tokens=50", "optim.total_steps=16", "optim.learning_rate=3e-3",
                 "optim.warmup_steps=2", "head.num_taps=2", "run.eval_every=4", "run.checkpoint_every=2"]
# A pair of heads (one of each kind) in one run; one bucket, so the pair's tests compile few steps.
PAIR = ['head.attention=["causal", "bidirectional"]', "data.length_buckets=[128]"]


def write_corpus(out_dir, vocab_size: int, seed: int = 0) -> Corpus:
    """A small regenerated corpus of random tokens shaped like the real one: short and long prompts, some
    prompts with several answers, and HELDOUT_PER_SOURCE held-out prompts in every source."""
    rng = np.random.default_rng(seed)
    prompts, prompt_ids, answers = [], [], Answers()
    for source, kind, n_train, (p_lo, p_hi), (a_lo, a_hi), samples in CORPUS:
        ids = [f"{source}-{j}" for j in range(10_000)]
        keep = ([i for i in ids if not is_heldout(source, i)][:n_train]
                + [i for i in ids if is_heldout(source, i)][:HELDOUT_PER_SOURCE])
        for record_id in keep:
            prompts.append({"source": source, "id": record_id, "kind": kind})
            prompt_ids.append(rng.integers(3, vocab_size, rng.integers(p_lo, p_hi + 1)).tolist())
            for sample in range(samples):
                tokens = rng.integers(3, vocab_size, rng.integers(a_lo, a_hi + 1)).tolist()
                answers.add(len(prompts) - 1, sample, tokens, finished=bool(sample % 2))
    writer = CorpusWriter.create(str(out_dir), {"test": True}, prompts, prompt_ids, vocab_size, {"by": "test_train"})
    sources = [p["source"] for p in prompts]
    while len(answers):
        writer.write_shard(answers.take(50), sources, seconds=0.0)
    writer.finish({})
    return Corpus(str(out_dir))


@pytest.fixture(scope="module")
def tiny_target(tiny_qwen3):
    return tiny_qwen3[0]


@pytest.fixture(scope="module")
def corpus(tiny_target, tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"), tiny_target.cfg.vocab_size)


def tiny_config(tmp_path, *overrides):
    return load_config("tiny-cpu", [f"run.out_dir={tmp_path}", *TEST_SETTINGS, *overrides])


def one_device():
    return sharding.make_mesh(1, jax.devices()[:1])


def drawn_answers(stream, steps: int) -> list[int]:
    """Indices into the train split of every answer the first `steps` batches hold."""
    return [int(i) for step in range(steps) for i in stream.indices[step][1]]


def record_step_states(monkeypatch) -> list:
    """The state each training step starts from, appended as the steps run."""
    states, train_step = [], Trainer.train_step

    def recording_step(self, state, batch):
        states.append(jax.device_get(state))
        return train_step(self, state, batch)

    monkeypatch.setattr(Trainer, "train_step", recording_step)
    return states


# ---------------------------------------------------------------------------------------------
# Losses


def test_forward_kl_ce_rkl_against_hand_computation():
    student = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]]))  # (1 block, 2 depths, V=3)
    teacher = jnp.log(jnp.asarray([[[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]]))
    labels = jnp.asarray([[1, 2]])
    valid = jnp.asarray([[True, True]])
    kl0 = 0.25 * np.log(0.25 / 0.5) + 0.5 * np.log(0.5 / 0.25)  # depth 2 is identical: KL 0
    assert float(draft_loss(student, teacher, labels, valid)) == pytest.approx(kl0 / 2, rel=1e-6)
    rkl0 = 0.5 * np.log(0.5 / 0.25) + 0.25 * np.log(0.25 / 0.5)
    assert float(draft_loss(student, teacher, labels, valid, kind="rkl")) == pytest.approx(rkl0 / 2, rel=1e-6)
    ce = (-np.log(0.25) - np.log(0.1)) / 2
    assert float(draft_loss(student, teacher, labels, valid, kind="ce")) == pytest.approx(ce, rel=1e-6)
    # gamma=2: weights 1, exp(-1/2); an invalid position drops out of numerator and denominator
    w = np.exp(-0.5)
    assert float(draft_loss(student, teacher, labels, valid, kind="ce", gamma=2.0)) == pytest.approx(
        (-np.log(0.25) - w * np.log(0.1)) / (1 + w), rel=1e-6)
    assert float(draft_loss(student, teacher, labels, jnp.asarray([[True, False]]), kind="ce")) == pytest.approx(
        -np.log(0.25), rel=1e-6)
    # temperature: KL of the softened distributions times T^2
    t = 2.0
    p = np.array([0.25, 0.5, 0.25]) ** (1 / t)
    q = np.array([0.5, 0.25, 0.25]) ** (1 / t)
    p, q = p / p.sum(), q / q.sum()
    want = t**2 * np.sum(p * np.log(p / q)) / 2
    assert float(draft_loss(student, teacher, labels, valid, temperature=t)) == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(np.asarray(depth_weights(3, 0.0)), [1, 1, 1])


def test_acceptance_stats_and_per_row_sums_pool_to_the_same_numbers():
    teacher = jax.nn.one_hot(jnp.asarray([[[1, 2, 0], [0, 0, 0]]]), 3)  # 2 blocks x 3 depths
    student = jax.nn.one_hot(jnp.asarray([[[1, 0, 0], [0, 0, 1]]]), 3)
    valid = jnp.asarray([[[True, True, True], [True, True, False]]])
    per_depth, tau = acceptance_stats(student, teacher, valid)
    np.testing.assert_allclose(np.asarray(per_depth), [1.0, 0.5, 1.0])
    assert float(tau) == pytest.approx(1 + (1 + 2) / 2)  # leading matches: 1 and 2
    # three rows (the second one twice, one all padding): pooling any set of rows = the metric on those rows
    rng = np.random.default_rng(0)
    s, t = jnp.asarray(rng.normal(size=(3, 4, 3, 5))), jnp.asarray(rng.normal(size=(3, 4, 3, 5)))
    labels, valid = jnp.asarray(rng.integers(0, 5, (3, 4, 3))), jnp.asarray(rng.random((3, 4, 3)) < 0.7)
    valid = valid.at[2].set(False)
    stats = jax.tree.map(np.asarray, per_row_stats(s, t, labels, valid, gamma=2.0))
    pooled = pooled_stats(stats, np.asarray([True, True, False]))
    assert pooled["loss"] == pytest.approx(float(draft_loss(s[:2], t[:2], labels[:2], valid[:2], gamma=2.0)), rel=1e-5)
    want_depth, want_tau = acceptance_stats(s[:2], t[:2], valid[:2])
    np.testing.assert_allclose(pooled["accept_per_depth"], np.asarray(want_depth), atol=1e-4)
    assert pooled["expected_tau"] == pytest.approx(float(want_tau), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# The data stream


def test_mixture_weights_are_honoured(corpus, tmp_path):
    train_split = corpus.answers("train")
    sources = train_split.sources()
    counts = collections.Counter(sources)
    # chat x3 by source; the math kind at 0 but its source gsm8k at 2 (the source wins); translation never
    mixture = {"chat": 3.0, "math": 0.0, "gsm8k": 2.0, "translation": 0.0}
    cfg = tiny_config(tmp_path, f"data.mixture={json.dumps(mixture)}")
    stream = training_stream(train_split, cfg.buckets(), mixture=cfg.data.mixture, seed=0)
    drawn = collections.Counter(sources[i] for i in drawn_answers(stream, 400))
    assert drawn["translation_wmt_de_en"] == 0
    weights = {"gsm8k": 2.0, "chat": 3.0, "long_context_qmsum": 1.0}
    expected = {s: w * counts[s] / sum(weights[k] * counts[k] for k in weights) for s, w in weights.items()}
    total = sum(drawn.values())
    for source, share in expected.items():
        assert drawn[source] / total == pytest.approx(share, abs=0.03), (source, drawn, expected)
    assert stream.plan["draw_share_by_source"] == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="weight 0 to every training answer"):
        training_stream(train_split, cfg.buckets(), mixture={s: 0 for s in counts}, seed=0)


def test_heldout_answers_never_reach_the_training_stream(corpus, tmp_path):
    train_split, heldout = corpus.answers("train"), corpus.answers("heldout")
    heldout_keys = {(heldout[i]["source"], heldout[i]["id"]) for i in range(len(heldout))}
    assert len(heldout_keys) == HELDOUT_PER_SOURCE * len(CORPUS)
    cfg = tiny_config(tmp_path)
    stream = training_stream(train_split, cfg.buckets(), mixture={}, seed=0)
    seen = {(train_split[i]["source"], train_split[i]["id"]) for i in set(drawn_answers(stream, 200))}
    assert len(seen) == sum(n for _, _, n, *_ in CORPUS)  # every training prompt drawn, no held-out one
    assert not seen & heldout_keys
    batches = heldout_batches(heldout, cfg.buckets(), per_kind=4, seed=0)
    kinds = collections.Counter(k for b in batches for k in b["kind"].tolist() if k)
    assert kinds == {"math": 2, "chat": 4, "translation": 2, "long_context": 2}  # chat: 2 prompts x 2 answers


def test_a_long_answer_lands_whole_in_its_bucket_and_rows_fill_the_token_budget(corpus, tmp_path):
    cfg = tiny_config(tmp_path)
    buckets = {b.length: b for b in cfg.buckets()}
    assert [(b.rows, b.anchors) for b in buckets.values()] == [(32, 2), (8, 6), (2, 26)]
    train_split = corpus.answers("train")
    by_tokens = {}
    for i in range(len(train_split)):
        r = train_split[i]
        by_tokens[tuple(np.concatenate([r["prompt_ids"], r["completion_ids"]]).tolist())] = r
    stream = training_stream(train_split, cfg.buckets(), mixture={}, seed=0)
    shapes, long_rows = set(), 0
    for step in range(40):
        batch = stream.dataset[step]
        rows, length = batch["tokens"].shape
        bucket = buckets[length]
        assert rows == bucket.rows == cfg.optim.tokens_per_batch // length
        assert batch["anchors"].shape == batch["anchor_valid"].shape == (rows, bucket.anchors)
        shapes.add((rows, length))
        for row, n, p in zip(batch["tokens"], batch["length"], batch["prompt_len"]):
            r = by_tokens[tuple(row[:n].tolist())]  # the whole answer: prompt + completion, nothing cut
            assert p == len(r["prompt_ids"]) and not row[n:].any()
            assert length == min(b for b in buckets if b >= n)  # the smallest bucket that holds it
            long_rows += n > OLD_SEQ_LEN
        valid = batch["anchors"][batch["anchor_valid"]]
        assert valid.min() >= batch["prompt_len"].min() - 1
    assert len(shapes) == len(buckets) and long_rows > 0
    # beyond the largest bucket: the prompt's end and the completion's start are kept
    tokens, kept = fit_to_row(np.arange(100), np.arange(1000, 1040), 64)
    assert kept == 32 and tokens.tolist() == list(range(68, 100)) + list(range(1000, 1032))
    tokens, kept = fit_to_row(np.arange(10), np.arange(1000, 1100), 64)
    assert kept == 10 and tokens.tolist() == list(range(10)) + list(range(1000, 1054))


def test_a_bucket_of_one_row_streams(corpus, tmp_path):
    """A token budget that fits one row of the longest bucket (grain's batch of an endless source once
    overflowed len() there)."""
    cfg = tiny_config(tmp_path, "optim.tokens_per_batch=512")
    assert [b.rows for b in cfg.buckets()] == [16, 4, 1]
    stream = training_stream(corpus.answers("train"), cfg.buckets(), mixture={}, seed=0)
    shapes = {stream.dataset[step]["tokens"].shape for step in range(60)}
    assert shapes == {(16, 32), (4, 128), (1, 512)}


def test_resumed_iterator_gives_the_identical_next_batches_and_processes_split_each_batch(corpus, tmp_path):
    cfg = tiny_config(tmp_path)
    train_split = corpus.answers("train")
    stream = training_stream(train_split, cfg.buckets(), mixture={}, seed=3)
    it = batch_iterator(stream.dataset)
    for _ in range(5):
        next(it)
    state = it.get_state()
    want = [next(it) for _ in range(4)]
    resumed = batch_iterator(training_stream(train_split, cfg.buckets(), mixture={}, seed=3).dataset,
                             json.loads(json.dumps(state)))  # as the checkpoint stores it
    for a, b in zip(want, (next(resumed) for _ in range(4))):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    halves = [training_stream(train_split, cfg.buckets(), mixture={}, seed=3, process_index=p, process_count=2)
              .dataset[7] for p in range(2)]
    whole = stream.dataset[7]
    for k in whole:
        np.testing.assert_array_equal(np.concatenate([h[k] for h in halves]), whole[k])


# ---------------------------------------------------------------------------------------------
# The head's training path


def test_chunked_training_logits_equal_one_pass_and_give_the_same_gradients(tiny_target):
    from drafters import random_head

    target = tiny_target
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", num_layers=2)
    cfg = drafter.cfg
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 97, (2, 40)))
    taps = jnp.asarray(rng.normal(size=(2, 40, len(cfg.tap_layers), target.cfg.hidden_size)), jnp.float32)
    anchors = jnp.asarray(np.sort(rng.integers(0, 38, (2, 7)), axis=1))

    def total(params, chunk):
        return jnp.sum(jnp.sin(draft_head.training_logits(params, target.params, target.cfg, tokens, taps, anchors,
                                                          cfg, anchors_per_chunk=chunk)))

    whole, chunked = (jax.jit(jax.value_and_grad(total), static_argnums=1)(head, c)
                      for c in (None, 3))  # 3 chunks, the last padded
    assert float(chunked[0]) == pytest.approx(float(whole[0]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(whole[1]), jax.tree.leaves(chunked[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_gradients_do_not_reach_the_target(tiny_target, corpus, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer = Trainer(cfg, tiny_target, one_device())
    state = trainer.init_state(0)
    stream = training_stream(corpus.answers("train"), cfg.buckets(), mixture={}, seed=0)
    batch = trainer.place_batch(stream.dataset[0])
    loss_fn = lambda h, t: forward_and_loss(h, t, batch, loss_cfg=cfg.loss, head_cfg=trainer.head_cfg,  # noqa: E731
                                            target_cfg=tiny_target.cfg, dtype=jnp.float32)[0]
    head_grads, target_grads = jax.jit(jax.grad(loss_fn, argnums=(0, 1)))(state["params"], trainer.target_params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(target_grads))
    assert float(jnp.abs(head_grads["fc"]).max()) > 0


def test_the_tree_causal_loss_trains_the_causal_heads_tree_pass_and_is_measured_per_kind(tiny_target, corpus,
                                                                                         tmp_path):
    """loss.tree_causal_weight: a causal head's loss adds that weight x the same loss of its tree-causal pass
    along the data, the held-out numbers gain the tree pass's per kind, and a pair's bidirectional head
    trains as it would without it."""
    from jetspec_jax.train.config import HEAD_NAMES

    cfg = tiny_config(tmp_path, "loss.tree_causal_weight=0.5")
    trainer = Trainer(cfg, tiny_target, one_device())
    params = trainer.init_state(0)["params"]
    batch = training_stream(corpus.answers("train"), cfg.buckets(), mixture={}, seed=0).dataset[0]
    batch = {k: jnp.asarray(batch[k]) for k in MODEL_INPUTS}
    loss, (block, teacher_logits, labels, valid, tree) = forward_and_loss(
        params, tiny_target.params, batch, loss_cfg=cfg.loss, head_cfg=trainer.head_cfg, target_cfg=tiny_target.cfg,
        dtype=jnp.float32)
    taps = teacher_targets(tiny_target.params, batch, head_cfg=trainer.head_cfg, target_cfg=tiny_target.cfg)[3]
    want_tree = draft_head.training_tree_logits(params, tiny_target.params, tiny_target.cfg, batch["tokens"], taps,
                                                batch["anchors"], trainer.head_cfg)
    np.testing.assert_allclose(tree, want_tree, rtol=1e-5, atol=1e-5)
    want = draft_loss(block, teacher_logits, labels, valid) + 0.5 * draft_loss(want_tree, teacher_logits, labels, valid)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    heldout = trainer.evaluate(params, heldout_batches(corpus.answers("heldout"), cfg.buckets(), per_kind=4, seed=0))
    for numbers in [heldout, *heldout["eval_by_kind"].values()]:
        tree_numbers = {k.removeprefix("eval_") for k in numbers if "tree_" in k}
        assert tree_numbers == {"tree_loss", "tree_expected_tau", "tree_accept_per_depth"}, numbers
    assert heldout["eval_tree_expected_tau"] >= 1 and len(heldout["eval_tree_accept_per_depth"]) == labels.shape[-1]
    np.testing.assert_allclose(heldout["eval_by_kind"]["math"]["tree_accept_per_depth"][0],
                               heldout["eval_by_kind"]["math"]["accept_per_depth"][0])  # depth 1 sees the anchor alone

    pair = tiny_config(tmp_path, *PAIR, "loss.tree_causal_weight=0.5")
    assert [c.loss.tree_causal_weight for c in pair.single_heads().values()] == [0.5, 0.0]
    assert pair.single_heads()[HEAD_NAMES["bidirectional"]].fingerprint() == tiny_config(
        tmp_path, *PAIR[1:], "head.attention=bidirectional").fingerprint()
    with pytest.raises(ValueError, match="loss.tree_causal_weight=0.5 trains a causal head's tree-causal pass "
                                         "\\(jetspec-tc\\), which head.attention='bidirectional' has none of"):
        load_config("tiny-cpu", ["loss.tree_causal_weight=0.5", "head.attention=bidirectional"])
    with pytest.raises(ValueError, match="loss.tree_causal_weight must be >= 0"):
        load_config("tiny-cpu", ["loss.tree_causal_weight=-1"])


# ---------------------------------------------------------------------------------------------
# Runs (every run shares one config's compiled steps: they differ only in run.* settings)


def test_a_short_run_learns_and_writes_rates_and_heldout_numbers_per_kind(tiny_target, corpus, tmp_path):
    head_dir = tmp_path / "head"
    summary = train(tiny_config(tmp_path, f"run.export_head={head_dir}"), tiny_target, corpus, mesh=one_device())
    rows = [json.loads(line) for line in (tmp_path / "tiny-cpu" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 17))
    first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
    assert last < 0.7 * first, (first, last)
    for r in rows:
        assert r["tokens_per_s"] > 0 and 0 < r["answer_tokens_per_s"] < r["tokens_per_s"] <= r["padded_tokens_per_s"]
    assert rows[-1]["tokens_seen"] == summary["tokens_seen"] > rows[-1]["answer_tokens_seen"] > 0
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [4, 8, 12, 16]
    by_kind = evals[-1]["eval_by_kind"]
    assert sorted(by_kind) == ["chat", "long_context", "math", "translation"]
    assert by_kind["chat"]["answers"] == 4 and evals[-1]["eval_answers"] == 10
    for numbers in by_kind.values():
        assert numbers["expected_tau"] >= 1 and len(numbers["accept_per_depth"]) == 15 and numbers["loss"] > 0
    plan = json.loads((tmp_path / "tiny-cpu" / "data_plan.json").read_text())
    assert plan["answers_per_bucket"]["512"] == 12 and plan["cut_answers"] == 0
    assert (head_dir / "head.safetensors").is_file() and summary["steps"] == 16


def test_sigterm_stops_cleanly_with_the_eval_a_checkpoint_and_the_export(tiny_target, corpus, tmp_path):
    import os
    import signal

    head_dir = tmp_path / "head"

    def terminate_at_step_3(step, row):
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    summary = train(tiny_config(tmp_path, f"run.export_head={head_dir}"), tiny_target, corpus, mesh=one_device(),
                    on_step=terminate_at_step_3)
    # the signal came while step 3 was logged: step 4 is the one in progress, and the last
    assert summary["steps"] == 4 and "eval_loss" in summary and (head_dir / "head.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "tiny-cpu" / "checkpoints").iterdir() if p.name.isdigit())[-1] == "4"
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the process's again


@pytest.mark.parametrize("heads", [[], PAIR], ids=["one-head", "pair"])
def test_kill_and_resume_reproduces_the_uninterrupted_run(tiny_target, corpus, tmp_path, heads):
    straight, resumed, after = {}, {}, {}
    train(tiny_config(tmp_path / "a", *heads, "run.max_steps=7"), tiny_target, corpus, mesh=one_device(),
          on_step=lambda s, r: straight.__setitem__(s, r))
    cfg_b = tiny_config(tmp_path / "b", *heads, "run.max_steps=7")
    # "killed" after step 5: the last checkpoint is step 4, so step 5 is lost and recomputed
    out = train(cfg_b, tiny_target, corpus, mesh=one_device(), stop_after=5,
                on_step=lambda s, r: resumed.__setitem__(s, r))
    assert out == {"stopped_at": 5}
    summary = train(cfg_b, tiny_target, corpus, mesh=one_device(), on_step=lambda s, r: after.__setitem__(s, r))
    assert sorted(after) == [5, 6, 7] and summary["steps"] == 7
    loss = "loss_by_head" if heads else "loss"  # a pair's losses: {"jetspec": ..., "ddtree": ...}
    keys = (loss, "tokens_seen", "answer_tokens_seen")
    assert [[after[s][k] for k in keys] for s in (5, 6, 7)] == [[straight[s][k] for k in keys] for s in (5, 6, 7)]
    assert resumed[5][loss] == straight[5][loss]
    # the resumed run's clock continues from the checkpoint's, as its token counts do
    assert after[5]["train_seconds"] > resumed[4]["train_seconds"]
    assert summary["train_seconds"] > after[5]["train_seconds"]
    # the rest of the schedule continues from a stop at max_steps
    rest = {}
    train(tiny_config(tmp_path / "a", *heads, "run.max_steps=9"), tiny_target, corpus, mesh=one_device(),
          on_step=lambda s, r: rest.__setitem__(s, r))
    assert sorted(rest) == [8, 9]
    with pytest.raises(ValueError, match="another config"):
        train(tiny_config(tmp_path / "a", *heads, "data.anchors_per_1k_tokens=60"), tiny_target, corpus,
              mesh=one_device())
    if heads:  # nor does one head of the pair resume alone from the pair's checkpoint
        with pytest.raises(ValueError, match="another config"):
            train(tiny_config(tmp_path / "a", *heads[1:]), tiny_target, corpus, mesh=one_device())


def test_a_checkpoint_from_another_corpus_is_refused(tiny_target, corpus, tmp_path):
    train(tiny_config(tmp_path, "run.max_steps=2"), tiny_target, corpus, mesh=one_device())
    other = write_corpus(tmp_path / "other", tiny_target.cfg.vocab_size, seed=1)
    with pytest.raises(ValueError, match="another corpus"):
        train(tiny_config(tmp_path, "run.max_steps=4"), tiny_target, other, mesh=one_device())


def test_a_run_warm_started_from_an_exported_head_begins_at_its_weights(tiny_target, corpus, tmp_path, monkeypatch):
    from jetspec_jax.loading.head_checkpoint import CONFIG_FILE, load_head

    head_dir = tmp_path / "head"
    train(tiny_config(tmp_path / "a", f"run.export_head={head_dir}", "run.max_steps=4"), tiny_target, corpus,
          mesh=one_device())
    _, exported = load_head(str(head_dir), jnp.float32)  # the run's fp32 weights rounded to bf16
    states = record_step_states(monkeypatch)
    cfg = tiny_config(tmp_path / "b", f"head.init_from={head_dir}", "run.max_steps=2")
    assert cfg.fingerprint() != tiny_config(tmp_path / "b", "run.max_steps=2").fingerprint()
    summary = train(cfg, tiny_target, corpus, mesh=one_device())
    state = states[0]
    assert jax.tree.structure(state["params"]) == jax.tree.structure(exported)
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(exported)):
        assert got.dtype == np.float32  # fp32 master weights
        np.testing.assert_array_equal(got, np.asarray(want))
    assert int(state["step"]) == 0 and all(not np.any(x) for x in jax.tree.leaves(state["opt_state"]))  # fresh
    random_init = Trainer(cfg, tiny_target, one_device()).init_state(cfg.run.seed)["params"]
    assert not np.array_equal(np.asarray(random_init["fc"]), state["params"]["fc"])
    sha = json.loads((head_dir / CONFIG_FILE).read_text())["weights_sha256"]
    recorded = {"path": str(head_dir), "weights_sha256": sha, "layers": 1}
    rows = [json.loads(line) for line in (tmp_path / "b" / "tiny-cpu" / "metrics.jsonl").read_text().splitlines()]
    # the first row says where the run began and gives the exported head's own held-out numbers
    trainer = Trainer(cfg, tiny_target, one_device())
    start_params = trainer.init_state(cfg.run.seed, trainer.warm_start_params()[0])["params"]
    heldout = heldout_batches(corpus.answers("heldout"), cfg.buckets(), per_kind=cfg.run.eval_answers_per_kind,
                              seed=cfg.run.seed)
    assert heldout and rows[0]["eval_loss"] > 0
    assert rows[0] == json.loads(json.dumps({"step": 0, "warm_start": recorded,
                                             **trainer.evaluate(start_params, heldout)}))
    assert summary["warm_start"] == recorded
    # a resumed run starts from its checkpoint, not from the head, and still says where it began
    resumed = train(tiny_config(tmp_path / "b", f"head.init_from={head_dir}", "run.max_steps=3"), tiny_target,
                    corpus, mesh=one_device())
    assert resumed["steps"] == 3 and resumed["warm_start"] == recorded and int(states[-1]["step"]) == 2
    assert len(states) == 3 and not np.array_equal(states[-1]["params"]["fc"], state["params"]["fc"])


def test_a_warm_start_head_of_another_shape_or_target_is_refused(tiny_target, corpus, tmp_path):
    import shutil

    from jetspec_jax.loading.head_checkpoint import CONFIG_FILE, save_head

    head_dir = tmp_path / "head"
    trainer = Trainer(tiny_config(tmp_path, "head.num_layers=2"), tiny_target, one_device())
    save_head(str(head_dir), trainer.head_cfg, trainer.init_state(0)["params"], target=tiny_target)
    with pytest.raises(ValueError, match=f"head.init_from='{head_dir}': the exported head does not fit this run: "
                                         "num_layers is 2 there, 1 here \\(head.num_layers\\); point head.init_from "
                                         "at a head exported"):
        train(tiny_config(tmp_path, f"head.init_from={head_dir}"), tiny_target, corpus, mesh=one_device())
    trainer = Trainer(tiny_config(tmp_path), tiny_target, one_device())
    save_head(str(head_dir), trainer.head_cfg, trainer.init_state(0)["params"], target=tiny_target)
    other = tmp_path / "other-target"
    shutil.copytree(head_dir, other)
    record = json.loads((other / CONFIG_FILE).read_text())
    (other / CONFIG_FILE).write_text(json.dumps({**record, "target_fingerprint": "0123456789abcdef",
                                                 "target_name": "other-model"}))
    with pytest.raises(ValueError, match="was trained for target 'other-model' \\(fingerprint 0123456789abcdef\\)"):
        train(tiny_config(tmp_path, f"head.init_from={other}"), tiny_target, corpus, mesh=one_device())
    with pytest.raises(ValueError, match="head.init_from=.*no draft head at .*start from random weights"):
        train(tiny_config(tmp_path, f"head.init_from={tmp_path / 'nothing'}"), tiny_target, corpus, mesh=one_device())
    assert not (tmp_path / "tiny-cpu" / "metrics.jsonl").exists()  # refused before any step


def test_a_head_grown_from_a_shallower_one_computes_what_it_did(tiny_target, corpus, tmp_path):
    """head.init_from with fewer layers: the exported layers first, new ones with zero output projections,
    so the grown head's logits at step 0 are the shallower head's."""
    from jetspec_jax.loading.head_checkpoint import load_head, save_head

    small = Trainer(tiny_config(tmp_path), tiny_target, one_device())
    head_dir = tmp_path / "head"
    save_head(str(head_dir), small.head_cfg, small.init_state(5)["params"], target=tiny_target)
    _, exported = load_head(str(head_dir), jnp.float32)
    big = Trainer(tiny_config(tmp_path, f"head.init_from={head_dir}", "head.num_layers=3"), tiny_target, one_device())
    grown, recorded = big.warm_start_params()
    assert len(grown["layers"]) == 3 and recorded["layers"] == 1
    for got, want in zip(jax.tree.leaves(grown["layers"][0]), jax.tree.leaves(exported["layers"][0])):
        np.testing.assert_array_equal(got, want)
    assert all(not np.any(layer[name]) for layer in grown["layers"][1:] for name in ("wo", "w_down"))
    assert all(np.any(layer["wq"]) for layer in grown["layers"][1:])  # the rest starts random, to learn
    batch = training_stream(corpus.answers("train"), small.cfg.buckets(), mixture={}, seed=0).dataset[0]
    batch = {k: jnp.asarray(batch[k]) for k in MODEL_INPUTS}
    target_params = tiny_target.params
    logits = [forward_and_loss(p, target_params, batch, loss_cfg=t.cfg.loss, head_cfg=t.head_cfg,
                               target_cfg=tiny_target.cfg, dtype=jnp.float32)[1][0]
              for p, t in ((exported, small), (grown, big))]
    np.testing.assert_allclose(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_a_pair_of_heads_trains_each_exactly_as_it_would_alone(tiny_target, corpus, tmp_path, monkeypatch):
    """Two heads on one teacher per step: after N steps each head's fp32 weights, every step's loss and
    gradient norm, its held-out numbers and its exported file equal a single-head run's with the same
    config, seed and data. Sharing the teacher changes the cost, nothing else."""
    from safetensors import safe_open

    from jetspec_jax.loading.head_checkpoint import load_head

    finals = {}  # run -> the state its last step returned
    train_step = Trainer.train_step

    def recording_step(self, state, batch):
        state, metrics = train_step(self, state, batch)
        finals[self.cfg.run.out_dir] = jax.device_get(state)
        return state, metrics

    monkeypatch.setattr(Trainer, "train_step", recording_step)
    exports = [str(tmp_path / "heads" / name) for name in ("jetspec", "ddtree")]
    pair_cfg = tiny_config(tmp_path / "pair", *PAIR, "run.max_steps=6", f"run.export_head={json.dumps(exports)}")
    pair_rows = {}
    pair_summary = train(pair_cfg, tiny_target, corpus, mesh=one_device(), on_step=pair_rows.__setitem__)
    pair = finals[pair_cfg.run.out_dir]
    assert not np.array_equal(pair["params"]["jetspec"]["fc"], pair["params"]["ddtree"]["fc"])  # two heads
    assert sorted(pair["params"]) == sorted(pair["opt_state"]) == ["ddtree", "jetspec"] and int(pair["step"]) == 6
    assert pair_summary["exported_head"] == exports and sorted(pair_summary["eval_by_head"]) == ["ddtree", "jetspec"]
    for (name, alone), export in zip(pair_cfg.single_heads().items(), exports):
        alone = dataclasses.replace(alone, run=dataclasses.replace(alone.run, out_dir=str(tmp_path / name),
                                                                   export_head=str(tmp_path / name / "head")))
        rows = {}
        summary = train(alone, tiny_target, corpus, mesh=one_device(), on_step=rows.__setitem__)
        single = finals[alone.run.out_dir]
        for part in ("params", "opt_state"):
            for got, want in zip(jax.tree.leaves(pair[part][name]), jax.tree.leaves(single[part]), strict=True):
                np.testing.assert_array_equal(got, want)  # bit for bit, fp32
        assert [pair_rows[s]["loss_by_head"][name] for s in rows] == [rows[s]["loss"] for s in rows]
        assert [pair_rows[s]["grad_norm_by_head"][name] for s in rows] == [rows[s]["grad_norm"] for s in rows]
        assert [pair_rows[s]["tokens_seen"] for s in rows] == [rows[s]["tokens_seen"] for s in rows]
        evals = [s for s in rows if "eval_loss" in rows[s]]
        assert evals == [4, 6] and all("eval_loss" not in pair_rows[s] for s in pair_rows)
        for s in evals:
            assert pair_rows[s]["eval_by_head"][name] == {k: v for k, v in rows[s].items() if k.startswith("eval_")}
        assert pair_summary["eval_by_head"][name]["eval_by_kind"] == summary["eval_by_kind"]
        (cfg_pair, exported), (cfg_single, alone_exported) = (load_head(d, jnp.float32) for d in (
            export, alone.run.export_head))
        assert cfg_pair == cfg_single and cfg_pair.attention == alone.head.attention
        for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(alone_exported), strict=True):
            np.testing.assert_array_equal(got, want)
        with safe_open(f"{export}/head.safetensors", "np") as f:  # the head's own numbers, as its run's
            recorded = json.loads(f.metadata()["summary"])
        assert recorded["head"] == name and recorded["trained_with"] == ["jetspec", "ddtree"]
        assert recorded["eval_loss"] == summary["eval_loss"] and recorded["steps"] == summary["steps"] == 6


def test_each_head_of_a_pair_warm_starts_from_its_own_export(tiny_target, corpus, tmp_path, monkeypatch):
    from jetspec_jax.loading.head_checkpoint import CONFIG_FILE, load_head, save_head

    causal = Trainer(tiny_config(tmp_path), tiny_target, one_device())
    head_dir = tmp_path / "head"
    save_head(str(head_dir), causal.head_cfg, causal.init_state(5)["params"], target=tiny_target)
    _, exported = load_head(str(head_dir), jnp.float32)
    states = record_step_states(monkeypatch)
    cfg = tiny_config(tmp_path / "run", *PAIR, f'head.init_from=["{head_dir}", ""]', "run.max_steps=1",
                      "run.eval_answers_per_kind=0")
    summary = train(cfg, tiny_target, corpus, mesh=one_device())
    params = states[0]["params"]
    for got, want in zip(jax.tree.leaves(params["jetspec"]), jax.tree.leaves(exported), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
    random_init = causal.init_state(cfg.run.seed)["params"]  # "": the random weights it would start alone from
    for got, want in zip(jax.tree.leaves(params["ddtree"]), jax.tree.leaves(random_init), strict=True):
        np.testing.assert_array_equal(got, np.asarray(want))
    sha = json.loads((head_dir / CONFIG_FILE).read_text())["weights_sha256"]
    recorded = {"jetspec": {"path": str(head_dir), "weights_sha256": sha, "layers": 1}}
    rows = [json.loads(line) for line in (tmp_path / "run" / "tiny-cpu" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"step": 0, "warm_start": recorded} and summary["warm_start"] == recorded
    with pytest.raises(ValueError, match="does not fit this run: attention is 'causal' there, 'bidirectional' here "
                                         "\\(head.attention\\)"):  # the causal head given for the ddtree entry
        train(tiny_config(tmp_path / "swapped", *PAIR, f'head.init_from=["", "{head_dir}"]'), tiny_target, corpus,
              mesh=one_device())


@pytest.mark.parametrize("heads", [[], PAIR[:1]], ids=["one-head", "pair"])
def test_sharded_step_equals_single_device_step(tiny_target, corpus, tmp_path, heads):
    assert len(jax.devices()) == 8
    cfg = tiny_config(tmp_path, *heads, "head.intermediate_size=512", "data.length_buckets=[64]",
                      "optim.tokens_per_batch=512")
    batch = training_stream(corpus.answers("train"), cfg.buckets(), mixture={}, seed=0).dataset[0]
    assert batch["tokens"].shape == (8, 64)
    results = []
    for mesh in (one_device(), sharding.make_mesh(2, jax.devices())):
        trainer = Trainer(cfg, tiny_target, mesh)
        state, metrics = trainer.train_step(trainer.init_state(0), batch)
        results.append((jax.tree.map(float, metrics["loss"]), int(metrics["real_tokens"]),
                        jax.tree.map(np.asarray, state["params"])))
    (loss1, real1, params1), (loss8, real8, params8) = results
    assert loss8 == pytest.approx(loss1, rel=1e-5) and real1 == real8 == int(batch["length"].sum())
    assert jax.tree.structure(params1) == jax.tree.structure(params8)  # a pair: both heads, by name
    for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params8)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    spec = sharding.partition_spec(draft_head.param_specs(trainer.head_cfg)["layers"][0]["w_gate"],
                                   sharding.make_mesh(2, jax.devices()))
    assert spec == jax.sharding.PartitionSpec(None, "model")  # the MLP really is split


@pytest.mark.parametrize("heads,devices", [([], 1), (PAIR[:1], 8)], ids=["one-head-one-device", "pair-2x4-mesh"])
def test_programs_compiled_ahead_are_the_ones_run_and_train_as_the_jitted_steps(tiny_target, corpus, tmp_path, heads,
                                                                                 devices):
    """compile_ahead's executables (a train step per bucket, each head's held-out program per length) are
    what the steps and the evaluation then call, and give the jitted programs' parameters and held-out
    numbers."""
    from jetspec_jax.compilation import CompileWatch

    cfg = tiny_config(tmp_path, *heads, "data.length_buckets=[64, 128]", "optim.tokens_per_batch=512")
    stream = training_stream(corpus.answers("train"), cfg.buckets(), mixture={}, seed=0).dataset
    by_length = collections.defaultdict(list)  # two batches of each bucket
    for i in range(64):
        batch = stream[i]
        if len(by_length[batch["tokens"].shape[1]]) < 2:
            by_length[batch["tokens"].shape[1]].append(batch)
    batches = [b for length in sorted(by_length) for b in by_length[length]]
    assert sorted(by_length) == [64, 128] and len(batches) == 4  # both buckets' programs are called
    evals = heldout_batches(corpus.answers("heldout"), cfg.buckets(), per_kind=2, seed=0)
    eval_lengths = {b["tokens"].shape[1] for b in evals}
    jitted_names = {"jit(train_step)", "jit(train_step_heads)", "jit(eval_stats)"}
    mesh = one_device() if devices == 1 else sharding.make_mesh(2, jax.devices())
    results = []
    for ahead in (False, True):
        trainer = Trainer(cfg, tiny_target, mesh)
        state = trainer.init_state(0)
        calls = collections.Counter()
        if ahead:
            info = trainer.compile_ahead(state, cfg.buckets(), eval_lengths, workers=2)
            assert info["programs_compiled_ahead"] == 2 + len(trainer.heads) * len(eval_lengths)
            assert info["compile_seconds"] > 0
            trainer.ahead = {key: (lambda *args, key=key, f=f: (calls.update([key]), f(*args))[1])
                             for key, f in trainer.ahead.items()}
        with CompileWatch() as watch:
            for batch in batches:
                state, _ = trainer.train_step(state, batch)
            held_out = trainer.evaluate(state["params"], evals)
        results.append((jax.tree.map(np.asarray, state["params"]), held_out))
    assert set(calls) == set(trainer.ahead) and not jitted_names & set(watch.names)
    (params_jit, eval_jit), (params_ahead, eval_ahead) = results
    for a, b in zip(jax.tree.leaves(params_jit), jax.tree.leaves(params_ahead), strict=True):
        np.testing.assert_array_equal(a, b)
    assert eval_ahead == eval_jit


# ---------------------------------------------------------------------------------------------
# Config errors


def test_config_errors_are_one_clear_message():
    with pytest.raises(ValueError, match="unknown key\\(s\\) optim.learnin_rate"):
        load_config("tiny-cpu", ["optim.learnin_rate=1"])
    with pytest.raises(ValueError, match="section.key=value"):
        load_config("tiny-cpu", ["total_steps=5"])
    with pytest.raises(ValueError, match="total_steps=.many. is not a valid int"):
        load_config("tiny-cpu", ["optim.total_steps=many"])
    with pytest.raises(FileNotFoundError, match="available in train/configs"):
        load_config("no-such-config")
    with pytest.raises(ValueError) as e:  # every problem in one message
        load_config("tiny-cpu", ["data.seq_len=640", "optim.batch_size=32", "data.mixture={\"gsm9k\": 1}"])
    message = str(e.value)
    assert "data.seq_len was replaced by data.length_buckets" in message
    assert "optim.batch_size was replaced by optim.tokens_per_batch" in message and "unknown key 'gsm9k'" in message
    with pytest.raises(ValueError, match="data.length_buckets must be a non-empty list of increasing row lengths"):
        load_config("tiny-cpu", ["data.length_buckets=[256, 128]"])
    with pytest.raises(ValueError, match="tokens_per_batch=200 holds no row of the largest bucket \\(256 tokens\\); "
                                         "raise it to at least 256"):
        load_config("tiny-cpu", ["optim.tokens_per_batch=200"])
    cfg = load_config("tiny-cpu", ["optim.tokens_per_batch=768"])  # 6 rows of 128, 3 of 256
    check_data_parallel(cfg, 3)
    with pytest.raises(ValueError, match="gives 6 rows of 128, 3 rows of 256 tokens; every bucket's rows must split "
                                         "evenly over the 2 data-parallel devices and 1 processes: use "
                                         "optim.tokens_per_batch=1024"):
        check_data_parallel(cfg, 2)
    for name in ("smollm2-135m-jetspec", "smollm2-135m-dflash", "smollm2-135m-general-jetspec",
                 "smollm2-135m-general-dflash", "smollm2-135m-general-pair"):
        check_data_parallel(load_config(name), 8)  # the shipped and the new recipes load and split over 8 GPUs
    old = load_config("smollm2-135m-jetspec")
    assert [tuple(b) for b in old.buckets()] == [(640, 32, 48)]  # the shipped heads' layout, as recorded
    general = load_config("smollm2-135m-general-dflash")
    assert dataclasses.replace(general.head, attention="causal") == load_config("smollm2-135m-general-jetspec").head
    assert general.optim == load_config("smollm2-135m-general-jetspec").optim


def test_a_list_of_heads_is_checked_with_the_rest_of_the_config():
    pair = 'head.attention=["causal", "bidirectional"]'
    for overrides, message in [
            (['head.attention=["causal"]'], "head.attention=\\['causal'\\] lists 1 kind\\(s\\): a list trains "
                                            "several heads, one per kind \\(causal, bidirectional\\); write a "
                                            "single kind as a string for one head"),
            (['head.attention=["causal", "causal"]'], "head.attention lists 'causal' 2 times: a list trains one "
                                                      "head of each kind"),
            (['head.attention=["causal", "bidi"]'], "head.attention entries must be one of causal, bidirectional, "
                                                    "got 'bidi'"),
            (['head.attention=[1, 2]'], "head.attention must be a string or a list of strings \\(one per head\\)"),
            ([pair, "run.export_head=heads/x"], "run.export_head='heads/x' must list one directory per "
                                                "head.attention entry"),
            ([pair, 'head.init_from=["heads/a"]'], "head.init_from lists 1 entries for the 2 heads of "
                                                   "head.attention=\\['causal', 'bidirectional'\\]: one per head, "
                                                   "in the same order"),
            ([pair, 'run.export_head=["heads/a", "heads/a/"]'], "names a directory twice: each head needs its own"),
            (['run.export_head=["heads/a", "heads/b"]'], "run.export_head=\\['heads/a', 'heads/b'\\] is a list, "
                                                        "but head.attention='causal' names one head")]:
        with pytest.raises(ValueError, match=message):
            load_config("tiny-cpu", overrides)
    with pytest.raises(ValueError) as e:  # still every problem in one message
        load_config("tiny-cpu", ['head.attention=["causal", "causal"]', "optim.learnin_rate=1"])
    assert "lists 'causal' 2 times" in str(e.value) and "optim.learnin_rate" in str(e.value)
    cfg = load_config("tiny-cpu", [pair, 'run.export_head=["heads/a", ""]'])
    assert cfg.is_pair and not load_config("tiny-cpu").is_pair
    heads = cfg.single_heads()
    assert list(heads) == ["jetspec", "ddtree"]
    assert [(c.head.attention, c.head.init_from, c.run.export_head) for c in heads.values()] == [
        ("causal", "", "heads/a"), ("bidirectional", "", "")]
    assert heads["jetspec"] == load_config("tiny-cpu", ["run.export_head=heads/a"])


def test_one_head_configs_keep_their_fingerprints_and_the_pair_config_is_both_general_ones():
    """The fingerprints that checkpoints recorded before head.attention could be a list (so those runs
    still resume), and the pair config trains each head with its single-head config's exact recipe."""
    assert {name: load_config(name).fingerprint() for name in (
        "tiny-cpu", "smollm2-135m-jetspec", "smollm2-135m-general-jetspec", "smollm2-135m-general-dflash")} == {
        "tiny-cpu": "6aa76653dec4cd8c", "smollm2-135m-jetspec": "1a4b1c3277e637b7",
        "smollm2-135m-general-jetspec": "3bdacafe349dfc80", "smollm2-135m-general-dflash": "53c63bdb57de8e77"}
    assert load_config("tiny-cpu", ["head.init_from=heads/x"]).fingerprint() == "d622e06463660a69"
    pair = load_config("smollm2-135m-general-pair")
    assert list(pair.single_heads()) == ["jetspec", "ddtree"]
    for alone, name in zip(pair.single_heads().values(), ("general-jetspec", "general-dflash")):
        single = load_config(f"smollm2-135m-{name}")
        assert alone.fingerprint() == single.fingerprint()
        assert alone.run == dataclasses.replace(single.run, name=pair.run.name)
    assert pair.fingerprint() not in (alone.fingerprint() for alone in pair.single_heads().values())
