"""The library's layers import downward only: the serving engine, the HTTP server and the server's command
line never load the generation command line (which sits on top of the engine), so the two cannot form an
import circle."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import jetspec_jax.serve


def test_the_server_never_imports_the_generation_command_line():
    modules = ["jetspec_jax.serve"] + [f"jetspec_jax.serve.{m.name}" for m in pkgutil.iter_modules(
        jetspec_jax.serve.__path__)]
    assert {"jetspec_jax.serve.engine", "jetspec_jax.serve.http_server", "jetspec_jax.serve.__main__"} <= set(modules)
    probe = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
             "print('jetspec_jax.generate' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-1] == "False"
