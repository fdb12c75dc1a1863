"""Tree-causal drafting (jetspec-tc): the head's tree pass equals each root-to-node path run alone, the
re-selection equals best-first growth over the same pool, branch conditioning pays off, and the eval
runs the method. (Its T=0 and T>0 losslessness tests run with the other methods' in test_speculative.py.)"""

from __future__ import annotations

import dataclasses
import heapq
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import TargetGreedyDrafter, random_head
from test_speculative import PROMPTS, run_ar, run_spec

from jetspec_jax.autoregressive import GenerationConfig, prefill
from jetspec_jax.models import draft_head
from jetspec_jax.speculative import SpecConfig, mean_accepted_length
from jetspec_jax.tree import (ancestor_mask, build_tree, internal_nodes, max_internal_nodes, select_conditioned,
                              subtree, tree_causal_block)


def random_parents(rng, n: int) -> np.ndarray:
    """A random tree in insertion order: node i's parent is any earlier node."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)], np.int32)


def depths_of(parents: np.ndarray) -> np.ndarray:
    depths = np.zeros(len(parents), np.int32)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return depths


def path_to(parents: np.ndarray, i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = int(parents[i])
    return path[::-1]


def test_tree_causal_block_layout():
    """Root 0 with children 1 and 2, node 3 under 1: node slots see their ancestors, query slot 4+i
    sees node i's path and itself, never a sibling, a descendant or another query."""
    parents = jnp.asarray([-1, 0, 0, 1])
    block = tree_causal_block(jnp.asarray([7, 8, 9, 10]), jnp.asarray([0, 1, 1, 2]), ancestor_mask(parents, 3))
    assert block.tokens.tolist() == [7, 8, 9, 10, 0, 0, 0, 0]
    assert block.is_query.tolist() == [False] * 4 + [True] * 4
    assert block.depths.tolist() == [0, 1, 1, 2, 1, 2, 2, 3]
    sees = [np.flatnonzero(row).tolist() for row in np.asarray(block.mask)]
    assert sees == [[0], [0, 1], [0, 2], [0, 1, 3], [0, 4], [0, 1, 5], [0, 2, 6], [0, 1, 3, 7]]


@pytest.fixture(scope="module")
def head_and_context(tiny_qwen3):
    """A random 2-layer causal head (fp32) and its context for two sequences of different lengths."""
    target, _ = tiny_qwen3
    drafter, head = random_head(target.cfg, jax.random.key(4), attention="causal", num_layers=2)
    seq = jnp.asarray([[3, 9, 27, 81, 14, 42, 5, 6, 7, 8, 11], [4, 8, 15, 16, 23, 42, 0, 0, 0, 0, 0]])
    lengths = jnp.asarray([11, 6])
    _, taps, _ = prefill(target.params, seq, lengths, target.cfg, 32, tap_layers=drafter.cfg.tap_layers)
    ctx = draft_head.new_context(drafter.cfg, 2, 32)  # rows past the context: the kernel path's block
    ctx = draft_head.extend_context(head, ctx, taps, lengths - 1, drafter.cfg)
    return target, drafter, head, ctx, jnp.asarray([11, 42])


def path_alone_logits(target, cfg, head, ctx, b: int, tokens: list[int]) -> np.ndarray:
    """The plain causal block [anchor, path tokens..., MASK] of sequence b alone: its last slot's logits."""
    n = len(tokens) + 1
    one = jax.tree.map(lambda a: a[b: b + 1], ctx)
    x = draft_head.slot_embeddings(head, target.params, jnp.asarray([tokens + [0]]),
                                   jnp.asarray([[False] * (n - 1) + [True]]), cfg)
    hidden = draft_head.block_hidden(head, x, jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), bool)), one, cfg)
    return np.asarray(draft_head.slot_logits(head, target.params, target.cfg, hidden[:, -1], cfg))[0]


