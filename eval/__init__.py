"""Evaluation harness: benchmarks, scoring, timed runs, reports. Entry: python -m jetspec_jax.eval."""
