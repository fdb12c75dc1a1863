"""Training prompts and regeneration: the mixture's sources and held-out slice, the slot engine's answers
(greedy equal to `generate`, sampled ones numbered and reproducible whatever the batch, the same with a
prompt's rows shared by its answers or copied for each, through the attention kernel or the
reference, with programs compiled ahead or at first call), long prompts in their own bucket, the corpus
on disk, the time box and resume."""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import os

import numpy as np
import pytest

from jetspec_jax.api import generate
from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.train import regenerate as regen_module
from jetspec_jax.train.config import DEFAULT_DATA_DIR, DataConfig
from jetspec_jax.train.corpus import MANIFEST_FILE, PROMPT_META_FILE, PROMPTS_FILE, Corpus
from jetspec_jax.train.mixture import SOURCES, TRAIN_MIX_FILES, is_heldout, load_prompts
from jetspec_jax.train.regenerate import load_regeneration_prompts, prompt_buckets, regenerate

LONG = "Summarise this passage in one sentence.\n\n" + " ".join(
    f"Sentence {i} says that the river rose by {i} centimetres overnight." for i in range(14))
PROMPTS = [
    {"source": "gsm8k", "id": "0", "kind": "math", "prompt": "What is 15 plus 27?"},
    {"source": "chat", "id": "a", "kind": "chat", "prompt": "Say hello in French."},
    {"source": "chat", "id": "b", "kind": "chat", "prompt": "Name three colors of the rainbow, one per line."},
    {"source": "long_context_qmsum", "id": "q", "kind": "long_context", "prompt": LONG},
]
SETTINGS = DataConfig(answer_temperatures=[0.0, 1.0], max_new_tokens=8, max_answer_tokens=8, max_prompt_tokens=256,
                      regen_batch_size=3, regen_cache_gib=0.25, regen_chunk_steps=3, regen_shard_answers=3)


def write_jsonl(path, rows, compress=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if compress:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)


@pytest.fixture
def data_dir(tmp_path):
    write_jsonl(tmp_path / "gsm8k_train.jsonl", [{"question": f"q{i}", "answer": "#### 1"} for i in range(200)])
    write_jsonl(tmp_path / "mbpp.jsonl", [dict(task_id=t, text=f"task {t}", test_list=[f"assert f({t})"])
                                          for t in (1, 10, 11, 510, 600, 601, 700, 974, 975)])
    (tmp_path / "train_mix").mkdir()
    write_jsonl(tmp_path / "train_mix" / "translation_multi30k.jsonl.gz",
                [{"id": f"m{i}", "source": "Multi30k", "category": "translation", "prompt": f"Translate {i}"}
                 for i in range(300)], compress=True)
    return tmp_path


def all_records(corpus: Corpus) -> list[dict]:
    return [source[i] for split in ("train", "heldout") for source in [corpus.answers(split)]
            for i in range(len(source))]


def test_prompts_are_capped_deterministic_and_never_held_out(data_dir):
    first = load_prompts(str(data_dir), {"gsm8k": 5}, seed=1)
    assert len(first) == 5 and first == load_prompts(str(data_dir), {"gsm8k": 5}, seed=1)
    assert first != load_prompts(str(data_dir), {"gsm8k": 5}, seed=2)
    train = load_prompts(str(data_dir), {"gsm8k": None, "translation_multi30k": None}, seed=1)
    heldout = load_prompts(str(data_dir), {"gsm8k": None, "translation_multi30k": None}, seed=1, split="heldout")
    assert heldout and not any(is_heldout(p["source"], p["id"]) for p in train)
    assert all(is_heldout(p["source"], p["id"]) for p in heldout)
    assert len(train) + len(heldout) == 500
    assert first == [p for p in train if p["source"] == "gsm8k"][:5]  # the cap takes a prefix of the shuffle
    assert first[0]["prompt"] == (f"q{first[0]['id']}\nPlease reason step by step, and put your final "
                                  "answer within \\boxed{}.") and first[0]["kind"] == "math"
    mix = [p for p in train if p["source"] == "translation_multi30k"]
    assert mix[0]["kind"] == "translation" and mix[0]["prompt"].startswith("Translate")


