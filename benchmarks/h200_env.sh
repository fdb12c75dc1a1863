# Sourced by the H200 session scripts (repo root, after the model is staged): the environment every
# step needs; `within COMMAND...`, which runs it with the time left until the script's $deadline
# (epoch seconds) if more than 10 s are left; `unpack_archived DIR FILE.jsonl.gz...`, which
# gunzips archived eval runs (with their .meta.json) into DIR unless already there, so the eval
# resumes them; and `install_carried_tokamax LOG`, which installs tokamax where its wheels were
# carried (benchmarks/stage_tokamax.sh), taking from them only what the GPU image lacks.
export JETSPEC_GGUF=${JETSPEC_GGUF:-/tmp/jetspec-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONPATH=/tmp/jetspec-site:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0.5
ln -sfn ../train jetspec_jax/train && ln -sfn ../kernels jetspec_jax/kernels && ln -sfn ../eval jetspec_jax/eval

within() { local l=$(( deadline - $(date +%s) )); [ "$l" -gt 10 ] && timeout "$l" "$@"; }

unpack_archived() {
  local dir=$1 archived name
  shift
  mkdir -p "$dir"
  for archived in "$@"; do
    name=$(basename "$archived" .gz)
    [ -f "$dir/$name" ] || { gunzip -c "$archived" > "$dir/$name" && cp "$archived.meta.json" "$dir/$name.meta.json"; }
  done
}

install_carried_tokamax() {  # python -m pip: the image's bare `pip` belongs to another interpreter
  [ -d .carry/tokamax ] || return 0
  { python -m pip install -q --no-index --no-deps .carry/tokamax/tokamax-*.whl &&
    python -m pip install -q --no-index --find-links .carry/tokamax "absl-py>=2.3.0" einshape "jaxtyping>=0.3" \
      "pydantic>=2.11.0" "qwix>=0.1.2" tqdm immutabledict tensorboardx && export PYTHONPATH=$PYTHONPATH:$PWD/.carry/tokamax/shim &&
    python -c "import tokamax"; } > "$1" 2>&1 || echo "tokamax did not install (see $1): timed without it"
}
