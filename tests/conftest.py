"""Shared fixtures: tiny random Hugging Face checkpoints (Qwen3, Qwen3-MoE, Llama) written to disk,
so every test goes through the real loader, and the embedded SmolLM2 model."""

from __future__ import annotations

import gc
import os

# Eight fake CPU devices for the sharding tests; set before jax starts. Unsharded code uses device 0.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Drops JAX's caches after each test file. Every compiled CPU program keeps memory mappings;
    without this the suite reached Linux's limit of 65,530 per process (vm.max_map_count) in the
    kernel tests, where XLA's compiler then segfaulted (63,593 mappings seen just before)."""
    yield
    jax.clear_caches()
    gc.collect()

TINY_COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                   initializer_range=0.15, rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_hf_config(kind: str):
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(intermediate_size=96, rope_theta=10000.0, **TINY_COMMON)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                                           num_experts_per_tok=2, norm_topk_prob=True,
                                           mlp_only_layers=[1], rope_theta=10000.0, **TINY_COMMON)
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=96, rope_theta=10000.0,
                                        **{**TINY_COMMON, "tie_word_embeddings": True})
    raise ValueError(kind)


def make_tiny_checkpoint(kind: str, path: str, seed: int = 0):
    """Writes a random tiny model with safetensors; returns the torch model (fp32, eval mode)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_hf_config(kind), dtype=torch.float32)
    with torch.no_grad():  # transformers' init leaves norms at 1; perturb them so they are tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session", params=["qwen3", "qwen3_moe", "llama"])
def tiny_checkpoint(request, tmp_path_factory):
    """(kind, path, torch model) for each supported architecture."""
    path = str(tmp_path_factory.mktemp(f"tiny-{request.param}"))
    model = make_tiny_checkpoint(request.param, path)
    return request.param, path, model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from jetspec_jax.target import load_target

    path = str(tmp_path_factory.mktemp("tiny-qwen3-target"))
    model = make_tiny_checkpoint("qwen3", path, seed=1)
    return load_target(path, dtype="float32"), model


@pytest.fixture(scope="session")
def embedded_target():
    from jetspec_jax.target import embedded_model_path, load_target

    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        if os.environ.get("CI"):  # CI installs the model; its absence there is a failure
            raise
        pytest.skip(str(e))
    return load_target(path, dtype="float32")
