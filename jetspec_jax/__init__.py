"""jetspec_jax: JetSpec-style speculative decoding over Qwen3-family targets in JAX."""

__all__ = ["Target", "load_target"]


def __getattr__(name):
    # Imported on first use, not with the package: `python -m jetspec_jax.serve` installs its signal
    # handlers before jax loads (a SIGINT during that import would otherwise be lost).
    if name in __all__:
        from jetspec_jax import target

        return getattr(target, name)
    raise AttributeError(f"module 'jetspec_jax' has no attribute {name!r}")
