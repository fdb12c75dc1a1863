"""The tokenizer and chat template of a GGUF file, built with `tokenizers` from the file's metadata.

transformers' own GGUF path needs torch even for the tokenizer; this one does not, and it builds the
same byte-level BPE that transformers' GGUF converter builds (checked token for token in the tests).
"""

from __future__ import annotations

from typing import Any

from jetspec_jax.errors import DamagedFileError, InputError
from jetspec_jax.loading.gguf_file import damaged_gguf_fix, open_gguf

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special tokens


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def load_gguf_tokenizer(path: str):
    reader = open_gguf(path)
    try:
        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise InputError(f"{path}: GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' "
                             "is); use the model's Hugging Face directory instead")
        return _build_tokenizer(reader)
    except InputError:
        raise
    except Exception as e:
        # tokenizers reports a bad vocabulary or merge list as a bare Exception; other types are bugs
        if not isinstance(e, (ValueError, IndexError, KeyError, TypeError)) and type(e) is not Exception:
            raise
        raise DamagedFileError(path, f"corrupt tokenizer metadata ({type(e).__name__}: {e})",
                               damaged_gguf_fix(path)) from None


def _build_tokenizer(reader):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("tokenizer.ggml.tokens is missing or empty")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = _field(reader, "tokenizer.ggml.token_type", [])
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False,
                                   continuing_subword_prefix="", end_of_word_suffix=""))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])

    def token(key):
        index = _field(reader, f"tokenizer.ggml.{key}")
        return None if index is None else tokens[int(index)]

    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=token("bos_token_id"),
                                   eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
                                   pad_token=token("padding_token_id"),
                                   chat_template=_field(reader, "tokenizer.chat_template"))
