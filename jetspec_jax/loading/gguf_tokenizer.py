"""The tokenizer and chat template of a GGUF file, built with `tokenizers` from the file's metadata.

transformers' own GGUF path needs torch even for the tokenizer; this one does not, and it builds the
same byte-level BPE that transformers' GGUF converter builds (checked token for token in the tests).
"""

from __future__ import annotations

import datetime
import functools
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

    return ChatTokenizer(backend, chat_template=_field(reader, "tokenizer.chat_template"),
                         bos_token=token("bos_token_id"), eos_token=token("eos_token_id"),
                         unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"))


class ChatTokenizer:
    """A `tokenizers` tokenizer with its special tokens and chat template, offering the part of
    transformers' tokenizer interface this project uses. It keeps transformers out of the main
    command's start (importing it costs seconds, torch included where torch is installed); the tests
    check it against transformers' own GGUF tokenizer."""

    SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")

    def __init__(self, backend, chat_template: str | None = None, **special: str | None):
        self.backend_tokenizer, self.chat_template = backend, chat_template
        for name in self.SPECIAL:
            setattr(self, name, special.get(name))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs) -> dict[str, list[int]] | str:
        """The template rendered as transformers renders it (sandboxed jinja2, trimmed blocks);
        token ids come back as {"input_ids": [...]}, as transformers 5 returns them."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _compiled_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            **{name: getattr(self, name) for name in self.SPECIAL}, **kwargs)
        return self(text, add_special_tokens=False) if tokenize else text

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend_tokenizer.to_str(), "chat_template": self.chat_template,
                **{name: getattr(self, name) for name in self.SPECIAL}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ChatTokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(data["backend"]), data["chat_template"],
                   **{name: data[name] for name in cls.SPECIAL})


@functools.cache
def _compiled_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)