def test_regeneration_prompts_take_both_splits_in_proportion(data_dir):
    prompts = load_regeneration_prompts(str(data_dir), {"gsm8k": 40, "translation_multi30k": -1, "mbpp": 0}, seed=0)
    gsm = [p for p in prompts if p["source"] == "gsm8k"]
    assert sum(not is_heldout("gsm8k", p["id"]) for p in gsm) == 40
    assert sum(is_heldout("gsm8k", p["id"]) for p in gsm) == 2  # ceil(40 * 3 / 97)
    assert len([p for p in prompts if p["source"] == "translation_multi30k"]) == 300
    assert not [p for p in prompts if p["source"] == "mbpp"]


def test_prompt_source_errors(data_dir):
    with pytest.raises(ValueError, match="unknown training source.*'nope'.*known"):
        load_prompts(str(data_dir), {"nope": 1}, seed=0)
    with pytest.raises(FileNotFoundError, match="math_train.jsonl.*--data-dir"):
        load_prompts(str(data_dir), {"math": 1}, seed=0)
    (data_dir / "train_mix" / "stem_qa_p3.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(DamagedFileError, match="stem_qa_p3.jsonl.gz"):
        load_prompts(str(data_dir), {"stem_qa_p3": 1}, seed=0)


def test_mbpp_keeps_only_train_task_ids(data_dir):
    prompts = load_prompts(str(data_dir), {"mbpp": None}, seed=0) + load_prompts(str(data_dir), {"mbpp": None},
                                                                                 seed=0, split="heldout")
    assert sorted(int(p["id"]) for p in prompts) == [601, 700, 974]
    task = next(p for p in prompts if p["id"] == "700")
    assert task["prompt"] == ("task 700\nWrite a Python function that solves this. Your code should pass "
                              "tests like:\nassert f(700)")


def test_real_data_sources_load():
    if not os.path.isdir(DEFAULT_DATA_DIR):
        pytest.skip(f"no data at {DEFAULT_DATA_DIR}")
    prompts = load_regeneration_prompts(None, {name: 2 for name in SOURCES}, seed=0)
    assert {p["source"] for p in prompts} == set(SOURCES) and len(SOURCES) == 4 + len(TRAIN_MIX_FILES)
    assert all(p["prompt"].strip() for p in prompts)
    kinds = {p["kind"] for p in prompts}
    assert {"math", "code", "chat", "instruction", "long_context", "translation", "stem_qa"} <= kinds


def test_prompt_buckets():
    assert prompt_buckets(4096) == [128, 256, 512, 1024, 2048, 4096]
    assert prompt_buckets(300) == [128, 256, 320]
    assert prompt_buckets(100) == [128]


@pytest.fixture(scope="module")
def greedy_and_sampled(embedded_target, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("regen") / "corpus")
    return out, regenerate(embedded_target, PROMPTS, out, SETTINGS)


@pytest.mark.parametrize("share", [1, 3])
def test_slot_layout_fills_the_cache_rows_without_passing_them(share):
    """As many answer slots as the rows hold with their prompt slots (rounded up), never more, up to
    data.regen_batch_size; check_settings refuses a cache without room for one prompt's answers."""
    cfg = dataclasses.replace(SETTINGS, regen_batch_size=4096)
    for width in (128, 512, 4096):
        prompt_rows = regen_module.prompt_rows_for(width, share)
        for answer_tokens in (64, 500):
            answer_rows = regen_module.round_up_64(answer_tokens)
            smallest = regen_module.layout_rows(share, answer_rows, prompt_rows, share)
            for total in [smallest, smallest + 1, 3 * smallest - 7, 1000 * smallest + 13, 10**7]:
                layout = regen_module.slot_layout(width, answer_tokens, share, cfg, total)
                n = layout["num_slots"]
                assert layout["prompt_slots"] == regen_module.prompt_slots_for(n, share)
                assert regen_module.layout_rows(n, answer_rows, prompt_rows, share) <= total
                assert n == 4096 or regen_module.layout_rows(n + 1, answer_rows, prompt_rows, share) > total


def test_greedy_answers_match_generate_and_long_prompts_get_their_bucket(embedded_target, greedy_and_sampled):
    out, manifest = greedy_and_sampled
    assert manifest["complete"] and manifest["num_answers"] == 8
    assert manifest["counts"] == {"gsm8k": 2, "chat": 4, "long_context_qmsum": 2}
    assert [s["file"] for s in manifest["shards"]] == ["answers-00000.npz", "answers-00001.npz", "answers-00002.npz"]
    assert sorted(os.listdir(out)) == sorted([MANIFEST_FILE, PROMPTS_FILE, PROMPT_META_FILE]
                                             + [s["file"] for s in manifest["shards"]])  # no temporaries left
    buckets = manifest["sessions"][0]["buckets"]
    assert [b["prompt_width"] for b in buckets] == [128, 256]  # the long prompt decodes in its own bucket
    for b in buckets:  # a prompt's two answers share one prompt slot; the bucket's time split is recorded
        assert b["prompt_slots"] == 3 and b["slots"] == 3 and b["admissions"] >= 1 and b["chunks"] >= 1
        assert 0 < b["admission_seconds"] + b["chunk_seconds"] <= b["seconds"]
        # the programs were compiled before the first bucket ran; what a bucket compiles is small eager work
        assert 0 <= b["compile_seconds"] <= b["admission_seconds"] + b["chunk_seconds"]
    session = manifest["sessions"][0]
    assert session["compile_seconds"] > 0 and session["compile_workers"] >= 1
    corpus = Corpus(out)
    records = all_records(corpus)
    assert manifest["num_completion_tokens"] == sum(len(r["completion_ids"]) for r in records)

    expected = generate([p["prompt"] for p in PROMPTS], embedded_target, max_new_tokens=8)
    assert len(expected.prompt_token_ids[3]) > 128
    by_key = {(r["source"], r["id"], r["sample"]): r for r in records}
    for p, completion, prompt_ids in zip(PROMPTS, expected.token_ids, expected.prompt_token_ids):
        record = by_key[(p["source"], p["id"], 0)]
        assert record["completion_ids"].tolist() == completion and record["prompt_ids"].tolist() == prompt_ids
        assert record["finished"] == (len(completion) < 8) and record["kind"] == p["kind"]


def test_sampled_answers_are_numbered_and_the_same_whatever_the_batch(embedded_target, greedy_and_sampled, tmp_path):
    out, _ = greedy_and_sampled
    first = {(r["source"], r["id"], r["sample"]): r["completion_ids"].tolist() for r in all_records(Corpus(out))}
    assert sorted({k[2] for k in first}) == [0, 1]
    # at T=1 over 8 tokens the sampled answers are not all the greedy ones
    assert any(first[(p["source"], p["id"], 1)] != first[(p["source"], p["id"], 0)] for p in PROMPTS)
    other = dataclasses.replace(SETTINGS, regen_batch_size=8, regen_chunk_steps=5, regen_shard_answers=100)
    regenerate(embedded_target, PROMPTS, str(tmp_path / "b"), other)
    second = {(r["source"], r["id"], r["sample"]): r["completion_ids"].tolist()
              for r in all_records(Corpus(str(tmp_path / "b")))}
    assert second == first


def test_shared_prompt_rows_give_the_answers_of_a_copy_per_answer(embedded_target, greedy_and_sampled, tmp_path):
    out, manifest = greedy_and_sampled
    shared = {(r["source"], r["id"], r["sample"]): r["completion_ids"].tolist() for r in all_records(Corpus(out))}
    copies = regenerate(embedded_target, PROMPTS, str(tmp_path / "copies"),
                        dataclasses.replace(SETTINGS, regen_share_prompts=False))
    assert {(r["source"], r["id"], r["sample"]): r["completion_ids"].tolist()
            for r in all_records(Corpus(str(tmp_path / "copies")))} == shared
    for bucket in copies["sessions"][0]["buckets"]:  # a prompt slot per answer slot
        assert bucket["prompt_slots"] == bucket["slots"]
    assert manifest["sessions"][0]["share_prompts"] and not copies["sessions"][0]["share_prompts"]


@pytest.mark.parametrize("answers_per_prompt", [3, 1])
def test_slot_engine_through_the_attention_kernel_equals_xla(tiny_qwen3, answers_per_prompt):
    """The decode steps' two attention calls (prompt rows, own rows) through the Pallas kernel in
    interpret mode give the tokens the reference gives: a greedy and two sampled answers per prompt,
    prompts of different lengths, more answers than slots so slots are refilled."""
    import jax

    from jetspec_jax.train.regen_engine import Job, run_bucket

    target = tiny_qwen3[0]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, target.cfg.vocab_size, n).tolist() for n in (5, 17, 30, 9, 12)]
    jobs = [Job(i, s, 1000 + i, t, 12 - 2 * s) for i in range(len(prompts)) for s, t in enumerate([0.0, 1.0, 0.7])]

    def run(attention):
        answers = {}
        run_bucket(target.params, target.cfg, jobs, prompts, width=32, answer_rows=64, num_slots=6,
                   prompt_slots=3 if answers_per_prompt > 1 else 6, answers_per_prompt=answers_per_prompt,
                   admit_prompts=2, chunk_steps=4, run_key=jax.random.key(7), eos_token_ids=(), pad_token_id=0,
                   top_p=1.0, attention=attention,
                   on_answer=lambda job, tokens, _: answers.__setitem__((job.prompt_index, job.sample), tokens))
        return answers

    want = run("xla")
    assert sorted(want) == sorted((j.prompt_index, j.sample) for j in jobs)
    assert all(len(want[(j.prompt_index, j.sample)]) == j.limit for j in jobs)
    assert run("pallas_interpret") == want


