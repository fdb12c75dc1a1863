"""Where a draft-head training step's time goes on the GPU: one step of each length bucket profiled, every
kernel attributed to the part of the step that launched it (the teacher, each head's block and tree-causal
passes and their parts, forward or backward, the optimizer) through the named scopes in its HLO metadata.

    python benchmarks/train_step_profile.py --target random \
        --out benchmarks/results/train_step_profile_h200.json

The shipped heads' configuration (the general pair, 3 layers, the tree-causal loss; overrides go after it)
on a synthetic corpus shaped like the mixture (train_throughput.py's), random weights unless `--target
config`. Per bucket: `--steps` steps timed on the wall after a compiling one, then one step profiled: the
GPU's busy time and, per part, milliseconds and share; the fusions taking the most time. Parts are named by
the scopes the trainer and the head open (`teacher`, `jetspec` / `ddtree`, `block_pass` / `tree_pass`,
`lm_head`, `loss`, `block_attention`, ...); `bwd` marks the backward pass (a transpose in the op's name).
XLA's command buffers (CUDA graphs) are turned off, since a kernel inside one is reported as the buffer;
`--command-buffers` keeps them (the trainer's own setting: step times as training sees them, no per-part
table).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile
import time

if "--command-buffers" not in sys.argv:  # before jax reads its flags
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, print_table, write_json_atomic  # noqa: E402
from train_throughput import PAIR, SHAPES, build_target, synthetic_corpus  # noqa: E402

from jetspec_jax import sharding  # noqa: E402
from jetspec_jax.train.config import load_config  # noqa: E402
from jetspec_jax.train.data import training_stream  # noqa: E402
from jetspec_jax.train.trainer import Trainer, check_batch_size  # noqa: E402

SHIPPED = [*PAIR, "head.num_layers=3", "loss.tree_causal_weight=1.0"]
# Scopes opened by train/trainer.py, train/loss.py and models/draft_head.py, outermost first.
HEADS = ("jetspec", "ddtree")
PASSES = ("teacher", "block_pass", "tree_pass", "optimizer")
PARTS = ("fuse_taps", "context_kv", "qkv", "block_attention", "out_mlp", "lm_head", "loss")
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"")


def op_names(hlo_text: str) -> dict[str, str]:
    """Instruction name -> the jax op name in its metadata, over every computation of a compiled module."""
    out = {}
    for line in hlo_text.splitlines():
        m = INSTRUCTION.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def part_of(op_name: str) -> str:
    """'jetspec/tree_pass/lm_head/bwd' from an op name's scopes; 'other' where it names none."""
    scopes = set(re.split(r"[/()]", op_name))
    head = next((h for h in HEADS if h in scopes), None)
    stage = next((p for p in PASSES if p in scopes), None)
    part = next((p for p in PARTS if p in scopes), None)
    names = [n for n in (head, stage, part) if n]
    if not names:
        return "other"
    return "/".join(names) + ("/bwd" if "transpose" in op_name else "")


def profiled_kernels(fn) -> list[tuple[str, str, int]] | None:
    """(kernel, hlo instruction, duration ns) of every GPU kernel one fn() ran; None without a GPU plane."""
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(fn())
        files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            return None
        profile = jax.profiler.ProfileData.from_file(files[0])
    events = []
    for plane in profile.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                stats = dict(e.stats)
                events.append((e.name, str(stats.get("hlo_op", e.name)), int(e.duration_ns)))
    return events or None


