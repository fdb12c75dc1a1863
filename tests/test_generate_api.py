"""Host API and CLI: speculative methods through `generate`, and draft-head files."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.api import generate, random_head
from jetspec_jax.generate import main
from jetspec_jax.loading.head_checkpoint import CONFIG_FILE, load_head, save_head


def test_head_files_round_trip(tiny_qwen3, tmp_path):
    target, _ = tiny_qwen3
    cfg, params = random_head(target, "causal", seed=3)
    save_head(str(tmp_path / "head"), cfg, params)
    save_head(str(tmp_path / "head"), cfg, params)  # overwriting an existing head is atomic too
    loaded_cfg, loaded = load_head(str(tmp_path / "head"), jnp.float32)
    assert loaded_cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temporary left behind


def test_head_file_errors(tiny_qwen3, tmp_path):
    target, _ = tiny_qwen3
    with pytest.raises(FileNotFoundError, match="no draft head"):
        load_head(str(tmp_path / "missing"), jnp.float32)
    cfg, params = random_head(target, "causal")
    save_head(str(tmp_path / "head"), cfg, params)
    config = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    config["num_layerz"] = 3
    (tmp_path / "head" / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown key 'num_layerz'"):
        load_head(str(tmp_path / "head"), jnp.float32)


def test_a_method_s_head_is_checked(embedded_target):
    """(Speculative output equal to AR's on this model: test_shipped_heads_are_lossless_and_accept.)"""
    prompts = ["What is 15 plus 27?", "Say hello in French."]
    head = random_head(embedded_target, "bidirectional")
    with pytest.raises(ValueError, match="needs a draft head"):
        generate(prompts, embedded_target, method="jetspec")
    with pytest.raises(ValueError, match="expects a causal head, but this head is bidirectional"):
        generate(prompts, embedded_target, method="jetspec", head=head)
    with pytest.raises(ValueError, match="'jetspec-tc' expects a causal head, but this head is bidirectional"):
        generate(prompts, embedded_target, method="jetspec-tc", head=head)
    with pytest.raises(ValueError, match="is not one of .*'jetspec-tc'"):
        generate(prompts, embedded_target, method="jetspec-tree", head=head)


def test_cli_default_is_jetspec_with_the_shipped_head(capsys):
    """The main command speculates with the trained head and prints what AR prints."""
    question = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                "May. How many clips did Natalia sell altogether in April and May?")
    assert main([question, "--max-new-tokens", "48"]) == 0
    spec = capsys.readouterr()
    assert "jetspec" in spec.err and "untrained" not in spec.err
    tau = float(spec.err.split("tau ")[1].split()[0])
    assert tau > 1.5  # the trained head really accepts drafts (about 2.3 on this question)
    assert main([question, "--max-new-tokens", "48", "--method", "ar"]) == 0
    assert capsys.readouterr().out == spec.out


def test_cli_without_a_trained_head_warns(capsys, monkeypatch):
    monkeypatch.setattr("jetspec_jax.cli_loading.packaged_head_path", lambda target, method: None)
    assert main(["What is 2 plus 2?", "--method", "ddtree", "--budget", "8", "--max-new-tokens", "8"]) == 0
    err = capsys.readouterr().err
    assert "untrained head" in err and "tau" in err and "ddtree" in err


def test_cli_rejects_tree_causal_settings_before_loading(capsys):
    assert main(["hi", "--method", "jetspec", "--candidate-budget", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1 and "only apply to jetspec-tc" in err
    assert main(["hi", "--method", "jetspec-tc", "--budget", "32", "--candidate-budget", "16"]) == 2
    assert "candidate_budget (16) must be >= budget (32)" in capsys.readouterr().err
    assert main(["hi", "--method", "jetspec-tc", "--budget", "1"]) == 2
    assert "needs budget >= 2" in capsys.readouterr().err


@pytest.mark.parametrize("method,budgets", [("jetspec", (16, 64)), ("ddtree", (64,)), ("dflash", (16,)),
                                            pytest.param("jetspec-tc", (64,), marks=pytest.mark.slow)])
def test_shipped_heads_are_lossless_and_accept(embedded_target, method, budgets):
    """The trained heads on unseen GSM8K-style questions: token-identical to AR in fp32, tau well above 1."""
    from jetspec_jax.loading.head_checkpoint import packaged_head_path

    path = packaged_head_path(embedded_target, method)  # jetspec-tc: the JetSpec head, as it was trained
    assert path is not None
    head = load_head(path, jnp.float32)
    prompts = ["A farmer has 12 cows and buys 7 more. Then he sells 5. How many cows does he have?",
               "Tom reads 15 pages a day. How many pages does he read in 2 weeks?",
               "What is the sum of the first 10 positive integers?"]
    ar = generate(prompts, embedded_target, max_new_tokens=64)
    for budget in budgets:
        spec = generate(prompts, embedded_target, method=method, head=head, budget=budget, max_new_tokens=64)
        assert spec.token_ids == ar.token_ids and spec.texts == ar.texts
        assert spec.tau > 1.8
        assert sum(spec.accept_counts) == spec.target_forwards
