"""An fp32 run computes in fp32 on every backend: whatever jax's default matmul precision is, every dot
of fp32 operands in the whole AR and speculative programs (target, MoE experts, head, tree attention,
vocabulary projection) asks for full precision, every dot with a bf16 operand keeps the backend's fast
default, and the Triton kernels' fp32 dots are not TF32."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from conftest import make_tiny_checkpoint
from drafters import random_head
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from triton_lowering import lowered_triton_modules, tf32_dots

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.speculative import ATTENTION_OF_METHOD, SpecConfig, jitted_generate, speculative_cache_rows

OPERAND_TYPES = re.compile(r": \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\)")


def dots_by_operand_type(lowered) -> dict[str, set[str]]:
    """{"f32" or "mixed": the precision attributes of the program's dot_generals with those operands}."""
    found: dict[str, set[str]] = {"f32": set(), "mixed": set()}
    for line in lowered.as_text().splitlines():
        if "stablehlo.dot_general" not in line:
            continue
        types = OPERAND_TYPES.search(line).groups()
        attribute = re.search(r"precision = \[(\w+), \w+\]", line)
        found["f32" if types == ("f32", "f32") else "mixed"].add(attribute.group(1) if attribute else "none")
    return found


def cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def prompt_args(batch: int = 2, length: int = 8):
    return jnp.ones((batch, length), jnp.int32), jnp.full((batch,), length // 2, jnp.int32), jax.random.key(0)


@pytest.mark.parametrize("method", ["jetspec", "jetspec-tc"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_speculative_program_dots_take_their_operands_precision(tiny_qwen3, method, dtype):
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(1), attention=ATTENTION_OF_METHOD[method])
    spec, gen = SpecConfig(method, 16, 4), GenerationConfig(max_new_tokens=8)
    cache_len = 8 + gen.max_new_tokens + speculative_cache_rows(spec.budget, spec.depth(drafter.max_depth))
    with jax.default_matmul_precision("default"):  # the tests' global "highest" must not be what decides
        lowered = jitted_generate("xla").trace(cast(target.params, dtype), cast(head, dtype), *prompt_args(),
                                               cfg=target.cfg, drafter=drafter, spec=spec, gen=gen,
                                               cache_len=cache_len).lower()
    found = dots_by_operand_type(lowered)
    if dtype == jnp.float32:
        assert found == {"f32": {"HIGHEST"}, "mixed": set()}
    else:
        assert found["mixed"] == {"DEFAULT"} and found["f32"] <= {"HIGHEST"}


def test_moe_target_dots_are_full_precision_in_fp32(tmp_path):
    from jetspec_jax.target import load_target

    make_tiny_checkpoint("qwen3_moe", str(tmp_path))
    target = load_target(str(tmp_path), dtype="float32")
    with jax.default_matmul_precision("default"):
        lowered = generate_tokens.trace(target.params, *prompt_args(), cfg=target.cfg,
                                        gen=GenerationConfig(max_new_tokens=4), cache_len=16).lower()
    assert dots_by_operand_type(lowered) == {"f32": {"HIGHEST"}, "mixed": set()}


def test_tf32_check_sees_a_default_precision_triton_dot(monkeypatch):
    """The negative control of the kernels' lowering tests: Triton rounds an fp32 dot of default
    precision to TF32, and `tf32_dots` finds it."""
    def lowered_dot(precision):
        def kernel(a_ref, b_ref, o_ref):
            o_ref[...] = plgpu.dot(a_ref[...], b_ref[...], precision=precision)

        def dot(a, b):
            return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float32),
                                  compiler_params=plgpu.CompilerParams(num_warps=4))(a, b)

        operand = jax.ShapeDtypeStruct((16, 16), jnp.float32)
        return lowered_triton_modules(monkeypatch, lambda: jax.jit(dot).trace(operand, operand).lower(
            lowering_platforms=("cuda",)))[-1]

    assert len(tf32_dots(lowered_dot(None))) == 1
    assert tf32_dots(lowered_dot(lax.Precision.HIGHEST)) == []
