"""Distillation losses for the draft head, in fp32: forward KL (JetSpec), hard-label CE (DFlash/DDTree,
SFT ablation) and reverse KL (ablation), with DFlash-style per-depth weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def depth_weights(num_depths: int, gamma: float) -> jax.Array:
    """w_k = exp(-(k-1)/gamma) for depth k = 1..D; gamma = 0 means uniform."""
    k = jnp.arange(num_depths, dtype=jnp.float32)
    return jnp.ones_like(k) if gamma == 0 else jnp.exp(-k / gamma)


def per_position_loss(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array, kind: str,
                      temperature: float) -> jax.Array:
    """(..., V) logits -> (...) loss per position."""
    s = student_logits.astype(jnp.float32)
    if kind == "ce":
        logq = jax.nn.log_softmax(s, axis=-1)
        return -jnp.take_along_axis(logq, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logq = jax.nn.log_softmax(s / temperature, axis=-1)
    logp = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    if kind == "fkl":
        kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    elif kind == "rkl":
        kl = jnp.sum(jnp.exp(logq) * (logq - logp), axis=-1)
    else:
        raise ValueError(f"unknown loss kind {kind!r}; use fkl, ce or rkl")
    return kl * temperature**2


def draft_loss(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array, valid: jax.Array, *,
               kind: str = "fkl", temperature: float = 1.0, gamma: float = 0.0) -> jax.Array:
    """Weighted mean over valid positions. Logits (..., D, V), labels/valid (..., D), depth on axis -1
    of labels: L = sum_m w_m L_m / sum_m w_m over non-anchor, non-padding positions."""
    with jax.named_scope("loss"):
        losses = per_position_loss(student_logits, teacher_logits, labels, kind, temperature)
        weights = depth_weights(labels.shape[-1], gamma) * valid.astype(jnp.float32)
        return jnp.sum(weights * losses) / jnp.maximum(jnp.sum(weights), 1e-9)


def acceptance_stats(student_logits: jax.Array, teacher_logits: jax.Array, valid: jax.Array):
    """Per depth: fraction of valid blocks where draft top-1 == target greedy; and the chain's expected
    tau: 1 + mean number of leading depths that all match (teacher-forced along the sequence)."""
    match = (jnp.argmax(student_logits, -1) == jnp.argmax(teacher_logits, -1)) & valid
    per_depth = jnp.sum(match, axis=tuple(range(match.ndim - 1))) / jnp.maximum(
        jnp.sum(valid, axis=tuple(range(valid.ndim - 1))), 1)
    block_valid = valid[..., 0]
    leading = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)
    expected_tau = 1.0 + jnp.sum(jnp.where(block_valid, leading, 0)) / jnp.maximum(jnp.sum(block_valid), 1)
    return per_depth, expected_tau


def per_row_stats(student_logits: jax.Array, teacher_logits: jax.Array, labels: jax.Array, valid: jax.Array, *,
                  kind: str = "fkl", temperature: float = 1.0, gamma: float = 0.0) -> dict[str, jax.Array]:
    """Per sequence (logits (B, K, D, V)): the sums that `draft_loss` and `acceptance_stats` divide, so
    any set of rows (a kind of prompt, all of them) pools exactly (`pooled_stats`)."""
    losses = per_position_loss(student_logits, teacher_logits, labels, kind, temperature)
    weights = depth_weights(labels.shape[-1], gamma) * valid.astype(jnp.float32)
    match = (jnp.argmax(student_logits, -1) == jnp.argmax(teacher_logits, -1)) & valid
    leading = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=-1), axis=-1)  # (B, K)
    return {"loss_sum": jnp.sum(weights * losses, axis=(1, 2)), "weight_sum": jnp.sum(weights, axis=(1, 2)),
            "match": jnp.sum(match, axis=1), "valid": jnp.sum(valid, axis=1),
            "leading": jnp.sum(jnp.where(valid[..., 0], leading, 0), axis=1), "blocks": jnp.sum(valid[..., 0], axis=1)}


def pooled_stats(stats: dict[str, np.ndarray], rows: np.ndarray) -> dict:
    """Loss, expected chain tau and per-depth acceptance over the selected rows of `per_row_stats`."""
    pick = {k: np.asarray(v)[rows] for k, v in stats.items()}
    return {"loss": float(pick["loss_sum"].sum() / max(pick["weight_sum"].sum(), 1e-9)),
            "expected_tau": float(1 + pick["leading"].sum() / max(pick["blocks"].sum(), 1)),
            "accept_per_depth": [round(float(x), 4)
                                 for x in pick["match"].sum(0) / np.maximum(pick["valid"].sum(0), 1)],
            "anchors": int(pick["blocks"].sum())}
