"""Weight declarations: each parameter's shape, logical axes and init, declared once.

Model files describe their weights as a nested dict of `ParamSpec`; initialisation, loading
(shape checks) and, later, sharding are all derived from that one declaration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

# Logical axis names used by model declarations; a mesh rule table maps them to mesh axes.
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "experts", "layers")


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str = "normal"  # "normal" | "ones" | "zeros"

    def __post_init__(self):
        if len(self.shape) != len(self.axes):
            raise ValueError(f"ParamSpec shape {self.shape} and axes {self.axes} differ in rank")
        for axis in self.axes:
            if axis is not None and axis not in LOGICAL_AXES:
                raise ValueError(f"unknown logical axis {axis!r}; known: {LOGICAL_AXES}")


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def flatten_specs(specs: Any) -> dict[str, ParamSpec]:
    """{'layers/3/wq': spec, ...} in a stable order: the path syntax used by loaders and errors."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return {path_to_str(path): spec for path, spec in leaves}


def path_to_str(path) -> str:
    parts = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            parts.append(str(entry.key))
        elif isinstance(entry, jax.tree_util.SequenceKey):
            parts.append(str(entry.idx))
        else:
            parts.append(str(entry))
    return "/".join(parts)


def unflatten_like(specs: Any, flat: dict[str, Any]) -> Any:
    """Rebuilds the nested structure of `specs` from a flat {path: value} dict."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_to_str(p)] for p, _ in leaves])


def init_params(specs: Any, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Any:
    """Random weights for tests and fresh heads: normal(0, scale) matrices, ones/zeros vectors."""
    flat = flatten_specs(specs)
    keys = jax.random.split(key, len(flat))
    out = {}
    for k, (name, spec) in zip(keys, flat.items()):
        if spec.init == "ones":
            out[name] = jnp.ones(spec.shape, dtype)
        elif spec.init == "zeros":
            out[name] = jnp.zeros(spec.shape, dtype)
        else:
            out[name] = (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)
    return unflatten_like(specs, out)