def test_buckets_compiled_ahead_run_without_compiling_and_give_the_same_answers(tiny_qwen3):
    """compile_buckets' executables replace the jitted programs: run_bucket then compiles neither of them,
    and every answer is the one the jitted programs give."""
    import jax

    from jetspec_jax.compilation import CompileWatch
    from jetspec_jax.train.regen_engine import BucketPrograms, Job, StaticSettings, compile_buckets, run_bucket

    target = tiny_qwen3[0]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, target.cfg.vocab_size, n).tolist() for n in (7, 20, 11, 3)]
    jobs = [Job(i, s, 50 + i, t, 10 - s) for i in range(len(prompts)) for s, t in enumerate([0.0, 1.0])]
    layouts = {32: dict(answer_rows=64, num_slots=4, prompt_slots=3, admit_prompts=2),
               16: dict(answer_rows=64, num_slots=2, prompt_slots=2, admit_prompts=1)}
    run_key = jax.random.key(3)

    def run(width, bucket_programs):
        answers = {}
        run_bucket(target.params, target.cfg, [j for j in jobs if len(prompts[j.prompt_index]) <= width], prompts,
                   width=width, answers_per_prompt=2, chunk_steps=3, run_key=run_key, eos_token_ids=(),
                   pad_token_id=0, top_p=1.0, attention="xla", programs=bucket_programs,
                   on_answer=lambda job, tokens, _: answers.__setitem__((job.prompt_index, job.sample), tokens),
                   **layouts[width])
        return answers

    programs_named = {f"jit({name})" for name in BucketPrograms._fields}
    want = {}
    for width in layouts:  # jitted first: compiled ahead, the same programs would come from jax's caches
        with CompileWatch() as jitted:
            want[width] = run(width, None)
        assert programs_named <= set(jitted.names)  # compiled at their first call
    programs = compile_buckets(target.params, StaticSettings(target.cfg, 3, (), 0, 1.0, "xla"), run_key, layouts,
                               workers=2, answers_per_prompt=2)
    assert sorted(programs) == [16, 32]
    for width in layouts:
        calls = collections.Counter()

        def counted(name, executable):
            return lambda *args: (calls.update([name]), executable(*args))[1]

        with CompileWatch() as ahead:
            got = run(width, BucketPrograms(*(counted(n, f) for n, f in zip(BucketPrograms._fields, programs[width]))))
        assert got == want[width] and len(got) == 2 * sum(len(p) <= width for p in prompts)
        assert not programs_named & set(ahead.names) and set(calls) == set(BucketPrograms._fields)


