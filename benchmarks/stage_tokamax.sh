#!/usr/bin/env bash
# Downloads tokamax (its Pallas attention is one of tree_attention_bench.py's comparisons) and the
# packages it needs beyond jax into .carry/tokamax, as Python 3.12 wheels for the GPU image, which
# has neither and no network. Run here, from the repo root; install_carried_tokamax (h200_env.sh)
# installs them there.
# tokamax 0.0.17: the newest release for jax >= 0.11.1 (0.0.12 calls Pallas APIs jax 0.11 removed;
# 0.1.0 on the index is an empty placeholder). Its top-level import pulls in xprof (a 32 MB profiler
# with cloud-storage dependencies) for its own benchmarking helpers, which the bench never calls:
# shim/ stands in for it and raises if anything does call it.
set -euo pipefail
dest=.carry/tokamax
rm -rf "$dest"
mkdir -p "$dest"
for package in tokamax==0.0.17 absl-py einshape jaxtyping wadler-lindig pydantic pydantic-core annotated-types \
               typing-inspection typing-extensions qwix typeguard==2.13.3 immutabledict tensorboardx protobuf tqdm; do
  pip download -q --no-deps -d "$dest" --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "$package"
done
mkdir -p "$dest/shim/xprof/cli"
touch "$dest/shim/xprof/__init__.py" "$dest/shim/xprof/cli/__init__.py"
cat > "$dest/shim/xprof/cli/tools.py" <<'PY'
"""Stands in for xprof, which tokamax imports for its own profiling helpers (not used by our bench)."""


def get_kernel_stats_tool(*args, **kwargs):
    raise NotImplementedError("xprof is not installed here; tokamax's profiling helpers are unavailable")
PY
ls "$dest"
