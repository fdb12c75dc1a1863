"""Greedy, temperature, top-k and top-p selection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.sampling import SamplingConfig, filtered_logits, select_tokens

LOGITS = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def test_greedy_is_argmax():
    assert select_tokens(LOGITS, jax.random.key(0), SamplingConfig()).tolist() == [1]


def test_top_k_keeps_k_largest():
    kept = np.isfinite(np.asarray(filtered_logits(LOGITS, SamplingConfig(1.0, top_k=2))))[0]
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted probs 0.4, 0.3, 0.15, 0.1, 0.05: p=0.7 keeps {0.4, 0.3}; p=0.71 also keeps 0.15
    kept = np.isfinite(np.asarray(filtered_logits(LOGITS, SamplingConfig(1.0, top_p=0.7))))[0]
    assert kept.tolist() == [False, True, False, True, False]
    kept = np.isfinite(np.asarray(filtered_logits(LOGITS, SamplingConfig(1.0, top_p=0.71))))[0]
    assert kept.tolist() == [False, True, False, True, True]


def test_samples_follow_the_tempered_distribution():
    cfg = SamplingConfig(temperature=0.5)
    keys = jax.random.split(jax.random.key(0), 20000)
    draws = jax.vmap(lambda k: select_tokens(LOGITS, k, cfg))(keys)[:, 0]
    freq = np.bincount(np.asarray(draws), minlength=5) / len(draws)
    want = np.asarray(jax.nn.softmax(LOGITS[0] / 0.5))
    np.testing.assert_allclose(freq, want, atol=0.015)  # ~4.5 sigma at n=20000


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_invalid_settings_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_inverse_cdf_sampling_follows_the_tempered_distribution():
    """The regeneration sampler (one uniform per row, the CDF searched in blocks) against softmax(l / T)
    over a vocabulary that is not a multiple of its block, with a tail of tiny probabilities: Pearson's
    chi-square at a 1e-4 false-alarm rate (bins of expected count < 5 pooled), per temperature."""
    from scipy.stats import chi2

    from jetspec_jax.sampling import sample_rows_inverse_cdf

    vocab, n = 300, 100_000
    logits = jax.random.normal(jax.random.key(1), (vocab,)) * 2.5
    keys = jax.random.split(jax.random.key(2), n)
    draw = jax.jit(sample_rows_inverse_cdf, static_argnames="block")
    for temperature in (0.7, 1.0):
        tokens = draw(jnp.broadcast_to(logits, (n, vocab)), keys, jnp.full((n,), temperature), block=128)
        counts = np.bincount(np.asarray(tokens), minlength=vocab)
        expected = np.asarray(jax.nn.softmax(logits / temperature), np.float64) * n
        big = expected >= 5
        stat = (((counts[big] - expected[big]) ** 2) / expected[big]).sum()
        stat += (counts[~big].sum() - expected[~big].sum()) ** 2 / expected[~big].sum()
        assert stat < chi2.isf(1e-4, big.sum()), (temperature, stat)


def test_inverse_cdf_sampling_is_greedy_at_temperature_zero_per_row():
    from jetspec_jax.sampling import sample_rows_inverse_cdf

    logits = jax.random.normal(jax.random.key(3), (4, 1000))
    keys = jax.random.split(jax.random.key(4), 4)
    tokens = sample_rows_inverse_cdf(logits, keys, jnp.asarray([0.0, 1.0, 0.0, 1.0]))
    argmax = np.asarray(jnp.argmax(logits, axis=-1))
    assert tokens[0] == argmax[0] and tokens[2] == argmax[2]
    assert np.asarray(sample_rows_inverse_cdf(logits, keys, jnp.zeros((4,)))).tolist() == argmax.tolist()
