"""Heads are matched to their target by the model's fingerprint, not its file name, and damaged or
malformed head files are refused with one `error:` line (exit 2) before any work starts."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_checkpoint

from jetspec_jax import api, draft_vocab
from jetspec_jax import generate as generate_cli
from jetspec_jax.cli_loading import resolve_method_and_head
from jetspec_jax.eval import runner
from jetspec_jax.eval.__main__ import main as eval_main
from jetspec_jax.eval.heads import resolve_heads
from jetspec_jax.loading.head_checkpoint import (CONFIG_FILE, MAX_SHARD_BYTES, PACKAGED_HEADS_DIR, PACKAGED_INDEX,
                                                 SHARDS_KEY, WEIGHTS_FILE, file_sha256, load_head,
                                                 packaged_head_path, packaged_heads, save_head, shard_file_name,
                                                 verify_head_files)
from jetspec_jax.models import draft_head
from jetspec_jax.models.params import init_params, path_to_str
from jetspec_jax.target import load_target
from jetspec_jax.train.config import DEFAULT_DATA_DIR

FAST = ["--max-new-tokens", "4", "--budget", "8"]


def run_cli(argv, capsys) -> tuple[int, str, str]:
    code = generate_cli.main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_error_line(err: str, *fragments: str):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def renamed_target(embedded_target, tmp_path_factory):
    """The embedded GGUF copied under another name, loaded for real from the copy."""
    path = str(tmp_path_factory.mktemp("renamed") / "my-model.gguf")
    shutil.copyfile(embedded_target.source, path)
    return load_target(path, dtype="float32")


@pytest.fixture(scope="module")
def single_file_shipped_head(embedded_target, tmp_path_factory):
    """The shipped JetSpec head (sharded) re-saved as one head.safetensors, the layout of heads exported
    before shards existed, so the damage tests below each hit the one weights file."""
    cfg, params = load_head(packaged_head_path(embedded_target, "jetspec"), jnp.bfloat16, target=embedded_target)
    path = str(tmp_path_factory.mktemp("single-file") / "head")
    save_head(path, cfg, params, target=embedded_target, max_shard_bytes=2**40)
    return path


@pytest.fixture()
def shipped_head_copy(single_file_shipped_head, tmp_path):
    path = str(tmp_path / "head")
    shutil.copytree(single_file_shipped_head, path)
    return path


def edit_config(head_dir: str, edit) -> None:
    config_path = os.path.join(head_dir, CONFIG_FILE)
    with open(config_path) as f:
        data = json.load(f)
    edit(data)
    with open(config_path, "w") as f:
        json.dump(data, f)


def test_fingerprint_ignores_file_name_and_dtype(embedded_target, renamed_target):
    assert renamed_target.name == "my-model.gguf" and renamed_target.fingerprint == embedded_target.fingerprint
    bf16 = dataclasses.replace(embedded_target, params={**embedded_target.params})
    bf16.params["final_norm"] = bf16.params["final_norm"].astype(jnp.bfloat16)
    bf16.params["layers"] = [{k: v.astype(jnp.bfloat16) for k, v in layer.items()}
                             for layer in embedded_target.params["layers"]]
    assert bf16.fingerprint == embedded_target.fingerprint  # GPU runs load bf16 weights


def test_fingerprint_tells_models_apart(tmp_path):
    make_tiny_checkpoint("qwen3", str(tmp_path / "a"), seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")
    make_tiny_checkpoint("qwen3", str(tmp_path / "b"), seed=1)
    a, a_copy, b = (load_target(str(tmp_path / n), dtype="float32", with_tokenizer=False)
                    for n in ("a", "a-copy", "b"))
    assert a.fingerprint == a_copy.fingerprint != b.fingerprint
    fine_tuned = dataclasses.replace(a, params={**a.params, "final_norm": a.params["final_norm"] * 1.01})
    assert fine_tuned.fingerprint != a.fingerprint


def test_hugging_face_export_of_the_gguf_has_its_fingerprint(embedded_target, tmp_path):
    """transformers' own GGUF import, saved as an HF directory, is the same model to a head."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(embedded_target.source),
                                                 gguf_file=os.path.basename(embedded_target.source))
    model.hf_quantizer = None  # the weights are dequantised already: save them as a plain checkpoint
    model.config.__dict__.pop("quantization_config", None)
    model.save_pretrained(str(tmp_path / "hf"))
    del model
    exported = load_target(str(tmp_path / "hf"), dtype="float32", with_tokenizer=False)
    assert exported.fingerprint == embedded_target.fingerprint
    assert packaged_head_path(exported, "jetspec") is not None


