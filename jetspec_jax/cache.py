"""On-disk caches that make a second start fast: JAX's compilation cache (`xla/`) and GGUF targets as
loaded, dequantised weights and tokenizer (`weights/`), under one user folder. The command lines turn
them on (`configure`); library calls leave them off unless a caller configures them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile
import threading
import time
import warnings
import zlib
from typing import Any

import jax
import numpy as np

CACHE_DIR_ENV = "JETSPEC_CACHE_DIR"
# Bump when what a weights or tokenizer entry holds changes; the loader's source is hashed into the key
# as well. 2: the weights entry's config and the whole tokenizer entry carry a crc32 too.
WEIGHTS_FORMAT = 2
_MIB = 1 << 20

_weights_dir: str | None = None  # set by configure(); None = load GGUF files from scratch


class CacheWarning(UserWarning):
    """A cache that cannot be used (unwritable folder, damaged entry): the run goes on without it."""


def default_cache_dir() -> str:
    """$JETSPEC_CACHE_DIR, else $XDG_CACHE_HOME/jetspec-jax, else ~/.cache/jetspec-jax."""
    if os.environ.get(CACHE_DIR_ENV):
        return os.environ[CACHE_DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jetspec-jax")


def writable_dir(path: str, what: str) -> bool:
    """Creates `path` and checks a file can be written there; warns and returns False if not."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".probe-")
        os.close(fd)
        os.unlink(probe)
        return True
    except OSError as e:
        warnings.warn(f"{what} folder {path} is not writable ({e}); running without it", CacheWarning,
                      stacklevel=3)
        return False


def enable_compilation_cache(cache_dir: str) -> str | None:
    """Points JAX's persistent compilation cache at `cache_dir` and caches every program (jax 0.10 and
    0.11 options). On GPU jax also keeps XLA's autotuning results there (its default
    jax_persistent_cache_enable_xla_caches). Returns the folder, or None if it is not writable."""
    if not writable_dir(cache_dir, "compilation cache"):
        return None
    _replace_unloadable_compilation_entries()
    remove_orphaned_temporaries(cache_dir)
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small GPU programs pay too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no size threshold
    _reset_jax_cache()
    return cache_dir


def disable_compilation_cache() -> None:
    jax.config.update("jax_compilation_cache_dir", None)
    _reset_jax_cache()


def _reset_jax_cache() -> None:
    # jax decides once per process whether the cache is in use; reset so a new setting takes effect
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()


