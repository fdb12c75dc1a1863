"""Jitted speculative generation: draft a tree in one head pass, verify it in one target pass.

The whole loop runs in one `lax.while_loop` with per-sequence trees, lengths, acceptance and stopping;
the host sees results once. Invariant per sequence: the target cache holds every committed token but
the newest (the anchor), and the drafter has seen the taps of exactly those cached tokens.

Methods: `jetspec` (causal head, best-first tree), `ddtree` (bidirectional head, best-first tree),
`dflash` (bidirectional head, a chain of each depth's top-1 token), `jetspec-tc` (causal head,
tree-causal: a candidate tree from the per-depth pass, a second head pass over it in which every node
sees only its own ancestors, and the tree re-selected by path-conditioned log-probability).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jetspec_jax import draft_vocab
from jetspec_jax.autoregressive import GenerationConfig, is_stop_token, prefill
from jetspec_jax.kernels.attention import IMPLEMENTATIONS as ATTENTION_IMPLS
from jetspec_jax.kernels.cache_compact import IMPLEMENTATIONS as COMPACT_IMPLS
from jetspec_jax.kernels.head_attention import IMPLEMENTATIONS as DRAFT_ATTENTION_IMPLS  # noqa: F401 (re-exported)
from jetspec_jax.kernels.head_attention import check_implementation as check_draft_attention  # noqa: F401 (re-exported)
from jetspec_jax.kernels.head_attention import resolve_implementation as resolve_draft_attention
from jetspec_jax.kernels.top_k import IMPLEMENTATIONS as TOP_K_IMPLS
from jetspec_jax.kernels.tree_build import IMPLEMENTATIONS as TREE_IMPLS
from jetspec_jax.kernels.tree_build import build_trees
from jetspec_jax.kv_cache import KVCache, write_block
from jetspec_jax.models import draft_head, qwen3
from jetspec_jax.sampling import RowSampling, row_keys, select_tokens
from jetspec_jax.tree import (Tree, internal_nodes, max_internal_nodes, select_conditioned, subtree, top_candidates,
                              validate_tree_settings)
from jetspec_jax.verify import accept, compact_cache, verify_tree

# the head's: a dense mask or the tree kernel; auto = the kernel on GPU (it drafts 1.1-1.8x faster on the H200,
# jetspec-tc's second pass 1.1-4x: benchmarks/results/spec_step_breakdown_tree_causal_batch*_h200.json)

METHODS = ("jetspec", "ddtree", "dflash", "jetspec-tc")
ATTENTION_OF_METHOD = {"jetspec": "causal", "jetspec-tc": "causal", "ddtree": "bidirectional",
                       "dflash": "bidirectional"}  # the head each method drafts with
TREE_CAUSAL_METHODS = ("jetspec-tc",)
# jetspec-tc's candidate tree (pass 1) is this many times the verified budget by default: the second
# pass reads only its nodes that have children, about candidates / width of them
CANDIDATE_FACTOR = 4

# XLA options per GEMM backend of the generation executable (GPU only; other backends ignore them).
# "xla" keeps XLA's autotuned Triton GEMMs; "cublas" sends every dot to cuBLAS, which on the H200
# made the embedded target's B=256 step 11% faster and its B=16 step 7% slower
# (benchmarks/results/spec_step_breakdown_gemm_*_h200.json)
GEMM_BACKENDS = {"xla": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}


def check_tree_temperature(value: float) -> None:
    """Shared by SpecConfig and the eval's settings (checked there before the target loads)."""
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"tree_temperature must be a positive number, got {value}")