def test_renamed_model_keeps_its_shipped_heads_in_the_cli(renamed_target, capsys, monkeypatch):
    loaded = []
    monkeypatch.setattr("jetspec_jax.cli_loading.load_target", lambda path, **kw: loaded.append(path) or renamed_target)
    code, _, err = run_cli(["What is 2 plus 2?", "--model", renamed_target.source] + FAST, capsys)
    assert code == 0 and loaded == [renamed_target.source]
    assert "jetspec, tau" in err and "untrained" not in err and "note:" not in err


@pytest.mark.skipif(not os.path.isdir(DEFAULT_DATA_DIR), reason=f"no data at {DEFAULT_DATA_DIR}")
def test_renamed_model_keeps_its_shipped_heads_in_the_eval(renamed_target, tmp_path, monkeypatch, caplog):
    heads = resolve_heads(("ar", "jetspec", "ddtree", "dflash"), {}, renamed_target, allow_untrained=False)
    assert set(heads) == {"jetspec", "bidirectional"} and all(h.path for h in heads.values())
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: renamed_target)
    results = tmp_path / "results.jsonl"
    assert eval_main(["run", "--benchmarks", "gsm8k", "--methods", "ar", "jetspec", "--budgets", "8", "--limit",
                      "1", "--max-new-tokens", "4", "--no-progress", "--model", renamed_target.source,
                      "--results", str(results)]) == 0
    methods = [json.loads(line)["method"] for line in results.read_text().splitlines()]
    assert methods == ["ar", "jetspec"] and "skipping" not in caplog.text


def test_head_of_another_target_is_refused(embedded_target, shipped_head_copy, capsys, monkeypatch, tmp_path):
    edit_config(shipped_head_copy, lambda d: d.update(target_fingerprint="0123456789abcdef",
                                                      target_name="other-model.gguf"))
    monkeypatch.setattr("jetspec_jax.cli_loading.load_target", lambda path, **kw: embedded_target)
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, "other-model.gguf", "0123456789abcdef", embedded_target.name,
                          embedded_target.fingerprint, "python -m jetspec_jax.train")
    with pytest.raises(ValueError, match="was trained for target 'other-model.gguf'"):
        resolve_heads(("ar", "jetspec"), {"jetspec": shipped_head_copy}, embedded_target, allow_untrained=False)


def test_saved_head_records_its_target(tiny_qwen3, tmp_path):
    target, _ = tiny_qwen3
    cfg, params = api.random_head(target, "causal")
    save_head(str(tmp_path / "head"), cfg, params, target=target)
    record = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    assert record["target_fingerprint"] == target.fingerprint and record["target_name"] == target.name
    load_head(str(tmp_path / "head"), jnp.float32, target=target)
    other = dataclasses.replace(target, params={**target.params, "final_norm": target.params["final_norm"] + 1})
    with pytest.raises(ValueError, match="was trained for target"):
        load_head(str(tmp_path / "head"), jnp.float32, target=other)


def test_unknown_target_says_no_head_exists_and_how_to_train(tiny_qwen3, capsys):
    target, _ = tiny_qwen3
    args = generate_cli.build_parser().parse_args(["hi"])
    method, head = resolve_method_and_head(args, target)
    err = capsys.readouterr().err
    assert method == "ar" and head is None
    assert "no trained jetspec head exists" in err and target.fingerprint in err
    assert "python -m jetspec_jax.train" in err


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999])
def test_truncated_head_weights(shipped_head_copy, capsys, fraction):
    weights = os.path.join(shipped_head_copy, WEIGHTS_FILE)
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(int(size * fraction))
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, weights, "truncated or corrupt")


