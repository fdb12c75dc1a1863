"""A training campaign over segments (train/campaign.py): each segment resumes from exactly what the last
brought back; carried with its optimizer state and data position, two segments equal one uninterrupted
run; restarted from the exported heads, a segment begins at their weights with the schedule planned from
the last segment's rate; every segment's record lands in the campaign's log."""

from __future__ import annotations

import hashlib
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_heldout import rewritten
from test_train import TEST_SETTINGS, corpus, one_device, tiny_target  # noqa: F401  (fixtures)

from jetspec_jax import draft_vocab
from jetspec_jax.errors import InputError
from jetspec_jax.loading.head_checkpoint import load_head_weights, verify_head_files
from jetspec_jax.train import campaign
from jetspec_jax.train.campaign import (AFTER_TRAINING_S, COMPILE_GUESS_S, CampaignSpec, append_record,
                                        overhead_seconds, read_records, run_segment, segment_overrides,
                                        tokens_estimated, training_minutes)
from jetspec_jax.train.config import load_config
from jetspec_jax.train.data import training_stream
from jetspec_jax.train.mixture import is_heldout
from jetspec_jax.train.regenerate import draw_prompts, sample_key
from jetspec_jax.train.token_counts import corpus_counts
from jetspec_jax.train.trainer import train


@pytest.fixture(scope="module")
def start_head(tiny_target, corpus, tmp_path_factory):
    """The head a campaign starts from: two steps of a tiny run, exported."""
    out = tmp_path_factory.mktemp("start")
    train(load_config("tiny-cpu", [f"run.out_dir={out}", *TEST_SETTINGS, f"run.export_head={out / 'head'}",
                                   "run.max_steps=2"]), tiny_target, corpus, mesh=one_device())
    return str(out / "head")


def write_campaign(folder, tiny_target, start_head, cycle: str, top: str = "") -> CampaignSpec:
    folder.mkdir(parents=True)
    # one bucket (a train step and a held-out program to compile a segment), long prompts whole in it
    settings = [s for s in TEST_SETTINGS if not s.startswith(("optim.", "data.length_buckets"))] + [
        "data.length_buckets=[512]", "run.eval_every=3", "run.checkpoint_every=2", f"run.target={tiny_target.source}"]
    (folder / "campaign.toml").write_text(f'config = "tiny-cpu"\noverrides = {json.dumps(settings)}\n'
                                          f'heads = ["{start_head}"]\n{top}\n[cycle]\n{cycle}\n')
    return CampaignSpec.read(str(folder))


def on_machine(spec, tmp_path, machine: int, corpus, **kwargs) -> dict:
    """A segment run in its own folder, as on a fresh machine, on the given corpus and one device."""
    return run_segment(spec, out_dir=str(tmp_path / f"machine-{machine}"), corpus_dir=corpus.out_dir,
                       mesh=one_device(), **kwargs)


