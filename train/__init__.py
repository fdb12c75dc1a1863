"""Draft-head training: target-regenerated data, grain pipeline, forward-KL distillation, sharded
optax trainer with orbax checkpoints. Entry point: `python -m jetspec_jax.train --config ...`."""