@pytest.mark.parametrize("offset", [3, 100, 1 << 20, -1])
def test_flipped_byte_in_head_weights(shipped_head_copy, capsys, offset):
    weights = os.path.join(shipped_head_copy, WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.seek(offset if offset >= 0 else os.path.getsize(weights) + offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, weights, "sha256")


def test_unreadable_weights_without_a_recorded_sha(embedded_target, shipped_head_copy, capsys, monkeypatch):
    """Heads exported before the sha was recorded: safetensors' own error, named and on one line."""
    edit_config(shipped_head_copy, lambda d: d.pop("weights_sha256"))
    weights = os.path.join(shipped_head_copy, WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    monkeypatch.setattr("jetspec_jax.cli_loading.load_target", lambda path, **kw: embedded_target)
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, weights, "not a readable safetensors file")


def shipped_head_dirs() -> list[str]:
    """The directory names heads.json lists, each once."""
    with open(PACKAGED_INDEX) as f:
        return sorted({name for entry in json.load(f).values() for key, name in entry.items() if key != "target"})


def head_config_keys() -> list[str]:
    """The shipped heads' draft_config.json keys as a one-file head has them: weights_sha256 in place of
    the shard list (test_malformed_shard_list_is_refused covers that one)."""
    keys = set()
    for name in shipped_head_dirs():
        with open(os.path.join(PACKAGED_HEADS_DIR, name, CONFIG_FILE)) as f:
            keys |= {"weights_sha256" if key == SHARDS_KEY else key for key in json.load(f)}
    return sorted(keys)


# A wrong type for each key: strings for numbers, numbers for strings and lists, and so on.
MISTYPED = {"tap_layers": "1,8", "attention": 3, "mask_token_id": "mask", "rms_norm_eps": "small",
            "rope_theta": [1], "target_fingerprint": 7, "target_name": None, "weights_sha256": 0}


@pytest.mark.parametrize("key", head_config_keys())
def test_head_config_key_dropped_or_mistyped(shipped_head_copy, capsys, key):
    config_path = os.path.join(shipped_head_copy, CONFIG_FILE)
    with open(config_path) as f:
        assert key in json.load(f)  # the one-file copy has every key the shipped heads have
    optional = key in ("target_fingerprint", "target_name", "weights_sha256")
    if not optional:
        edit_config(shipped_head_copy, lambda d: d.pop(key))
        code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
        assert code == 2
        assert_one_error_line(err, config_path, f"missing key {key!r}")
    edit_config(shipped_head_copy, lambda d: d.update({key: MISTYPED.get(key, "12")}))
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, config_path, repr(key))


