"""Runs untrusted Python (model-written code plus its tests) in a child `python -I` with a timeout, a
fresh temporary directory, only PATH in its environment, resource limits and sockets disabled."""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import tempfile

PROGRAM_FILE = "program.py"
MEMORY_LIMIT_BYTES = 4 << 30
OUTPUT_LIMIT_BYTES = 16 << 20  # a program printing in a loop is killed rather than filling the disk

# Runs in the child before the program: limits, no sockets, then the program under a non-main name (so
# `if __name__ == "__main__":` demos, often with input(), stay off), then a nonce proving it finished.
BOOTSTRAP = """\
import resource, socket, sys
for _limit, _value in ((resource.RLIMIT_AS, {memory}), (resource.RLIMIT_FSIZE, {output})):
    try:
        resource.setrlimit(_limit, (_value, _value))
    except (ValueError, OSError):
        pass
def _no_network(*args, **kwargs):
    raise PermissionError("network access is disabled in the evaluation sandbox")
class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        _no_network()
socket.socket = socket.SocketType = _NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
              "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(socket, _name, _no_network)
import _socket
_socket.socket = _socket.SocketType = _NoSocket
with open({program!r}, encoding="utf-8") as _f:
    _source = _f.read()
exec(compile(_source, {program!r}, "exec"), {{"__name__": "__solution__", "__builtins__": __builtins__}})
sys.stdout.flush()
print({nonce!r}, flush=True)
"""


@dataclasses.dataclass(frozen=True)
class ExecutionResult:
    passed: bool
    status: str  # "passed", "failed" or "timeout"
    detail: str  # the tail of stderr for failures


def run_program(source: str, timeout: float = 10.0) -> ExecutionResult:
    """Passes when the whole program runs to its end (exit 0 and the bootstrap's closing nonce)."""
    nonce = f"sandbox-finished-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="jetspec-eval-") as workdir:
        with open(os.path.join(workdir, PROGRAM_FILE), "w", encoding="utf-8") as f:
            f.write(source)
        bootstrap = BOOTSTRAP.format(memory=MEMORY_LIMIT_BYTES, output=OUTPUT_LIMIT_BYTES,
                                     program=PROGRAM_FILE, nonce=nonce)
        stdout_path, stderr_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            # its own session, so a timeout kills whatever the program forked too
            proc = subprocess.Popen([sys.executable, "-I", "-c", bootstrap], cwd=workdir,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    env={"PATH": os.environ.get("PATH", "")}, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:
                kill_session(proc)  # also anything it left running in the background
        if returncode is None:
            return ExecutionResult(False, "timeout", f"no result within {timeout:g} s")
        stdout_tail, stderr_tail = read_tail(stdout_path), read_tail(stderr_path)
    finished = returncode == 0 and stdout_tail.rstrip().endswith(nonce)
    return ExecutionResult(finished, "passed" if finished else "failed",
                           "" if finished else stderr_tail or f"exit code {returncode}")


def kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def read_tail(path: str, size: int = 2000) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.path.getsize(path) - size))
        return f.read().decode("utf-8", errors="replace")
