"""The start-up caches: a second process takes its compiled programs from the compilation cache,
the weights cache gives the fresh load's arrays bit for bit, and a bad cache never stops a run."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_tiny_gguf

from jetspec_jax import cache, compilation, generate
from jetspec_jax.cache import CacheWarning
from jetspec_jax.target import load_target


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_tiny_gguf(str(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf"))


def assert_same_target(a, b):
    (cfg_a, params_a, tok_a), (cfg_b, params_b, tok_b) = a, b
    assert cfg_a == cfg_b
    assert jax.tree.structure(params_a) == jax.tree.structure(params_b)
    for x, y in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    assert tok_a.to_json() == tok_b.to_json()  # vocabulary, merges, special tokens and chat template
    messages = [{"role": "user", "content": "What is 7 times 8? é 日本 <|im_end|>"}]
    assert (tok_a.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
            == tok_b.apply_chat_template(messages, tokenize=True, add_generation_prompt=True))


def entries(folder, suffix):
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(suffix))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_cache_is_bit_identical_and_rebuilds_damaged_entries(tiny_gguf, tmp_path, dtype, monkeypatch):
    fresh = cache.load_gguf_target(tiny_gguf, dtype)  # no folder configured: straight from the file
    assert_same_target(cache.load_gguf_target(tiny_gguf, dtype, folder=str(tmp_path)), fresh)
    [weights] = entries(tmp_path, f"-{dtype}.safetensors")
    [tokenizer] = entries(tmp_path, "-tokenizer.json")

    def no_file_reads(*args, **kwargs):
        raise AssertionError("read the GGUF file despite a cache entry")
    with monkeypatch.context() as m:
        m.setattr("jetspec_jax.loading.gguf_file.load_gguf", no_file_reads)
        m.setattr("jetspec_jax.loading.gguf_tokenizer.load_gguf_tokenizer", no_file_reads)
        assert_same_target(cache.load_gguf_target(tiny_gguf, dtype, folder=str(tmp_path)), fresh)

    data = bytearray(open(weights, "rb").read())
    data[-100] ^= 0x01  # one flipped bit in the last tensor
    open(weights, "wb").write(bytes(data))
    open(tokenizer, "w").write("{")  # half a file
    with pytest.warns(CacheWarning, match="damaged") as caught:
        assert_same_target(cache.load_gguf_target(tiny_gguf, dtype, folder=str(tmp_path)), fresh)
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == 2
    with open(weights, "rb") as f:
        assert f.read() != bytes(data)  # rewritten
    assert_same_target(cache.load_gguf_target(tiny_gguf, dtype, folder=str(tmp_path)), fresh)
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp-")]


def test_flipped_bits_in_the_cached_tokenizer_or_config_rebuild_the_entry(tiny_gguf, tmp_path):
    """Two flipped bits in the cached chat template still parse, as another template, and one in the
    config's rope_theta as another model: both were used silently. Their checksums now send the load to
    the file, which rewrites the entries; the next load reads them without a warning."""
    fresh = cache.load_gguf_target(tiny_gguf, "float32")
    cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path))
    [weights] = entries(tmp_path, "-float32.safetensors")
    [tokenizer] = entries(tmp_path, "-tokenizer.json")
    data = bytearray(open(tokenizer, "rb").read())
    at = data.index(b"add_generation_prompt")
    data[at] ^= 0x20  # 'a' -> 'A'
    data[at + 4] ^= 0x01  # 'g' -> 'f'
    open(tokenizer, "wb").write(bytes(data))
    data = bytearray(open(weights, "rb").read())
    at = data.index(b"10000.0", data.index(b"rope_theta"))
    data[at] ^= 0x02  # 10000.0 -> 30000.0
    open(weights, "wb").write(bytes(data))
    with pytest.warns(CacheWarning, match="does not match its checksum") as caught:
        assert_same_target(cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path)), fresh)
    assert sum(issubclass(w.category, CacheWarning) for w in caught) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert_same_target(cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path)), fresh)


def test_a_garbled_compilation_cache_entry_is_replaced(tmp_path):
    """jax warns about an entry it cannot load and compiles the program again, but keeps the entry: every
    start warned and compiled again. Now the entry is rewritten, and the next start loads it. Entries
    are written atomically; a killed writer's temporary file goes once it is old."""
    folder = tmp_path / "xla"
    folder.mkdir()
    orphan, running = folder / ".tmp-k1ll3d_0jit_f-0123.part", folder / ".tmp-wr1t1ng0jit_f-4567.part"
    orphan.write_bytes(b"x")
    running.write_bytes(b"x")
    long_ago = time.time() - 2 * cache.ORPHAN_SECONDS
    os.utime(orphan, (long_ago, long_ago))
    folder = str(folder)
    assert cache.enable_compilation_cache(folder) == folder
    assert not orphan.exists() and running.exists()
    running.unlink()
    events = collections.Counter()

    def count(name, **kwargs):
        events[name.rsplit("/", 1)[-1]] += 1

    def garbled_entry_program(x):
        return jnp.sin(x) * 3 + x @ x.T

    def start() -> list[str]:
        """Runs the program as a new process would (jax's in-memory caches emptied); its warnings."""
        jax.clear_caches()
        events.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.jit(garbled_entry_program)(np.ones((8, 8), np.float32)).block_until_ready()
        return [str(w.message) for w in caught if "compilation cache" in str(w.message)]

    jax.monitoring.register_event_listener(count)
    try:
        assert start() == [] and events["cache_misses"] == 1
        [entry] = entries(folder, "-cache")
        data = bytearray(open(entry, "rb").read())
        data[len(data) // 2:len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 64])
        open(entry, "wb").write(bytes(data))
        jax_warning, ours = start()
        assert "Error reading persistent compilation cache entry" in jax_warning
        assert ours.startswith(f"compilation cache entry {entry} could not be loaded; replaced it")
        assert open(entry, "rb").read() != bytes(data) and not [f for f in os.listdir(folder) if f.startswith(".tmp-")]
        assert start() == [] and events["cache_hits"] == 1 and events["cache_misses"] == 0
    finally:
        jax.monitoring.unregister_event_listener(count)


def test_a_changed_file_replaces_its_entries(tiny_gguf, tmp_path):
    mtime = os.stat(tiny_gguf).st_mtime_ns
    cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path))
    before = set(os.listdir(tmp_path))
    os.utime(tiny_gguf, ns=(mtime, mtime + 1))  # a new version of the file, as far as the key knows
    try:
        cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path))
    finally:
        os.utime(tiny_gguf, ns=(mtime, mtime))
    after = set(os.listdir(tmp_path))
    assert len(before) == len(after) == 2 and not before & after  # weights + tokenizer, old ones removed