def test_tree_pass_equals_each_path_alone(head_and_context):
    """Per node, fp32: the tree pass's logits equal the path from the anchor run alone as a causal block,
    so no node sees a sibling or a descendant; the root's are the per-depth pass's depth 1."""
    target, drafter, head, ctx, anchor = head_and_context
    cfg = drafter.cfg
    rng = np.random.default_rng(0)
    n = 10
    parents = np.stack([random_parents(rng, n) for _ in range(2)])
    depths = np.stack([depths_of(p) for p in parents])
    tokens = rng.integers(0, target.cfg.vocab_size, (2, n)).astype(np.int32)
    tokens[:, 0] = np.asarray(anchor)
    ancestors = ancestor_mask(jnp.asarray(parents), int(depths.max()))
    got = np.asarray(draft_head.tree_logits(head, target.params, target.cfg, jnp.asarray(tokens), jnp.asarray(depths),
                                            ancestors, ctx, cfg))
    assert got.shape == (2, n, target.cfg.vocab_size)
    for b in range(2):
        for i in range(n):
            want = path_alone_logits(target, cfg, head, ctx, b, tokens[b, path_to(parents[b], i)].tolist())
            np.testing.assert_allclose(got[b, i], want, rtol=1e-5, atol=1e-5, err_msg=f"sequence {b}, node {i}")
    per_depth = draft_head.draft_logits(head, target.params, target.cfg, anchor, ctx, cfg, num_depths=1)
    np.testing.assert_allclose(got[:, 0], np.asarray(per_depth)[:, 0], rtol=1e-5, atol=1e-5)
    # the tree-attention kernel (interpreted) gives the same logits; its 20 slots fit the context's spare rows
    kernel = draft_head.tree_logits(head, target.params, target.cfg, jnp.asarray(tokens), jnp.asarray(depths),
                                    ancestors, ctx, cfg, attention_impl="pallas_interpret")
    np.testing.assert_allclose(np.asarray(kernel), got, rtol=1e-4, atol=1e-4)


