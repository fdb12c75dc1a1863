"""Builds a parameter pytree from a stream of named tensors and a rule table.

A rule maps a checkpoint key pattern to one of our parameter paths (optionally one row of a
stacked array, e.g. one expert) and a transform. Every problem (unknown key, wrong shape, missing
weight) is collected and raised once, so a bad checkpoint is diagnosed in one run.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable

import jax.numpy as jnp
import numpy as np

from jetspec_jax.models.params import ParamSpec, flatten_specs, unflatten_like

Transform = Callable[[np.ndarray], np.ndarray]


def identity(x: np.ndarray) -> np.ndarray:
    return x


def transpose(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.T)


def swap_last_two(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # regex over checkpoint keys, full match
    # Our path with {0},{1}.. from the regex groups; "path[{1}]" writes one row of a stacked
    # array. A tuple of targets splits one tensor: the transform then returns a tuple.
    target: str | tuple[str, ...]
    transform: Callable[[np.ndarray], Any] = identity


class CheckpointMismatch(ValueError):
    """Raised with every name/shape problem found in a checkpoint."""


MAX_LISTED = 30  # problems spelled out in one error; a wrong layer count alone gives hundreds


def assemble_params(specs: Any, tensors: Iterable[tuple[str, Callable[[], np.ndarray]]],
                    rules: list[Rule], dtype, source: str,
                    ignore: tuple[str, ...] = ()) -> Any:
    """tensors yields (key, loader) pairs; loaders are called only for keys that match a rule."""
    flat_specs: dict[str, ParamSpec] = flatten_specs(specs)
    compiled = [(re.compile(r.pattern), r) for r in rules]
    ignored = [re.compile(p) for p in ignore]
    store_dtype = np.dtype(dtype)  # convert while streaming: no full fp32 copy of a big model
    arrays: dict[str, np.ndarray] = {}
    rows_filled: dict[str, set[int]] = {}
    problems: list[str] = []
    for key, load in tensors:
        match = next(((m, r) for rx, r in compiled if (m := rx.fullmatch(key))), None)
        if match is None:
            if not any(rx.fullmatch(key) for rx in ignored):
                problems.append(f"unexpected tensor {key!r} (no rule maps it)")
            continue
        m, rule = match
        targets = (rule.target,) if isinstance(rule.target, str) else rule.target
        values = rule.transform(np.asarray(load()))
        values = (values,) if isinstance(rule.target, str) else values
        for target, value in zip(targets, values):
            problems.extend(_place(key, target.format(*m.groups()), np.asarray(value), flat_specs,
                                   arrays, rows_filled, store_dtype))
    for name, spec in flat_specs.items():
        if name not in arrays:
            problems.append(f"missing weight {name} {spec.shape}")
        elif name in rows_filled and len(rows_filled[name]) != spec.shape[0]:
            missing = sorted(set(range(spec.shape[0])) - rows_filled[name])
            problems.append(f"missing rows {missing[:8]}{'...' if len(missing) > 8 else ''} of {name}")
    if problems:
        shown = problems[:MAX_LISTED] + ([f"... and {len(problems) - MAX_LISTED} more"]
                                          if len(problems) > MAX_LISTED else [])
        raise CheckpointMismatch(f"{len(problems)} problem(s) loading {source}:\n  " + "\n  ".join(shown))
    return unflatten_like(specs, {k: jnp.asarray(v) for k, v in arrays.items()})


def _place(key: str, target: str, value: np.ndarray, flat_specs: dict[str, ParamSpec],
           arrays: dict[str, np.ndarray], rows_filled: dict[str, set[int]],
           store_dtype: np.dtype) -> list[str]:
    """Stores one tensor (or one row of a stacked array); returns the problems found."""
    row = None
    if target.endswith("]"):
        target, row_text = target[:-1].split("[")
        row = int(row_text)
    spec = flat_specs.get(target)
    if spec is None:
        return [f"tensor {key!r} maps to {target!r}, which this config does not have"]
    want = spec.shape if row is None else spec.shape[1:]
    if tuple(value.shape) != tuple(want):
        where = target if row is None else f"{target}[{row}]"
        return [f"tensor {key!r} -> {where}: shape {tuple(value.shape)}, expected {tuple(want)}"]
    if row is None:
        if target in arrays:
            return [f"tensor {key!r}: {target} given twice"]
        arrays[target] = value.astype(store_dtype)
        return []
    if row >= spec.shape[0]:
        return [f"tensor {key!r}: row {row} out of range for {target} {spec.shape}"]
    arrays.setdefault(target, np.zeros(spec.shape, store_dtype))[row] = value
    rows_filled.setdefault(target, set()).add(row)
    return []