def rows_of(folder, segment: int) -> dict[int, dict]:
    lines = (folder / f"segment-{segment:03d}" / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def test_continued_segments_equal_one_uninterrupted_run(tiny_target, corpus, start_head, tmp_path):
    cycle = 'mode = "continue"\ntotal_steps = 8\nwarmup_steps = 2\npeak_learning_rate = 3e-3'
    whole = write_campaign(tmp_path / "whole", tiny_target, start_head, cycle)
    on_machine(whole, tmp_path, 0, corpus, minutes=60)

    split = write_campaign(tmp_path / "split", tiny_target, start_head, cycle)
    carried = tmp_path / "carried"
    first = on_machine(split, tmp_path, 1, corpus, minutes=60, max_steps=4, bring_back_to=str(carried))
    assert sorted(p.name for p in (carried / "checkpoint").iterdir()) == ["4"]
    with pytest.raises(InputError, match="--resume-from"):
        on_machine(split, tmp_path, 2, corpus, minutes=60)
    # a fresh machine: nothing but the carried checkpoint and the corpus
    second = on_machine(split, tmp_path, 2, corpus, minutes=60, resume_from=str(carried / "checkpoint"))

    assert (first["steps"], first["steps_this_run"], second["steps"], second["steps_this_run"]) == (4, 4, 8, 4)
    assert second["resumed_from_checkpoint"] and [r["segment"] for r in read_records(split.directory)] == [1, 2]
    straight, resumed = rows_of(tmp_path / "whole", 1), rows_of(tmp_path / "split", 2)
    for step in range(5, 9):  # losses and token counts as the uninterrupted run had them
        for key in ("loss", "tokens_seen"):
            assert resumed[step][key] == straight[step][key], (step, key)
    (whole_record,) = read_records(whole.directory)
    got = load_head_weights(verify_head_files(str(tmp_path / "machine-2" / "export" / "head-0")), jnp.float32)
    want = load_head_weights(verify_head_files(str(tmp_path / "machine-0" / "export" / "head-0")), jnp.float32)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # the same final weights
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert first["tokens_this_run"] + second["tokens_this_run"] == whole_record["tokens_this_run"]
    assert second["campaign_tokens"] == whole_record["campaign_tokens"]


def test_restarted_segments_begin_at_the_heads_the_last_brought_back(tiny_target, corpus, start_head, tmp_path):
    cycle = "steps_per_minute = 5\nwarmup_steps = 2\npeak_learning_rate = 3e-3\nfresh_samples = false"
    spec = write_campaign(tmp_path / "campaign", tiny_target, start_head, cycle)
    carried = tmp_path / "carried"
    first = on_machine(spec, tmp_path, 1, corpus, minutes=1, bring_back_to=str(carried))
    assert first["training_minutes"] == 1
    assert first["segment_seconds"] > first["train_seconds_this_run"] + first["compile_seconds"]
    assert first["planned_steps"] == first["steps"] == 5 and first["heads_before"] == [
        verify_head_files(start_head).weights_digest()]
    assert not (carried / "checkpoint").exists()  # restart mode carries the heads alone
    # and the records: the log with the segment's line, and its folder
    records = carried / "records"
    assert (records / "segments.jsonl").read_text() == (tmp_path / "campaign" / "segments.jsonl").read_text()
    assert sorted(p.name for p in (records / "segment-001").iterdir()) == ["data_plan.json", "metrics.jsonl",
                                                                          "segment.json"]
    # beside the exported head, its corpus's token counts (what --draft-vocab picks from)
    counts = draft_vocab.load_counts(str(carried / "export" / "head-0"), tiny_target.cfg.vocab_size,
                                     tiny_target.fingerprint)
    np.testing.assert_array_equal(counts, corpus_counts(corpus, tiny_target.cfg.vocab_size))

    # a short box: the plan at the measured rate is hundreds of steps, the box stops it after a few seconds
    second = on_machine(spec, tmp_path, 2, corpus, minutes=0.05, state=str(carried / "export"))
    assert second["heads_before"] == first["heads_after"] != first["heads_before"]
    start_row = rows_of(tmp_path / "campaign", 2)[0]
    assert start_row["warm_start"]["weights_sha256"] == first["heads_after"][0]
    # planned from the first segment's measured rate, and the cycle's warm-up to its peak again
    rate = 60 * first["steps_this_run"] / first["train_seconds_this_run"]
    assert second["planned_steps"] == max(3, round(0.05 * rate)) and second["warmup_steps"] == 2
    for record in (first, second):
        assert set(record["held_out_start"]["head"]["tau_by_kind"]) == {"chat", "long_context", "math", "translation"}
        assert record["held_out_end"]["head"]["loss"] > 0 and record["tokens_per_s"] > 0
    assert second["campaign_tokens"] == first["tokens_this_run"] + second["tokens_this_run"]
    assert (tmp_path / "campaign" / "segment-002" / "data_plan.json").is_file()
    # the same corpus: the second segment takes the batch stream up where the first stopped
    assert first["corpus"]["start_step"] == 0 and second["corpus"]["start_step"] == first["steps_this_run"] == 5
    assert first["corpus"]["fingerprint"] == second["corpus"]["fingerprint"]
    cfg = load_config("tiny-cpu", spec.overrides)
    stream = training_stream(corpus.answers("train"), cfg.buckets(), mixture=cfg.data.mixture,
                             seed=cfg.run.seed).dataset
    tokens = [int(np.sum(stream[i]["length"])) for i in range(5 + second["steps_this_run"])]
    assert second["tokens_this_run"] == sum(tokens[5:]) != sum(tokens[:second["steps_this_run"]])


class MachineLost(Exception):
    """The machine taken back in the middle of a segment."""


def test_a_segment_lost_mid_run_leaves_its_last_interim_bring_back(tiny_target, corpus, start_head, tmp_path,
                                                                   monkeypatch):
    cycle = "steps_per_minute = 5\nwarmup_steps = 2\npeak_learning_rate = 3e-3\nfresh_samples = false"
    spec = write_campaign(tmp_path / "campaign", tiny_target, start_head, cycle)
    back = tmp_path / "back"
    seen = []  # each interim bring-back's record, as a copy of the folder taken then holds it
    replace = campaign.replace_folder

    def replace_then_lose_the_machine(destination, build):
        replace(destination, build)
        seen.append(json.loads((back / "records" / "segment-001" / "segment.json").read_text()))
        if len(seen) == 3:
            raise MachineLost

    monkeypatch.setattr(campaign, "replace_folder", replace_then_lose_the_machine)
    with pytest.raises(MachineLost):  # every step is past the interval: a bring-back after steps 1, 2 and 3
        on_machine(spec, tmp_path, 1, corpus, minutes=1, bring_back_to=str(back), bring_back_every=1e-9)
    monkeypatch.setattr(campaign, "replace_folder", replace)
    assert not (tmp_path / "campaign" / "segments.jsonl").exists()  # the segment never finished
    assert [r["steps"] for r in seen] == [1, 2, 3] and all(r["unfinished"] for r in seen)
    assert seen[-1]["tokens_this_run"] > seen[0]["tokens_this_run"] > 0 and seen[-1]["held_out_end"] is None
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("back")) == ["back"]  # swapped whole
    last = seen[-1]
    assert verify_head_files(str(back / "export" / "head-0")).weights_digest() == last["heads_after"][0]
    assert last["heads_after"] != last["heads_before"]
    log = [json.loads(line) for line in (back / "records" / "segments.jsonl").read_text().splitlines()]
    assert log == [last]
    # the heads brought back are the weights after step 3: a segment of three steps exports the same
    clean = write_campaign(tmp_path / "clean", tiny_target, start_head, cycle)
    three = on_machine(clean, tmp_path, 2, corpus, minutes=1, max_steps=3)
    assert three["planned_steps"] == last["planned_steps"]
    got, want = (load_head_weights(verify_head_files(str(path / "head-0")), jnp.float32)
                 for path in (back / "export", tmp_path / "machine-2" / "export"))
    jax.tree.map(np.testing.assert_array_equal, got, want)

    # the next machine: the records copied over the campaign folder, the heads as its state
    shutil.copytree(back / "records", tmp_path / "campaign", dirs_exist_ok=True)
    carried = tmp_path / "carried"
    second = on_machine(spec, tmp_path, 3, corpus, minutes=1, max_steps=2, state=str(back / "export"),
                        bring_back_to=str(carried), bring_back_every=1e-9)
    assert second["segment"] == 2 and second["heads_before"] == last["heads_after"]
    assert second["corpus"]["start_step"] == 3  # the stream goes on after the lost segment's three steps
    # a finished segment's bring-back replaces its interim ones whole
    log = (tmp_path / "campaign" / "segments.jsonl").read_text()
    assert (carried / "records" / "segments.jsonl").read_text() == log
    assert "unfinished" not in read_records(str(carried / "records"))[-1]
    assert verify_head_files(str(carried / "export" / "head-0")).weights_digest() == second["heads_after"][0]