def test_finished_corpus_is_returned_untouched(embedded_target, greedy_and_sampled):
    out, manifest = greedy_and_sampled
    mtimes = {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)}
    assert regenerate(embedded_target, PROMPTS, out, SETTINGS) == manifest
    assert {name: os.stat(os.path.join(out, name)).st_mtime_ns for name in os.listdir(out)} == mtimes


def test_other_settings_are_refused_without_deleting(embedded_target, greedy_and_sampled):
    out, _ = greedy_and_sampled
    before = sorted(os.listdir(out))
    with pytest.raises(InputError, match="other settings.*answer_temperatures.*new folder"):
        regenerate(embedded_target, PROMPTS, out, dataclasses.replace(SETTINGS, answer_temperatures=[0.0]))
    assert sorted(os.listdir(out)) == before


def test_interrupted_run_resumes_to_the_same_corpus(embedded_target, greedy_and_sampled, tmp_path, monkeypatch):
    reference, _ = greedy_and_sampled
    out = str(tmp_path / "resumed")
    settings = dataclasses.replace(SETTINGS, regen_shard_answers=1)
    real = regen_module.run_bucket
    calls = []

    def stop_in_second_bucket(*args, **kwargs):
        calls.append(kwargs["width"])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(regen_module, "run_bucket", stop_in_second_bucket)
    with pytest.raises(KeyboardInterrupt):
        regenerate(embedded_target, PROMPTS, out, settings)
    partial = json.load(open(os.path.join(out, MANIFEST_FILE)))
    assert not partial["complete"] and partial["num_answers"] == 6  # the short bucket, one shard per answer
    with pytest.raises(ValueError, match="not finished.*resume"):
        Corpus(out)
    monkeypatch.setattr(regen_module, "run_bucket", real)
    manifest = regenerate(embedded_target, PROMPTS, out, settings)
    assert manifest["complete"] and manifest["num_answers"] == 8 and len(manifest["sessions"]) == 1
    key = lambda r: (r["source"], r["id"], r["sample"])  # noqa: E731
    resumed = {key(r): r["completion_ids"].tolist() for r in all_records(Corpus(out))}
    assert resumed == {key(r): r["completion_ids"].tolist() for r in all_records(Corpus(reference))}


