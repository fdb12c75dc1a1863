"""The Pallas cache-compaction kernel (interpret mode on the CPU) against its jnp reference, inside
speculative generation, and its CUDA lowering."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.kernels.cache_compact import compact_rows, compact_rows_pallas
from triton_lowering import lowered_triton_modules

CASES = [  # buffer shape (B, S, Hkv, D), lengths, path rows (nondecreasing, as accepted paths are)
    ((1, 40, 3, 64), [5], [[0, 2, 3, 3]]),
    ((2, 48, 2, 8), [10, 30], [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 3, 7, 9, 9, 9, 9, 9, 9]]),  # 9 rows: padded to 16
    # the buffer's last rows: the fourth (padding) row of sequence 2 would fall past its end
    ((3, 30, 1, 128), [0, 21, 27], [[0, 4, 5], [0, 1, 8], [0, 1, 2]]),
]


def dense_rows(shape, lengths, path):
    """The (sources, targets) of moving rows lengths + path to lengths + 0.. in a dense (B, S, ...) buffer."""
    b, s = shape[:2]
    base = jnp.arange(b, dtype=jnp.int32)[:, None] * s + lengths[:, None]
    return base + path, base + jnp.arange(path.shape[1], dtype=jnp.int32)[None]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, lengths, path", CASES)
def test_kernel_equals_reference(shape, lengths, path, dtype):
    rng = np.random.default_rng(len(path[0]))
    buffers = tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(5))
    lengths, path = jnp.asarray(lengths, jnp.int32), jnp.asarray(path, jnp.int32)
    sources, targets = dense_rows(shape, lengths, path)
    want = compact_rows(buffers, sources, targets, implementation="xla")
    got = compact_rows(buffers, sources, targets, implementation="pallas_interpret")
    for w, g, x in zip(want, got, buffers):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        for i in range(shape[0]):  # the reference itself: the path's rows, in order, from lengths on
            moved = np.asarray(x)[i, np.asarray(lengths[i] + path[i])]
            np.testing.assert_array_equal(np.asarray(w)[i, int(lengths[i]):int(lengths[i]) + path.shape[1]], moved)


def test_paged_rows_move_between_pages():
    """A paged pool: sequence rows map to pool pages through a table, and a path that crosses a page
    boundary lands in the right page (kv_cache.flat_rows gives the indices)."""
    from jetspec_jax.kv_cache import KVCache

    rng = np.random.default_rng(3)
    pool = jnp.asarray(rng.standard_normal((7, 16, 2, 8)), jnp.float32)
    cache = KVCache(k=(pool,), v=(pool,), lengths=jnp.asarray([13, 30], jnp.int32),
                    pages=jnp.asarray([[5, 2, 6], [1, 4, 3]], jnp.int32))
    path = jnp.asarray([[0, 2, 5, 6], [0, 1, 1, 1]], jnp.int32)
    rows = cache.lengths[:, None] + path
    sources = cache.flat_rows(rows)
    targets = cache.flat_rows(cache.lengths[:, None] + jnp.arange(4, dtype=jnp.int32)[None])
    for impl in ("xla", "pallas_interpret"):
        (got,) = compact_rows((pool,), sources, targets, implementation=impl)
        view = KVCache(k=(got,), v=(got,), lengths=cache.lengths, pages=cache.pages)
        np.testing.assert_array_equal(np.asarray(view.gather(got, cache.lengths[:, None] + jnp.arange(4)[None])),
                                      np.asarray(cache.gather(pool, rows)))


def test_sources_are_read_before_targets_are_written():
    """Row 2 is both a source (of row 1) and a target (of row 3): an in-place copy that wrote row 2
    first would move the wrong values into row 1. (On the GPU that order across warps is the barrier's,
    which the lowering test checks.)"""
    buffer = jnp.arange(8, dtype=jnp.float32).reshape(1, 8, 1, 1) * jnp.ones((1, 1, 1, 4))
    (got,) = compact_rows((buffer,), jnp.asarray([[0, 2, 3]], jnp.int32), jnp.asarray([[0, 1, 2]], jnp.int32),
                          implementation="pallas_interpret")
    np.testing.assert_array_equal(np.asarray(got[0, :4, 0, 0]), [0, 2, 3, 3])


def test_unknown_implementation_is_named():
    with pytest.raises(ValueError, match="cache compaction 'triton'"):
        compact_rows((jnp.zeros((1, 4, 1, 2)),), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                     implementation="triton")


def test_speculative_generate_with_the_kernel_equals_ar(tiny_qwen3):
    from drafters import greedy_speculative_and_ar

    from jetspec_jax.speculative import SpecConfig

    spec = SpecConfig("jetspec", budget=8, width=2, attention_impl="xla", compact_impl="pallas_interpret")
    got, want = greedy_speculative_and_ar(tiny_qwen3[0], spec, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want))
    assert float(np.asarray(got.target_forwards).max()) < 12  # drafts were accepted, so rows were moved


@pytest.mark.parametrize("shape", [(1, 1100, 3, 64, 16), (2, 4400, 8, 128, 9)])
def test_kernel_lowers_to_a_valid_triton_module(shape, monkeypatch):
    b, s, hkv, d, rows = shape
    args = (tuple(jax.ShapeDtypeStruct((b, s, hkv, d), jnp.bfloat16) for _ in range(6)),
            jax.ShapeDtypeStruct((b, rows), jnp.int32), jax.ShapeDtypeStruct((b, rows), jnp.int32))
    modules = lowered_triton_modules(monkeypatch, lambda: compact_rows_pallas.trace(*args).lower(
        lowering_platforms=("cuda",)))
    for module in modules:
        assert module.operation.verify()
        assert stores_after_a_barrier(str(module))


def stores_after_a_barrier(module_text: str) -> bool:
    """Whether every store of the moved rows comes after a block-wide barrier that follows their gather:
    the rows are spread over the warps, and in place a warp that stored before another had read would
    hand it a row already overwritten (interpret mode, which loads the whole tile before storing, cannot
    show that)."""
    stores, state = 0, "idle"
    for line in module_text.splitlines():
        if re.search(r"tt\.load .*tensor<\d+x\d+x!tt\.ptr", line):  # the (rows, width) gather
            state = "gathered" if state == "idle" else state
        elif "gpu.barrier" in line and state == "gathered":
            state = "fenced"
        elif "tt.store" in line:
            if state != "fenced":
                return False
            stores, state = stores + 1, "idle"
    return stores > 0