def test_bring_backs_need_a_folder_of_their_own_and_interim_ones_the_restart_mode(tiny_target, start_head, tmp_path):
    restart = write_campaign(tmp_path / "restart", tiny_target, start_head, "steps_per_minute = 5")
    with pytest.raises(InputError, match="--bring-back-every needs --bring-back"):
        run_segment(restart, minutes=1, out_dir=str(tmp_path / "out"), bring_back_every=1.0)
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("a user's file")
    with pytest.raises(InputError, match="holds notes.txt"):  # never replaced by a bring-back
        run_segment(restart, minutes=1, out_dir=str(tmp_path / "out"), bring_back_to=str(home))
    assert (home / "notes.txt").read_text() == "a user's file"
    continued = write_campaign(tmp_path / "continue", tiny_target, start_head, 'mode = "continue"\ntotal_steps = 8')
    with pytest.raises(InputError, match="restart"):
        run_segment(continued, minutes=1, out_dir=str(tmp_path / "out"), bring_back_to=str(tmp_path / "back"),
                    bring_back_every=1.0)


def test_segments_on_other_corpora_measure_the_pinned_heldout_answers(tiny_target, corpus, start_head, tmp_path):
    """The first segment pins its corpus's held-out answers; the next, on a corpus that decoded them otherwise
    and starting from the same heads, measures them as the first did."""
    cycle = "steps_per_minute = 5\nwarmup_steps = 2\npeak_learning_rate = 3e-3\nfresh_samples = false"
    spec = write_campaign(tmp_path / "campaign", tiny_target, start_head, cycle, 'heldout_answers = "heldout.npz"')
    first = on_machine(spec, tmp_path, 1, corpus, minutes=1, max_steps=2)
    pinned = tmp_path / "campaign" / "heldout.npz"  # the segment pinned its copy, then the campaign's
    assert first["heldout"] == {"file": "heldout.npz", "sha256": hashlib.sha256(pinned.read_bytes()).hexdigest()}
    other = rewritten(corpus, tmp_path / "other-corpus", tiny_target.cfg.vocab_size)
    carried = tmp_path / "carried"
    # from campaign.toml's heads again
    second = on_machine(spec, tmp_path, 2, other, minutes=1, max_steps=2, bring_back_to=str(carried))
    assert second["heldout"] == first["heldout"] and second["corpus"]["fingerprint"] != first["corpus"]["fingerprint"]
    assert (carried / "records" / "heldout.npz").read_bytes() == pinned.read_bytes()
    assert [p.name for p in (carried / "records").glob("segment-*")] == ["segment-002"]
    assert second["heads_before"] == first["heads_before"] and second["held_out_start"] == first["held_out_start"]
    plan = json.loads((tmp_path / "campaign" / "segment-002" / "data_plan.json").read_text())
    assert plan["heldout_answers"] == {"file": str(tmp_path / "machine-2" / "heldout.npz"),
                                       "sha256": first["heldout"]["sha256"]}


