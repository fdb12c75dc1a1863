"""jetspec_jax: JetSpec-style speculative decoding over Qwen3-family targets in JAX.

    from jetspec_jax import generate, load_head, load_target
"""

# name -> the module that defines it
_EXPORTS = {"Target": "target", "load_target": "target", "generate": "api", "prepare_generate": "api",
            "GenerationResult": "api", "load_head": "loading.head_checkpoint"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    # Imported on first use, not with the package: `python -m jetspec_jax.serve` installs its signal
    # handlers before jax loads (a SIGINT during that import would otherwise be lost).
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"jetspec_jax.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'jetspec_jax' has no attribute {name!r}")
