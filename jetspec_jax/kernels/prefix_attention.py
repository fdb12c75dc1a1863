"""Prefix attention: query row i of a sequence attends to that sequence's keys [0, limits[b, i]), with
gradients. The draft head's training pass is its main user: the K blocks of a row each read the context
before their own anchor, so a row's queries see prefixes of one key sequence of many lengths.

q (B, M, H, D), k/v (B, S, Hkv, D), limits (B, M) -> the output (B, M, H, D) in q's dtype and each row's
natural-log log-sum-exp (B, M, H) in fp32, so a caller can merge further keys (a block's own slots) by
their maxima and sums; a row that sees no key gives zeros and -inf. GQA: query head h reads kv head
h // (H / Hkv).

`prefix_attention` dispatches: on GPU the Pallas kernels here (Triton lowering; forward, dQ and dK/dV in
flash-attention style, the scores never leave the chip), the plain-jnp reference elsewhere. A program
takes one query head's block of rows and walks the keys only up to the largest limit among them, so rows
ordered by limit (anchors sorted along the sequence) skip the keys none of them sees; the dK/dV program of
a key block skips the row blocks that do not reach it. Dots run at the inputs' precision: full fp32 for
fp32 inputs, never TF32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret")
LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class PrefixAttentionTuning:
    block_q: int = 64  # query rows of one head per program (Triton dots need >= 16)
    block_k: int = 64  # keys per inner step
    num_warps: int = 4
    num_stages: int = 2


def prefix_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array,
                               limits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Plain jnp, scores and softmax in fp32: (out in q's dtype, lse fp32)."""
    b, m, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, m, hkv, h // hkv, d)
    scores = jnp.einsum("bmkgd,bskd->bkgms", qg, k, preferred_element_type=jnp.float32,
                        precision=lax.Precision.HIGHEST) / math.sqrt(d)
    visible = jnp.arange(s)[None, None, :] < limits[:, :, None]  # (B, M, S)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)  # (B, Hkv, G, M)
    probs = jnp.where(visible[:, None, None], jnp.exp(scores - jnp.where(lse == -jnp.inf, 0.0, lse)[..., None]), 0.0)
    out = jnp.einsum("bkgms,bskd->bmkgd", probs.astype(v.dtype) if v.dtype != jnp.float32 else probs, v,
                     preferred_element_type=jnp.float32, precision=lax.Precision.HIGHEST)
    return out.reshape(b, m, h, d).astype(q.dtype), lse.transpose(0, 3, 1, 2).reshape(b, m, h)


def _dot(a, b, *, trans_a=False, trans_b=False):
    # HIGHEST: fp32 inputs multiply in fp32 (Triton's "ieee"), bf16 ones as they are
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=lax.Precision.HIGHEST)


def _key_steps(limits_tile: jax.Array, block_k: int) -> jax.Array:
    """Key blocks a row block reads: up to its largest limit."""
    return (jnp.max(limits_tile) + block_k - 1) // block_k