def check_gemm_backend(value: str) -> None:
    """Shared by SpecConfig and the eval's settings (checked there before the target loads)."""
    if value not in GEMM_BACKENDS:
        raise ValueError(f"gemm_backend {value!r} is not one of {', '.join(GEMM_BACKENDS)}")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    method: str = "jetspec"
    budget: int = 64  # tree nodes verified per step, the root included
    width: int = 7  # candidates per depth (ignored by dflash, which uses 1)
    max_depth: int | None = None  # None: as deep as the drafter predicts
    attention_impl: str = "auto"  # verify attention (kernels.attention.IMPLEMENTATIONS); auto = a Pallas kernel on GPU
    tree_impl: str = "auto"  # tree builder (kernels.tree_build.IMPLEMENTATIONS); auto = Pallas kernel on GPU
    compact_impl: str = "auto"  # cache compaction (kernels.cache_compact.IMPLEMENTATIONS); auto = Pallas on GPU
    top_k_impl: str = "auto"  # the per-depth top-W over the vocabulary (kernels.top_k); auto = Pallas on GPU
    tree_temperature: float = 1.0  # the head's logits are divided by it before the tree is scored: 1 is the
    # published accum_logp; below 1 sharpens the per-depth distributions, so the best-first growth goes
    # deeper along likely paths. Only which nodes are drafted changes: the output stays exact
    gemm_backend: str = "xla"  # the GEMM library of the whole generation executable (GEMM_BACKENDS)
    # jetspec-tc only: nodes of the candidate tree grown from the per-depth pass (None: CANDIDATE_FACTOR x
    # budget), and how many of each candidate parent's top path-conditioned tokens it may add as new
    # children (None: width; 0: only re-score the candidates)
    candidate_budget: int | None = None
    conditioned_width: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not one of {METHODS}")
        check_tree_causal_settings(self.method, self.budget, self.candidate_budget, self.conditioned_width)
        check_tree_temperature(self.tree_temperature)
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl {self.attention_impl!r} is not one of {', '.join(ATTENTION_IMPLS)}")
        if self.tree_impl not in TREE_IMPLS:
            raise ValueError(f"tree_impl {self.tree_impl!r} is not one of {', '.join(TREE_IMPLS)}")
        if self.compact_impl not in COMPACT_IMPLS:
            raise ValueError(f"compact_impl {self.compact_impl!r} is not one of {', '.join(COMPACT_IMPLS)}")
        if self.top_k_impl not in TOP_K_IMPLS:
            raise ValueError(f"top_k_impl {self.top_k_impl!r} is not one of {', '.join(TOP_K_IMPLS)}")
        check_gemm_backend(self.gemm_backend)
        validate_tree_settings(self.budget, self.width, self.max_depth if self.max_depth is not None else 1)

    def depth(self, drafter_depth: int) -> int:
        depth = drafter_depth if self.max_depth is None else self.max_depth
        validate_tree_settings(self.budget, self.width, depth, drafter_depth)
        return depth

    @property
    def tree_width(self) -> int:
        return 1 if self.method == "dflash" else self.width

    def expected_attention(self) -> str:
        return ATTENTION_OF_METHOD[self.method]

    @property
    def tree_causal(self) -> bool:
        return self.method in TREE_CAUSAL_METHODS

    @property
    def candidates(self) -> int:
        """jetspec-tc: nodes of the pass-1 candidate tree."""
        return self.candidate_budget or CANDIDATE_FACTOR * self.budget

    @property
    def extend_width(self) -> int:
        """jetspec-tc: new children each candidate parent may get from its conditioned distribution."""
        return self.width if self.conditioned_width is None else self.conditioned_width

    def conditioned_nodes(self, depth: int) -> int:
        """jetspec-tc: nodes the second pass reads (a bound on the candidate tree's parents)."""
        return max_internal_nodes(self.candidates, self.tree_width, depth)

    def tree_pass_slots(self, depth: int) -> int:
        """jetspec-tc: block slots of the second pass, a node slot and a query slot per conditioned node."""
        return 2 * self.conditioned_nodes(depth)