def test_time_box_stops_cleanly_and_resumes(embedded_target, tmp_path):
    out = str(tmp_path / "boxed")
    boxed = dataclasses.replace(SETTINGS, regen_max_minutes=1e-9)
    manifest = regenerate(embedded_target, PROMPTS[:2], out, boxed)
    assert not manifest["complete"] and manifest["num_answers"] == 0
    manifest = regenerate(embedded_target, PROMPTS[:2], out, SETTINGS)
    assert manifest["complete"] and manifest["num_answers"] == 4


def test_damaged_corpus_is_named(greedy_and_sampled, tmp_path):
    out, manifest = greedy_and_sampled
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(out):
        (copy / name).write_bytes(open(os.path.join(out, name), "rb").read())
    shard = copy / manifest["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DamagedFileError, match="answers-00001.npz.*sha256"):
        Corpus(str(copy))
    (copy / MANIFEST_FILE).write_text('{"format": "something else"}')
    with pytest.raises(DamagedFileError, match="manifest.json.*older regeneration"):
        Corpus(str(copy))
    with pytest.raises(FileNotFoundError, match="no manifest.json.*regenerat"):
        Corpus(str(tmp_path / "nothing"))


def test_settings_errors(embedded_target, tmp_path):
    with pytest.raises(InputError, match="max_prompt_tokens.*positions"):
        regenerate(embedded_target, PROMPTS, str(tmp_path / "x"), dataclasses.replace(SETTINGS, max_prompt_tokens=8190))
    with pytest.raises(InputError, match=r"regen_cache_gib \(0.001\) cannot hold.*GiB"):
        regenerate(embedded_target, PROMPTS, str(tmp_path / "y"), dataclasses.replace(SETTINGS, regen_cache_gib=0.001))
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_token_dtype_follows_the_vocabulary(greedy_and_sampled):
    out, _ = greedy_and_sampled
    corpus = Corpus(out)
    assert corpus.prompt_tokens.dtype == np.uint16  # 49,152 tokens fit 16 bits
