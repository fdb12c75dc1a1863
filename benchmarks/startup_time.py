"""Wall time of a command in fresh processes: the first run with an empty cache folder, then runs with the
filled one (and optionally one with --no-cache as the baseline).

    python benchmarks/startup_time.py --runs 2 --baseline --out benchmarks/results/startup_time_cpu.json
    python benchmarks/startup_time.py -- python -m jetspec_jax.generate "Hi" --method ar

The default command is the README's main command. Each run gets JETSPEC_CACHE_DIR = one fresh temporary
folder (removed at the end). Compile, load and generation seconds come from the CLI's last stderr line;
`new_xla_entries` counts the programs a run compiled and wrote to the compilation cache (0 = every
program came from the cache).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402

MAIN_COMMAND = [sys.executable, "-m", "jetspec_jax.generate", "Give three tips for staying focused while studying."]
# The generate CLI's last stderr line: "[gpu] 48 tokens in 0.15 s = ... (compile 18.0 s, load 2.1 s, ..."
STATS = {"generate_s": r"tokens in ([\d.]+) s", "compile_s": r"compile ([\d.]+) s", "load_s": r"load ([\d.]+) s"}


def xla_entries(cache_dir: str) -> set[str]:
    folder = os.path.join(cache_dir, "xla")
    return {f for f in os.listdir(folder) if f.endswith("-cache")} if os.path.isdir(folder) else set()


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(folder) for f in files)


def run_once(command: list[str], cache_dir: str, kind: str, index: int) -> dict:
    before = xla_entries(cache_dir)
    env = dict(os.environ, JETSPEC_CACHE_DIR=cache_dir)
    t0 = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"run {index} ({kind}) failed with status {done.returncode}:\n{done.stderr[-4000:]}")
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    row = {"run": index, "kind": kind, "wall_s": round(wall, 3),
           "new_xla_entries": len(xla_entries(cache_dir) - before), "stdout": done.stdout, "last_stderr_line": last}
    for key, pattern in STATS.items():
        m = re.search(pattern, last)
        row[key] = float(m.group(1)) if m else None
    # what the start costs: the wall time less the generation itself
    row["wall_less_generate_s"] = round(wall - row["generate_s"], 3) if row["generate_s"] is not None else None
    row["load_avg_1m"] = os.getloadavg()[0]  # other work on the machine slows every phase
    print(f"run {index} ({kind}): {wall:.1f} s wall | {last}", flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=2, help="runs after the first, with the filled cache")
    p.add_argument("--baseline", action="store_true", help="also one run with --no-cache (generate/eval CLIs)")
    p.add_argument("--command", default=None, help="the command as one shell-quoted string (or give it after --)")
    p.add_argument("--out", default="benchmarks/results/startup_time.json")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...: the command to time")
    args = p.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    command = shlex.split(args.command) if args.command else argv or MAIN_COMMAND
    if command[0] == "python":  # this interpreter, as the default command uses
        command = [sys.executable] + command[1:]

    cache_dir = tempfile.mkdtemp(prefix="jetspec-startup-")
    rows = []
    try:
        rows.append(run_once(command, cache_dir, "first (empty cache)", 1))
        for i in range(args.runs):
            rows.append(run_once(command, cache_dir, "cached", i + 2))
        cache_bytes = {name: folder_bytes(os.path.join(cache_dir, name)) for name in ("xla", "weights")}
        if args.baseline:
            rows.append(run_once(command + ["--no-cache"], cache_dir, "--no-cache", len(rows) + 1))
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print_table(rows, ["run", "kind", "wall_s", "wall_less_generate_s", "compile_s", "load_s", "generate_s",
                       "new_xla_entries", "load_avg_1m"])
    cached = [r for r in rows if r["kind"] == "cached"]

    def median(key):
        values = [r[key] for r in cached if r[key] is not None]
        return statistics.median(values) if values else None
    summary = {"first_wall_s": rows[0]["wall_s"], "cached_wall_s_median": median("wall_s"),
               "first_wall_less_generate_s": rows[0]["wall_less_generate_s"],
               "cached_wall_less_generate_s_median": median("wall_less_generate_s"),
               "same_output_every_run": len({r["stdout"] for r in rows}) == 1, "cache_bytes": cache_bytes}
    print(summary)
    # environment() starts jax in this process: only after the runs, which had the device to themselves
    write_json_atomic(args.out, dict(benchmark="startup_time", timed_command=command, runs=rows, **summary,
                                     environment=environment()))


if __name__ == "__main__":
    main()