def test_a_segment_brings_back_what_it_pinned_when_the_campaign_folder_changes_under_it(
        tiny_target, corpus, start_head, tmp_path, monkeypatch, capsys):
    """The working tree holding the campaign folder can be synced afresh while a segment runs, taking away the
    files earlier segments left there: the segment measures on, and brings back, its own copy of the pinned
    held-out answers, and its records come from its run, not from the folder. An interim bring-back that
    fails is a warning, not the end of the training it guards."""
    from jetspec_jax.train import trainer

    cycle = "steps_per_minute = 5\nwarmup_steps = 2\npeak_learning_rate = 3e-3\nfresh_samples = false"
    spec = write_campaign(tmp_path / "campaign", tiny_target, start_head, cycle, 'heldout_answers = "heldout.npz"')
    first = on_machine(spec, tmp_path, 1, corpus, minutes=1, max_steps=2)
    pinned = (tmp_path / "campaign" / "heldout.npz").read_bytes()
    real_train, synced = trainer.train, []

    def train_in_a_synced_tree(*args, **kwargs):  # all but campaign.toml gone as training starts
        for path in sorted((tmp_path / "campaign").iterdir()):
            if path.name != "campaign.toml":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
                synced.append(path.name)
        return real_train(*args, **kwargs)

    replace, replaced = campaign.replace_folder, []

    def replace_but_the_first_fails(destination, build):  # a full disk, say: training goes on
        replaced.append(destination)
        if len(replaced) == 1:
            raise OSError(28, "No space left on device")
        replace(destination, build)

    monkeypatch.setattr(trainer, "train", train_in_a_synced_tree)
    monkeypatch.setattr(campaign, "replace_folder", replace_but_the_first_fails)
    back = tmp_path / "back"
    second = on_machine(spec, tmp_path, 2, corpus, minutes=1, max_steps=3, bring_back_to=str(back),
                        bring_back_every=1e-9)  # an interim bring-back after every step but the last
    assert "the interim bring-back" in capsys.readouterr().err
    assert len(replaced) == 3  # after steps 1 and 2 (the first failed), then the final one
    assert synced == ["heldout.npz", "segment-001", "segments.jsonl"]
    assert second["segment"] == 2 and second["heldout"] == first["heldout"] and "unfinished" not in second
    assert (back / "records" / "heldout.npz").read_bytes() == pinned
    assert read_records(str(back / "records")) == [first, second]
    assert json.loads((back / "records" / "segment-002" / "segment.json").read_text()) == second
    assert verify_head_files(str(back / "export" / "head-0")).weights_digest() == second["heads_after"][0]