def check_tree_causal_settings(method: str, budget: int, candidate_budget: int | None,
                               conditioned_width: int | None) -> None:
    """jetspec-tc's own settings (shared by SpecConfig and the command lines)."""
    problems = []
    if method not in TREE_CAUSAL_METHODS:
        given = [name for name, value in (("candidate_budget", candidate_budget),
                                          ("conditioned_width", conditioned_width)) if value is not None]
        if given:
            problems.append(f"{' and '.join(given)} only apply to {', '.join(TREE_CAUSAL_METHODS)}, not to "
                            f"method {method!r}")
    else:
        if budget < 2:
            problems.append(f"method {method!r} needs budget >= 2 (the root and at least one drafted node), "
                            f"got {budget}")
        if candidate_budget is not None and candidate_budget < budget:
            problems.append(f"candidate_budget ({candidate_budget}) must be >= budget ({budget}): the "
                            "candidate tree is what the verified tree is chosen from")
        if conditioned_width is not None and conditioned_width < 0:
            problems.append(f"conditioned_width must be >= 0, got {conditioned_width}")
    if problems:
        raise ValueError("invalid tree-causal settings: " + "; ".join(problems))


@dataclasses.dataclass(frozen=True)
class HeadDrafter:
    """Drafts with a parallel draft head; its state is the head's context K/V cache (a KVCache, as any
    drafter's state is: the server's slots page it under the target's page table)."""

    cfg: draft_head.DraftConfig
    target_cfg: qwen3.Config
    attention_impl: str = "auto"  # one of DRAFT_ATTENTION_IMPLS, held resolved ("auto" becomes xla or pallas)
    # jetspec-tc: slots of the tree-causal pass (SpecConfig.tree_pass_slots) that the kernel path keeps
    # rows free for past the context; a pass with more slots than this and the block falls back to "xla",
    # whose dense mask spans the whole context buffer
    tree_slots: int = 0

    def __post_init__(self):
        draft_head.check_pairing(self.cfg, self.target_cfg)
        if self.tree_slots < 0:
            raise ValueError(f"tree_slots must be >= 0, got {self.tree_slots}")
        # resolved here, so that kernel_rows and the jit cache key see the implementation that runs
        object.__setattr__(self, "attention_impl", resolve_draft_attention(self.attention_impl))

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.cfg.tap_layers

    @property
    def max_depth(self) -> int:
        return self.cfg.max_depth

    def for_specs(self, specs: Iterable[SpecConfig]) -> HeadDrafter:
        """This drafter keeping rows for the largest tree-causal pass of `specs` (kernel_rows counts them
        where the kernel path runs), so that every one of them runs on the kernel too."""
        slots = max((s.tree_pass_slots(s.depth(self.max_depth)) for s in specs if s.tree_causal), default=0)
        return dataclasses.replace(self, tree_slots=slots)

    @property
    def kernel_rows(self) -> int:
        """Rows the kernel path writes past the longest context: the block, or a tree-causal pass."""
        return 0 if self.attention_impl == "xla" else max(self.cfg.block_size, self.tree_slots)

    def init_state(self, params, batch: int, max_len: int, dtype, page_size: int | None = None,
                   num_pages: int | None = None):
        """The head's context for sequences of `max_len` rows and the kernel path's rows past them; with
        `page_size`, paged as the target's cache is. With `num_pages` (a pool whose table the caller
        fills, as the server's, sharing the target's) the table spans `max_len` rows: the caller's pages
        reach the kernel rows."""
        rows = max_len if num_pages is not None else max_len + self.kernel_rows
        return draft_head.new_context(self.cfg, batch, rows, dtype, page_size, num_pages)

    def observe(self, params, state, taps, counts):
        return draft_head.extend_context(params, state, taps, counts, self.cfg)

    def propose(self, params, state, target_params, target_cache: KVCache, anchor, num_depths: int):
        return draft_head.draft_logits(params, target_params, self.target_cfg, anchor, state, self.cfg,
                                       num_depths=num_depths, attention_impl=self.attention_impl)

    def propose_tree(self, params, state, target_params, target_cache: KVCache, tokens, depths, ancestors):
        """Path-conditioned child logits (B, N, V) of every node of a tree (draft_head.tree_logits)."""
        if self.cfg.attention != "causal":
            raise ValueError(f"tree-causal drafting needs a causal (JetSpec) head; this head's attention is "
                             f"{self.cfg.attention if isinstance(self.cfg.attention, str) else 'an explicit mask'}")
        impl = self.attention_impl if 2 * tokens.shape[1] <= self.kernel_rows else "xla"
        return draft_head.tree_logits(params, target_params, self.target_cfg, tokens, depths, ancestors, state,
                                      self.cfg, attention_impl=impl)


