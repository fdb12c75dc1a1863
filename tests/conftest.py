"""Shared fixtures: tiny random Hugging Face checkpoints (Qwen3, Qwen3-MoE, Llama) written to disk,
so every test goes through the real loader, and the embedded SmolLM2 model."""

from __future__ import annotations

import gc
import os

# Eight fake CPU devices for the sharding tests; set before jax starts. Unsharded code uses device 0.
# LLVM's optimisation level 0: the tests' programs are many and small, and compiling them is much of the
# suite's time (docs/tests.md). Results differ from the default build's in rounding alone, as on another
# CPU; every comparison a test makes is between programs built alike, or to a tolerance.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
# Each test worker takes its share of the cores for torch (the transformers comparisons): its OpenMP
# threads spin while they wait, so a thread a core in every worker oversubscribes them (docs/tests.md).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # in a worker (the main process would pass its value on)
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

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

@pytest.fixture(scope="session")
def session_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jetspec-cache"))


@pytest.fixture(autouse=True)
def isolated_cache_dir(session_cache_dir, monkeypatch):
    """Command lines called in-process turn the caches on: keep them out of the user's home, and turn
    them off again after the test."""
    from jetspec_jax import cache

    monkeypatch.setenv(cache.CACHE_DIR_ENV, session_cache_dir)
    yield
    if cache.weights_cache_dir() or jax.config.jax_compilation_cache_dir:
        cache.configure(enabled=False)


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


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_tokens() -> list[str]:
    """The 256 byte tokens of a byte-level BPE, in byte order (GPT-2's printable mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
    return [chars[b] for b in range(256)]


def make_tiny_gguf(path: str, seed: int = 0, layers: int = 2, hidden: int = 64, heads: int = 4,
                   kv_heads: int = 2, ffn: int = 96) -> str:
    """Writes a random tiny Llama GGUF (Q8_0 matrices, F32 norms) with a byte-level tokenizer and a
    chat template, so the GGUF path runs end to end in seconds; returns the path."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    tokens = byte_level_tokens() + ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * 3)  # normal bytes, control specials
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_pad_token_id(258)
    w.add_chat_template(TINY_CHAT_TEMPLATE)

    def matrix(name, shape):
        q = gguf.quants.quantize((0.1 * rng.standard_normal(shape)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    def norm(name, size):
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    head_dim = hidden // heads
    matrix("token_embd.weight", (len(tokens), hidden))
    norm("output_norm.weight", hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        matrix(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden))
        matrix(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim))
        matrix(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        matrix(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        matrix(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
