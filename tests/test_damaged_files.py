"""Damaged and malformed inputs through the command lines: a truncated or corrupt GGUF, a malformed
Hugging Face directory, bad training and eval settings and data files each give one `error:` line
naming the file and exit status 2, before any model loads where the input allows it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
from conftest import make_tiny_checkpoint

from jetspec_jax import target as target_module
from jetspec_jax.eval import runner
from jetspec_jax.eval.__main__ import main as eval_main
from jetspec_jax.generate import main as generate_main
from jetspec_jax.models.qwen3 import HF_REQUIRED
from jetspec_jax.train.__main__ import main as train_main

REINSTALL = target_module.EMBEDDED_REINSTALL


def error_line(capsys, main, argv) -> str:
    """Runs a CLI main; asserts exit 2 and a stderr of exactly one `error:` line; returns that line."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in err, err
    return lines[0]


def generate_error(capsys, model) -> str:
    return error_line(capsys, generate_main, ["hi", "--model", str(model), "--method", "ar", "--no-cache"])


# ---------------------------------------------------------------------------------------------
# GGUF


@pytest.fixture(scope="session")
def gguf_original():
    """(bytes of the embedded GGUF, byte offsets of the regions the cases damage)."""
    import gguf

    try:
        path = target_module.embedded_model_path()
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    reader = gguf.GGUFReader(path)
    block = reader.fields["llama.block_count"]
    tokens = reader.fields["tokenizer.ggml.tokens"]
    embed = reader.tensors[0]
    assert embed.name == "token_embd.weight" and embed.tensor_type.name == "Q8_0"
    info = embed.field.offset + 8 + len(embed.name)  # n_dims, dims, type, offset follow the name
    where = {
        "block_count_key": block.offset + 8 + len("llama."),  # the 'b' of block_count
        "block_count_type": block.offset + 8 + len(block.name),
        "tokens_length": tokens.offset + 8 + len(tokens.name) + 4 + 4,  # past the value and item types
        "first_tensor_info": embed.field.offset,
        "n_dims": info, "dim0": info + 4, "tensor_type": info + 4 + 16,
        "data": reader.data_offset, "embed_scale": embed.data_offset,
    }
    with open(path, "rb") as f:
        data = f.read()
    del reader
    return data, where


@pytest.fixture
def damaged_gguf(gguf_original, tmp_path_factory):
    """Writes a damaged copy, named like the embedded file, over the previous one (one file on disk)."""
    folder = tmp_path_factory.getbasetemp() / "damaged-gguf"
    folder.mkdir(exist_ok=True)
    path = folder / target_module.EMBEDDED_FILE

    def write(data: bytes):
        path.unlink(missing_ok=True)  # a reader of the previous copy may still map it
        path.write_bytes(data)
        return path
    return write


def flipped(data: bytes, offset: int, value: int | None = None) -> bytes:
    out = bytearray(data)
    out[offset] = out[offset] ^ 0xFF if value is None else value
    return bytes(out)