class SpecOutput(NamedTuple):
    tokens: jax.Array  # (B, max_new_tokens), pad after each sequence's end
    num_tokens: jax.Array  # (B,) generated tokens, EOS included
    target_forwards: jax.Array  # (B,) verify passes while the sequence was live (prefill excluded)
    accept_counts: jax.Array  # (B, D+1) how often 0..D draft tokens were accepted in one step


def speculative_cache_rows(budget: int, depth: int) -> int:
    """Scratch rows a step writes past the committed length (the tree, then the compacted path)."""
    return max(budget, depth + 1)


def speculative_generate(params: Any, drafter_params: Any, prompt_tokens: jax.Array, prompt_lens: jax.Array,
                         keys: jax.Array, *, cfg: qwen3.Config, drafter, spec: SpecConfig,
                         gen: GenerationConfig, cache_len: int) -> SpecOutput:
    """prompt_tokens (B, P) right-padded; cache_len >= P + max_new_tokens + speculative_cache_rows.
    `keys` as autoregressive.generate_tokens takes them: with the same keys, a row commits exactly the
    tokens AR decoding draws, at any temperature. Jitted (by `spec.gemm_backend`'s executable);
    `jitted_generate` gives the jitted function itself."""
    return jitted_generate(spec.gemm_backend)(params, drafter_params, prompt_tokens, prompt_lens, keys, cfg=cfg,
                                              drafter=drafter, spec=spec, gen=gen, cache_len=cache_len)


def jitted_generate(gemm_backend: str):
    """The jitted generation loop compiled for one GEMM backend (for `.lower(...).compile()`)."""
    check_gemm_backend(gemm_backend)
    return _JITTED[gemm_backend]


class StepOutput(NamedTuple):
    tokens: jax.Array  # (B, D+1) accepted drafts then the bonus; pad for sequences that were not live
    num_committed: jax.Array  # (B,) tokens of `tokens` that count (0 where not live), cut at EOS and limit
    hit_eos: jax.Array  # (B,) a committed token is a stop token
    accept_len: jax.Array  # (B,) drafts accepted
    anchor: jax.Array
    cache: KVCache
    state: Any


def speculative_step(params: Any, drafter_params: Any, anchor: jax.Array, cache: KVCache, state: Any,
                     live: jax.Array, remaining: jax.Array, choose, *, cfg: qwen3.Config, drafter,
                     spec: SpecConfig, depth: int, eos_token_ids: tuple[int, ...], pad_token_id: int) -> StepOutput:
    """One step for every sequence: draft a tree, verify it, accept, commit. `params` are fused for
    decode; `choose(logits (B, N, V), depths (B, N)) -> (B, N)` gives the target's token at every node
    (argmax or a sample); `remaining` (B,) caps the committed tokens; sequences that are not `live` commit nothing."""
    taps_wanted = tuple(drafter.tap_layers)
    tree = draft_tree(params, drafter_params, anchor, cache, state, drafter=drafter, spec=spec, depth=depth)
    logits, node_taps, cache = verify_tree(params, tree, cache, cfg, taps_wanted, spec.attention_impl)
    result = accept(tree, choose(logits, tree.depths), depth)

    # commit accepted drafts + bonus, cut at EOS and at the sequence's limit
    slot = jnp.arange(depth + 1, dtype=jnp.int32)[None]
    n_commit = result.accept_len + 1
    stop = is_stop_token(result.tokens, eos_token_ids) & (slot < n_commit[:, None])
    hit_eos = jnp.any(stop, axis=-1)
    n_commit = jnp.where(hit_eos, jnp.argmax(stop, axis=-1) + 1, n_commit)
    n_commit = jnp.where(live, jnp.minimum(n_commit, remaining), 0)

    keep = jnp.where(live, result.accept_len + 1, 0)  # root + accepted nodes enter the cache
    cache = compact_cache(cache, result.path, keep, spec.compact_impl)
    if taps_wanted:
        path_taps = jax.vmap(lambda t, p: t[p])(node_taps, result.path)
        state = drafter.observe(drafter_params, state, path_taps, keep)
    return StepOutput(tokens=jnp.where(live[:, None], result.tokens, pad_token_id), num_committed=n_commit,
                      hit_eos=hit_eos & live, accept_len=result.accept_len,
                      anchor=jnp.where(live, result.bonus, anchor), cache=cache, state=state)


