#!/usr/bin/env bash
# Downloads tokamax (its Pallas attention is one of tree_attention_bench.py's comparisons) and the
# packages it needs beyond jax into .carry/tokamax, as Python 3.12 wheels for the GPU image, which
# has neither and no network. Run here, from the repo root; h200_kernel_bench.sh installs them.
# tokamax 0.0.12: the newest on this index with code in it (0.1.0 here is an empty placeholder).
set -euo pipefail
dest=.carry/tokamax
mkdir -p "$dest"
for package in tokamax==0.0.12 einshape jaxtyping wadler-lindig pydantic pydantic-core annotated-types \
               typing-inspection typing-extensions qwix typeguard==2.13.3 immutabledict tensorboardx protobuf; do
  pip download -q --no-deps -d "$dest" --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 "$package"
done
ls "$dest"
