"""Tree attention for Hopper in Mosaic GPU: the tree-shaped calls (64+ nodes) of `tree_attention`.

Same contract as `tree_attention.tree_attention_reference`. Warp-specialised: per CTA, two compute
warpgroups each own 64 query rows (one query head's 64 consecutive nodes) of one KV head, so the pair
shares every K/V tile, and a third warpgroup streams 64-key K/V tiles into shared memory with the
bulk tensor copy engine (TMA), `stages` deep. Both products run on wgmma, QK^T from shared memory
and PV with P in registers. Split-K as in the Triton kernel: each sequence's prefix is cut into
`splits` shares, the last one also takes the tree nodes (its share is shorter by N keys, so the
splits balance), and `merge_partials` combines the per-split (output, log-sum-exp) pairs.

Why a second kernel: the Triton-lowered one runs one 64-row warpgroup per program with no warp
specialisation, and at the Qwen3-8B tree shape (L=4096, N=256) sat at about 47% of the bf16 matmul
rate; this one reaches 51% there (kernel 40.4 us against 52.0 on the H200) and more at batch 8.

Needs N % 64 == 0, head dim 64 or 128, bf16 or f16, cache rows a multiple of 8 (`unsupported_reason`).
Checked with jax 0.10.2 on the CPU (Mosaic GPU's interpreter against the reference; that version's
interpreter knows no register layouts nor transposed shared-memory operands, so under `interpret` the
layouts are dropped and the products are jnp dots) and with jax 0.11.2 on an H200 against the
reference (benchmarks/results/tree_attention_h200_mosaic_check.json).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

BLOCK = 64  # query rows per warpgroup and keys per step: one m64 wgmma tile, two mask words
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)  # a (64,) per-row vector next to a (64, x) wgmma tile
COMPUTE_WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class MosaicTreeAttentionTuning:
    stages: int = 4  # K/V tiles in flight per CTA: of 2/3/4 on the H200 4 was fastest at the 8B tree
    # shape (kernel 40.3 us against 41.3 and 44.3) and within 3% of the best elsewhere
    # (tree_attention_h200_mosaic_07aefb2_*.json)
    splits: int | None = None  # prefix splits; None: as many as fit the CTAs of a split in one wave
    target_ctas: int = 132  # one CTA per multiprocessor (registers allow one), 132 on the H200


def unsupported_reason(q: jax.Array, k: jax.Array) -> str | None:
    """Why this kernel cannot take the call, or None."""
    n, h, d = q.shape[1:]
    if n % BLOCK:
        return f"tree nodes N={n} must be a multiple of {BLOCK}"
    if d not in (64, 128):
        return f"head dim {d} must be 64 or 128"
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype:
        return f"q and k/v must share dtype bf16 or f16 (got {q.dtype}, {k.dtype})"
    if k.shape[1] % 8:  # TMA reads the cache as whole 8-row tiles
        return f"cache rows S={k.shape[1]} must be a multiple of 8"
    if h % k.shape[2]:
        return f"query heads {h} must be a multiple of KV heads {k.shape[2]}"
    return None


def grid_for(q_shape: tuple, k_shape: tuple, tuning: MosaicTreeAttentionTuning) -> tuple[int, int, int]:
    """(CTAs per KV head and split: pairs of 64-row blocks, KV heads, batch x prefix splits)."""
    b, n, h, _ = q_shape
    hkv = k_shape[2]
    row_blocks = h // hkv * (n // BLOCK)
    pairs = -(-row_blocks // COMPUTE_WARPGROUPS)
    splits = tuning.splits
    if splits is None:  # whole waves only: a second, partial wave would cost as much as the first
        splits = max(1, min(tuning.target_ctas // (pairs * hkv * b), k_shape[1] // (2 * BLOCK)))
    return pairs, hkv, b * splits


def _tree_kernel(lengths_ref, q_ref, k_ref, v_ref, words_ref, out_ref, lse_ref, scoped, *, splits: int,
                 node_blocks: int, group: int, row_blocks: int, stages: int, scale: float, interpret: bool):
    (q_smem, k_smem, v_smem, words_smem, lse_smem), barriers = scoped
    q_barriers, k_barriers, v_barriers, k_free, v_free, schedule = barriers
    dtype = q_smem.dtype
    pair, kv_head, batch_split = lax.axis_index("pairs"), lax.axis_index("kv_heads"), lax.axis_index("batch_split")
    b, split = lax.div(batch_split, jnp.int32(splits)), lax.rem(batch_split, jnp.int32(splits))
    wg = lax.axis_index("wg")
    # register layouts place values for the GPU; jax 0.10's interpreter knows none of them (0.11's does)
    with_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
    num_nodes = node_blocks * BLOCK
    num_words = num_nodes // 32

    # Key rows of this split, in 64-row tiles from a multiple of 64 (tiled TMA copies must start on a
    # tile): a share of prefix + tree; the last split runs from its share's start (or the last whole
    # prefix tile before it, when the prefix ended earlier) through the tree. Tiles whose keys are all
    # inside [first visible, prefix end) need no mask; the rest ("edge" tiles: the split's ragged end,
    # the tree) are masked per key.
    length = lengths_ref[b]
    share = (length + num_nodes + splits * BLOCK - 1) // (splits * BLOCK)  # tiles
    is_last = split == splits - 1
    visible_from = split * share * BLOCK  # earlier keys belong to earlier splits
    prefix_end = jnp.where(is_last, length, jnp.minimum(length, visible_from + share * BLOCK))
    end = jnp.where(is_last, length + num_nodes, prefix_end)
    first_tile = jnp.where(is_last, jnp.minimum(split * share, length // BLOCK), split * share)
    full_steps = jnp.maximum(prefix_end - first_tile * BLOCK, 0) // BLOCK
    full_steps = jnp.where(first_tile * BLOCK < visible_from, 0, full_steps)
    steps = jnp.maximum(end - first_tile * BLOCK + BLOCK - 1, 0) // BLOCK
    cache_rows = k_ref.shape[1]

    def tile_row(i):
        """First cache row of step i's K/V tile: a multiple of 64, or of 8 (a TMA tile) for a last tile
        that would overhang the cache, moved back to end with it."""
        nominal = (first_tile + i) * (BLOCK // 8)
        return (nominal - jnp.maximum(nominal + BLOCK // 8 - cache_rows // 8, 0)) * 8

    def schedule_turn():  # the two compute warpgroups take turns on the tensor cores
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(wg < COMPUTE_WARPGROUPS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        # a CTA with an odd last pair repeats the last row block in its second warpgroup, unwritten
        row_block = jnp.minimum(pair * COMPUTE_WARPGROUPS + wg, row_blocks - 1)
        head = kv_head * group + row_block // node_blocks
        node0 = row_block % node_blocks * BLOCK
        q_tile, words = q_smem.at[wg], words_smem.at[wg]
        plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(node0, BLOCK), head], q_tile, q_barriers.at[wg])
        plgpu.copy_gmem_to_smem(words_ref.at[b, :, pl.ds(node0, BLOCK)], words,
                                q_barriers.at[COMPUTE_WARPGROUPS + wg])
        plgpu.barrier_wait(q_barriers.at[wg])
        plgpu.barrier_wait(q_barriers.at[COMPUTE_WARPGROUPS + wg])
        d = q_tile.shape[-1]
        m = with_layout(jnp.full((BLOCK,), -jnp.inf, jnp.float32), ROW_LAYOUT)
        l = with_layout(jnp.full((BLOCK,), 0.0, jnp.float32), ROW_LAYOUT)
        acc = with_layout(jnp.full((BLOCK, d), 0.0, jnp.float32), plgpu.Layout.WGMMA)
        column = with_layout(lax.broadcasted_iota(jnp.int32, (BLOCK, BLOCK), 1), plgpu.Layout.WGMMA)

        @pl.when(steps > 0)
        def _():
            plgpu.barrier_wait(k_barriers.at[0])

        pl.when(wg == 1)(schedule_turn)

        def step(i, carry, mask: str):
            acc, m, l = carry
            slot = lax.rem(i, jnp.int32(stages))

            def qk_product(acc_ref):
                if interpret:  # jax 0.10's interpreter cannot transpose a shared-memory operand
                    product = lax.dot_general(q_tile[...], k_smem[slot], (((1,), (1,)), ((), ())),
                                              preferred_element_type=jnp.float32)
                else:
                    plgpu.wgmma(acc_ref, q_tile, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                schedule_turn()
                return product if interpret else acc_ref[...]
            s = pl.run_scoped(qk_product, plgpu.ACC((BLOCK, BLOCK), jnp.float32))
            plgpu.barrier_arrive(k_free.at[slot])
            if mask == "edge":
                key = tile_row(i) + column  # cache row of each key
                visible = (key >= visible_from) & (key < prefix_end)
                node = key - length  # tree node j: bit j % 32 of the row's word j // 32
                first_word = (tile_row(i) - length) >> 5  # floor: negative where keys are prefix
                word_of = (node >> 5) - first_word  # 0, 1 or 2 within a tile
                row_words = [lax.broadcast_in_dim(
                    with_layout(words[jnp.clip(first_word + t, 0, num_words - 1)], ROW_LAYOUT), s.shape, [0])
                    for t in range(3)]
                word = jnp.where(word_of == 0, row_words[0], jnp.where(word_of == 1, row_words[1], row_words[2]))
                bit = (word >> (node & 31)) & 1
                visible |= is_last & (node >= 0) & (node < num_nodes) & (bit != 0)
                # keys before the tile's own start were the previous tile's (a tile moved back off the end)
                s = jnp.where(visible & (key >= (first_tile + i) * BLOCK), s, -jnp.inf)
            # m is kept in the scaled base-2 units of the exponent, so p is one FMA and an exp2
            m_next = jnp.maximum(m, s.max(axis=1) * scale)
            m_safe = m_next if mask == "none" else jnp.where(m_next == -jnp.inf, 0.0, m_next)  # all masked
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s * scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            p_low = p.astype(dtype)
            plgpu.barrier_arrive(schedule)  # softmax done: the other warpgroup's turn
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule)

            def pv_product(acc_ref):
                if interpret:
                    product = jnp.dot(p_low, v_smem[slot], preferred_element_type=jnp.float32)
                else:
                    plgpu.wgmma(acc_ref, p_low, v_smem.at[slot])

                @pl.when(i + 1 < steps)  # while the product runs: the next K tile
                def _():
                    plgpu.barrier_wait(k_barriers.at[lax.rem(i + 1, jnp.int32(stages))])
                return product if interpret else acc_ref[...]
            pv = pl.run_scoped(pv_product, plgpu.ACC((BLOCK, d), jnp.float32))
            plgpu.barrier_arrive(v_free.at[slot])
            return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_next, l

        carry = lax.fori_loop(0, full_steps, functools.partial(step, mask="none"), (acc, m, l))
        acc, m, l = lax.fori_loop(full_steps, steps, functools.partial(step, mask="edge"), carry)
        pl.when(wg == 0)(schedule_turn)

        empty = l == 0.0  # no visible key in this split (an empty share)
        safe_l = jnp.where(empty, 1.0, l)
        q_tile[...] = (acc / lax.broadcast_in_dim(safe_l, acc.shape, [0])).astype(dtype)
        lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m * math.log(2) + jnp.log(safe_l))
        plgpu.commit_smem()

        @pl.when(pair * COMPUTE_WARPGROUPS + wg < row_blocks)
        def _():
            plgpu.copy_smem_to_gmem(q_tile, out_ref.at[b, split, pl.ds(node0, BLOCK), head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, split, head, pl.ds(node0, BLOCK)])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WARPGROUPS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def fetch(i):
            slot = lax.rem(i, jnp.int32(stages))
            rows = (b, pl.ds(tile_row(i), BLOCK), kv_head)
            plgpu.copy_gmem_to_smem(k_ref.at[rows], k_smem.at[slot], k_barriers.at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[rows], v_smem.at[slot], v_barriers.at[slot])

        for i in range(stages):
            pl.when(i < steps)(functools.partial(fetch, jnp.int32(i)))

        def refill(i, _):
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])  # both compute warpgroups are done with step i - stages
            plgpu.barrier_wait(v_free.at[slot])
            fetch(i)
        lax.fori_loop(jnp.int32(stages), steps, refill, None)

        def drain(i, _):  # the last tiles' releases: every phase of a barrier is observed before exit
            slot = lax.rem(i, jnp.int32(stages))
            plgpu.barrier_wait(k_free.at[slot])
            plgpu.barrier_wait(v_free.at[slot])
        lax.fori_loop(jnp.maximum(steps - stages, 0), steps, drain, None)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def tree_attention_mosaic_splits(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_words: jax.Array,
                                 *, tuning: MosaicTreeAttentionTuning = MosaicTreeAttentionTuning(),
                                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """The kernel alone: per-split outputs (B, P, N, H, D) in q's dtype and their natural-log
    log-sum-exps (B, P, H, N) fp32 (-inf where a split saw no key)."""
    reason = unsupported_reason(q, k)
    if reason is not None:
        raise ValueError(f"the Mosaic tree-attention kernel cannot take this call: {reason}; "
                         "use implementation='pallas' (Triton) or 'xla'")
    b, n, h, d = q.shape
    group = h // k.shape[2]
    node_blocks = n // BLOCK
    grid = grid_for(q.shape, k.shape, tuning)
    splits = grid[2] // b
    # (B, W, N) int32 bit patterns: one word of a row block's 64 nodes is contiguous (one TMA box)
    words = jnp.swapaxes(lax.bitcast_convert_type(tree_words, jnp.int32), 1, 2)
    stages = tuning.stages
    tiles = (plgpu.TilingTransform((8, 128 // jnp.dtype(q.dtype).itemsize)), plgpu.SwizzleTransform(128))

    def tree_attention_mosaic(lengths_ref, q_ref, k_ref, v_ref, words_ref, out_ref, lse_ref):  # names the kernel
        smem = (plgpu.SMEM((COMPUTE_WARPGROUPS, BLOCK, d), q.dtype, transforms=tiles),
                plgpu.SMEM((stages, BLOCK, d), q.dtype, transforms=tiles),
                plgpu.SMEM((stages, BLOCK, d), q.dtype, transforms=tiles),
                plgpu.SMEM((COMPUTE_WARPGROUPS, words.shape[1], BLOCK), jnp.int32),
                plgpu.SMEM((COMPUTE_WARPGROUPS, BLOCK), jnp.float32))
        barriers = (plgpu.Barrier(num_barriers=2 * COMPUTE_WARPGROUPS),  # q and mask words, per warpgroup
                    plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
                    plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS, num_barriers=stages),
                    plgpu.Barrier(num_arrivals=COMPUTE_WARPGROUPS))
        kernel = functools.partial(_tree_kernel, splits=splits, node_blocks=node_blocks, group=group,
                                   row_blocks=group * node_blocks, stages=stages,
                                   scale=math.log2(math.e) / math.sqrt(d), interpret=interpret)
        pl.run_scoped(lambda *scoped: kernel(lengths_ref, q_ref, k_ref, v_ref, words_ref, out_ref, lse_ref,
                                             (scoped[:5], scoped[5:])),
                      *smem, *barriers, collective_axes="wg")

    out, lse = plgpu.kernel(
        tree_attention_mosaic,
        out_type=(jax.ShapeDtypeStruct((b, splits, n, h, d), q.dtype),
                  jax.ShapeDtypeStruct((b, splits, h, n), jnp.float32)),
        grid=grid,
        grid_names=("pairs", "kv_heads", "batch_split"),
        num_threads=COMPUTE_WARPGROUPS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=_interpret_params() if interpret else None,
    )(lengths.astype(jnp.int32), q, k, v, words)
    return out, lse


def _interpret_params():
    """Mosaic GPU's CPU interpreter (tests); its parameters class is public only from jax 0.11."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()