def test_a_segment_draws_fresh_samples_for_training_prompts_only(tiny_target, start_head, tmp_path):
    spec = write_campaign(tmp_path / "campaign", tiny_target, start_head, "steps_per_minute = 100")
    plan = segment_overrides(spec, [{"steps_this_run": 300, "train_seconds_this_run": 60}], 10, "OUT", [start_head])
    assert "data.resample=2" in plan and "data.regen_dir=regen-draw2" in plan and "optim.total_steps=3000" in plan
    train_prompt = next({"source": "gsm8k", "id": f"q{i}"} for i in range(100) if not is_heldout("gsm8k", f"q{i}"))
    heldout_prompt = next({"source": "gsm8k", "id": f"q{i}"} for i in range(100) if is_heldout("gsm8k", f"q{i}"))
    assert sample_key(train_prompt, 0) == "gsm8k:" + train_prompt["id"] != sample_key(train_prompt, 2)
    assert sample_key(heldout_prompt, 2) == sample_key(heldout_prompt, 0)


def test_a_segment_that_regenerated_keeps_its_corpus_manifest_beside_its_metrics(tmp_path):
    run, manifest = tmp_path / "run", tmp_path / "regen-draw3" / "manifest.json"
    run.mkdir(), manifest.parent.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    manifest.write_text('{"num_answers": 7}')
    append_record(str(tmp_path / "campaign"), {"segment": 3}, str(run), str(manifest))
    folder = tmp_path / "campaign" / "segment-003"
    assert (folder / "corpus_manifest.json").read_text() == manifest.read_text()
    assert json.loads((folder / "segment.json").read_text()) == {"segment": 3}
    assert read_records(str(tmp_path / "campaign")) == [{"segment": 3}]


def test_a_partial_draw_keeps_every_heldout_prompt_and_moves_over_the_training_prompts():
    prompts = [{"source": "gsm8k", "id": f"q{i}"} for i in range(4000)]
    heldout = [p for p in prompts if is_heldout(p["source"], p["id"])]
    draws = [draw_prompts(prompts, 0.25, resample) for resample in (2, 3)]
    assert draw_prompts(prompts, 1.0, 2) == prompts and heldout
    for drawn in draws:
        assert all(p in drawn for p in heldout)
        assert 0.22 < (len(drawn) - len(heldout)) / (len(prompts) - len(heldout)) < 0.28
    assert draws[0] != draws[1]  # the next draw answers other training prompts
    with pytest.raises(InputError, match="data.regen_fraction"):
        load_config("tiny-cpu", ["data.regen_fraction=0"])


def test_a_time_boxed_segment_trains_for_what_the_corpus_left():
    records = [{"compile_seconds": 150.0}]
    assert training_minutes(9, None, 10_000, records) == 9  # no box: the training time asked for
    assert training_minutes(9, 30, 300, records) == 9  # the box leaves more than asked
    left = (18 * 60 - 300 - 150 - AFTER_TRAINING_S) / 60  # a slow corpus: training gets the rest
    assert left < 9 and training_minutes(9, 18, 300, records) == pytest.approx(left)
    assert training_minutes(60, 20, 300, []) == pytest.approx((20 * 60 - 300 - COMPILE_GUESS_S - AFTER_TRAINING_S) / 60)
    with pytest.raises(InputError, match="--finish-within 8 leaves 0.0 minutes.*carry a corpus"):
        training_minutes(9, 8, 500, records)
    # a timed segment: keep what it spent besides regenerating and training (here 400 s)
    timed = records + [{"segment_seconds": 1300.0, "regen_seconds": 500.0, "train_seconds_this_run": 400.0,
                        "compile_seconds": 150.0}]
    assert training_minutes(30, 20, 300, timed) == pytest.approx((20 * 60 - 300 - 400) / 60)