def _forward_kernel(limits_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, block_k: int, scale: float):
    """Grid (batch, query head, row block). Online softmax in base 2 (`scale` includes log2(e))."""
    block_q, d = q_ref.shape
    limits = limits_ref[...]
    q = q_ref[...]

    def step(i, carry):
        acc, m_prev, l_prev = carry
        start = i * block_k
        s = _dot(q, k_ref[pl.ds(start, block_k), :], trans_b=True) * scale
        visible = start + jnp.arange(block_k)[None, :] < limits[:, None]
        s = jnp.where(visible, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # a row with nothing seen yet stays at zero
        correction = jnp.exp2(m_prev - m_safe)
        p = jnp.exp2(s - m_safe[:, None])
        acc = acc * correction[:, None] + _dot(p.astype(v_ref.dtype), v_ref[pl.ds(start, block_k), :])
        return acc, m_next, l_prev * correction + jnp.sum(p, axis=1)

    init = (jnp.zeros((block_q, d), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(0, _key_steps(limits, block_k), step, init)
    o_ref[...] = (acc / jnp.where(l == 0, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(jnp.where(l == 0, 1.0, l))) / LOG2E)


def _probabilities(q, k, limits, lse, start: int | jax.Array, block_k: int, scale: float):
    """A tile's softmax probabilities, recomputed from the forward pass's lse: (rows, keys) fp32."""
    s = _dot(q, k, trans_b=True) * scale
    visible = start + jnp.arange(block_k)[None, :] < limits[:, None]
    return jnp.where(visible, jnp.exp2(s - jnp.where(lse == -jnp.inf, 0.0, lse * LOG2E)[:, None]), 0.0)


def _dq_kernel(limits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, block_k: int,
               scale: float, sm_scale: float):
    """Grid (batch, query head, row block): dQ = sum over keys of dS K, dS = P (dP - delta)."""
    block_q, d = q_ref.shape
    limits, q, do = limits_ref[...], q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def step(i, dq):
        start = i * block_k
        k, v = k_ref[pl.ds(start, block_k), :], v_ref[pl.ds(start, block_k), :]
        p = _probabilities(q, k, limits, lse, start, block_k, scale)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, _key_steps(limits, block_k), step, jnp.zeros((block_q, d), jnp.float32))
    dq_ref[...] = (dq * sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(limits_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, block_q: int,
                scale: float, sm_scale: float):
    """Grid (batch, query head, key block): this head's share of dK and dV over the row blocks that reach
    the key block (the rest are skipped)."""
    block_k, d = k_ref.shape
    start = pl.program_id(2) * block_k
    k, v = k_ref[...], v_ref[...]

    def step(i, carry):
        rows = pl.ds(i * block_q, block_q)
        limits = limits_ref[rows]

        def attend(carry):
            dk, dv = carry
            q, do = q_ref[rows, :], do_ref[rows, :]
            p = _probabilities(q, k, limits, lse_ref[rows], start, block_k, scale)
            dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
            ds = p * (_dot(do, v, trans_b=True) - delta_ref[rows][:, None])
            return dk + _dot(ds.astype(q.dtype), q, trans_a=True), dv

        return lax.cond(jnp.max(limits) > start, attend, lambda c: c, carry)

    init = (jnp.zeros((block_k, d), jnp.float32), jnp.zeros((block_k, d), jnp.float32))
    dk, dv = lax.fori_loop(0, q_ref.shape[0] // block_q, step, init)
    dk_ref[...] = dk * sm_scale
    dv_ref[...] = dv


def _padded(q, k, v, limits, tuning: PrefixAttentionTuning):
    """Rows padded to whole row blocks (limit 0: they see nothing) and keys to whole key blocks."""
    m, s = q.shape[1], k.shape[1]
    pad_m, pad_s = -m % tuning.block_q, -s % tuning.block_k
    if pad_m:
        q = jnp.pad(q, ((0, 0), (0, pad_m), (0, 0), (0, 0)))
        limits = jnp.pad(limits, ((0, 0), (0, pad_m)))
    if pad_s:
        k = jnp.pad(k, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad_s), (0, 0), (0, 0)))
    return q, k, v, jnp.minimum(limits.astype(jnp.int32), s)


def prefix_attention_supported(head_dim: int) -> bool:
    """Whether the kernels take this head dim (Triton tiles are powers of two, dots at least 16 wide)."""
    return head_dim >= 16 and not head_dim & (head_dim - 1)


def _check(q, k, v, limits, tuning: PrefixAttentionTuning) -> None:
    b, m, h, d = q.shape
    problems = []
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        problems.append(f"k {k.shape} and v {v.shape} must be (B={b}, S, Hkv, D={d})")
    elif h % k.shape[2]:
        problems.append(f"query heads {h} are not a multiple of kv heads {k.shape[2]}")
    if limits.shape != (b, m):
        problems.append(f"limits {limits.shape} must be (B, M) = {(b, m)}")
    if not prefix_attention_supported(d):
        problems.append(f"head dim {d} must be a power of two >= 16 for the kernel")
    if problems:
        raise ValueError("prefix_attention: " + "; ".join(problems))


def _specs(tuning: PrefixAttentionTuning, s: int, m: int, d: int, group: int):
    row_block = lambda b, h, i: (b, i, h, 0)  # noqa: E731
    return dict(
        limits=pl.BlockSpec((None, tuning.block_q), lambda b, h, i: (b, i)),
        q=pl.BlockSpec((None, tuning.block_q, None, d), row_block),
        kv=pl.BlockSpec((None, s, None, d), lambda b, h, i: (b, 0, h // group, 0)),
        lse=pl.BlockSpec((None, tuning.block_q, None), lambda b, h, i: (b, i, h)),
        all_limits=pl.BlockSpec((None, m), lambda b, h, j: (b, 0)),
        all_rows=pl.BlockSpec((None, m, None, d), lambda b, h, j: (b, 0, h, 0)),
        all_lse=pl.BlockSpec((None, m, None), lambda b, h, j: (b, 0, h)),
        key_block=pl.BlockSpec((None, tuning.block_k, None, d), lambda b, h, j: (b, j, h // group, 0)),
        key_block_of_head=pl.BlockSpec((None, tuning.block_k, None, d), lambda b, h, j: (b, j, h, 0)),
    )


def _forward(q, k, v, limits, tuning: PrefixAttentionTuning, interpret: bool):
    b, m, h, d = q.shape
    s, group = k.shape[1], h // k.shape[2]
    specs = _specs(tuning, s, m, d, group)
    kernel = functools.partial(_forward_kernel, block_k=tuning.block_k, scale=LOG2E / math.sqrt(d))
    return pl.pallas_call(
        kernel, grid=(b, h, m // tuning.block_q),
        in_specs=[specs["limits"], specs["q"], specs["kv"], specs["kv"]],
        out_specs=[specs["q"], specs["lse"]],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, m, h), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret, name="prefix_attention_forward",
    )(limits, q, k, v)


def _backward(q, k, v, limits, out, lse, d_out, d_lse, tuning: PrefixAttentionTuning, interpret: bool):
    b, m, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    group = h // hkv
    specs = _specs(tuning, s, m, d, group)
    # d(out)/d(scores) gives P (dP - sum(out * d_out)); d(lse)/d(scores) gives P d_lse: one term
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1) - d_lse  # (B, M, H)
    delta = jnp.where(lse == -jnp.inf, 0.0, delta)
    d_out = d_out.astype(q.dtype)
    params = plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    scale, sm_scale = LOG2E / math.sqrt(d), 1.0 / math.sqrt(d)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=tuning.block_k, scale=scale, sm_scale=sm_scale),
        grid=(b, h, m // tuning.block_q),
        in_specs=[specs["limits"], specs["q"], specs["kv"], specs["kv"], specs["q"], specs["lse"], specs["lse"]],
        out_specs=specs["q"], out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params, interpret=interpret, name="prefix_attention_dq",
    )(limits, q, k, v, d_out, lse, delta)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, block_q=tuning.block_q, scale=scale, sm_scale=sm_scale),
        grid=(b, h, s // tuning.block_k),
        in_specs=[specs["all_limits"], specs["all_rows"], specs["key_block"], specs["key_block"],
                  specs["all_rows"], specs["all_lse"], specs["all_lse"]],
        out_specs=[specs["key_block_of_head"], specs["key_block_of_head"]],
        out_shape=[jax.ShapeDtypeStruct((b, s, h, d), jnp.float32)] * 2,
        compiler_params=params, interpret=interpret, name="prefix_attention_dkv",
    )(limits, q, k, v, d_out, lse, delta)
    per_kv_head = lambda x: x.reshape(b, s, hkv, group, d).sum(axis=3)  # noqa: E731  (each head's share)
    return dq, per_kv_head(dk).astype(k.dtype), per_kv_head(dv).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _prefix_attention_kernel(q, k, v, limits, tuning, interpret):
    return _forward(q, k, v, limits, tuning, interpret)


def _kernel_fwd(q, k, v, limits, tuning, interpret):
    out, lse = _forward(q, k, v, limits, tuning, interpret)
    return (out, lse), (q, k, v, limits, out, lse)


def _kernel_bwd(tuning, interpret, residuals, cotangents):
    q, k, v, limits, out, lse = residuals
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(q, k, v, limits, out, lse, d_out, d_lse, tuning, interpret)
    return dq, dk, dv, None


_prefix_attention_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def default_implementation() -> str:
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def prefix_attention(q: jax.Array, k: jax.Array, v: jax.Array, limits: jax.Array, *, implementation: str = "auto",
                     tuning: PrefixAttentionTuning = PrefixAttentionTuning()) -> tuple[jax.Array, jax.Array]:
    """(out (B, M, H, D) in q's dtype, lse (B, M, H) fp32); differentiable in q, k and v.
    implementation: "auto" (the kernels on GPU, the reference elsewhere), "xla" (the reference),
    "pallas", "pallas_interpret" (the kernels' semantics on any backend, slowly)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"prefix_attention implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    if implementation == "auto":
        implementation = default_implementation()
    if implementation == "xla":
        return prefix_attention_reference(q, k, v, limits)
    _check(q, k, v, limits, tuning)
    m = q.shape[1]
    out, lse = _prefix_attention_kernel(*_padded(q, k, v, limits, tuning), tuning,
                                        implementation == "pallas_interpret")
    return out[:, :m], lse[:, :m]