def test_tree_pass_takes_the_kernel_where_the_drafter_keeps_rows(head_and_context, monkeypatch):
    """A tree-causal pass larger than the block runs on the kernel path when the drafter keeps rows for it
    (tree_slots), and falls back to the dense mask when it does not."""
    target, drafter, head, ctx, anchor = head_and_context
    paths = []
    real = draft_head.tree_logits

    def spy(*args, attention_impl="xla", **kwargs):
        paths.append(attention_impl)
        return real(*args, attention_impl=attention_impl, **kwargs)
    monkeypatch.setattr(draft_head, "tree_logits", spy)
    parents = np.stack([random_parents(np.random.default_rng(b), 10) for b in range(2)])
    depths = jnp.asarray(np.stack([depths_of(p) for p in parents]))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, target.cfg.vocab_size, (2, 10)), jnp.int32)
    ancestors = ancestor_mask(jnp.asarray(parents), int(depths.max()))
    kernel = dataclasses.replace(drafter, attention_impl="pallas_interpret")
    roomy = dataclasses.replace(kernel, tree_slots=20)  # 2 x 10 slots; the context's 32 rows hold 11 + 20
    assert kernel.kernel_rows == drafter.cfg.block_size < 20 == roomy.kernel_rows
    out = [d.propose_tree(head, ctx, target.params, None, tokens, depths, ancestors) for d in (kernel, roomy)]
    assert paths == ["xla", "pallas_interpret"]
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(out[0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="tree_slots must be >= 0"):
        dataclasses.replace(drafter, tree_slots=-1)


# ---- re-selection against a plain best-first reference ----

def best_first_reference(tree, cond_logps, budget: int, extend: int, max_depth: int):
    """Best-first growth one node at a time over the candidates and the offered children, written
    plainly: (token, parent, depth, score) per chosen node, in the order chosen."""
    tokens, parents, depths = (np.asarray(a) for a in (tree.tokens, tree.parents, tree.depths))
    n = int(tree.num_nodes)
    internal = sorted({int(p) for p in parents[1:n]})
    row = {v: k for k, v in enumerate(internal)}
    pool = {0: (int(tokens[0]), -1, 0, np.float32(0.0))}  # pool index -> (token, parent, depth, score)
    for u in range(1, n):
        p = int(parents[u])
        score = np.float32(pool[p][3] + np.float32(cond_logps[row[p], tokens[u]]))
        pool[u] = (int(tokens[u]), p, int(depths[u]), score)
    c = len(tokens)
    for k, v in enumerate(internal):
        order = sorted(range(cond_logps.shape[1]), key=lambda t: (-cond_logps[k, t], t))[:extend]
        children = {int(tokens[u]) for u in range(1, n) if parents[u] == v}
        for j, t in enumerate(order):
            if t not in children and depths[v] + 1 <= max_depth:
                score = np.float32(pool[v][3] + np.float32(cond_logps[k, t]))
                pool[c + k * extend + j] = (t, v, int(depths[v]) + 1, score)
    kids: dict[int, list[int]] = {}
    for idx, (_, p, _, _) in pool.items():
        if p >= 0:
            kids.setdefault(p, []).append(idx)
    chosen, heap = [], [(-0.0, 0)]
    while heap and len(chosen) < budget:
        _, idx = heapq.heappop(heap)
        chosen.append(idx)
        for child in kids.get(idx, []):
            heapq.heappush(heap, (-float(pool[child][3]), child))
    position = {idx: i for i, idx in enumerate(chosen)}
    return [(pool[i][0], position.get(pool[i][1], -1), pool[i][2], float(pool[i][3])) for i in chosen]


@pytest.mark.parametrize("candidates,width,depth,budget,extend", [
    (20, 3, 4, 8, 2), (30, 2, 6, 12, 0), (12, 4, 3, 12, 3), (25, 1, 5, 10, 2), (16, 7, 15, 30, 7)])
def test_selection_equals_best_first_growth(candidates, width, depth, budget, extend):
    """Random candidate trees and conditioned distributions, ties included (logits rounded to quarters):
    the chosen nodes, their parents, depths and scores, in order, are best-first growth's."""
    vocab = 12
    pick = jax.jit(lambda tree, lp: select_conditioned(tree, *internal_nodes(tree.parents, size), lp, budget,
                                                       extend, depth))
    size = max_internal_nodes(candidates, width, depth)
    build = jax.jit(lambda r, t, lp: build_tree(r, t, lp, candidates))
    for seed in range(8):
        rng = np.random.default_rng(seed)
        cand_tokens = np.stack([rng.permutation(vocab)[:width] for _ in range(depth)]).astype(np.int32)
        cand_logps = -np.sort(rng.integers(0, 6, (depth, width)) / 2, axis=1).astype(np.float32)
        tree = build(jnp.int32(vocab - 1), jnp.asarray(cand_tokens), jnp.asarray(cand_logps))
        parents = np.asarray(tree.parents)[: int(tree.num_nodes)]
        assert len(set(parents[1:].tolist())) <= size  # the bound the second pass is sized by
        cond = np.asarray(jax.nn.log_softmax(jnp.asarray(np.round(rng.normal(size=(size, vocab)) * 4) / 4), axis=-1))
        got = pick(tree, jnp.asarray(cond))
        want = best_first_reference(tree, cond, budget, extend, depth)
        n = len(want)
        assert int(got.num_nodes) == n and np.asarray(got.valid).tolist() == [i < n for i in range(budget)]
        assert np.asarray(got.tokens)[:n].tolist() == [w[0] for w in want]
        assert np.asarray(got.parents)[:n].tolist() == [w[1] for w in want]
        assert np.asarray(got.depths)[:n].tolist() == [w[2] for w in want]
        np.testing.assert_array_equal(np.asarray(got.scores)[:n], np.asarray([w[3] for w in want], np.float32))
        # siblings carry distinct tokens (acceptance follows at most one child)
        pairs = [(w[1], w[0]) for w in want[1:]]
        assert len(pairs) == len(set(pairs))


def test_subtree_of_the_internal_nodes():
    parents = jnp.asarray([-1, 0, 0, 1, 1, 3, -1, -1])
    tree = build_tree(jnp.int32(0), jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2)), 8)._replace(
        parents=parents, tokens=jnp.arange(8) + 50, depths=jnp.asarray([0, 1, 1, 2, 2, 3, 0, 0]),
        ancestors=ancestor_mask(parents, 3))
    nodes, real = internal_nodes(parents, 4)
    assert nodes.tolist()[:3] == [0, 1, 3] and real.tolist() == [True, True, True, False]
    tokens, depths, ancestors = subtree(tree, nodes, real)
    assert tokens.tolist() == [50, 51, 53, 0] and depths.tolist() == [0, 1, 2, 0]
    assert np.asarray(ancestors).astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]]


@pytest.mark.parametrize("budget,width,depth", [(8, 3, 4), (64, 7, 15), (256, 7, 15), (40, 1, 15), (30, 2, 3)])
def test_internal_node_bound_holds_for_the_builder(budget, width, depth):
    """However the scores fall, best-first trees have at most max_internal_nodes parents."""
    build = jax.jit(lambda lp: build_tree(jnp.int32(0), jnp.zeros((depth, width), jnp.int32), lp, budget))
    bound = max_internal_nodes(budget, width, depth)
    for seed in range(4):
        logps = -np.sort(np.random.default_rng(seed).exponential(2.0 * seed + 0.01, (depth, width)), axis=1)
        tree = build(jnp.asarray(logps, jnp.float32))
        assert len(set(np.asarray(tree.parents)[1: int(tree.num_nodes)].tolist())) <= bound