def test_a_bad_campaign_file_is_one_clear_error(tmp_path):
    (tmp_path / "campaign.toml").write_text('config = "tiny-cpu"\nheads = []\nheldout = "h.npz"\n'
                                            '[cycle]\nmode = "continue"\nbogus = 1\n')
    with pytest.raises(InputError, match=r"cycle.bogus is not a.*heldout is not a.*needs cycle.total_steps"):
        CampaignSpec.read(str(tmp_path))
    with pytest.raises(InputError, match="no campaign.toml"):
        CampaignSpec.read(str(tmp_path / "nowhere"))


def test_the_shipped_campaign_plans_its_next_segment():
    """campaign.toml and the log in the repository make a valid config for the next segment: a bad override
    there fails here, not on the GPU."""
    from jetspec_jax.train.config import REPO_ROOT

    folder = f"{REPO_ROOT}/train/results/smollm2-135m-general/campaign"
    spec, records = CampaignSpec.read(folder), read_records(folder)
    heads = [f"{REPO_ROOT}/{h}" for h in spec.heads]
    cfg = load_config(spec.config, [*spec.overrides, *segment_overrides(spec, records, 7, "OUT", heads)])
    assert cfg.data.resample == len(records) + 1 and cfg.data.regen_batch_size == 4096
    assert cfg.data.heldout_answers == "OUT/heldout_answers.npz"  # the segment's copy of the campaign's
    last = next(r for r in reversed(records) if r["train_seconds_this_run"])  # the last segment that timed it
    assert cfg.optim.total_steps == round(7 * 60 * last["steps_this_run"] / last["train_seconds_this_run"])


def test_the_repository_root_is_found_through_a_linked_package_folder(tmp_path, monkeypatch):
    """train/ reached through a link (a checkout that links jetspec_jax/train -> ../train) still names the
    checkout as the root, so campaign.toml's heads and the default data folder resolve."""
    import importlib
    import importlib.util
    import os
    import sys

    from jetspec_jax.train import config

    linked = tmp_path / "train"
    linked.symlink_to(os.path.dirname(config.__file__))
    spec = importlib.util.spec_from_file_location("linked_train", linked / "__init__.py",
                                                  submodule_search_locations=[str(linked)])
    package = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "linked_train", package)
    spec.loader.exec_module(package)
    linked_config = importlib.import_module("linked_train.config")
    monkeypatch.setitem(sys.modules, "linked_train.config", linked_config)  # dropped again after the test
    assert linked_config.__file__.startswith(str(tmp_path))
    assert linked_config.REPO_ROOT == config.REPO_ROOT
    assert os.path.isdir(os.path.join(linked_config.REPO_ROOT, "jetspec_jax", "heads"))


