"""Tree attention: N query nodes against a sequence's cached prefix and the tree nodes themselves.

Keys/values live in one cache buffer (B, S, Hkv, D): rows < lengths[b] are the committed prefix, rows
lengths[b] .. lengths[b]+N-1 the tree nodes (written there by the verify forward). Node i sees the
whole prefix and the nodes whose bit is set in its row of a packed ancestor mask (B, N, ceil(N/32))
uint32, never a dense N x (L+N) mask. GQA: query head h reads kv head h // (H / Hkv).

`tree_attention` dispatches: on GPU the Pallas kernel here (Triton lowering), or on Hopper for the
calls it takes with head dim 128 the Mosaic GPU kernel of tree_attention_mosaic.py; the plain-jnp
reference elsewhere. This kernel is split-K (flash-decoding): each program handles one (batch, KV
head, block of query rows, key split). A block is one query head's run of nodes, read and written in
place, when its size divides N (`head_blocked`); otherwise its rows are (query head of the KV head's
group, node) pairs, so a small tree's GQA group shares its K/V loads. The last split takes the tree
nodes, the others share the prefix, and a log-sum-exp merge combines them (XLA's after the call, or
with `merge_in_kernel` the last program's of each row block).

Checked with jax 0.10.2 on the CPU (interpret=True against the reference, and the Triton module
lowered for CUDA passes MLIR's verifier) and with jax 0.11.2 on an H200 (Triton lowering; on the GPU's
own clock faster than XLA's dense-mask attention at all 36 benchmarked shapes and than cuDNN at 35:
benchmarks/results/tree_attention_h200_gpu_clock_*.json).

Triton or Mosaic GPU, by measurement on the H200 (tree_attention_h200_mosaic_*.json): the Mosaic
kernel, warp-specialised with wgmma, runs 11 of the 12 Qwen3-8B tree shapes faster (1.07-1.84x;
L=4096 N=256: 44.9 us whole call against 55.9), 5 of the embedded model's 12 (head dim 64), and takes
no decode step (N must be a multiple of 64), where this kernel's split-K over 64-row programs stays
the fastest (L=16384 N=16: 25.9 us against 199 for upstream's FA3 without split-K).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jetspec_jax.kernels import precision
from jetspec_jax.kernels.tree_attention_mosaic import MosaicTreeAttentionTuning, tree_attention_mosaic_splits
from jetspec_jax.kernels.tree_attention_mosaic import unsupported_reason as mosaic_unsupported_reason
from jetspec_jax.kv_cache import check_page_size, sequence_rows

WORD_BITS = 32


def pack_tree_mask(ancestors: jax.Array) -> jax.Array:
    """(..., N, N) bool -> (..., N, ceil(N/32)) uint32; bit j of word w marks node 32w + j."""
    n = ancestors.shape[-1]
    words = -(-n // WORD_BITS)
    padded = jnp.pad(ancestors.astype(jnp.uint32), [(0, 0)] * (ancestors.ndim - 1) + [(0, words * WORD_BITS - n)])
    bits = padded.reshape(ancestors.shape[:-1] + (words, WORD_BITS))
    return jnp.sum(bits << jnp.arange(WORD_BITS, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_tree_mask(words: jax.Array, n: int) -> jax.Array:
    bits = (words[..., :, None] >> jnp.arange(WORD_BITS, dtype=jnp.uint32)) & 1
    return bits.reshape(words.shape[:-1] + (-1,))[..., :n].astype(bool)


def tree_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                             tree_words: jax.Array) -> jax.Array:
    """Plain jnp: q (B, N, H, D), k/v (B, S, Hkv, D), lengths (B,), tree_words (B, N, W) -> (B, N, H, D).
    Scores and softmax in fp32."""
    out, _ = tree_attention_reference_with_lse(q, k, v, lengths, tree_words)
    return out.astype(q.dtype)


def tree_attention_reference_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                                      tree_words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`tree_attention_reference` in fp32 with each row's natural-log log-sum-exp of its scores
    (B, N, H); a row that sees nothing gives zeros and -inf."""
    b, n, h, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    rel = jnp.arange(s, dtype=jnp.int32)[None, :] - lengths[:, None]  # (B, S)
    tree = unpack_tree_mask(tree_words, n)  # (B, N, N)
    in_tree = (rel >= 0) & (rel < n)
    tree_visible = jnp.take_along_axis(tree, jnp.broadcast_to(jnp.clip(rel, 0, n - 1)[:, None, :], (b, n, s)),
                                       axis=2)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_visible)  # (B, N, S)
    qg = q.reshape(b, n, hkv, h // hkv, d)
    scores = precision.einsum("bnkgd,bskd->bkgns", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = precision.einsum("bkgns,bskd->bnkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(scores, axis=-1).transpose(0, 3, 1, 2).reshape(b, n, h)  # (B, Hkv, G, N) -> (B, N, H)
    return jnp.where((lse == -jnp.inf)[..., None], 0.0, out.reshape(b, n, h, d)), lse


@dataclasses.dataclass(frozen=True)
class TreeAttentionTuning:
    block_rows: int = 64  # query rows per program (group heads x nodes, flattened); Triton dots need >= 16
    block_k: int = 64  # prefix keys per inner step
    prefix_splits: int | None = None  # None: enough splits to give the GPU about `target_programs` programs
    target_programs: int = 132  # one wave on the H200's 132 multiprocessors: best of 1/2/4/8 waves swept
    num_warps: int = 4
    num_stages: int = 3  # with the above: best of the tilings swept on the H200 (benchmarks/results)
    min_blocks_per_split: int = 4  # 1 and 2 swept: shorter kernels, but the larger merge costs more
    tree_in_last_split: bool = False  # the last prefix split's programs also take the tree nodes: one
    # partial result fewer to write and merge, no programs for the tree alone. Best at the 8B tree
    # shape, 3% slower at the embedded model's B=256 verify (tree_attention_h200_rows32_sweep.json): off
    low_precision_partials: bool = True  # partial outputs in the inputs' dtype (bf16: half the merge's
    # traffic, one more rounding of each partial): best of the H200 sweep for both call classes
    # (tree_attention_h200_rows32_sweep.json)
    tree_block_k: int = 32  # tree nodes per inner step: 32 (one mask word) or 64 (two: half the steps,
    # each a full 64-key dot like the prefix's). H200 (tree_attention_h200_targets_tree64_bylength.json):
    # 15% slower at the 8B tree shape; with split_by_length 8-9% faster at the embedded verify: off
    split_by_length: bool = False  # prefix splits divide each sequence's own length, not the cache's
    # rows: with a cache longer than its prefix (every decode step) the capacity-based split leaves the
    # later splits empty and the first ones long. Same run: equal at the 8B decode shape, faster at
    # the embedded AR step mid-generation only (~1 us a layer): off
    merge_in_kernel: bool = False  # the last of a row block's split programs to finish (an atomic
    # counter per block) merges the partials and writes the final rows: no merge kernels after the call.
    # H200 (tree_attention_h200_kernel_merge_*.json): with tree_in_last_split and fp32 partials the 8B
    # target shape took 51.9 us against 53.8 with XLA's merge, but with more partials the merge's
    # registers slow the whole kernel (embedded B=256 verify 13.0 vs 10.3 us, 8B decode shape 4x), and
    # a looped merge was slower at every shape: off

    def __post_init__(self):
        if self.tree_block_k not in (WORD_BITS, 2 * WORD_BITS):
            raise ValueError(f"tree_block_k must be {WORD_BITS} or {2 * WORD_BITS} (one or two mask words), "
                             f"got {self.tree_block_k}")

    def num_partials(self, splits: int) -> int:
        return splits if self.tree_in_last_split else splits + 1

    def splits_for(self, cache_rows: int, programs_per_split: int) -> int:
        if self.prefix_splits is not None:
            return self.prefix_splits
        wanted = -(-self.target_programs // programs_per_split)
        return max(1, min(wanted, 64, -(-cache_rows // (self.min_blocks_per_split * self.block_k))))


def _online_softmax_step(q, k, v, visible, carry, scale):
    """One flash-attention block in base 2 (`scale` includes log2(e); exp2 is one instruction where
    exp is a libdevice call): scores (M, K) -> updated (acc, running max, running sum).
    visible None: every key is visible, so the mask and the all-masked guard are skipped."""
    acc, m_prev, l_prev = carry
    s = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    m_safe = m_next if visible is None else jnp.where(m_next == -jnp.inf, 0.0, m_next)  # fully masked: stay 0
    correction = jnp.exp2(m_prev - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
    return acc, m_next, l_prev * correction + jnp.sum(p, axis=1)


def _tree_attention_kernel(lengths_ref, q_ref, k_ref, v_ref, words_ref, *refs, num_nodes: int, num_words: int,
                           prefix_splits: int, tree_split: int, split_rows: int | None, block_k: int,
                           tree_block_k: int, scale: float, merge_in_kernel: bool, interpret: bool,
                           page_size: int | None = None):
    """Grid (batch, kv head, row block, split). A row is one (query head of the group, node) pair, so
    the group's heads share every K/V load. Splits < prefix_splits cover prefix rows
    [split * split_rows, ...) up to the prefix length; split `tree_split` covers the tree nodes (the
    one after the prefix splits, or the last of them); split_rows None: each split's share of this
    sequence's length, in whole blocks. refs: the outputs (o, lse), or with
    `merge_in_kernel` the arrival counters (input), final o, partial o and lse, counters (output).
    With `page_size`, k/v are a paged pool (pages, page_size, D) and refs start with the sequence's
    page table row: a prefix block (block_k divides page_size) is a slice of one page, a tree chunk
    gathers its rows page by page."""
    if page_size is not None:
        pages_ref, *refs = refs
    b, split = pl.program_id(0), pl.program_id(3)
    block_rows, d = q_ref.shape
    length = lengths_ref[b]
    if split_rows is None:
        split_rows = ((length + prefix_splits - 1) // prefix_splits + block_k - 1) // block_k * block_k
    q = q_ref[...]
    init = (jnp.zeros((block_rows, d), jnp.float32), jnp.full((block_rows,), -jnp.inf, jnp.float32),
            jnp.zeros((block_rows,), jnp.float32))

    def prefix_rows_of(ref, start):
        if page_size is None:
            return ref.at[pl.ds(start, block_k), :]
        return ref.at[pages_ref[start // page_size], pl.ds(start % page_size, block_k), :]

    def prefix_block(i, carry, masked: bool):
        start = split * split_rows + i * block_k
        if not masked:  # a whole block inside the prefix: plain loads, no mask
            return _online_softmax_step(q, prefix_rows_of(k_ref, start)[...], prefix_rows_of(v_ref, start)[...],
                                        None, carry, scale)
        inside = start + jnp.arange(block_k) < jnp.minimum(length, (split + 1) * split_rows)
        k = plgpu.load(prefix_rows_of(k_ref, start), mask=inside[:, None], other=0.0)
        v = plgpu.load(prefix_rows_of(v_ref, start), mask=inside[:, None], other=0.0)
        return _online_softmax_step(q, k, v, inside[None, :], carry, scale)

    def tree_rows_of(ref, rows, inside):
        if page_size is None:
            return plgpu.load(ref.at[pl.ds(rows, tree_block_k), :], mask=inside[:, None], other=0.0)
        at = rows + key
        page = plgpu.load(pages_ref.at[jnp.minimum(at // page_size, pages_ref.shape[0] - 1)], mask=inside, other=0)
        cols = jnp.arange(d)
        return plgpu.load(ref.at[page[:, None], (at % page_size)[:, None], cols[None, :]], mask=inside[:, None],
                          other=0.0)

    words_per_step = tree_block_k // WORD_BITS
    key = jnp.arange(tree_block_k)

    def tree_block(c, carry):
        # (block_rows,) mask words of this chunk for each row's node; past the last word (an odd count
        # with two per step) the last is read again, its nodes are >= num_nodes and masked below
        words = [words_ref[:, jnp.minimum(c * words_per_step + w, num_words - 1)] for w in range(words_per_step)]

        def attend(carry):
            inside = c * tree_block_k + key < num_nodes
            rows = length + c * tree_block_k
            k, v = tree_rows_of(k_ref, rows, inside), tree_rows_of(v_ref, rows, inside)
            word = words[0][:, None]
            if words_per_step == 2:
                word = jnp.where(key[None, :] < WORD_BITS, word, words[1][:, None])
            bits = (word >> (key % WORD_BITS).astype(jnp.uint32)[None, :]) & 1
            return _online_softmax_step(q, k, v, (bits == 1) & inside[None, :], carry, scale)

        # no row of this block sees a node of this chunk (later nodes, other branches): skip it
        seen = functools.reduce(jnp.logical_or, [w != 0 for w in words])
        return lax.cond(jnp.sum(seen.astype(jnp.int32)) > 0, attend, lambda carry: carry, carry)

    # loop bounds are built arithmetically in int32: jnp.where(flag, 1, 0) lowers to an i1 select,
    # which Triton's scf.for rejects next to an i32 lower bound
    is_prefix = 1 - (split == prefix_splits).astype(jnp.int32)
    prefix_rows = jnp.clip(length - split * split_rows, 0, split_rows)
    full_steps = is_prefix * (prefix_rows // block_k)
    tail_steps = is_prefix * jnp.minimum(prefix_rows % block_k, 1)
    carry = init
    if page_size is not None or k_ref.shape[0] >= block_k:  # a cache shorter than a block has no whole block
        carry = lax.fori_loop(0, full_steps, functools.partial(prefix_block, masked=False), carry)
    carry = lax.fori_loop(full_steps, full_steps + tail_steps, functools.partial(prefix_block, masked=True), carry)
    tree_steps = -(-num_words // words_per_step)
    acc, m, l = lax.fori_loop(0, (split == tree_split).astype(jnp.int32) * tree_steps, tree_block, carry)
    out = acc / jnp.where(l == 0, 1.0, l)[:, None]
    # m and l are in base 2: the natural-log lse is ln(2) * (m + log2 l)
    lse = jnp.where(l == 0, -jnp.inf, (m + jnp.log2(jnp.where(l == 0, 1.0, l))) * math.log(2))
    if not merge_in_kernel:
        o_ref, lse_ref = refs
        o_ref[...] = out.astype(o_ref.dtype)
        lse_ref[...] = lse
        return
    _counts_in, o_ref, part_o_ref, part_lse_ref, counts_ref = refs
    tile = (b, pl.program_id(1), pl.program_id(2))
    part_o_ref[tile + (split,)] = out.astype(part_o_ref.dtype)
    part_lse_ref[tile + (split,)] = lse
    if not interpret:  # (interpret mode has no threads, nor this primitive)
        plgpu.debug_barrier()  # every thread's partial is stored before the release below publishes it
    arrived = plgpu.atomic_add(counts_ref, tile, jnp.int32(1))  # acquire-release at GPU scope

    @pl.when(arrived == part_lse_ref.shape[3] - 1)  # the tile's last program: the others' partials are out
    def _merge():
        # volatile: read past this multiprocessor's L1, which is not coherent with the others' stores
        # (cache_modifier=".cg" would, but jax 0.10-0.11 look it up under the wrong key)
        at = [tile + (jnp.int32(p),) for p in range(part_lse_ref.shape[3])]  # int32: interpret mode's indexer
        outs = [plgpu.load(part_o_ref.at[i], volatile=True).astype(jnp.float32) for i in at]
        lses = [plgpu.load(part_lse_ref.at[i], volatile=True) for i in at]
        o_ref[...] = combine_partials(outs, lses).astype(o_ref.dtype)


def next_power_of_two(x: int) -> int:
    """Triton block dimensions must be powers of two."""
    return 1 << max(0, x - 1).bit_length()


def rows_layout(q: jax.Array, tree_words: jax.Array, num_kv_heads: int, block_rows: int):
    """Packed layout: q (B, N, H, D) -> (B, Hkv, R, D) kernel rows and their tree words (B, R, W), R
    padded to a multiple of block_rows. Row g * N + i of KV head j is query head j * group + g at node
    i; padded rows see the root, so every row has a finite softmax (they are cut off after the merge)."""
    b, n, h, d = q.shape
    group = h // num_kv_heads
    rows = group * n
    rows_pad = -(-rows // block_rows) * block_rows
    words = jnp.pad(jnp.tile(tree_words, (1, group, 1)), ((0, 0), (0, rows_pad - rows), (0, 0)))
    words = words.at[:, rows:, 0].set(jnp.uint32(1))
    q_rows = q.reshape(b, n, num_kv_heads, group, d).transpose(0, 2, 3, 1, 4).reshape(b, num_kv_heads, rows, d)
    return jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_pad - rows), (0, 0))), words


def block_rows_for(tuning: TreeAttentionTuning, rows: int) -> int:
    return max(16, min(tuning.block_rows, next_power_of_two(rows)))


def head_blocked(num_nodes: int, block_rows: int) -> bool:
    """Whether each row block is one query head's run of block_rows nodes, read and written in place
    in the (B, N, H, D) layout (no copies around the kernel): when block_rows divides N. Otherwise
    (small or odd trees) the rows are packed by `rows_layout`, a block holding (head, node) pairs of
    a GQA group so the group shares its K/V loads, at the price of a layout copy each way."""
    return num_nodes % block_rows == 0


def kernel_inputs(q: jax.Array, tree_words: jax.Array, num_kv_heads: int, block_rows: int):
    """The kernel's (q, words): unchanged when head-blocked, else `rows_layout`'s."""
    if head_blocked(q.shape[1], block_rows):
        return q, tree_words
    return rows_layout(q, tree_words, num_kv_heads, block_rows)


@functools.partial(jax.jit, static_argnames=("num_nodes", "num_heads", "block_rows", "tuning", "interpret"))
def tree_attention_splits(q_in: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, words: jax.Array,
                          pages: jax.Array | None = None, *, num_nodes: int, num_heads: int, block_rows: int,
                          tuning: TreeAttentionTuning, interpret: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """The pallas_call alone, on `kernel_inputs`' (q, words): per-split normalised outputs and their
    log-sum-exps (fp32), P = `tuning.num_partials`. Head-blocked: (B, P, N, H, D) and (B, P, N, H);
    packed: (B, Hkv, P, R, D) and (B, Hkv, P, R). With one partial, or `merge_in_kernel`, the output
    is final, in q's dtype, with P = 1 (and lse None when merged in the kernel); otherwise the
    partials are fp32 (q's dtype with `low_precision_partials`). With `pages` (B, pages_per_sequence)
    k and v are a paged pool (pages, page_size, Hkv, D) (kv_cache.KVCache)."""
    page_size = None
    if pages is None:
        b, s, hkv, d = k.shape
    else:
        (b, per_sequence), (_, page_size, hkv, d) = pages.shape, k.shape
        s = per_sequence * page_size
        check_page_size(page_size)
        tuning = dataclasses.replace(tuning, block_k=min(tuning.block_k, page_size))
    group = num_heads // hkv
    blocked = head_blocked(num_nodes, block_rows)
    node_blocks = num_nodes // block_rows
    row_blocks = group * node_blocks if blocked else q_in.shape[2] // block_rows
    num_words = words.shape[-1]
    splits = tuning.splits_for(s, b * hkv * row_blocks)
    split_rows = None if tuning.split_by_length else -(-(-(-s // splits)) // tuning.block_k) * tuning.block_k
    partials = tuning.num_partials(splits)
    merge_in_kernel = tuning.merge_in_kernel and partials > 1
    out_dtype = q_in.dtype if partials == 1 or tuning.low_precision_partials else jnp.float32
    kernel = functools.partial(_tree_attention_kernel, num_nodes=num_nodes, num_words=num_words,
                               prefix_splits=splits, tree_split=partials - 1, split_rows=split_rows,
                               block_k=tuning.block_k, scale=math.log2(math.e) / math.sqrt(d),
                               tree_block_k=tuning.tree_block_k if s >= tuning.tree_block_k else WORD_BITS,
                               merge_in_kernel=merge_in_kernel, interpret=interpret, page_size=page_size)
    if pages is None:
        kv_spec = pl.BlockSpec((None, s, None, d), lambda i, j, r, sp: (i, 0, j, 0))
    else:  # every program may read any page of the pool: its KV head's column of all of them
        kv_spec = pl.BlockSpec((k.shape[0], page_size, None, d), lambda i, j, r, sp: (0, 0, j, 0))
    if blocked:  # row block r of KV head j: query head j * group + r // node_blocks, nodes of block r % node_blocks
        def head(j, r):
            return j * group + r // node_blocks
        q_spec = pl.BlockSpec((None, block_rows, None, d), lambda i, j, r, sp: (i, r % node_blocks, head(j, r), 0))
        words_spec = pl.BlockSpec((None, block_rows, num_words), lambda i, j, r, sp: (i, r % node_blocks, 0))
        partial_axis, rows_shape = 1, (num_nodes, num_heads)
        o_spec = pl.BlockSpec((None, None, block_rows, None, d),
                              lambda i, j, r, sp: (i, sp, r % node_blocks, head(j, r), 0))
        lse_spec = pl.BlockSpec((None, None, block_rows, None), lambda i, j, r, sp: (i, sp, r % node_blocks, head(j, r)))
    else:
        q_spec = pl.BlockSpec((None, None, block_rows, d), lambda i, j, r, sp: (i, j, r, 0))
        words_spec = pl.BlockSpec((None, block_rows, num_words), lambda i, j, r, sp: (i, r, 0))
        partial_axis, rows_shape = 2, (hkv, q_in.shape[2])
        o_spec = pl.BlockSpec((None, None, None, block_rows, d), lambda i, j, r, sp: (i, j, sp, r, 0))
        lse_spec = pl.BlockSpec((None, None, None, block_rows), lambda i, j, r, sp: (i, j, sp, r))
    in_specs = [pl.BlockSpec((b,), lambda i, j, r, sp: (0,)), q_spec, kv_spec, kv_spec, words_spec]
    inputs = [lengths.astype(jnp.int32), q_in, k, v, words]
    if pages is not None:
        in_specs.append(pl.BlockSpec((None, pages.shape[1]), lambda i, j, r, sp: (i, 0)))
        inputs.append(pages.astype(jnp.int32))

    def with_partials(shape, count):  # rows_shape with a partial axis of `count` at partial_axis
        full = (b,) + rows_shape + shape
        return full[:partial_axis] + (count,) + full[partial_axis:]

    if not merge_in_kernel:
        out_specs = [o_spec, lse_spec]
        out_shape = [jax.ShapeDtypeStruct(with_partials((d,), partials), out_dtype),
                     jax.ShapeDtypeStruct(with_partials((), partials), jnp.float32)]
        aliases = {}
    else:  # final rows by the last program of each tile; partials and counters in tile-major scratch
        def final_index(i, j, r, sp):
            return o_spec.index_map(i, j, r, 0)
        final_spec = pl.BlockSpec(o_spec.block_shape, final_index)
        tiles = (b, hkv, row_blocks)

        def whole(shape):
            return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
        in_specs.append(whole(tiles))
        inputs.append(jnp.zeros(tiles, jnp.int32))
        out_specs = [final_spec, whole(tiles + (partials, block_rows, d)), whole(tiles + (partials, block_rows)),
                     whole(tiles)]
        out_shape = [jax.ShapeDtypeStruct(with_partials((d,), 1), q_in.dtype),
                     jax.ShapeDtypeStruct(tiles + (partials, block_rows, d), out_dtype),
                     jax.ShapeDtypeStruct(tiles + (partials, block_rows), jnp.float32),
                     jax.ShapeDtypeStruct(tiles, jnp.int32)]
        aliases = {len(inputs) - 1: 3}
    outs = pl.pallas_call(
        kernel,
        grid=(b, hkv, row_blocks, partials),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages),
        interpret=interpret,
        name="tree_attention",
    )(*inputs)
    return (outs[0], None) if merge_in_kernel else tuple(outs)


def combine_partials(outs: list, lses: list, *, with_lse: bool = False):
    """fp32 sum of partial outputs (each (..., D)), each weighted by exp(lse_p - lse_total) (each (...,);
    an empty partial has lse = -inf and weight 0), and with `with_lse` also the merged log-sum-exp
    (-inf where every partial is empty), for merging with attention over other keys. Written out over
    the few, static partials: XLA makes two kernels of it, 3.5-3.8 us at the 8B target shape on the
    H200 (a logsumexp and a weighted sum over an axis were three, 4.7 us), and the kernel's own merge
    runs the same code."""
    top = functools.reduce(jnp.maximum, lses)
    top = jnp.where(top == -jnp.inf, 0.0, top)  # every partial empty: all weights 0
    weights = [jnp.exp(x - top) for x in lses]
    total = functools.reduce(jnp.add, weights)
    merged = functools.reduce(jnp.add, [o * w[..., None] for o, w in zip(outs, weights)])
    merged = merged / jnp.where(total == 0, 1.0, total)[..., None]
    if not with_lse:
        return merged
    return merged, jnp.where(total == 0, -jnp.inf, jnp.log(total) + top)


def merge_partials(out: jax.Array, lse: jax.Array, axis: int, *, with_lse: bool = False):
    """`combine_partials` of the partials along `axis` of out and lse (lse has no D axis), in fp32; a
    single partial is returned as it is, unless its lse is asked for too."""
    count = out.shape[axis]
    if count == 1 and not with_lse:  # already final, in the kernel's output dtype
        return jnp.take(out, 0, axis=axis)
    return combine_partials([jnp.take(out, i, axis=axis).astype(jnp.float32) for i in range(count)],
                            [jnp.take(lse, i, axis=axis) for i in range(count)], with_lse=with_lse)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def tree_attention_pallas(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_words: jax.Array,
                          pages: jax.Array | None = None, *, tuning: TreeAttentionTuning = TreeAttentionTuning(),
                          interpret: bool = False) -> jax.Array:
    """The Pallas kernel; same contract as `tree_attention_reference`. Needs lengths + N <= S.
    K/V are read in place from the (B, S, Hkv, D) cache (strided), or with `pages` from the paged pool
    (pages, page_size, Hkv, D), never transposed or copied."""
    b, n, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    block_rows = block_rows_for(tuning, group * n)
    q_in, words = kernel_inputs(q, tree_words, hkv, block_rows)
    out, lse = tree_attention_splits(q_in, k, v, lengths, words, pages, num_nodes=n, num_heads=h,
                                     block_rows=block_rows, tuning=tuning, interpret=interpret)
    if head_blocked(n, block_rows):  # with one partial no op runs around the kernel
        return merge_partials(out, lse, axis=1).astype(q.dtype)
    merged = merge_partials(out, lse, axis=2)[:, :, :group * n]  # (B, Hkv, rows, D)
    return merged.reshape(b, hkv, group, n, d).transpose(0, 3, 1, 2, 4).reshape(b, n, h, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("implementation", "tuning"))
def tree_attention_with_lse(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_words: jax.Array, *,
                            implementation: str | None = None,
                            tuning: TreeAttentionTuning = TreeAttentionTuning()) -> tuple[jax.Array, jax.Array]:
    """Tree attention that also returns each row's log-sum-exp: (out (B, N, H, D) fp32, lse (B, N, H)),
    so attention over keys split between caches (a shared prompt and each answer's own rows) merges
    exactly (`combine_partials`). A row that sees nothing gives zeros and -inf. "pallas" /
    "pallas_interpret" take the Triton kernel (its partials merged here, never in the kernel), "xla"
    the reference, None / "auto" the kernel on GPU."""
    if implementation in (None, "auto"):
        implementation = default_implementation()
    if implementation == "xla":
        return tree_attention_reference_with_lse(q, k, v, lengths, tree_words)
    if implementation not in ("pallas", "pallas_interpret"):
        raise ValueError(f"tree_attention_with_lse takes 'auto', 'xla', 'pallas' or 'pallas_interpret', "
                         f"not {implementation!r}")
    b, n, h, d = q.shape
    hkv = k.shape[2]
    group = h // hkv
    tuning = dataclasses.replace(tuning, merge_in_kernel=False)
    block_rows = block_rows_for(tuning, group * n)
    q_in, words = kernel_inputs(q, tree_words, hkv, block_rows)
    out, lse = tree_attention_splits(q_in, k, v, lengths, words, num_nodes=n, num_heads=h, block_rows=block_rows,
                                     tuning=tuning, interpret=implementation == "pallas_interpret")
    if head_blocked(n, block_rows):
        return merge_partials(out, lse, axis=1, with_lse=True)
    out, lse = merge_partials(out, lse, axis=2, with_lse=True)  # (B, Hkv, rows, D), (B, Hkv, rows)
    out = out[:, :, :group * n].reshape(b, hkv, group, n, d).transpose(0, 3, 1, 2, 4).reshape(b, n, h, d)
    lse = lse[:, :, :group * n].reshape(b, hkv, group, n).transpose(0, 3, 1, 2).reshape(b, n, h)
    return out, lse


def default_implementation() -> str:
    """The path a kernel's entry point takes unless one is named (every kernel here): the kernel on
    GPU, the reference elsewhere."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


# Splits from which `merge_weighted` beats `merge_partials` (H200, tree_attention_h200_mosaic_*.json):
# at 8 splits 14.3 vs 17.2 and 19.3 vs 22.0 us whole call, at 22 12.2 vs 12.6; at 2 splits 45.5 vs
# 44.9 and 23.9 vs 23.2, and 17.0 vs 15.3 at 7 with head dim 64 (a shape Mosaic is not picked for).
WEIGHTED_MERGE_FROM = 8


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def tree_attention_mosaic(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_words: jax.Array,
                          *, tuning: MosaicTreeAttentionTuning = MosaicTreeAttentionTuning(),
                          interpret: bool = False) -> jax.Array:
    """The Mosaic GPU kernel (Hopper; `mosaic_unsupported_reason` says which calls it takes) and the
    merge of its splits; same contract as `tree_attention_reference`."""
    out, lse = tree_attention_mosaic_splits(q, k, v, lengths, tree_words, tuning=tuning, interpret=interpret)
    return merge_mosaic_splits(out, lse).astype(q.dtype)


def merge_mosaic_splits(out: jax.Array, lse: jax.Array, weighted: bool | None = None) -> jax.Array:
    """The Mosaic kernel's splits, out (B, P, N, H, D) and lse (B, P, H, N), merged in fp32 by
    `merge_weighted` or per slice (`merge_partials`); None picks by the split count."""
    if weighted is None:
        weighted = out.shape[1] >= WEIGHTED_MERGE_FROM
    return merge_weighted(out, lse) if weighted else merge_partials(out, jnp.swapaxes(lse, 2, 3), axis=1)


def merge_weighted(out: jax.Array, lse: jax.Array) -> jax.Array:
    """Each split's weight exp(lse_p - lse_total) from the small lse array first, then one weighted
    sum over P (`combine_partials` over P slices became four XLA kernels at P=8)."""
    top = jnp.max(lse, axis=1, keepdims=True)
    weights = jnp.exp(lse - jnp.where(top == -jnp.inf, 0.0, top))  # an empty split weighs 0
    total = jnp.sum(weights, axis=1, keepdims=True)
    weights = jnp.swapaxes(weights / jnp.where(total == 0, 1.0, total), 2, 3)  # (B, P, N, H)
    return precision.einsum("bpnhd,bpnh->bnhd", out.astype(jnp.float32), weights)


IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_interpret", "mosaic", "mosaic_interpret")


def mosaic_preferred(q: jax.Array, k: jax.Array) -> bool:
    """Whether "auto" takes the Mosaic kernel: on Hopper, for calls it supports with head dim 128. On
    the H200 (tree_attention_h200_mosaic_*.json) it beat the Triton kernel's whole call at 11 of the
    12 tree shapes of Qwen3-8B's heads (L=4096 N=256: 45.5 against 55.9 us; not at L=1024 N=64, 14.3
    against 11.0), but at 5 of 12 of the embedded model's (9/3 heads of dim 64), none of them the
    short contexts its eval runs (L=1024 N=256: 15.4 against 10.3)."""
    if jax.default_backend() != "gpu" or q.shape[-1] != 128 or mosaic_unsupported_reason(q, k) is not None:
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def tree_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, tree_words: jax.Array, *,
                   implementation: str | None = None,
                   tuning: TreeAttentionTuning = TreeAttentionTuning(),
                   mosaic_tuning: MosaicTreeAttentionTuning = MosaicTreeAttentionTuning(),
                   pages: jax.Array | None = None) -> jax.Array:
    """Entry point. "mosaic" takes the Mosaic GPU kernel (Hopper) where it supports the call (trees of
    64k nodes) and the Triton one ("pallas") for the rest (decode steps, small trees); "auto" (or
    None) takes "mosaic" where `mosaic_preferred`, else "pallas" on GPU and "xla" (the reference)
    elsewhere. The *_interpret forms run the kernels' semantics on any backend (tests). With `pages`
    (B, pages_per_sequence), k/v are a paged pool (pages, page_size, Hkv, D), which the Triton kernel
    reads in place (the Mosaic kernel's calls go to it) and the reference gathers into rows."""
    paged = pages is not None
    if implementation in (None, "auto"):
        implementation = "mosaic" if not paged and mosaic_preferred(q, k) else default_implementation()
    if implementation == "xla":
        if paged:
            k, v = sequence_rows(k, pages), sequence_rows(v, pages)
        return tree_attention_reference(q, k, v, lengths, tree_words)
    interpret = implementation.endswith("_interpret")
    if implementation in ("mosaic", "mosaic_interpret") and not paged and mosaic_unsupported_reason(q, k) is None:
        return tree_attention_mosaic(q, k, v, lengths, tree_words, tuning=mosaic_tuning, interpret=interpret)
    if implementation in IMPLEMENTATIONS:
        return tree_attention_pallas(q, k, v, lengths, tree_words, pages, tuning=tuning, interpret=interpret)
    raise ValueError(f"unknown tree attention implementation {implementation!r}; use one of "
                     f"{', '.join(IMPLEMENTATIONS)}")


def random_tree_parents(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Parent arrays for tests and benchmarks: chain, star, deep, wide or random (parents first)."""
    if kind == "chain":
        return np.arange(-1, n - 1)
    if kind == "star":
        return np.array([-1] + [0] * (n - 1))
    if kind == "deep":  # two long branches
        return np.array([-1] + [max(0, i - 2) for i in range(1, n)])
    if kind == "wide":  # fan-out of 8 per node
        return np.array([-1] + [(i - 1) // 8 for i in range(1, n)])
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])


def ancestors_from_parents(parents: np.ndarray) -> np.ndarray:
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        if parents[i] >= 0:
            anc[i] |= anc[parents[i]]
    return anc