TRUNCATIONS = {  # name -> (offset in the file, what the error says)
    "empty": (lambda d, w: 0, "empty file"),
    "inside the magic": (lambda d, w: 2, "truncated to 2 bytes"),
    "header": (lambda d, w: 10, "truncated or corrupt header"),
    "metadata": (lambda d, w: 1000, "truncated or corrupt metadata"),
    "tensor infos": (lambda d, w: w["first_tensor_info"] + 30, "truncated or corrupt tensor infos"),
    "data start": (lambda d, w: w["data"] + 100, "truncated: tensor token_embd.weight (Q8_0) needs bytes up to"),
    "mid data": (lambda d, w: len(d) // 2, "truncated: tensor blk."),
}


@pytest.mark.parametrize("case", list(TRUNCATIONS))
def test_truncated_gguf(case, gguf_original, damaged_gguf, capsys):
    data, where = gguf_original
    offset, message = TRUNCATIONS[case]
    path = damaged_gguf(data[:offset(data, where)])
    line = generate_error(capsys, path)
    assert line.startswith(f"error: {path}: ") and message in line and REINSTALL in line, line


def test_gguf_short_of_its_last_byte_through_a_fresh_process(gguf_original, damaged_gguf):
    """The installed command line, as a user runs it: one stderr line, nothing else."""
    data, _ = gguf_original
    path = damaged_gguf(data[:-1])
    run = subprocess.run([sys.executable, "-m", "jetspec_jax.generate", "hi", "--model", str(path), "--no-cache"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr == (f"error: {path}: truncated: tensor output_norm.weight (F32) needs bytes up to "
                          f"{len(data):,} but the file has {len(data) - 1:,}; reinstall the embedded model with: "
                          f"{REINSTALL}\n")


FLIPS = {  # name -> (offset, new byte or None to invert it, what the error says)
    "magic": (lambda w: 0, None, "not a GGUF file (it starts with"),
    "version": (lambda w: 4, None, "corrupt header: "),
    "metadata count": (lambda w: 16, None, "corrupt metadata"),
    "metadata key bytes": (lambda w: 32, None, "corrupt metadata (after 'GGUF.kv_count'): 'utf-8' codec"),
    "metadata value type": (lambda w: w["block_count_type"], None, "is not a valid GGUFValueType"),
    "metadata array length": (lambda w: w["tokens_length"] + 5, None, "truncated or corrupt metadata"),
    "renamed required key": (lambda w: w["block_count_key"], ord("c"),
                             "bad metadata: missing required key 'llama.block_count'"),
    "tensor dimension count": (lambda w: w["n_dims"], None, "truncated or corrupt tensor infos"),
    "tensor shape": (lambda w: w["dim0"] + 1, None, "corrupt tensor infos: tensor 'token_embd.weight'"),
    "tensor type": (lambda w: w["tensor_type"], None, "corrupt tensor info of 'token_embd.weight': unknown "
                                                      "tensor type"),
    "block scale": (lambda w: w["embed_scale"] + 1, 0xFF, "corrupt tensor token_embd.weight: 32 of its"),
}


@pytest.mark.parametrize("case", list(FLIPS))
def test_flipped_bytes_in_gguf(case, gguf_original, damaged_gguf, capsys):
    data, where = gguf_original
    offset, value, message = FLIPS[case]
    path = damaged_gguf(flipped(data, offset(where), value))
    line = generate_error(capsys, path)
    assert line.startswith(f"error: {path}: ") and message in line and REINSTALL in line, line


def test_embedded_model_is_checked_by_its_sha256(gguf_original, tmp_path, capsys, monkeypatch):
    """A byte flipped inside quantised weights changes no structure; the embedded file's hash catches it."""
    data, where = gguf_original
    (tmp_path / target_module.EMBEDDED_FILE).write_bytes(flipped(data, where["embed_scale"] + 40))
    real_find_spec = target_module.importlib.util.find_spec
    monkeypatch.setattr(target_module.importlib.util, "find_spec", lambda name, *a: (
        types.SimpleNamespace(submodule_search_locations=[str(tmp_path)]) if name == target_module.EMBEDDED_PACKAGE
        else real_find_spec(name, *a)))
    for variable in target_module.TARGET_ENV_VARS:
        monkeypatch.delenv(variable, raising=False)
    line = error_line(capsys, generate_main, ["hi", "--method", "ar", "--no-cache"])
    assert line.startswith(f"error: {tmp_path / target_module.EMBEDDED_FILE}: damaged: its sha256 is ")
    assert REINSTALL in line


def with_flipped_quants(data: bytes, where) -> bytes:
    """64 KiB of token_embd's int8 quants inverted, its f16 block scales kept: every value stays finite
    and every structure intact, so only a hash can tell."""
    out = bytearray(data)
    for block in range(where["embed_scale"], where["embed_scale"] + 2048 * 34, 34):  # Q8_0: scale, 32 quants
        out[block + 2:block + 34] = bytes(b ^ 0xFF for b in out[block + 2:block + 34])
    return bytes(out)


def test_a_damaged_copy_of_the_embedded_model_given_as_model_is_checked_by_its_sha256(gguf_original, tmp_path,
                                                                                     capsys, monkeypatch):
    """Given by --model, a copy of the embedded model with 64 KiB of flipped quants ran to exit 0 with
    garbage text: only the default path was hashed. A copy is known by its size and its name, or its
    size and metadata (first MiB) when renamed; an intact copy passes. (Before the hash's error comes
    the loader's where it finds the damage: test_flipped_bytes_in_gguf's copies; skipped here.)"""
    monkeypatch.setattr(target_module, "load_gguf", lambda *a: None)
    data, where = gguf_original
    damaged = with_flipped_quants(data, where)
    named = tmp_path / target_module.EMBEDDED_FILE
    named.write_bytes(damaged)
    line = generate_error(capsys, named)
    assert line.startswith(f"error: {named}: damaged: its sha256 is "), line
    assert f"copy it again from {target_module.installed_embedded_path()}" in line and REINSTALL in line, line

    renamed = tmp_path / "model.gguf"
    renamed.write_bytes(damaged)
    with pytest.raises(target_module.DamagedFileError, match="damaged: its sha256 is "):
        target_module.resolve_target_path(str(renamed))
    renamed.write_bytes(data)
    assert target_module.resolve_target_path(str(renamed)) == str(renamed)


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-damaged")
    make_tiny_checkpoint("qwen3", str(path))
    return path


@pytest.fixture
def hf_copy(tiny_dir, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_dir, path)
    return path


def edit_config(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("key", HF_REQUIRED + ("intermediate_size",))
def test_hf_config_key_dropped_mistyped_or_negative(key, hf_copy, capsys):
    config_path = hf_copy / "config.json"
    edit_config(hf_copy, lambda c: c.pop(key))
    line = generate_error(capsys, hf_copy)
    assert line.startswith(f"error: {config_path}: missing required key '{key}'"), line
    edit_config(hf_copy, lambda c: c.update({key: "64"}))
    assert f"{key} must be a " in generate_error(capsys, hf_copy)
    edit_config(hf_copy, lambda c: c.update({key: -3}))
    line = generate_error(capsys, hf_copy)
    assert f"{key} must be a " in line and "got -3" in line, line


def test_hf_config_problems_are_reported_together(hf_copy, capsys):
    edit_config(hf_copy, lambda c: c.update(hidden_size=-3, rms_norm_eps="small", tie_word_embeddings="no"))
    line = generate_error(capsys, hf_copy)
    assert "hidden_size must be a positive integer, got -3" in line
    assert "rms_norm_eps must be a positive number, got 'small'" in line
    assert "tie_word_embeddings must be a boolean, got 'no'" in line


@pytest.mark.parametrize("content, message", [
    ("{\"model_type\": \"qwen3\", \"vocab_", "not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ("\xff\xfe", "not valid JSON"),
])
def test_hf_config_that_is_not_a_json_object(content, message, hf_copy, capsys):
    (hf_copy / "config.json").write_text(content, encoding="latin-1")
    line = generate_error(capsys, hf_copy)
    assert line.startswith(f"error: {hf_copy / 'config.json'}: {message}"), line


@pytest.mark.parametrize("cut", [0, 5, 100, -1])
def test_truncated_safetensors(cut, hf_copy, capsys):
    weights = hf_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:cut % len(data)])
    line = generate_error(capsys, hf_copy)
    assert line.startswith(f"error: {weights}: not a readable safetensors file"), line


def test_non_finite_weights_in_safetensors(hf_copy, capsys):
    from safetensors.numpy import load_file, save_file

    weights = hf_copy / "model.safetensors"
    tensors = load_file(str(weights))
    tensors["model.norm.weight"][3] = np.inf
    save_file(tensors, str(weights))
    line = generate_error(capsys, hf_copy)
    assert line.startswith(f"error: {weights}: corrupt tensor model.norm.weight: 1 of its"), line


def test_missing_and_damaged_shard_index(hf_copy, capsys):
    index = hf_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    line = generate_error(capsys, hf_copy)
    assert "shards listed in the index are missing: ['model-00002-of-00002.safetensors']" in line
    index.write_text("{\"weight_map\": ")
    assert generate_error(capsys, hf_copy).startswith(f"error: {index}: not valid JSON")
    index.write_text("{\"metadata\": {}}")
    assert "has no weight_map object" in generate_error(capsys, hf_copy)


# ---------------------------------------------------------------------------------------------
# Training config and data: refused before the target loads


@pytest.fixture
def no_target_load(monkeypatch):
    monkeypatch.setattr(target_module, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))


def write_jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))