def test_the_learning_curve_reads_every_segment_and_names_the_kinds_that_stopped_growing(tmp_path):
    from jetspec_jax.train.learning_curve import write_learning_curve

    def numbers(tau, math, code):
        return {"head": {"loss": 3.0 / tau, "tau": tau, "tau_by_kind": {"math": math, "code": code}}}

    pinned = {"file": "heldout.npz", "sha256": "a" * 64}
    records = [{"segment": 1, "campaign_tokens": 40e6, "tokens_this_run": 40e6, "heldout": pinned,
                "held_out_start": numbers(2.0, 2.2, 1.8), "held_out_end": numbers(2.2, 2.4, 2.0)},
               {"segment": 2, "campaign_tokens": 90e6, "tokens_this_run": 50e6, "heldout": pinned,
                "held_out_start": numbers(2.2, 2.4, 2.0), "held_out_end": numbers(2.3, 2.41, 2.2)}]
    with pytest.raises(InputError, match="no segment recorded yet"):
        write_learning_curve(str(tmp_path))
    (tmp_path / "segments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = write_learning_curve(str(tmp_path))
    assert [(p["segment"], p["tokens"], p["tau"]) for p in curves["head"]] == [(0, 0, 2.0), (1, 40e6, 2.2),
                                                                               (2, 90e6, 2.3)]
    table = (tmp_path / "learning_curve.md").read_text()
    assert "| 2 | A | 90.0M | 1.304 | 2.30 | 2.20 | 2.41 |" in table and "(flat) on: math." in table
    assert json.loads((tmp_path / "learning_curve.json").read_text()) == curves
    assert (tmp_path / "learning_curve.json").stat().st_mode & 0o777 == 0o644  # results readable by others
    assert (tmp_path / "learning_curve.png").stat().st_size > 0

    # a segment measured on other held-out answers (a campaign's own corpora before it pinned them): its
    # start joins the curve, and its growth compares numbers of that set alone
    records.append({"segment": 3, "campaign_tokens": 130e6, "tokens_this_run": 40e6,
                    "corpus": {"fingerprint": "c3"}, "held_out_start": numbers(2.5, 2.6, 2.4),
                    "held_out_end": numbers(2.6, 2.8, 2.41)})
    (tmp_path / "segments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = write_learning_curve(str(tmp_path))
    assert [(p["segment"], p["tokens"], p["tau"]) for p in curves["head"]][2:] == [(2, 90e6, 2.3), (2, 90e6, 2.5),
                                                                                   (3, 130e6, 2.6)]
    table = (tmp_path / "learning_curve.md").read_text()
    assert "| 2 | B | 90.0M | 1.200 | 2.50 |" in table and "| 3 | B | 130.0M |" in table
    assert "grew +4.0% pooled; under 1% (flat) on: code." in table
    # the next segment on that same corpus measures the same answers: no start point of its own
    records.append({"segment": 4, "campaign_tokens": 170e6, "tokens_this_run": 40e6,
                    "corpus": {"fingerprint": "c3"}, "held_out_start": numbers(2.6, 2.8, 2.41),
                    "held_out_end": numbers(2.7, 2.9, 2.5)})
    (tmp_path / "segments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert [p["segment"] for p in write_learning_curve(str(tmp_path))["head"]] == [0, 1, 2, 2, 3, 4]

    # a segment whose records stayed behind: its tokens estimated, so every total from it on is marked
    records.append({"segment": 5, "campaign_tokens": 210e6, "tokens_this_run": 40e6, "held_out_start": None,
                    "held_out_end": numbers(2.8, 3.0, 2.6), "estimated": ["tokens_this_run", "campaign_tokens"]})
    records.append({"segment": 6, "campaign_tokens": 250e6, "tokens_this_run": 40e6, "heldout": pinned,
                    "held_out_start": numbers(2.3, 2.5, 2.1), "held_out_end": numbers(2.4, 2.6, 2.2)})
    (tmp_path / "segments.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    points = write_learning_curve(str(tmp_path))["head"]
    assert [(p["segment"], p["tokens_estimated"]) for p in points[5:]] == [(4, False), (5, True), (5, True),
                                                                          (6, True)]
    table = (tmp_path / "learning_curve.md").read_text()
    assert "| 4 | B | 170.0M |" in table and "| 5 | C | ~210.0M |" in table and "| 6 | A | ~250.0M |" in table


def test_a_record_with_lost_timings_or_estimated_tokens_is_read_for_what_it_has():
    lost = {"segment": 3, "segment_seconds": 1165.2, "regen_seconds": None, "train_seconds_this_run": None,
            "estimated": ["tokens_this_run", "campaign_tokens"]}
    timed = {"segment": 2, "segment_seconds": 700.0, "regen_seconds": 200.0, "train_seconds_this_run": 400.0}
    assert overhead_seconds(lost) is None and overhead_seconds(timed) == 100.0
    # --finish-within keeps the overhead of the last segment that timed it
    assert training_minutes(20, 10, 0.0, [timed, lost]) == (600 - 100) / 60
    assert tokens_estimated([timed, lost]) and not tokens_estimated([timed])
