"""The precision of every matmul the models and kernels run, decided here from the operands' dtype: a
dot of fp32 operands computes in full fp32 (a GPU's default TF32 keeps 10 mantissa bits, so an fp32
exactness check would mean less there than on the CPU); other dtypes keep the backend's fast default."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def dot_precision(*operands: jax.Array) -> lax.Precision | None:
    """HIGHEST when every operand is fp32, else None (jax's default matmul precision)."""
    return lax.Precision.HIGHEST if all(jnp.dtype(x.dtype) == jnp.float32 for x in operands) else None


def run_matmul_precision(dtype: str) -> str:
    """The precision a run's dots compute at, as results record it: "highest" for float32, else "default"."""
    return "highest" if jnp.dtype(dtype) == jnp.float32 else "default"


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.matmul(x, w, precision=dot_precision(x, w))


def einsum(subscripts: str, *operands: jax.Array, **kwargs) -> jax.Array:
    return jnp.einsum(subscripts, *operands, precision=dot_precision(*operands), **kwargs)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return lax.ragged_dot(lhs, rhs, group_sizes, precision=dot_precision(lhs, rhs))
