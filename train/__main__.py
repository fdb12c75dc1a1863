"""python -m jetspec_jax.train --config train/configs/<name>.toml [section.key=value ...]

Stages: `regenerate` (the frozen target answers the training prompts; shards + manifest on disk),
`train` (distil the draft head; resumes from the run's latest checkpoint), `all` (both, default)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax

from jetspec_jax.errors import OneLineErrorParser, run_command


def maybe_initialize_distributed() -> None:
    """Multi-host: started by a multi-process launcher, every process joins one JAX runtime."""
    launched = (os.environ.get("JAX_COORDINATOR_ADDRESS") or int(os.environ.get("SLURM_NTASKS", "1")) > 1
                or int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)
    if launched:
        jax.distributed.initialize()


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="python -m jetspec_jax.train", description=__doc__.split("\n\n")[1])
    p.add_argument("--config", required=True, help="a file in train/configs (name or path)")
    p.add_argument("--stage", choices=["all", "regenerate", "train"], default="all")
    p.add_argument("overrides", nargs="*", help="section.key=value, e.g. optim.total_steps=500")
    return p


def train_command(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from jetspec_jax import sharding
    from jetspec_jax.target import load_target

    from .config import load_config
    from .corpus import Corpus
    from .regenerate import load_regeneration_prompts, regenerate

    # Every setting and input file is checked before the target loads or anything is generated.
    cfg = load_config(args.config, args.overrides)
    regen_dir = os.path.join(cfg.run.out_dir, cfg.data.regen_dir) if not os.path.isabs(
        cfg.data.regen_dir) else cfg.data.regen_dir
    if args.stage in ("all", "regenerate"):
        prompts = load_regeneration_prompts(cfg.data.data_dir, cfg.data.sources, cfg.run.seed)
    corpus = Corpus(regen_dir) if args.stage == "train" else None
    maybe_initialize_distributed()
    mesh = None
    if args.stage in ("all", "train"):
        from .trainer import check_batch_size, train  # grain and orbax: the regenerate stage needs neither

        mesh = sharding.make_mesh(cfg.run.mesh_model)
        check_batch_size(cfg, mesh)
    target = load_target(cfg.run.target or None, dtype=cfg.run.compute_dtype)
    if args.stage in ("all", "regenerate"):
        manifest = regenerate(target, prompts, regen_dir, cfg.data, seed=cfg.run.seed, config_name=args.config)
        if not manifest["complete"]:
            print(f"regeneration stopped at data.regen_max_minutes with {manifest['num_answers']} answers in "
                  f"{regen_dir}; run the same command again to resume it", file=sys.stderr)
            return 0
    if args.stage in ("all", "train"):
        summary = train(cfg, target, Corpus(regen_dir) if corpus is None else corpus, mesh=mesh)
        print(json.dumps(summary, indent=2))
    return 0


def main(argv=None) -> int:
    """The CLI: bad input is one `error:` line and exit status 2."""
    return run_command(train_command, argv)


if __name__ == "__main__":
    sys.exit(main())