@pytest.mark.parametrize("overrides, messages", [
    (["optim.tokens_per_batch=-3"], ["optim.tokens_per_batch must be >= 2, got -3"]),
    (["optim.batch_sise=4", "nope.key=1", "optim.total_steps=many", "data.top_p=2", "loss.kind=kl",
      "run.compute_dtype=float16", "data.sources={\"gsm9k\": 1}", "total_steps=5"],
     ["unknown key(s) optim.batch_sise", "unknown section [nope]", "optim.total_steps='many' is not a valid int",
      "data.top_p must be in (0, 1], got 2.0", "loss.kind must be one of fkl, ce, rkl, got 'kl'",
      "run.compute_dtype must be one of float32, bfloat16", "unknown source 'gsm9k'",
      "override 'total_steps=5' must look like section.key=value"]),
    (["data.data_dir=/no/such/data"], ["/no/such/data/gsm8k_train.jsonl, which does not exist"]),
    (["optim.tokens_per_batch=768"], ["every bucket's rows must split evenly over the 8 data-parallel devices"]),
])
def test_train_settings_fail_before_the_target_loads(overrides, messages, tmp_path, capsys, no_target_load):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "gsm8k_train.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})] * 3)
    write_jsonl(data / "chat_prompts.jsonl", [json.dumps({"id": "a", "instruction": "hi"})])
    line = error_line(capsys, train_main, ["--config", "tiny-cpu", f"run.out_dir={tmp_path}",
                                           f"data.data_dir={data}", *overrides])
    for message in messages:
        assert message in line, line


