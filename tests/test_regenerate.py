"""Training-prompt loading and regeneration: caps, the MBPP train filter, shards that round-trip and
match `generate` at temperature 0, resumption without rewriting, seeded sampling, and several sampled
answers per prompt."""

from __future__ import annotations

import json
import os

import pytest

from jetspec_jax.generate import generate
from jetspec_jax.train.data import split_heldout
from jetspec_jax.train.regenerate import (DEFAULT_DATA_DIR, MANIFEST_FILE, load_training_prompts, read_shards,
                              regenerate)

PROMPTS = [
    {"source": "gsm8k", "id": "0", "prompt": "What is 15 plus 27?"},
    {"source": "chat", "id": "a", "prompt": "Say hello in French."},
    {"source": "chat", "id": "b", "prompt": "Name three colors of the rainbow, one per line."},
    {"source": "gsm8k", "id": "1", "prompt": "Tom has 3 apples and buys 4 more. How many does he have?"},
]
SETTINGS = dict(max_new_tokens=8, top_p=1.0, top_k=0, seed=0, batch_size=2, shard_size=3,
                max_prompt_tokens=256)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def data_dir(tmp_path):
    write_jsonl(tmp_path / "gsm8k_train.jsonl", [{"question": f"q{i}", "answer": "#### 1"}
                                                 for i in range(20)])
    write_jsonl(tmp_path / "mbpp.jsonl", [dict(task_id=t, text=f"task {t}", test_list=[f"assert f({t})"])
                                          for t in (1, 10, 11, 510, 600, 601, 700, 974, 975)])
    return tmp_path


def test_prompts_are_capped_and_deterministic(data_dir):
    first = load_training_prompts(str(data_dir), {"gsm8k": 5}, seed=1)
    assert len(first) == 5 and first == load_training_prompts(str(data_dir), {"gsm8k": 5}, seed=1)
    assert first != load_training_prompts(str(data_dir), {"gsm8k": 5}, seed=2)
    everything = load_training_prompts(str(data_dir), {"gsm8k": None}, seed=1)
    assert sorted(int(p["id"]) for p in everything) == list(range(20))
    assert everything[:5] == first  # the cap takes a prefix of the same shuffle
    assert first[0]["prompt"] == (f"q{first[0]['id']}\nPlease reason step by step, and put your final "
                                  "answer within \\boxed{}.")


def test_prompt_source_errors(data_dir):
    with pytest.raises(ValueError, match="unknown training source.*'nope'.*known"):
        load_training_prompts(str(data_dir), {"nope": 1}, seed=0)
    with pytest.raises(FileNotFoundError, match="math_train.jsonl.*--data-dir"):
        load_training_prompts(str(data_dir), {"math": 1}, seed=0)


def test_mbpp_keeps_only_train_task_ids(data_dir):
    prompts = load_training_prompts(str(data_dir), {"mbpp": None}, seed=0)
    assert sorted(int(p["id"]) for p in prompts) == [601, 700, 974]
    task = next(p for p in prompts if p["id"] == "700")
    assert task["prompt"] == ("task 700\nWrite a Python function that solves this. Your code should pass "
                              "tests like:\nassert f(700)")


def test_real_data_sources_load():
    if not os.path.isdir(DEFAULT_DATA_DIR):
        pytest.skip(f"no data at {DEFAULT_DATA_DIR}")
    prompts = load_training_prompts(None, {"gsm8k": 3, "math": 3, "mbpp": None, "chat": 3}, seed=0)
    mbpp_ids = [int(p["id"]) for p in prompts if p["source"] == "mbpp"]
    assert len(mbpp_ids) == 374 and min(mbpp_ids) == 601 and max(mbpp_ids) == 974
    assert len(prompts) == 383 and all(p["prompt"].strip() for p in prompts)


