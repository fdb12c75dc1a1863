"""Training: loss values, frozen target, a tiny run that learns, exact kill-and-resume, sharding."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax import sharding
from jetspec_jax.train.config import load_config
from jetspec_jax.train.loss import acceptance_stats, depth_weights, draft_loss
from jetspec_jax.train.trainer import Trainer, forward_and_loss, train


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


def test_acceptance_stats():
    teacher = jax.nn.one_hot(jnp.asarray([[[1, 2, 0], [0, 0, 0]]]), 3)  # 2 blocks x 3 depths
    student = jax.nn.one_hot(jnp.asarray([[[1, 0, 0], [0, 0, 1]]]), 3)
    valid = jnp.asarray([[[True, True, True], [True, True, False]]])
    per_depth, tau = acceptance_stats(student, teacher, valid)
    np.testing.assert_allclose(np.asarray(per_depth), [1.0, 0.5, 1.0])
    assert float(tau) == pytest.approx(1 + (1 + 2) / 2)  # leading matches: 1 and 2


@pytest.fixture(scope="module")
def training_records(embedded_target):
    from jetspec_jax.generate import generate

    prompts = ["What is 12 plus 30?", "Name a fruit that is yellow.", "Write a haiku about rain.",
               "What is the boiling point of water?", "Explain what a prime number is.",
               "Give me a synonym for happy.", "How many legs does a spider have?", "What is 9 times 7?"]
    result = generate(prompts, embedded_target, max_new_tokens=40)
    return [{"source": "test", "id": i, "prompt_ids": p, "completion_ids": c}
            for i, (p, c) in enumerate(zip(result.prompt_token_ids, result.token_ids))]


def tiny_config(tmp_path, *overrides):
    return load_config("tiny-cpu", [f"run.out_dir={tmp_path}", *overrides])


def one_device():
    return sharding.make_mesh(1, jax.devices()[:1])


def test_gradients_do_not_reach_the_target(embedded_target, training_records, tmp_path):
    cfg = tiny_config(tmp_path)
    trainer = Trainer(cfg, embedded_target, one_device())
    state = trainer.init_state(0)
    from jetspec_jax.train.data import training_dataset

    batch = trainer.place_batch(training_dataset(training_records, seq_len=192, anchors_per_seq=4, batch_size=4,
                                                 seed=0)[0])
    loss_fn = lambda h, t: forward_and_loss(h, t, batch, cfg=cfg, head_cfg=trainer.head_cfg,  # noqa: E731
                                            target_cfg=embedded_target.cfg, dtype=jnp.float32)[0]
    head_grads, target_grads = jax.grad(loss_fn, argnums=(0, 1))(state["params"], trainer.target_params)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(target_grads))
    assert float(jnp.abs(head_grads["fc"]).max()) > 0


def test_tiny_run_lowers_the_loss(embedded_target, training_records, tmp_path):
    cfg = tiny_config(tmp_path, "optim.total_steps=16", "optim.learning_rate=3e-3", "data.heldout_fraction=0")
    losses = {}
    train(cfg, embedded_target, training_records, mesh=one_device(), on_step=lambda s, row: losses.__setitem__(s, row["loss"]))
    first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (14, 15, 16)])
    assert last < 0.7 * first, (first, last)


def test_kill_and_resume_reproduces_the_uninterrupted_run(embedded_target, training_records, tmp_path):
    straight, resumed = {}, {}
    cfg_a = tiny_config(tmp_path / "a", "optim.total_steps=6")
    train(cfg_a, embedded_target, training_records, mesh=one_device(), on_step=lambda s, r: straight.__setitem__(s, r["loss"]))
    cfg_b = tiny_config(tmp_path / "b", "optim.total_steps=6")
    # "killed" after step 3: the last checkpoint is step 2, so step 3 is lost and recomputed
    out = train(cfg_b, embedded_target, training_records, mesh=one_device(), stop_after=3,
                on_step=lambda s, r: resumed.__setitem__(s, r["loss"]))
    assert out == {"stopped_at": 3}
    after = {}
    train(cfg_b, embedded_target, training_records, mesh=one_device(), on_step=lambda s, r: after.__setitem__(s, r["loss"]))
    assert sorted(after) == [3, 4, 5, 6]
    assert [after[s] for s in (3, 4, 5, 6)] == [straight[s] for s in (3, 4, 5, 6)]
    assert resumed[3] == straight[3]


def test_max_steps_stops_cleanly_and_a_later_run_continues_the_same_schedule(embedded_target, training_records,
                                                                              tmp_path):
    straight, first, rest = {}, {}, {}
    train(tiny_config(tmp_path / "a", "optim.total_steps=5"), embedded_target, training_records, mesh=one_device(),
          on_step=lambda s, r: straight.__setitem__(s, r["loss"]))
    head_dir = tmp_path / "head"
    stopped = tiny_config(tmp_path / "b", "optim.total_steps=5", "run.max_steps=3", f"run.export_head={head_dir}")
    summary = train(stopped, embedded_target, training_records, mesh=one_device(),
                    on_step=lambda s, r: first.__setitem__(s, r["loss"]))
    assert summary["steps"] == 3 and (head_dir / "head.safetensors").is_file()
    assert summary["mesh"] == {"data": 1, "model": 1} and len(summary["devices"]) == 1
    train(tiny_config(tmp_path / "b", "optim.total_steps=5"), embedded_target, training_records, mesh=one_device(),
          on_step=lambda s, r: rest.__setitem__(s, r["loss"]))
    assert sorted(first) == [1, 2, 3] and sorted(rest) == [4, 5]
    assert {**first, **rest} == straight


def test_checkpoint_from_another_config_is_refused(embedded_target, training_records, tmp_path):
    train(tiny_config(tmp_path, "optim.total_steps=2"), embedded_target, training_records, mesh=one_device())
    with pytest.raises(ValueError, match="another config"):
        train(tiny_config(tmp_path, "optim.total_steps=4", "head.num_layers=2"), embedded_target, training_records,
              mesh=one_device())


def test_sharded_step_equals_single_device_step(embedded_target, training_records, tmp_path):
    from jetspec_jax.train.data import training_dataset

    assert len(jax.devices()) == 8
    cfg = tiny_config(tmp_path, "head.intermediate_size=512")
    batch = training_dataset(training_records, seq_len=192, anchors_per_seq=4, batch_size=8, seed=0)[0]
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, batch_size=8))
    results = []
    for mesh in (one_device(), sharding.make_mesh(2, jax.devices())):
        trainer = Trainer(cfg, embedded_target, mesh)
        state, metrics = trainer.train_step(trainer.init_state(0), batch)
        results.append((float(metrics["loss"]), jax.tree.map(np.asarray, state["params"])))
    (loss1, params1), (loss8, params8) = results
    assert loss8 == pytest.approx(loss1, rel=1e-5)
    for a, b in zip(jax.tree.leaves(params1), jax.tree.leaves(params8)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    spec = sharding.partition_spec(__import__("jetspec_jax.models.draft_head", fromlist=["x"]).param_specs(
        trainer.head_cfg)["layers"][0]["w_gate"], sharding.make_mesh(2, jax.devices()))
    assert spec == jax.sharding.PartitionSpec(None, "model")  # the MLP really is split


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown key\\(s\\) optim.learnin_rate"):
        load_config("tiny-cpu", ["optim.learnin_rate=1"])
    with pytest.raises(ValueError, match="section.key=value"):
        load_config("tiny-cpu", ["total_steps=5"])
    with pytest.raises(ValueError, match="total_steps=.many. is not a valid int"):
        load_config("tiny-cpu", ["optim.total_steps=many"])
    with pytest.raises(FileNotFoundError, match="available in train/configs"):
        load_config("no-such-config")
    with pytest.raises(ValueError, match="samples_per_prompt=3 needs .* data.temperature > 0"):
        load_config("tiny-cpu", ["data.samples_per_prompt=3", "data.temperature=0"])
    sampled = load_config("tiny-cpu", ["data.samples_per_prompt=3", "data.temperature=0.8"])
    assert sampled.data.samples_per_prompt == 3