def profile_bucket(trainer: Trainer, state, batches: list[dict], top: int) -> tuple[dict, object]:
    step, static = trainer.step_function()
    with jax.set_mesh(trainer.mesh):
        placed = [trainer.place_batch(b) for b in batches]
        t0 = time.perf_counter()
        compiled = step.lower(state, trainer.target_params, placed[0], **static).compile()
        compile_s = time.perf_counter() - t0
        names = op_names(compiled.as_text())
        state, metrics = compiled(state, trainer.target_params, placed[0])
        jax.block_until_ready((state, metrics))
        t0 = time.perf_counter()
        for batch in placed:
            state, metrics = compiled(state, trainer.target_params, batch)
        jax.block_until_ready((state, metrics))
        wall_ms = 1e3 * (time.perf_counter() - t0) / len(placed)
        holder = {"state": state}

        def one_step():
            holder["state"], out = compiled(holder["state"], trainer.target_params, placed[0])
            return out

        events = profiled_kernels(one_step)
    tokens = batches[0]["tokens"]
    row = {"bucket": tokens.shape[1], "rows": tokens.shape[0], "step_ms": wall_ms, "compile_s": compile_s,
           "real_tokens": int(sum(b["length"].sum() for b in batches) / len(batches))}
    if events is None:
        return row, holder["state"]
    busy = collections.Counter()
    by_fusion = collections.Counter()
    for _, instruction, ns in events:
        busy[part_of(names.get(instruction, ""))] += ns / 1e6
        by_fusion[(instruction, part_of(names.get(instruction, "")))] += ns / 1e6
    total = sum(busy.values())
    row.update(gpu_busy_ms=total, kernels=len(events),
               parts={k: {"ms": v, "share": v / total} for k, v in busy.most_common()},
               top_fusions=[{"instruction": k, "part": p, "ms": v} for (k, p), v in by_fusion.most_common(top)])
    return row, holder["state"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="smollm2-135m-general-jetspec", help="a file in train/configs (name or path)")
    p.add_argument("--target", choices=["config", *SHAPES], default="config",
                   help="the config's target, or a shape with random weights (the same cost): random (SmolLM2-135M), "
                        "qwen3-8b-shaped")
    p.add_argument("--buckets", type=int, nargs="*", default=None, help="bucket lengths to profile (default: all)")
    p.add_argument("--prompts", type=int, default=2000, help="synthetic corpus: prompts")
    p.add_argument("--steps", type=int, default=5, help="timed steps per bucket")
    p.add_argument("--top", type=int, default=15, help="fusions listed per bucket")
    p.add_argument("--command-buffers", action="store_true", help="keep XLA's command buffers (no per-part table)")
    p.add_argument("--out", default="benchmarks/results/train_step_profile.json")
    p.add_argument("overrides", nargs="*", help="section.key=value after the shipped heads' settings (the pair, "
                                                "3 layers, the tree-causal loss), e.g. run.attention=xla")
    args = p.parse_args()
    overrides = [*SHIPPED, *args.overrides]
    cfg = load_config(args.config, overrides)
    target = build_target(args.target, cfg)
    mesh = sharding.make_mesh(cfg.run.mesh_model)
    check_batch_size(cfg, mesh)
    payload = dict(benchmark="train_step_profile", config=args.config, overrides=overrides, target=target.source,
                   xla_flags=os.environ.get("XLA_FLAGS", ""), rows=[], environment=environment())
    with tempfile.TemporaryDirectory() as tmp:
        corpus = synthetic_corpus(tmp, prompts=args.prompts, answers_per_prompt=len(cfg.data.answer_temperatures),
                                  max_prompt_tokens=cfg.data.max_prompt_tokens,
                                  max_new_tokens=cfg.data.max_new_tokens, vocab_size=target.cfg.vocab_size)
        buckets = [b for b in cfg.buckets() if args.buckets is None or b.length in args.buckets]
        stream = training_stream(corpus.answers("train"), cfg.buckets(), mixture=cfg.data.mixture, seed=0)
        wanted = {b.length: [] for b in buckets}
        for i in range(len(stream.indices)):
            length = cfg.buckets()[stream.indices[i][0]].length
            if length in wanted and len(wanted[length]) < args.steps:
                wanted[length].append(stream.dataset[i])
            if all(len(v) == args.steps for v in wanted.values()):
                break
        trainer = Trainer(cfg, target, mesh)
        state = trainer.init_state(0)
        for bucket in buckets:
            if not wanted[bucket.length]:
                continue
            row, state = profile_bucket(trainer, state, wanted[bucket.length], args.top)
            payload["rows"].append(row)
            print(row, flush=True)
            write_json_atomic(args.out, payload)
    for r in payload["rows"]:
        print(f"\nbucket {r['bucket']}: {r['step_ms']:.1f} ms a step")
        print_table([{"part": k, **v} for k, v in r.get("parts", {}).items()], ["part", "ms", "share"])
    write_json_atomic(args.out, payload)


if __name__ == "__main__":
    main()