def test_head_config_unknown_key_and_bad_json(shipped_head_copy, capsys):
    config_path = os.path.join(shipped_head_copy, CONFIG_FILE)
    edit_config(shipped_head_copy, lambda d: d.update(num_layerz=2))
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, config_path, "unknown key 'num_layerz'")
    with open(config_path) as f:
        text = f.read()
    with open(config_path, "w") as f:
        f.write(text[: len(text) // 2])
    code, _, err = run_cli(["hi", "--head", shipped_head_copy] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, config_path, "not valid JSON")


def test_identity_read_from_files_equals_the_loaded_targets(embedded_target, renamed_target, tiny_checkpoint):
    """The eval finds heads without loading the model: the fingerprint from config + norm tensors alone."""
    from jetspec_jax.target import target_identity

    assert target_identity(embedded_target.source) == embedded_target.identity
    assert target_identity(renamed_target.source) == renamed_target.identity
    _, path, _ = tiny_checkpoint  # Qwen3, Qwen3-MoE and Llama layouts
    assert target_identity(path) == load_target(path, dtype="float32", with_tokenizer=False).identity


# ---------------------------------------------------------------------------------------------
# Sharded weights: heads over MAX_SHARD_BYTES (3- and 4-layer heads of the embedded model) are split so
# that no file passes the repository's 16 MiB limit.


def sharded_head(tiny_qwen3, path, shards_wanted=3):
    """A random tiny head saved with a limit that splits it into about `shards_wanted` files."""
    target, _ = tiny_qwen3
    cfg, params = api.random_head(target, "causal", seed=5)
    total = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(params))
    limit = total // shards_wanted + 4096  # room for each file's header and metadata
    save_head(str(path), cfg, params, metadata={"note": "test"}, target=target, max_shard_bytes=limit)
    return cfg, params, limit


def flat_params(params) -> dict[str, np.ndarray]:
    """Parameter name (as the weights files key it) -> array."""
    return {path_to_str(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def shard_paths(head_dir) -> list[str]:
    record = json.loads((head_dir / CONFIG_FILE).read_text())
    return [str(head_dir / shard["file"]) for shard in record[SHARDS_KEY]]


def test_sharded_head_round_trip(tiny_qwen3, tmp_path):
    from safetensors import safe_open

    cfg, params, limit = sharded_head(tiny_qwen3, tmp_path / "head")
    record = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    shards = record[SHARDS_KEY]
    assert len(shards) >= 3 and "weights_sha256" not in record
    assert [s["file"] for s in shards] == [shard_file_name(i, len(shards)) for i in range(1, len(shards) + 1)]
    assert sorted(os.listdir(tmp_path / "head")) == sorted([CONFIG_FILE] + [s["file"] for s in shards])
    assert sorted(os.listdir(tmp_path)) == ["head"]  # written atomically: no temporary left behind
    keys = []
    for shard in shards:
        path = str(tmp_path / "head" / shard["file"])
        assert os.path.getsize(path) <= limit and file_sha256(path) == shard["sha256"]
        with safe_open(path, framework="numpy") as f:
            keys.append(sorted(f.keys()))
    # every tensor whole in one shard, filled greedily in sorted name order
    assert [k for shard_keys in keys for k in shard_keys] == sorted(flat_params(params))
    loaded_cfg, loaded = load_head(str(tmp_path / "head"), jnp.float32, target=tiny_qwen3[0])
    assert loaded_cfg == cfg
    assert jax.tree.structure(loaded) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    digest = verify_head_files(str(tmp_path / "head")).weights_digest()
    assert len(digest) == 64 and digest not in {s["sha256"] for s in shards}


def test_tampered_shard_is_refused(tiny_qwen3, tmp_path, capsys):
    sharded_head(tiny_qwen3, tmp_path / "head")
    second = shard_paths(tmp_path / "head")[1]
    with open(second, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ValueError, match="its sha256 differs .* re-export the head") as e:
        load_head(str(tmp_path / "head"), jnp.float32)
    assert str(e.value).startswith(second)
    code, _, err = run_cli(["hi", "--head", str(tmp_path / "head")] + FAST, capsys)  # refused before the model loads
    assert code == 2
    assert_one_error_line(err, second, "sha256", "truncated or corrupt")


def test_missing_shard_is_refused(tiny_qwen3, tmp_path, capsys):
    sharded_head(tiny_qwen3, tmp_path / "head")
    last = shard_paths(tmp_path / "head")[-1]
    os.remove(last)
    with pytest.raises(ValueError, match="missing .*lists [0-9]+ weight shards; missing: head-0000"):
        load_head(str(tmp_path / "head"), jnp.float32)
    code, _, err = run_cli(["hi", "--head", str(tmp_path / "head")] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, last, "missing", "re-export the head")


@pytest.mark.parametrize("shards", [[], "head-00001-of-00001.safetensors",
                                    [{"file": "../elsewhere.safetensors", "sha256": "0" * 64}],
                                    [{"file": "head-00002-of-00002.safetensors", "sha256": "0" * 64}]])
def test_malformed_shard_list_is_refused(tiny_qwen3, tmp_path, capsys, shards):
    sharded_head(tiny_qwen3, tmp_path / "head")
    edit_config(str(tmp_path / "head"), lambda d: d.update({SHARDS_KEY: shards}))
    code, _, err = run_cli(["hi", "--head", str(tmp_path / "head")] + FAST, capsys)
    assert code == 2
    assert_one_error_line(err, str(tmp_path / "head" / CONFIG_FILE), repr(SHARDS_KEY))


def test_sharded_head_without_its_shard_list_is_no_head(tiny_qwen3, tmp_path):
    """draft_config.json edited back to the one-file layout: the shards are not read as head.safetensors."""
    sharded_head(tiny_qwen3, tmp_path / "head")
    edit_config(str(tmp_path / "head"), lambda d: d.pop(SHARDS_KEY))
    with pytest.raises(FileNotFoundError, match="no draft head"):
        load_head(str(tmp_path / "head"), jnp.float32)


def test_heads_below_the_limit_keep_one_file(tiny_qwen3, tmp_path):
    target, _ = tiny_qwen3
    cfg, params = api.random_head(target, "causal")
    save_head(str(tmp_path / "head"), cfg, params)
    assert sorted(os.listdir(tmp_path / "head")) == [CONFIG_FILE, WEIGHTS_FILE]
    record = json.loads((tmp_path / "head" / CONFIG_FILE).read_text())
    assert record["weights_sha256"] == file_sha256(str(tmp_path / "head" / WEIGHTS_FILE)) and SHARDS_KEY not in record


@pytest.mark.parametrize("num_layers", [3, 4])
def test_deeper_heads_of_the_embedded_model_stay_under_the_repository_limit(embedded_target, tmp_path, num_layers):
    cfg = draft_head.DraftConfig.for_target(embedded_target.cfg, num_layers=num_layers, intermediate_size=1024)
    params = init_params(draft_head.param_specs(cfg), jax.random.key(0), jnp.bfloat16)
    assert sum(leaf.nbytes for leaf in jax.tree.leaves(params)) > 16 * 2**20  # one file would break the rule
    save_head(str(tmp_path / "head"), cfg, params, metadata={"summary": "x" * 4000}, target=embedded_target)
    files = shard_paths(tmp_path / "head")
    assert len(files) == 2 and all(os.path.getsize(f) <= MAX_SHARD_BYTES for f in files)
    _, loaded = load_head(str(tmp_path / "head"), jnp.bfloat16, target=embedded_target)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_single_file_heads_verify_and_load_unchanged(single_file_shipped_head, embedded_target):
    """Heads exported before shards existed (and heads under the limit): one head.safetensors, its sha256
    recorded and still the identity, loaded tensor for tensor as stored."""
    from safetensors import safe_open

    path = single_file_shipped_head
    record = verify_head_files(path)
    weights = os.path.join(path, WEIGHTS_FILE)
    assert sorted(os.listdir(path)) == [CONFIG_FILE, WEIGHTS_FILE]
    assert record.weights_shards == () and record.weight_files == ((weights, record.weights_sha256),)
    assert record.weights_digest() == record.weights_sha256 == file_sha256(weights)
    _, params = load_head(path, jnp.bfloat16, target=embedded_target)
    flat = flat_params(params)
    with safe_open(weights, framework="numpy") as f:
        assert sorted(f.keys()) == sorted(flat)
        for key in f.keys():
            np.testing.assert_array_equal(flat[key], f.get_tensor(key))
    _, sharded = load_head(packaged_head_path(embedded_target, "jetspec"), jnp.bfloat16)
    for key, value in flat_params(sharded).items():  # the same weights as the shipped shards
        np.testing.assert_array_equal(flat[key], value)


@pytest.mark.parametrize("name", shipped_head_dirs())
def test_shipped_sharded_heads_verify_and_load_unchanged(name):
    """The shipped heads outgrow MAX_SHARD_BYTES: shards only (beside the config and the token counts that
    --draft-vocab reads), each under the repository's limit with the sha256 draft_config.json records,
    loaded tensor for tensor as stored."""
    from safetensors import safe_open

    path = os.path.join(PACKAGED_HEADS_DIR, name)
    record = verify_head_files(path)
    shards = [os.path.join(path, shard_file_name(i, len(record.weights_shards)))
              for i in range(1, len(record.weights_shards) + 1)]
    assert len(shards) >= 2 and record.weights_sha256 is None
    assert sorted(os.listdir(path)) == sorted([CONFIG_FILE, draft_vocab.COUNTS_FILE]
                                              + [os.path.basename(s) for s in shards])
    assert [file for file, _ in record.weight_files] == shards
    for shard, (_, sha) in zip(shards, record.weights_shards):
        assert file_sha256(shard) == sha and os.path.getsize(shard) <= MAX_SHARD_BYTES
    digest = record.weights_digest()
    assert len(digest) == 64 and digest not in {sha for _, sha in record.weights_shards}
    _, params = load_head(path, jnp.bfloat16)
    flat = flat_params(params)
    stored = {}
    for shard in shards:
        with safe_open(shard, framework="numpy") as f:
            assert not set(f.keys()) & set(stored)  # every tensor in exactly one shard
            stored |= {key: f.get_tensor(key) for key in f.keys()}
    assert sorted(stored) == sorted(flat)
    for key, value in stored.items():
        np.testing.assert_array_equal(flat[key], value)


def test_shipped_index_gives_each_method_a_head_of_its_kind_for_its_target(embedded_target):
    heads = packaged_heads(embedded_target)
    assert set(heads) == {"jetspec", "jetspec-tc", "ddtree", "dflash"}
    for method, path in heads.items():
        record = verify_head_files(path)
        assert record.cfg.attention == ("causal" if method.startswith("jetspec") else "bidirectional"), method
        assert record.target_fingerprint == embedded_target.fingerprint
        draft_head.check_pairing(record.cfg, embedded_target.cfg)
