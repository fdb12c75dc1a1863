"""Where a result came from (hardware, versions, command, commit) and atomic JSON writes, shared by
benchmarks, training exports and evaluation reports."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax


def environment() -> dict[str, Any]:
    info = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "platform": platform.platform(),
        # orig_argv keeps "-m package" where argv[0] would be the module's file path
        "command": " ".join([os.path.basename(sys.executable)] + sys.orig_argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in ("flax", "transformers", "torch"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    info["git_commit"] = git_head()
    if os.environ.get("XLA_FLAGS"):  # they change what XLA compiles, so timings depend on them
        info["xla_flags"] = os.environ["XLA_FLAGS"]
    return info


def git_head() -> str | None:
    """HEAD of the checkout holding this package. A copy of the tree without its own git metadata
    (or with stale metadata) names its commit with JETSPEC_COMMIT instead."""
    if os.environ.get("JETSPEC_COMMIT"):
        return os.environ["JETSPEC_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_bytes_atomic(path: str, data: bytes) -> None:
    """Writes to a temporary file beside the target, then renames: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would leave results unreadable to anyone else
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def copy_atomic(source: str, destination: str) -> None:
    with open(source, "rb") as f:
        write_bytes_atomic(destination, f.read())


def write_json_atomic(path: str, payload: Any) -> None:
    write_bytes_atomic(path, (json.dumps(payload, indent=2) + "\n").encode("utf-8"))