# ---- generation ----

def test_branches_conditioned_on_their_own_tokens_accept_more(tiny_qwen3):
    """Sampling (T=0.5) with a drafter whose per-depth distributions follow the target's greedy chain:
    a sampled token off that chain leaves jetspec's deeper candidates conditioned on the wrong prefix,
    while jetspec-tc's second pass gives every branch the target's own continuation, so the same budget
    accepts more tokens per verify pass (1.84 against 1.98 with this seed)."""
    from jetspec_jax.sampling import SamplingConfig

    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=16, sampling=SamplingConfig(temperature=0.5))
    drafter = TargetGreedyDrafter(target.cfg, 4, sharpness=1.0)
    tau = {method: float(mean_accepted_length(run_spec(target, drafter, None, PROMPTS * 16, gen,
                                                       SpecConfig(method, 16, 4), key=3)))
           for method in ("jetspec", "jetspec-tc")}
    assert tau["jetspec-tc"] > tau["jetspec"] + 0.05, tau


def test_second_pass_on_the_kernel_is_lossless_at_t0(tiny_qwen3):
    """jetspec-tc with the head's tree kernel (interpreted) for both passes, rows kept for the second one
    (as generate sizes them): the output is AR's."""
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=12)
    drafter, head = random_head(target.cfg, jax.random.key(1), attention="causal")
    spec = SpecConfig("jetspec-tc", 8, 3)
    slots = spec.tree_pass_slots(spec.depth(drafter.max_depth))
    assert slots > drafter.cfg.block_size  # the pass the dense path used to take
    kernel = dataclasses.replace(drafter, attention_impl="pallas_interpret").for_specs([spec])
    assert kernel.tree_slots == slots
    want, want_n = run_ar(target, PROMPTS[:2], gen)
    out = run_spec(target, kernel, head, PROMPTS[:2], gen, spec)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


def test_tree_causal_needs_a_causal_head_and_a_tree_pass(tiny_qwen3):
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=4)
    drafter, head = random_head(target.cfg, jax.random.key(1), attention="bidirectional")
    with pytest.raises(ValueError, match="tree-causal drafting needs a causal \\(JetSpec\\) head"):
        run_spec(target, drafter, head, PROMPTS[:1], gen, SpecConfig("jetspec-tc", 8, 2))

    class NoTreePass(TargetGreedyDrafter):
        propose_tree = None

    with pytest.raises(ValueError, match="needs a drafter with a tree-causal pass"):
        run_spec(target, NoTreePass(target.cfg, 3), None, PROMPTS[:1], gen, SpecConfig("jetspec-tc", 8, 2))


def test_eval_runs_jetspec_tc_with_the_jetspec_head(embedded_target, tmp_path, monkeypatch):
    """The eval harness knows jetspec-tc (opt-in: not in the default methods), runs it with the causal
    head shipped for the target, and records its tokens as AR's in fp32."""
    from jetspec_jax.eval import runner
    from jetspec_jax.eval.__main__ import main
    from jetspec_jax.eval.heads import resolve_heads
    from jetspec_jax.eval.records import read_lines
    from jetspec_jax.loading.head_checkpoint import packaged_head_path
    from jetspec_jax.train.config import DEFAULT_DATA_DIR

    heads = resolve_heads(("ar", "jetspec-tc"), {}, embedded_target, allow_untrained=False)
    assert set(heads) == {"jetspec"} and heads["jetspec"].path == packaged_head_path(embedded_target, "jetspec")
    assert runner.method_budgets(("ar", "jetspec-tc"), (64, 16), heads) == [("ar", None), ("jetspec-tc", 16),
                                                                           ("jetspec-tc", 64)]
    assert "jetspec-tc" in runner.METHODS and "jetspec-tc" not in runner.EvalConfig().methods
    if not os.path.isdir(DEFAULT_DATA_DIR):
        pytest.skip(f"no data at {DEFAULT_DATA_DIR}")
    monkeypatch.setattr(runner, "load_target", lambda *args, **kwargs: embedded_target)
    results = tmp_path / "results.jsonl"
    assert main(["run", "--benchmarks", "gsm8k", "--methods", "jetspec-tc", "--budgets", "16", "--limit", "1",
                 "--max-new-tokens", "12", "--no-progress", "--results", str(results)]) == 0
    lines = {line["method"]: line for line in read_lines(str(results))}
    assert sorted(lines) == ["ar", "jetspec-tc"]
    assert lines["jetspec-tc"]["matches_ar"] is True and lines["jetspec-tc"]["width"] == 7
