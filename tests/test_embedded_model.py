"""The embedded SmolLM2-135M-Instruct (Q4_1 GGUF) against transformers' own GGUF load of the same file."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jetspec_jax.api import generate
from jetspec_jax.models import qwen3
from jetspec_jax.tokens import encode_prompts

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
]


@pytest.fixture(scope="module")
def hf_model(embedded_target):
    from transformers import AutoModelForCausalLM

    path = embedded_target.source
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


def test_config_read_from_gguf(embedded_target):
    cfg = embedded_target.cfg
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert cfg.tie_embeddings and not cfg.qk_norm and cfg.vocab_size == 49152
    assert embedded_target.tokenizer.eos_token == "<|im_end|>"


def test_logits_match_transformers_gguf_load(embedded_target, hf_model):
    ids_list = encode_prompts(embedded_target.tokenizer, CHAT_PROMPTS)
    for ids in ids_list:
        cache = qwen3.new_cache(embedded_target.cfg, 1, 128)
        logits, _, _ = qwen3.forward(embedded_target.params, jnp.asarray([ids]), jnp.arange(len(ids))[None],
                                     cache, embedded_target.cfg)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(logits[0])
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 1e-4 * scale, np.abs(got - ref).max()
        assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_64_tokens_match_transformers(embedded_target, hf_model):
    result = generate(CHAT_PROMPTS, embedded_target, max_new_tokens=64)
    eos = embedded_target.tokenizer.eos_token_id
    for ids, got in zip(result.prompt_token_ids, result.token_ids):
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                    eos_token_id=eos, pad_token_id=eos)
        assert got == ref[0, len(ids):].tolist()
    assert "Paris" in result.texts[0] and "def " in result.texts[1]  # the model is really loaded