class ReplacingFileCache:
    """jax's persistent compilation cache (`base`, its LRUCache), except that an entry jax could not
    load is replaced, and (unless jax evicts entries: it then writes them itself) entries are written
    atomically, so a writer killed mid-write leaves a temporary file instead of a garbled entry.

    jax compiles and stores a program only when get() gave it nothing usable, so a put() for a key whose
    get() returned bytes in this process means those bytes could not be loaded (jax has warned "Error
    reading persistent compilation cache entry"). LRUCache.put keeps an existing file, so without this
    the garbled entry stayed, and every start warned and compiled that program again."""

    def __init__(self, base, folder: str, entry_suffix: str):
        self.base, self.folder, self.entry_suffix = base, folder, entry_suffix  # jax's entry: KEY + suffix
        self.returned: set[str] = set()  # keys whose bytes get() handed to jax
        self.lock = threading.Lock()  # programs compile in a thread pool (compilation.py)

    @property
    def _path(self):  # jax logs it when the cache is reset
        return getattr(self.base, "_path", self.folder)

    def get(self, key: str) -> bytes | None:
        value = self.base.get(key)
        if value is not None:
            with self.lock:
                self.returned.add(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        with self.lock:
            unloadable = key in self.returned
            self.returned.discard(key)
        entry = os.path.join(self.folder, key + self.entry_suffix)
        if unloadable:
            try:
                os.unlink(entry)
            except FileNotFoundError:  # another process replaced it just now
                pass
            warnings.warn(f"compilation cache entry {entry} could not be loaded; replaced it with the program "
                          "compiled now", CacheWarning, stacklevel=2)
        if getattr(self.base, "eviction_enabled", True):
            self.base.put(key, value)  # under its lock, with the access times its eviction reads
        elif not os.path.exists(entry):
            # not ending in the entry suffix: jax's eviction (in another process) counts every file that does
            _write_atomic(entry, lambda tmp: _write_bytes(tmp, value), temp_suffix=key + ".part")


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _replace_unloadable_compilation_entries() -> None:
    """Has jax build its file cache as a ReplacingFileCache, once per process. jax has no public hook for
    the cache object; where its internals differ from jax 0.10's, its own cache stays in use."""
    try:
        from jax._src import compilation_cache as jax_cache
        from jax._src.lru_cache import _CACHE_SUFFIX as entry_suffix
    except ImportError:
        return
    make = getattr(jax_cache, "get_file_cache", None)
    if make is None or getattr(make, "replaces_unloadable_entries", False):
        return

    def get_file_cache(path):
        made = make(path)
        if made is None or "://" in str(path):  # a remote folder: leave it to jax
            return made
        base, folder = made
        return ReplacingFileCache(base, str(folder), entry_suffix), folder

    get_file_cache.replaces_unloadable_entries = True
    jax_cache.get_file_cache = get_file_cache


def configure(cache_dir: str | None = None, enabled: bool = True) -> str | None:
    """Turns both caches on under `cache_dir` (default: default_cache_dir()), or off. Returns the folder
    in use, or None when off or not writable (a CacheWarning says why). For the command lines and the
    server; a library caller can call it too."""
    global _weights_dir
    if not enabled:
        disable_compilation_cache()
        _weights_dir = None
        return None
    root = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    if not writable_dir(root, "cache"):
        disable_compilation_cache()
        _weights_dir = None
        return None
    xla = enable_compilation_cache(os.path.join(root, "xla"))
    weights = os.path.join(root, "weights")
    _weights_dir = weights if writable_dir(weights, "weights cache") else None
    return root if (xla or _weights_dir) else None


def add_cache_flags(parser) -> None:
    """--cache-dir and --no-cache, shared by the command lines; pass the result to configure()."""
    parser.add_argument("--cache-dir", default=None,
                        help=f"folder of the compilation and weights caches (default: ${CACHE_DIR_ENV}, else "
                             "$XDG_CACHE_HOME/jetspec-jax, else ~/.cache/jetspec-jax)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile and load from scratch, and write no cache")


def weights_cache_dir() -> str | None:
    return _weights_dir


# ---- GGUF targets as loaded ----

def _loader_version() -> str:
    """The format number and the loader's source: an edited loader never reads an older entry."""
    from jetspec_jax.loading import assemble, gguf_file, gguf_tokenizer

    h = hashlib.sha256(f"jetspec-weights-{WEIGHTS_FORMAT}".encode())
    for module in (assemble, gguf_file, gguf_tokenizer):
        with open(module.__file__, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def gguf_cache_key(path: str) -> str:
    """The file's identity (size, mtime, sha256 of its first and last MiB) and the loader's version."""
    stat = os.stat(path)
    h = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:{_loader_version()}".encode())
    with open(path, "rb") as f:
        h.update(f.read(_MIB))
        if stat.st_size > _MIB:
            f.seek(max(stat.st_size - _MIB, _MIB))
            h.update(f.read(_MIB))
    return h.hexdigest()[:24]


def _entry_prefix(folder: str, path: str) -> str:
    """Entries of one file path: its name (readable) and a hash of where it is (two model.gguf differ)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", os.path.basename(path).removesuffix(".gguf"))
    where = hashlib.sha256(os.path.realpath(path).encode()).hexdigest()[:8]
    return os.path.join(folder, f"{name}-{where}")


def _write_atomic(path: str, write, temp_suffix: str | None = None) -> None:
    """write(tmp_path) then rename: a reader never sees half an entry, and writers do not collide. The
    temporary file is .tmp-XXXXXXXX followed by temp_suffix (default: the entry's name)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    suffix = os.path.basename(path) if temp_suffix is None else temp_suffix
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-", suffix=suffix)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).view(np.uint8).reshape(-1))


def _text_crc(text: str) -> int:
    return zlib.crc32(text.encode())


def _config_from_json(data: dict[str, Any]):
    from jetspec_jax.models import qwen3

    def tuples(x):
        return tuple(tuples(v) for v in x) if isinstance(x, list) else x

    return qwen3.Config(**{k: tuples(v) for k, v in data.items()})


def save_weights(entry: str, cfg, params) -> None:
    from safetensors.numpy import save_file

    from jetspec_jax.models.params import path_to_str

    leaves, _ = jax.tree_util.tree_flatten_with_path(params)
    flat = {path_to_str(p): np.asarray(v) for p, v in leaves}
    config = json.dumps(dataclasses.asdict(cfg))
    # The config's scalars (eps, rope theta) change no tensor's shape: only a checksum shows their damage.
    meta = {"format": str(WEIGHTS_FORMAT), "config": config, "config_crc32": str(_text_crc(config)),
            "crc32": json.dumps({k: _crc(v) for k, v in flat.items()})}
    _write_atomic(entry, lambda tmp: save_file(flat, tmp, metadata=meta))


def read_weights(entry: str, dtype):
    """(cfg, params) from an entry, the config checked against its crc32 and every tensor against the
    config's specs and its own crc32; raises ValueError (or the reader's error) for a damaged entry."""
    import jax.numpy as jnp
    from safetensors import safe_open

    from jetspec_jax.models import qwen3
    from jetspec_jax.models.params import flatten_specs, unflatten_like

    with safe_open(entry, framework="np") as f:
        meta = f.metadata() or {}
        if meta.get("format") != str(WEIGHTS_FORMAT):
            raise ValueError(f"format {meta.get('format')!r}, expected {WEIGHTS_FORMAT}")
        if meta.get("config_crc32") != str(_text_crc(meta["config"])):
            raise ValueError("its config does not match its checksum")
        cfg = _config_from_json(json.loads(meta["config"]))
        crcs = json.loads(meta["crc32"])
        specs = qwen3.param_specs(cfg)
        want = flatten_specs(specs)
        if set(f.keys()) != set(want):
            raise ValueError(f"tensor names differ from the config's ({len(f.keys())} vs {len(want)})")
        flat = {}
        for name, spec in want.items():
            a = f.get_tensor(name)
            if a.shape != tuple(spec.shape) or a.dtype != jnp.dtype(dtype) or _crc(a) != crcs[name]:
                raise ValueError(f"tensor {name} is damaged (shape, dtype or checksum)")
            flat[name] = a
    return cfg, unflatten_like(specs, jax.device_put(flat))  # one transfer: 272 separate ones took 2 s


def _tokenizer_crc(tokenizer_json: dict[str, Any]) -> int:
    # Over the parsed content (keys sorted), so that whatever bytes decode to other text fail the check.
    return _text_crc(json.dumps(tokenizer_json, sort_keys=True))


def save_tokenizer(entry: str, tokenizer) -> None:
    """The built tokenizer (gguf_tokenizer.ChatTokenizer) as JSON, with a crc32 of its content."""
    content = tokenizer.to_json()
    payload = {"format": WEIGHTS_FORMAT, "crc32": _tokenizer_crc(content), "tokenizer": content}

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(payload, f)
    _write_atomic(entry, write)


def read_tokenizer(entry: str):
    """The tokenizer of an entry checked against its crc32 (a flipped bit in the chat template or the
    vocabulary still parses); raises ValueError (or the reader's error) for a damaged entry."""
    from jetspec_jax.loading.gguf_tokenizer import ChatTokenizer

    with open(entry) as f:
        payload = json.load(f)
    if payload.get("format") != WEIGHTS_FORMAT:
        raise ValueError(f"format {payload.get('format')!r}, expected {WEIGHTS_FORMAT}")
    content = payload.get("tokenizer")
    if not isinstance(content, dict) or payload.get("crc32") != _tokenizer_crc(content):
        raise ValueError("its content does not match its checksum")
    return ChatTokenizer.from_json(content)


def _cached(entry: str, read, what: str):
    """read(entry), or None when it is absent or damaged (warned: it is rebuilt)."""
    if not os.path.exists(entry):
        return None
    try:
        return read(entry)
    except FileNotFoundError:  # another process replaced it just now: absent, not damaged
        return None
    except Exception as e:  # any failure to read an entry means: load from the file instead
        warnings.warn(f"{what} cache entry {entry} is damaged ({type(e).__name__}: {e}); rebuilding it",
                      CacheWarning, stacklevel=3)
        return None


def _store(entry: str, save, what: str) -> None:
    """save(entry); a failure to write is a warning (the next start loads the file again)."""
    try:
        save(entry)
    except OSError as e:
        warnings.warn(f"could not write the {what} cache entry {entry} ({e}); the next start loads the file "
                      "again", CacheWarning, stacklevel=3)


ORPHAN_SECONDS = 3600  # a temporary file untouched this long was left by a killed writer, not a running one


def remove_stale_entries(prefix: str, key: str) -> None:
    """Removes this file path's entries under any other key (an older version of the file or of the
    loader: no run reads them again), of every dtype, and the temporary files of writers killed
    mid-write (untouched for ORPHAN_SECONDS). Entries of other paths, this key's entries of other
    dtypes and a running writer's temporary file stay."""
    folder, stem = os.path.split(prefix)
    name = re.escape(stem) + r"-([0-9a-f]{24})-(?:[a-z0-9]+\.safetensors|tokenizer\.json)"
    entry, temporary = re.compile(name), re.compile(r"\.tmp-[a-z0-9_]+" + name)

    def stale(file: str, path: str) -> bool:
        if found := entry.fullmatch(file):
            return found[1] != key
        return bool(temporary.fullmatch(file)) and _orphaned(path)
    _remove_files(folder, stale)


def remove_orphaned_temporaries(folder: str) -> None:
    """Removes the temporary files (.tmp-*) of writers killed mid-write, untouched for ORPHAN_SECONDS."""
    _remove_files(folder, lambda file, path: file.startswith(".tmp-") and _orphaned(path))


def _orphaned(path: str) -> bool:
    return time.time() - os.stat(path).st_mtime > ORPHAN_SECONDS


def _remove_files(folder: str, doomed) -> None:
    """Removes the files of `folder` for which doomed(name, path) is true."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for file in names:
        path = os.path.join(folder, file)
        try:
            if doomed(file, path):
                os.unlink(path)
        except OSError:  # removed by another process meanwhile, or not ours to remove
            pass


def load_gguf_target(path: str, dtype, with_tokenizer: bool = True, folder: str | None = None):
    """(cfg, params, tokenizer) of a GGUF file; through the weights cache in `folder` (default: the one
    configure() set), the same arrays bit for bit as a fresh load_gguf, without reading the file."""
    import jax.numpy as jnp

    from jetspec_jax.loading.gguf_file import load_gguf
    from jetspec_jax.loading.gguf_tokenizer import load_gguf_tokenizer

    folder = folder or _weights_dir
    if folder is None or not os.path.isfile(path):
        cfg, params = load_gguf(path, dtype)
        return cfg, params, load_gguf_tokenizer(path) if with_tokenizer else None
    prefix, key = _entry_prefix(folder, path), gguf_cache_key(path)
    weights_suffix, tokenizer_suffix = f"{jnp.dtype(dtype).name}.safetensors", "tokenizer.json"
    weights_entry, tokenizer_entry = f"{prefix}-{key}-{weights_suffix}", f"{prefix}-{key}-{tokenizer_suffix}"
    loaded = _cached(weights_entry, lambda e: read_weights(e, dtype), "weights")
    if loaded is None:
        loaded = load_gguf(path, dtype)
        _store(weights_entry, lambda e: save_weights(e, *loaded), "weights")
    tokenizer = None
    if with_tokenizer:
        tokenizer = _cached(tokenizer_entry, read_tokenizer, "tokenizer")
        if tokenizer is None:
            tokenizer = load_gguf_tokenizer(path)
            _store(tokenizer_entry, lambda e: save_tokenizer(e, tokenizer), "tokenizer")
    # On every load, not only after a write: an entry that a killed process or a concurrent writer of
    # another key left behind is otherwise never removed, as this key's entries are read from then on.
    remove_stale_entries(prefix, key)
    return (*loaded, tokenizer)