def draft_tree(params: Any, drafter_params: Any, anchor: jax.Array, cache: KVCache, state: Any, *, drafter,
               spec: SpecConfig, depth: int) -> Tree:
    """The step's draft tree (B sequences, padded to spec.budget): best-first growth on the head's
    per-depth distributions; for jetspec-tc that tree (spec.candidates nodes) is the candidate set of
    a tree-causal second pass (`tree_causal_pass`, `select_trees`)."""
    draft = drafter.propose(drafter_params, state, params, cache, anchor, depth)  # (B, D, V) or a draft vocabulary
    widest = max(spec.tree_width, spec.extend_width if spec.tree_causal else 0)
    if draft.shape[-1] < widest:
        raise ValueError(f"the head drafts over {draft.shape[-1]} tokens (its draft vocabulary), fewer than the "
                         f"{widest} candidates a tree node takes: give a larger --draft-vocab or a smaller width")
    cand_tokens, cand_logps = top_candidates(jax.nn.log_softmax(draft / spec.tree_temperature, axis=-1),
                                             spec.tree_width, implementation=spec.top_k_impl)
    cand_tokens = draft_vocab.to_token_ids(drafter_params, cand_tokens)
    if not spec.tree_causal:
        return build_trees(anchor, cand_tokens, cand_logps, budget=spec.budget, implementation=spec.tree_impl)
    candidates = build_trees(anchor, cand_tokens, cand_logps, budget=spec.candidates, implementation=spec.tree_impl)
    nodes, real, cond_logps = tree_causal_pass(params, drafter_params, candidates, cache, state, drafter=drafter,
                                               spec=spec, depth=depth)
    return select_trees(candidates, nodes, real, cond_logps, spec=spec, depth=depth, drafter_params=drafter_params)


