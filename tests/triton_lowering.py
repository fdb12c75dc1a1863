"""Lower a Pallas GPU kernel for CUDA on a CPU machine and keep its Triton modules, so tests can run
MLIR's verifier on them: that catches what would only fail when a GPU compiles the kernel."""

from __future__ import annotations

import jax
import pytest


def lowered_triton_modules(monkeypatch, lower) -> list:
    """Runs lower() (a jit(...).trace(...).lower(lowering_platforms=("cuda",)) call) and returns the
    Triton modules the Pallas kernels in it were lowered to."""
    registration = pytest.importorskip("jax._src.pallas.triton.pallas_call_registration")
    modules = []
    original = registration.lowering.lower_jaxpr_to_triton_module

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        modules.append(result.module)
        return result

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", capture)
    with jax.default_matmul_precision("default"):  # as a user's run lowers, not under the tests' "highest"
        lower()
    assert modules, "no kernel was lowered through Triton"
    return modules


def tf32_dots(module) -> list[str]:
    """The module's dot lines that round fp32 inputs to TF32 (Triton's default for fp32 dots); a kernel
    that takes fp32 inputs must have none, or an fp32 run on the GPU is not computed in fp32."""
    return [line.strip() for line in str(module).splitlines() if "tt.dot" in line and "inputPrecision = tf32" in line]