def test_stale_entries_go_on_the_next_load_and_nothing_else_does(tiny_gguf, tmp_path):
    """Entries of this file path under an older key, whatever their dtype, are removed by the next load
    even when it writes nothing (a cache hit): such entries were left when two processes of different
    loader versions wrote at once, or one was killed after writing, and stayed for good. This key's
    entries, other models' (one whose name begins like this one's included), a running writer's
    temporary file and other files stay; a killed writer's temporary file goes once it is old."""
    cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path))
    current = set(os.listdir(tmp_path))
    [weights] = [f for f in current if f.endswith("-float32.safetensors")]
    stem, key = weights.removesuffix("-float32.safetensors").rsplit("-", 1)
    old = "0123456789abcdef01234567"
    stale = [f"{stem}-{old}-{suffix}" for suffix in ("float32.safetensors", "bfloat16.safetensors", "tokenizer.json")]
    orphan = f".tmp-k1ll3d_0{stem}-{old}-float32.safetensors"
    kept = [f"{stem}-{key}-bfloat16.safetensors", f"other-89abcdef-{old}-float32.safetensors",
            f"{stem}-copy-89abcdef-{old}-float32.safetensors", f".tmp-wr1t1ng0{stem}-{key}-float32.safetensors",
            "notes.txt"]
    for name in stale + [orphan] + kept:
        (tmp_path / name).write_bytes(b"x")
    long_ago = time.time() - 2 * cache.ORPHAN_SECONDS
    os.utime(tmp_path / orphan, (long_ago, long_ago))
    cache.load_gguf_target(tiny_gguf, "float32", folder=str(tmp_path))  # a hit: nothing is written
    assert set(os.listdir(tmp_path)) == current | set(kept)


def test_cache_folder_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(cache.CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.default_cache_dir() == str(tmp_path / "xdg" / "jetspec-jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache.default_cache_dir() == os.path.join(os.path.expanduser("~"), ".cache", "jetspec-jax")
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert cache.default_cache_dir() == str(tmp_path / "mine")


def test_an_unwritable_cache_folder_warns_and_the_run_goes_on(tiny_gguf, tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.warns(CacheWarning, match="not writable"):
        assert cache.configure(str(tmp_path / "a-file" / "cache")) is None  # under a file: never creatable
    assert cache.weights_cache_dir() is None and jax.config.jax_compilation_cache_dir is None
    assert load_target(tiny_gguf).cfg.num_layers == 2


def test_cli_no_cache_writes_nothing(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(cache.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(compilation, "_COMPILED", {})
    jax.clear_caches()  # so that this run compiles, as a new process would
    assert generate.main(["hi", "--model", tiny_gguf, "--method", "ar", "--max-new-tokens", "2", "--no-cache"]) == 0
    assert "load " in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


# Runs the CLI in a fresh process and prints the compilation cache's hit and miss events.
CLI_WITH_CACHE_EVENTS = """
import collections, json, sys
import jax
from jetspec_jax.generate import main
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name.rsplit("/", 1)[-1]]))
status = main(sys.argv[1:])
print(json.dumps({"status": status, "hits": events["cache_hits"], "misses": events["cache_misses"]}))
"""


def test_a_second_process_takes_its_programs_from_the_compilation_cache(tiny_gguf, tmp_path):
    argv = ["hi", "--model", tiny_gguf, "--method", "ar", "--max-new-tokens", "2", "--cache-dir", str(tmp_path)]

    def run():
        done = subprocess.run([sys.executable, "-c", CLI_WITH_CACHE_EVENTS, *argv], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])
    first = run()
    assert first["status"] == 0 and first["misses"] > 0 and first["hits"] == 0
    written = entries(tmp_path / "xla", "-cache")
    assert len(written) == first["misses"] and entries(tmp_path / "weights", "-float32.safetensors")
    second = run()
    # nothing compiled; fewer programs run, as the weights now come from the weights cache, not converted
    assert second["status"] == 0 and second["misses"] == 0 and 0 < second["hits"] <= first["misses"]
    assert entries(tmp_path / "xla", "-cache") == written
