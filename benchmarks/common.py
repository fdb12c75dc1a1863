"""Shared helpers for benchmark scripts: timing with the device clock, environment facts, atomic JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import jax


def time_call(fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 5) -> float:
    """Median seconds of fn() after warm-up; fn's result is waited on with block_until_ready."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment() -> dict[str, Any]:
    info = {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "platform": platform.platform(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    for name in ("flax", "transformers", "torch"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                            check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        # the device machine gets the tree without .git: the caller passes the commit in
        info["git_commit"] = os.environ.get("JETSPEC_COMMIT")
    return info


def write_json_atomic(path: str, payload: Any) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
