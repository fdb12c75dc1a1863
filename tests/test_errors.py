"""Bad input fails early with a message that names the problem and the fix."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_checkpoint

from jetspec_jax.api import generate, random_head
from jetspec_jax.loading.assemble import CheckpointMismatch
from jetspec_jax.target import EMBEDDED_INSTALL, embedded_model_path, load_target
from jetspec_jax.tokens import encode_prompts, pad_prompts, plan_cache_len


def test_missing_model_file():
    with pytest.raises(FileNotFoundError, match="no GGUF file|no model at"):
        load_target("/nonexistent/model.gguf")
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_target("/nonexistent/dir")


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError) as e:
        embedded_model_path()
    assert EMBEDDED_INSTALL in str(e.value)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_target(str(tmp_path))


def test_checkpoint_mismatches_are_reported_together(tmp_path):
    bad = tmp_path / "bad"
    make_tiny_checkpoint("qwen3", str(bad))
    config = json.loads((bad / "config.json").read_text())
    config["intermediate_size"] = 100  # every MLP weight now has the wrong shape
    config["num_hidden_layers"] = 4  # and layer 3 is missing
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointMismatch) as e:
        load_target(str(bad), dtype="float32")
    msg = str(e.value)
    assert "w_gate" in msg and "w_down" in msg and "missing weight layers/3/wq" in msg
    assert msg.count("\n") >= 9  # 3 layers x 3 MLP shapes + the missing layer, all in one error


def test_empty_prompt(embedded_target):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        encode_prompts(embedded_target.tokenizer, ["hello", "   "])
    with pytest.raises(ValueError, match="no prompts"):
        pad_prompts([], pad_id=0)


def test_prompt_longer_than_cache():
    with pytest.raises(ValueError, match="does not fit max_cache_len=128"):
        plan_cache_len(prompt_width=128, longest_prompt=100, max_new_tokens=64, max_positions=8192,
                       max_cache_len=128)
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        plan_cache_len(prompt_width=512, longest_prompt=500, max_new_tokens=64, max_positions=512)


def test_cli_reports_errors_without_traceback(capsys):
    from jetspec_jax.generate import main

    assert main(["hi", "--model", "/nonexistent/x.gguf"]) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["pallas", "cudnn", "mosaic"])
def test_gpu_only_attention_paths_are_refused_on_the_cpu(embedded_target, attention):
    with pytest.raises(ValueError, match=f"attention '{attention}' runs only on a GPU"):
        generate("hi", embedded_target, method="jetspec", head=random_head(embedded_target, "causal"),
                 max_new_tokens=4, attention=attention)
