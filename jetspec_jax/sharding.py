"""Logical axis names -> mesh axes, in one table; parameter shardings derived from ParamSpecs."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jetspec_jax.models import qwen3
from jetspec_jax.models.params import ParamSpec, map_specs

DATA_AXIS, MODEL_AXIS = "data", "model"
# Which mesh axis each logical axis is split over (None: replicated). Experts stay whole: their MLP
# axis is already split, and one mesh axis may appear once per array.
LOGICAL_TO_MESH = {
    "batch": DATA_AXIS,
    "vocab": None,
    "embed": None,
    "heads": MODEL_AXIS,
    "kv_heads": MODEL_AXIS,
    "head_dim": None,
    "mlp": MODEL_AXIS,
    "experts": None,
    "layers": None,
}


def make_mesh(model_parallel: int = 1, devices=None) -> Mesh:
    devices = np.asarray(jax.devices() if devices is None else devices)
    if devices.size % model_parallel:
        raise ValueError(f"{devices.size} devices cannot be split into model-parallel groups of {model_parallel}")
    return Mesh(devices.reshape(-1, model_parallel), (DATA_AXIS, MODEL_AXIS))


def partition_spec(spec: ParamSpec, mesh: Mesh) -> PartitionSpec:
    """Splits each dimension over its mesh axis when the size divides evenly, else replicates it."""
    out, used = [], set()
    for size, axis in zip(spec.shape, spec.axes):
        mesh_axis = LOGICAL_TO_MESH.get(axis) if axis else None
        if mesh_axis is not None and mesh_axis in used:
            raise ValueError(f"logical axes {spec.axes} map mesh axis {mesh_axis!r} twice")
        if mesh_axis is not None and size % mesh.shape[mesh_axis] == 0 and mesh.shape[mesh_axis] > 1:
            out.append(mesh_axis)
            used.add(mesh_axis)
        else:
            out.append(None)
    return PartitionSpec(*out)


def param_shardings(specs: Any, mesh: Mesh) -> Any:
    return map_specs(lambda s: NamedSharding(mesh, partition_spec(s, mesh)), specs)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS, *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_target(target, mesh: Mesh):
    """The target (target.Target, weights in the loaded layout) with its weights split over the mesh's
    model axis: tensor parallel over attention heads, KV heads and the MLP; what does not divide stays
    whole. Generation takes it as it is: jit partitions each program from the weights' layout."""
    specs = qwen3.param_specs(target.cfg)
    return dataclasses.replace(target, params=jax.device_put(target.params, param_shardings(specs, mesh)))
