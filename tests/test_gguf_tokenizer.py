"""Our torch-free GGUF tokenizer equals transformers' GGUF tokenizer on the embedded model."""

from __future__ import annotations

import os

import pytest

from jetspec_jax.loading.gguf_tokenizer import load_gguf_tokenizer

TEXTS = ["Hello world", " leading space", "What is 12345 + 678?", "def f(x):\n    return x ** 2\n",
         "Ünïcödé — emoji 🙂 and 中文", "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\t\ttabs\n\n"]


@pytest.fixture(scope="module")
def tokenizers(embedded_target):
    from transformers import AutoTokenizer

    path = embedded_target.source
    theirs = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return load_gguf_tokenizer(path), theirs


def test_same_ids_and_decoding(tokenizers):
    ours, theirs = tokenizers
    for text in TEXTS:
        ids = ours(text, add_special_tokens=True)["input_ids"]
        assert ids == theirs(text, add_special_tokens=True)["input_ids"], text
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)


def test_same_chat_template_and_special_tokens(tokenizers):
    ours, theirs = tokenizers
    messages = [{"role": "user", "content": "What is 7 times 8?"}]
    kwargs = dict(tokenize=True, add_generation_prompt=True, enable_thinking=False)
    assert ours.apply_chat_template(messages, **kwargs)["input_ids"] == \
        theirs.apply_chat_template(messages, **kwargs)["input_ids"]
    assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token, ours.bos_token, ours.eos_token_id) == (theirs.eos_token, theirs.bos_token,
                                                                  theirs.eos_token_id)
