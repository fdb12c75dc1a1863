"""Speculative generation is lossless: token-identical to AR greedy at T=0 and distributed exactly
like AR sampling at T>0; the cache after a step equals the cache AR decoding builds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from drafters import TargetGreedyDrafter, random_head

from jetspec_jax.autoregressive import GenerationConfig, generate_tokens
from jetspec_jax.speculative import (ATTENTION_OF_METHOD, SpecConfig, jitted_generate, mean_accepted_length,
                                     speculative_cache_rows, speculative_generate)
from jetspec_jax.tokens import pad_prompts

PROMPTS = [[5, 12, 40], [7, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11], [90, 3], [33, 34, 35, 36, 37]]


def run_ar(target, prompts, gen):
    tokens, lengths = pad_prompts(prompts, pad_id=0, bucket=16)
    out = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                          cfg=target.cfg, gen=gen, cache_len=tokens.shape[1] + gen.max_new_tokens)
    return np.asarray(out.tokens), np.asarray(out.num_tokens)


def run_spec(target, drafter, drafter_params, prompts, gen, spec, key=0):
    tokens, lengths = pad_prompts(prompts, pad_id=0, bucket=16)
    depth = spec.depth(drafter.max_depth)
    cache_len = tokens.shape[1] + gen.max_new_tokens + speculative_cache_rows(spec.budget, depth)
    return speculative_generate(target.params, drafter_params, jnp.asarray(tokens), jnp.asarray(lengths),
                                jax.random.key(key), cfg=target.cfg, drafter=drafter, spec=spec, gen=gen,
                                cache_len=cache_len)


@pytest.mark.parametrize("method,budget,width,batch,settings", [
    ("jetspec", 1, 4, 4, {}), ("jetspec", 5, 2, 4, {}), ("jetspec", 24, 4, 4, {}), ("ddtree", 16, 3, 4, {}),
    ("dflash", 8, 7, 4, {}), ("jetspec-tc", 2, 1, 4, {}), ("jetspec-tc", 8, 3, 3, {}), ("jetspec-tc", 24, 4, 4, {}),
    ("jetspec-tc", 16, 7, 1, dict(candidate_budget=16, conditioned_width=0)),
    ("jetspec-tc", 12, 2, 2, dict(candidate_budget=48, conditioned_width=5))])
def test_random_head_is_lossless_at_t0(tiny_qwen3, method, budget, width, batch, settings):
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=24)
    drafter, head = random_head(target.cfg, jax.random.key(1), attention=ATTENTION_OF_METHOD[method])
    want, want_n = run_ar(target, PROMPTS[:batch], gen)
    out = run_spec(target, drafter, head, PROMPTS[:batch], gen, SpecConfig(method, budget, width, **settings))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)


@pytest.mark.parametrize("method,budget,width,depth", [
    ("jetspec", 7, 1, 6), ("jetspec", 40, 3, 6), ("jetspec", 32, 7, 4), ("jetspec-tc", 7, 1, 6),
    ("jetspec-tc", 40, 3, 6), ("jetspec-tc", 16, 2, 4)])
def test_good_drafter_is_lossless_and_accepts_to_the_depth_limit(tiny_qwen3, method, budget, width, depth):
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=41)
    drafter = TargetGreedyDrafter(target.cfg, depth)
    want, _ = run_ar(target, PROMPTS, gen)
    out = run_spec(target, drafter, None, PROMPTS, gen, SpecConfig(method, budget, width))
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    # every step accepts all `depth` drafts (+ bonus) except possibly the last, cut by max_new_tokens
    steps = -(-40 // (depth + 1))
    assert np.asarray(out.target_forwards).tolist() == [steps] * len(PROMPTS)
    assert float(mean_accepted_length(out)) == pytest.approx(40 / steps)
    assert (np.asarray(out.accept_counts)[:, depth] >= steps - 1).all()


def test_tree_temperature_changes_the_tree_not_the_output(tiny_qwen3):
    """The drafter's chain is always right but its distributions are as flat as the tiny target's:
    scored as they are, best-first growth fills whole fan-outs near the root; sharpened (logits / 0.05)
    it follows the chain deeper, so fewer verify passes give the same tokens."""
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=30)
    want, _ = run_ar(target, PROMPTS, gen)
    drafter = TargetGreedyDrafter(target.cfg, 6, sharpness=1.0)
    passes = {}
    for t in (1.0, 0.05):
        out = run_spec(target, drafter, None, PROMPTS, gen, SpecConfig("jetspec", 22, 7, tree_temperature=t))
        np.testing.assert_array_equal(np.asarray(out.tokens), want)
        passes[t] = int(np.asarray(out.target_forwards).sum())
    assert passes[0.05] < passes[1.0]


def test_cublas_gemm_backend_is_its_own_executable_with_the_same_tokens(tiny_qwen3):
    """On the CPU the GEMM option changes nothing, but compiling with it checks that this XLA still
    knows the option (an unknown one is an error)."""
    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=20)
    drafter, head = random_head(target.cfg, jax.random.key(1), attention="causal")
    want, want_n = run_ar(target, PROMPTS, gen)
    out = run_spec(target, drafter, head, PROMPTS, gen, SpecConfig("jetspec", 16, 4, gemm_backend="cublas"))
    np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
    np.testing.assert_array_equal(np.asarray(out.tokens), want)
    assert jitted_generate("cublas") is not jitted_generate("xla")
    with pytest.raises(ValueError, match="gemm_backend 'cudnn' is not one of xla, cublas"):
        SpecConfig("jetspec", gemm_backend="cudnn")


def test_eos_and_batch_stopping_match_ar(tiny_qwen3):
    target, _ = tiny_qwen3
    free, _ = run_ar(target, PROMPTS, GenerationConfig(max_new_tokens=20))
    eos = int(free[0, 5])
    gen = GenerationConfig(max_new_tokens=20, eos_token_ids=(eos,), pad_token_id=-1)
    want, want_n = run_ar(target, PROMPTS, gen)
    for drafter, params in [(TargetGreedyDrafter(target.cfg, 5), None),
                            random_head(target.cfg, jax.random.key(2))]:
        out = run_spec(target, drafter, params, PROMPTS, gen, SpecConfig("jetspec", 16, 3))
        np.testing.assert_array_equal(np.asarray(out.num_tokens), want_n)
        np.testing.assert_array_equal(np.asarray(out.tokens), want)


@pytest.mark.slow
def test_embedded_model_lossless_at_t0(embedded_target):
    """Drafts that are the target's own greedy tokens: nearly every node accepted, still AR's output. (Trained
    and random heads on this model: test_generate_api.py.)"""
    from jetspec_jax.tokens import encode_prompts

    prompts = encode_prompts(embedded_target.tokenizer, ["What is 12 times 12?", "Name three primary colors."])
    gen = GenerationConfig(max_new_tokens=32)
    want, _ = run_ar(embedded_target, prompts, gen)
    good = run_spec(embedded_target, TargetGreedyDrafter(embedded_target.cfg, 7), None, prompts, gen,
                    SpecConfig("jetspec", 16, 2))
    np.testing.assert_array_equal(np.asarray(good.tokens), want)
    assert float(mean_accepted_length(good)) > 6.0


def exact_token_distributions(target, prompt, sampling):
    """Exact target probabilities of (t1, t2) jointly and of t3, by enumerating the vocabulary."""
    from jetspec_jax.models import qwen3
    from jetspec_jax.sampling import RowSampling, filtered_logits

    v = target.cfg.vocab_size

    def next_probs(seqs):
        seqs = jnp.asarray(seqs)
        cache = qwen3.new_cache(target.cfg, seqs.shape[0], seqs.shape[1])
        pos = jnp.broadcast_to(jnp.arange(seqs.shape[1]), seqs.shape)
        logits, _, _ = qwen3.forward(target.params, seqs, pos, cache, target.cfg,
                                     logits_indices=jnp.full((seqs.shape[0], 1), seqs.shape[1] - 1))
        rows = RowSampling.uniform(sampling, seqs.shape[0])
        return np.asarray(jax.nn.softmax(filtered_logits(logits[:, 0], rows), axis=-1), np.float64)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [t1] for t1 in range(v)])  # (V, V): p(t2 | t1)
    joint12 = p1[:, None] * p2
    p3 = next_probs([prompt + [t1, t2] for t1 in range(v) for t2 in range(v)]).reshape(v, v, v)
    marginal3 = np.einsum("ab,abc->c", joint12, p3)
    return joint12.reshape(-1), marginal3


def chi_square_pvalue(counts, probs, min_expected=5.0):
    """Goodness of fit; cells expected below min_expected are pooled into one."""
    from scipy import stats

    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue


@pytest.mark.parametrize("method", ["jetspec", "jetspec-tc"])
@pytest.mark.parametrize("drafter_kind,sampling_kwargs", [("greedy", dict(temperature=1.0)),
                                                          ("random", dict(temperature=0.7, top_p=0.9))])
def test_sampling_follows_target_distribution(tiny_qwen3, drafter_kind, sampling_kwargs, method):
    """The first three tokens of 4000 speculative samples against the exact target distribution.
    Each p-value is compared with 1e-3; with two tests per case the false-alarm rate for a random
    seed is at most 0.2% per case (the seed is fixed, so the test is deterministic). jetspec-tc's
    trees differ per branch (its second pass), which acceptance must not notice."""
    from jetspec_jax.sampling import SamplingConfig

    target, _ = tiny_qwen3
    prompt = [5, 12, 40]
    sampling = SamplingConfig(**sampling_kwargs)
    gen = GenerationConfig(max_new_tokens=3, sampling=sampling)
    if drafter_kind == "greedy":
        drafter, params = TargetGreedyDrafter(target.cfg, 3, sharpness=1.0), None
    else:
        drafter, params = random_head(target.cfg, jax.random.key(5))
    n = 4000
    out = run_spec(target, drafter, params, [prompt] * n, gen, SpecConfig(method, 12, 3), key=11)
    tokens = np.asarray(out.tokens)
    assert (np.asarray(out.num_tokens) == 3).all()
    if drafter_kind == "greedy":  # the drafts were really used: some steps accepted two tokens
        assert np.asarray(out.accept_counts)[:, 1:].sum() > n // 4
    joint12, marginal3 = exact_token_distributions(target, prompt, sampling)
    v = target.cfg.vocab_size
    counts12 = np.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v)
    counts3 = np.bincount(tokens[:, 2], minlength=v)
    assert chi_square_pvalue(counts12, joint12) > 1e-3
    assert chi_square_pvalue(counts3, marginal3) > 1e-3


@pytest.mark.parametrize("method,budget,width,drafter_kind", [
    ("jetspec", 12, 3, "greedy"), ("jetspec", 24, 4, "random"), ("jetspec-tc", 12, 3, "greedy"),
    ("ddtree", 16, 3, "random"), ("dflash", 8, 7, "random")])
def test_sampled_output_is_ar_s_own_sample(tiny_qwen3, method, budget, width, drafter_kind):
    """At T>0, with top-k and top-p, each token is drawn with the key of its request and output index, so
    speculation commits exactly the tokens AR draws with the same keys, at any budget; a seed fixes a
    request's sample. The greedy drafter's drafts are really accepted."""
    from jetspec_jax.sampling import SamplingConfig, request_keys

    target, _ = tiny_qwen3
    gen = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(0.8, top_k=40, top_p=0.95))
    keys = request_keys([2**40 + i for i in range(len(PROMPTS))])
    tokens, lengths = pad_prompts(PROMPTS, pad_id=0, bucket=16)
    want = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), keys, cfg=target.cfg,
                           gen=gen, cache_len=tokens.shape[1] + gen.max_new_tokens)
    if drafter_kind == "greedy":
        drafter, params = TargetGreedyDrafter(target.cfg, 4, sharpness=1.0), None
    else:
        drafter, params = random_head(target.cfg, jax.random.key(1), attention=ATTENTION_OF_METHOD[method])
    spec = SpecConfig(method, budget, width)
    cache_len = tokens.shape[1] + gen.max_new_tokens + speculative_cache_rows(budget, spec.depth(drafter.max_depth))
    out = speculative_generate(target.params, params, jnp.asarray(tokens), jnp.asarray(lengths), keys,
                               cfg=target.cfg, drafter=drafter, spec=spec, gen=gen, cache_len=cache_len)
    np.testing.assert_array_equal(np.asarray(out.num_tokens), np.asarray(want.num_tokens))
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(want.tokens))
    if drafter_kind == "greedy":
        assert np.asarray(out.accept_counts)[:, 1:].sum() > 0


def test_sampling_check_detects_a_biased_sampler(tiny_qwen3):
    """The statistical check has power: AR samples at the wrong temperature fail it."""
    from jetspec_jax.sampling import SamplingConfig

    target, _ = tiny_qwen3
    prompt = [5, 12, 40]
    n = 4000
    wrong = GenerationConfig(max_new_tokens=3, sampling=SamplingConfig(temperature=0.8))
    tokens, lengths = pad_prompts([prompt] * n, pad_id=0, bucket=16)
    out = generate_tokens(target.params, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(3),
                          cfg=target.cfg, gen=wrong, cache_len=32)
    got = np.asarray(out.tokens)
    joint12, _ = exact_token_distributions(target, prompt, SamplingConfig(temperature=1.0))
    v = target.cfg.vocab_size
    assert chi_square_pvalue(np.bincount(got[:, 0] * v + got[:, 1], minlength=v * v), joint12) < 1e-3


def test_compacted_cache_and_head_context_equal_ar_prefill(tiny_qwen3):
    """After one verify step, the target cache and the head's context equal what feeding the committed
    tokens through an ordinary prefill gives."""
    from jetspec_jax.autoregressive import prefill
    from jetspec_jax.models import draft_head
    from jetspec_jax.tree import build_tree, top_candidates
    from jetspec_jax.verify import accept, compact_cache, verify_tree

    target, _ = tiny_qwen3
    cfg, params = target.cfg, target.params
    head, head_params = random_head(cfg, jax.random.key(7))
    prompt = [[5, 12, 40, 8], [7, 1, 2, 3, 4, 5, 6]]
    tokens, lengths = pad_prompts(prompt, pad_id=0, bucket=8)
    tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)
    logits, taps, cache = prefill(params, tokens, lengths, cfg, 64, tap_layers=head.tap_layers)
    ctx = head.observe(head_params, head.init_state(head_params, 2, 64, jnp.float32), taps, lengths)
    anchor = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    drafts = TargetGreedyDrafter(cfg, 4).propose(None, None, params, cache, anchor, 4)
    cand_tokens, cand_logps = top_candidates(jax.nn.log_softmax(drafts, axis=-1), 2)
    tree = jax.vmap(lambda a, t, l: build_tree(a, t, l, 9))(anchor, cand_tokens, cand_logps)
    vlogits, node_taps, cache = verify_tree(params, tree, cache, cfg, head.tap_layers)
    result = accept(tree, jnp.argmax(vlogits, axis=-1), 4)
    assert (np.asarray(result.accept_len) > 0).all()  # the step really accepted drafts
    cache = compact_cache(cache, result.path, result.accept_len + 1)
    path_taps = jax.vmap(lambda t, p: t[p])(node_taps, result.path)
    ctx = head.observe(head_params, ctx, path_taps, result.accept_len + 1)

    for b in range(2):
        seq = prompt[b] + [int(anchor[b])] + np.asarray(result.tokens[b, : int(result.accept_len[b])]).tolist()
        n = len(seq)
        assert int(cache.lengths[b]) == n and int(ctx.lengths[b]) == n
        _, ref_taps, ref = prefill(params, jnp.asarray([seq]), jnp.asarray([n]), cfg, 64,
                                   tap_layers=head.tap_layers)
        ref_ctx = draft_head.extend_context(head_params, head.init_state(head_params, 1, 64, jnp.float32),
                                            ref_taps, jnp.asarray([n]), head.cfg)
        for layer in range(cfg.num_layers):
            np.testing.assert_allclose(np.asarray(cache.k[layer][b, :n]), np.asarray(ref.k[layer][0, :n]),
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(cache.v[layer][b, :n]), np.asarray(ref.v[layer][0, :n]),
                                       rtol=1e-5, atol=1e-5)
        for layer in range(head.cfg.num_layers):
            np.testing.assert_allclose(np.asarray(ctx.k[layer][b, :n]), np.asarray(ref_ctx.k[layer][0, :n]),
                                       rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(ctx.v[layer][b, :n]), np.asarray(ref_ctx.v[layer][0, :n]),
                                       rtol=1e-5, atol=1e-5)


def test_bad_speculative_settings(tiny_qwen3):
    import dataclasses

    from jetspec_jax.models import draft_head
    from jetspec_jax.speculative import HeadDrafter

    target, _ = tiny_qwen3

    def head_for(**changes):
        return draft_head.DraftConfig.for_target(dataclasses.replace(target.cfg, **changes))

    with pytest.raises(ValueError, match="budget must be >= 1"):
        SpecConfig("jetspec", budget=0)
    with pytest.raises(ValueError, match="width must be >= 1"):
        SpecConfig("jetspec", budget=8, width=0)
    with pytest.raises(ValueError, match="exceeds what the draft head predicts"):
        SpecConfig("jetspec", budget=8, max_depth=20).depth(15)
    with pytest.raises(ValueError, match="method"):
        SpecConfig("medusa")
    with pytest.raises(ValueError, match="method 'jetspec-tree' is not one of .*'jetspec-tc'"):
        SpecConfig("jetspec-tree")
    with pytest.raises(ValueError, match="method 'jetspec-tc' needs budget >= 2"):
        SpecConfig("jetspec-tc", budget=1)
    with pytest.raises(ValueError, match=r"candidate_budget \(16\) must be >= budget \(32\)"):
        SpecConfig("jetspec-tc", budget=32, candidate_budget=16)
    with pytest.raises(ValueError, match="conditioned_width must be >= 0, got -1"):
        SpecConfig("jetspec-tc", budget=32, conditioned_width=-1)
    with pytest.raises(ValueError, match="candidate_budget and conditioned_width only apply to jetspec-tc, not "
                                         "to method 'jetspec'"):
        SpecConfig("jetspec", budget=32, candidate_budget=64, conditioned_width=2)
    assert SpecConfig("jetspec-tc", budget=32).candidates == 128 and SpecConfig("jetspec-tc", width=5).extend_width == 5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="tree_temperature must be a positive number"):
            SpecConfig("jetspec", tree_temperature=bad)
    with pytest.raises(ValueError, match="head width 128"):
        HeadDrafter(head_for(hidden_size=128), target.cfg)
    with pytest.raises(ValueError, match="head vocabulary 50 != target vocabulary 97"):
        HeadDrafter(head_for(vocab_size=50), target.cfg)
    with pytest.raises(ValueError, match="tap layers .* do not exist in a 3-layer target"):
        HeadDrafter(head_for(num_layers=12), target.cfg)
    with pytest.raises(ValueError, match="draft attention_impl 'cudnn' is not one of auto, xla, pallas"):
        HeadDrafter(head_for(), target.cfg, attention_impl="cudnn")


def test_auto_draft_attention_is_the_kernel_on_gpu_only(tiny_qwen3, monkeypatch):
    """"auto" resolves when the drafter is made, so kernel_rows and the jit key see what runs."""
    from jetspec_jax import speculative
    from jetspec_jax.models import draft_head

    target, _ = tiny_qwen3
    cfg = draft_head.DraftConfig.for_target(target.cfg)
    on_cpu = speculative.HeadDrafter(cfg, target.cfg)
    assert on_cpu.attention_impl == "xla" and on_cpu.kernel_rows == 0  # the dense mask keeps no rows
    monkeypatch.setattr(speculative.jax, "default_backend", lambda: "gpu")
    on_gpu = speculative.HeadDrafter(cfg, target.cfg, attention_impl="auto")
    assert on_gpu.attention_impl == "pallas" and on_gpu.kernel_rows == cfg.block_size
    assert speculative.resolve_draft_attention("xla") == "xla"
