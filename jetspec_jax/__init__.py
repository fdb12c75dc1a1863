"""jetspec_jax: JetSpec-style speculative decoding over Qwen3-family targets in JAX."""

from jetspec_jax.target import Target, load_target

__all__ = ["Target", "load_target"]