@pytest.mark.parametrize("content, message", [
    (json.dumps({"question": "q", "answer": "#### 1"}) + "\n{\"question\": ", "gsm8k_train.jsonl:2: not valid JSON"),
    (json.dumps({"answer": "#### 1"}), "gsm8k_train.jsonl:1: not a gsm8k record (KeyError: 'question')"),
])
def test_malformed_training_prompts_name_file_and_line(content, message, tmp_path, capsys, no_target_load):
    (tmp_path / "gsm8k_train.jsonl").write_text(content + "\n")
    line = error_line(capsys, train_main, ["--config", "tiny-cpu", f"data.data_dir={tmp_path}",
                                           "data.sources={\"gsm8k\": -1}"])
    assert message in line and str(tmp_path) in line, line


def test_train_config_file_that_is_not_toml(tmp_path, capsys, no_target_load):
    config = tmp_path / "broken.toml"
    config.write_text("[optim]\nbatch_size = = 3\n")
    line = error_line(capsys, train_main, ["--config", str(config)])
    assert line.startswith(f"error: {config}: not valid TOML"), line
    assert "no config file 'nope.toml'" in error_line(capsys, train_main, ["--config", "nope.toml"])
    assert "the following arguments are required: --config" in error_line(capsys, train_main, [])


def test_train_stage_without_regenerated_data(tmp_path, capsys, no_target_load):
    line = error_line(capsys, train_main, ["--config", "tiny-cpu", "--stage", "train", f"run.out_dir={tmp_path}"])
    assert "has no manifest.json" in line
    regen = tmp_path / "regen-tiny"
    regen.mkdir()
    (regen / "manifest.json").write_text(json.dumps({"shards": ["shard-00000.jsonl"]}))  # an older format
    line = error_line(capsys, train_main, ["--config", "tiny-cpu", "--stage", "train", f"run.out_dir={tmp_path}"])
    assert f"{regen / 'manifest.json'}: not a jetspec-regenerated-v2 manifest" in line and "regenerate" in line
    (regen / "manifest.json").write_text("{")
    line = error_line(capsys, train_main, ["--config", "tiny-cpu", "--stage", "train", f"run.out_dir={tmp_path}"])
    assert f"{regen / 'manifest.json'}: not valid JSON" in line