def tree_causal_pass(params: Any, drafter_params: Any, candidates: Tree, cache: KVCache, state: Any, *, drafter,
                     spec: SpecConfig, depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """jetspec-tc's second head pass: the candidate tree's nodes that have children (their paths are
    made of such nodes) go through the head with the tree-causal mask. Returns those nodes (B, P),
    which of them are real (B, P), and each one's log-distribution of its children given its path
    (B, P, V), scaled by the tree temperature as the first pass's."""
    if getattr(drafter, "propose_tree", None) is None:
        raise ValueError(f"method {spec.method!r} needs a drafter with a tree-causal pass (propose_tree); "
                         f"{type(drafter).__name__} has none")
    nodes, real = jax.vmap(lambda p: internal_nodes(p, spec.conditioned_nodes(depth)))(candidates.parents)
    tokens, depths, ancestors = subtree(candidates, nodes, real)
    logits = drafter.propose_tree(drafter_params, state, params, cache, tokens, depths, ancestors)
    return nodes, real, jax.nn.log_softmax(logits / spec.tree_temperature, axis=-1)


def select_trees(candidates: Tree, nodes: jax.Array, real: jax.Array, cond_logps: jax.Array, *, spec: SpecConfig,
                 depth: int, drafter_params: Any = None) -> Tree:
    """The verified trees: spec.budget nodes of each candidate tree (and its offered children) by
    path-conditioned score (`tree.select_conditioned`); cond_logps over the head's draft vocabulary
    where `drafter_params` carry one."""
    def to_draft(tokens):
        return draft_vocab.to_draft_ids(drafter_params, tokens)

    def to_target(ids):
        return draft_vocab.to_token_ids(drafter_params, ids)

    return jax.vmap(lambda t, n, r, lp: select_conditioned(t, n, r, lp, spec.budget, spec.extend_width, depth,
                                                           top_k_impl=spec.top_k_impl, to_draft=to_draft,
                                                           to_target=to_target))(
        candidates, nodes, real, cond_logps)


def _generate(params: Any, drafter_params: Any, prompt_tokens: jax.Array, prompt_lens: jax.Array,
              keys: jax.Array, *, cfg: qwen3.Config, drafter, spec: SpecConfig,
              gen: GenerationConfig, cache_len: int) -> SpecOutput:
    b = prompt_tokens.shape[0]
    depth = spec.depth(drafter.max_depth)
    taps_wanted = tuple(drafter.tap_layers)
    params = qwen3.fuse_for_decode(params)
    dtype = params["embed"].dtype

    logits, taps, cache = prefill(params, prompt_tokens, prompt_lens, cfg, cache_len, tap_layers=taps_wanted,
                                  page_size=gen.kv_page_size)
    state = drafter.init_state(drafter_params, b, cache_len, dtype, gen.kv_page_size)
    if taps_wanted:
        state = drafter.observe(drafter_params, state, taps, prompt_lens)
    keys, rows = row_keys(keys, b), RowSampling.uniform(gen.sampling, b)
    first = select_tokens(logits, keys, rows, jnp.zeros((b,), jnp.int32))
    out = jnp.full((b, gen.max_new_tokens + depth + 1), gen.pad_token_id, jnp.int32).at[:, 0].set(first)
    done = is_stop_token(first, gen.eos_token_ids) | (gen.max_new_tokens <= 1)
    zeros = jnp.zeros((b,), jnp.int32)
    carry = (first, cache, state, out, jnp.ones((b,), jnp.int32), done, zeros,
             jnp.zeros((b, depth + 1), jnp.int32))

    def cond(carry):
        return ~jnp.all(carry[5])

    def body(carry):
        anchor, cache, state, out, num, done, forwards, counts = carry
        live = ~done
        step = speculative_step(params, drafter_params, anchor, cache, state, live, gen.max_new_tokens - num,
                                lambda logits, depths: select_tokens(logits, keys, rows, num[:, None] + depths),
                                cfg=cfg, drafter=drafter, spec=spec, depth=depth, eos_token_ids=gen.eos_token_ids,
                                pad_token_id=gen.pad_token_id)
        out = write_block(out, step.tokens, num)
        num = num + step.num_committed
        done = done | step.hit_eos | (num >= gen.max_new_tokens)
        forwards = forwards + live.astype(jnp.int32)
        slot = jnp.arange(depth + 1, dtype=jnp.int32)[None]
        counts = counts + (live[:, None] & (slot == step.accept_len[:, None])).astype(jnp.int32)
        return step.anchor, step.cache, step.state, out, num, done, forwards, counts

    _, _, _, out, num, _, forwards, counts = lax.while_loop(cond, body, carry)
    positions = jnp.arange(gen.max_new_tokens)[None]
    tokens = jnp.where(positions < num[:, None], out[:, : gen.max_new_tokens], gen.pad_token_id)
    return SpecOutput(tokens=tokens, num_tokens=num, target_forwards=forwards, accept_counts=counts)


_JITTED = {name: jax.jit(_generate, static_argnames=("cfg", "drafter", "spec", "gen", "cache_len"),
                         compiler_options=options)
           for name, options in GEMM_BACKENDS.items()}


def mean_accepted_length(output: SpecOutput) -> jax.Array:
    """tau: tokens committed per verify pass (accepted drafts + bonus), over the batch."""
    committed = jnp.sum(output.num_tokens - 1)  # the first token comes from prefill
    return committed / jnp.maximum(jnp.sum(output.target_forwards), 1)