def test_greedy_regeneration_matches_generate_and_resumes(embedded_target, tmp_path):
    out = str(tmp_path / "regen")
    manifest = regenerate(embedded_target, PROMPTS, out, temperature=0.0, **SETTINGS)
    assert manifest["shards"] == ["shard-00000.jsonl", "shard-00001.jsonl"]
    assert sorted(os.listdir(out)) == [MANIFEST_FILE] + manifest["shards"]  # no temporaries left
    assert manifest["counts"] == {"gsm8k": 2, "chat": 2} and manifest["num_records"] == 4
    records = read_shards(out)
    assert manifest["num_completion_tokens"] == sum(len(r["completion_ids"]) for r in records)

    expected = generate([p["prompt"] for p in PROMPTS], embedded_target, max_new_tokens=8)
    by_key = {(r["source"], r["id"]): r for r in records}
    for p, completion, prompt_ids in zip(PROMPTS, expected.token_ids, expected.prompt_token_ids):
        record = by_key[(p["source"], p["id"])]
        assert record["completion_ids"] == completion and record["prompt_ids"] == prompt_ids
        assert record["finished"] == (len(completion) < 8)

    mtimes = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    (tmp_path / "regen" / "sentinel").write_text("kept")
    assert regenerate(embedded_target, PROMPTS, out, temperature=0.0, **SETTINGS) == manifest
    assert {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in mtimes} == mtimes
    assert (tmp_path / "regen" / "sentinel").exists()


def test_sampled_regeneration_is_seeded(embedded_target, tmp_path):
    first = regenerate(embedded_target, PROMPTS, str(tmp_path / "a"), temperature=1.0, **SETTINGS)
    second = regenerate(embedded_target, PROMPTS, str(tmp_path / "b"), temperature=1.0, **SETTINGS)
    assert read_shards(str(tmp_path / "a")) == read_shards(str(tmp_path / "b"))
    assert first["settings"] == second["settings"]


def test_several_samples_per_prompt(embedded_target, tmp_path):
    manifest = regenerate(embedded_target, PROMPTS, str(tmp_path / "k"), temperature=1.0,
                          **{**SETTINGS, "batch_size": 4, "samples_per_prompt": 3})
    records = read_shards(str(tmp_path / "k"))
    assert manifest["num_records"] == len(records) == 12 and manifest["counts"] == {"gsm8k": 6, "chat": 6}
    assert manifest["settings"]["samples_per_prompt"] == 3
    for p in PROMPTS:
        mine = [r for r in records if (r["source"], r["id"]) == (p["source"], p["id"])]
        assert sorted(r["sample"] for r in mine) == [0, 1, 2]
        assert all(r["prompt_ids"] == mine[0]["prompt_ids"] for r in mine)
    # independent draws: over 4 prompts x 8 tokens at T=1, a prompt's three answers are not all alike
    assert any(len({tuple(r["completion_ids"]) for r in records if r["id"] == p["id"]
                    and r["source"] == p["source"]}) > 1 for p in PROMPTS)
    # the held-out split keys on the prompt: its answers never sit on both sides
    for seed in range(5):
        train, heldout = split_heldout(records, 0.5, seed)
        assert train and heldout  # both sides hold prompts at these seeds, so the check below has teeth
        assert not {(r["source"], r["id"]) for r in train} & {(r["source"], r["id"]) for r in heldout}
    with pytest.raises(ValueError, match="samples_per_prompt=2 needs a temperature > 0"):
        regenerate(embedded_target, PROMPTS, str(tmp_path / "g"), temperature=0.0,
                   **{**SETTINGS, "samples_per_prompt": 2})
    assert not os.path.exists(tmp_path / "g")  # refused before anything is written


def test_changed_settings_regenerate_and_missing_manifest_is_explained(embedded_target, tmp_path):
    out = str(tmp_path / "regen")
    with pytest.raises(FileNotFoundError, match="no manifest.json.*regenerat"):
        read_shards(out)
    regenerate(embedded_target, PROMPTS[:2], out, temperature=0.0, **{**SETTINGS, "shard_size": 1})
    manifest = regenerate(embedded_target, PROMPTS[:2], out, temperature=0.0, **SETTINGS)
    assert manifest["shards"] == ["shard-00000.jsonl"]
    assert sorted(os.listdir(out)) == [MANIFEST_FILE, "shard-00000.jsonl"]  # the old shard 1 is gone
    assert len(read_shards(out)) == 2