# ---------------------------------------------------------------------------------------------
# Eval settings and benchmark files: refused before the target loads


@pytest.fixture
def eval_no_load(monkeypatch):
    monkeypatch.setattr(runner, "load_target", lambda *a, **k: pytest.fail("bad input loaded the model"))


@pytest.fixture
def eval_data(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "gsm8k_test.jsonl", [json.dumps({"question": "q", "answer": "#### 1"})] * 3)
    return data


@pytest.mark.parametrize("args, message", [
    (["--limit", "-1"], "limit must be >= 0"),
    (["--width", "0"], "width must be >= 1, got 0"),
    (["--temperatures", "nan"], "temperature must be >= 0, got nan"),
    (["--max-new-tokens", "1"], "max_new_tokens must be >= 2"),
    (["--code-timeout", "0"], "code_timeout must be a positive number of seconds"),
    (["--budgets", "1", "--width", "0"], "budget must be >= 2, got 1; width must be >= 1"),
    (["--budgets", "x"], "argument --budgets: invalid int value: 'x'"),
])
def test_eval_settings_fail_before_the_target_loads(args, message, eval_data, tmp_path, capsys, eval_no_load):
    line = error_line(capsys, eval_main, ["run", "--benchmarks", "gsm8k", "--data-dir", str(eval_data),
                                          "--results", str(tmp_path / "r.jsonl"), "--no-progress", *args])
    assert message in line, line
    assert not (tmp_path / "r.jsonl").exists()


@pytest.mark.parametrize("bad_line, message", [
    ("{\"question\": \"q\", ", "gsm8k_test.jsonl:2: not valid JSON"),
    (json.dumps({"question": "q"}), "gsm8k_test.jsonl:2: not a gsm8k record (KeyError: 'answer')"),
])
def test_malformed_benchmark_file_names_file_and_line(bad_line, message, eval_data, tmp_path, capsys, eval_no_load):
    benchmark = eval_data / "gsm8k_test.jsonl"
    write_jsonl(benchmark, [json.dumps({"question": "q", "answer": "#### 1"}), bad_line])
    line = error_line(capsys, eval_main, ["run", "--benchmarks", "gsm8k", "--data-dir", str(eval_data),
                                          "--results", str(tmp_path / "r.jsonl"), "--no-progress"])
    assert message in line and str(eval_data) in line, line


def test_eval_results_path_that_is_a_directory_or_has_a_damaged_sidecar(eval_data, tmp_path, capsys,
                                                                        eval_no_load):
    argv = ["run", "--benchmarks", "gsm8k", "--data-dir", str(eval_data), "--no-progress", "--results"]
    assert f"--results {tmp_path} is a directory" in error_line(capsys, eval_main, argv + [str(tmp_path)])
    results = tmp_path / "r.jsonl"
    (tmp_path / "r.jsonl.meta.json").write_text("{\"settings\": {")
    line = error_line(capsys, eval_main, argv + [str(results)])
    assert line.startswith(f"error: {results}.meta.json: not valid JSON"), line


# ---------------------------------------------------------------------------------------------
# generate's own settings: refused before the target loads


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--temperature", "-1", "--budget", "0"], "temperature must be >= 0, got -1.0; invalid tree settings: budget"),
    (["--top-p", "0"], "top_p must be in (0, 1], got 0.0"),
    (["--tree-temperature", "0"], "tree_temperature must be a positive number, got 0.0"),
    (["--method", "eagle"], "argument --method: invalid choice: 'eagle'"),
])
def test_generate_settings_fail_before_the_target_loads(args, message, capsys, monkeypatch):
    monkeypatch.setattr("jetspec_jax.cli_loading.load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    line = error_line(capsys, generate_main, ["hi", "--no-cache", *args])
    assert message in line, line
