"""Greedy, temperature, top-k and top-p selection per row; keys from 64-bit seeds and output positions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jetspec_jax.sampling import RowSampling, SamplingConfig, filtered_logits, request_keys, seed_words, select_tokens

LOGITS = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))


def kept(cfg: SamplingConfig) -> list[bool]:
    return np.isfinite(np.asarray(filtered_logits(LOGITS, RowSampling.uniform(cfg, 1))))[0].tolist()


def test_greedy_is_argmax():
    assert select_tokens(LOGITS, request_keys([0]), RowSampling.uniform(SamplingConfig(), 1),
                         jnp.zeros((1,), jnp.int32)).tolist() == [1]


def test_top_k_keeps_k_largest():
    assert kept(SamplingConfig(1.0, top_k=2)) == [False, True, False, True, False]


def test_top_p_keeps_smallest_prefix_reaching_p():
    # sorted probs 0.4, 0.3, 0.15, 0.1, 0.05: p=0.7 keeps {0.4, 0.3}; p=0.71 also keeps 0.15
    assert kept(SamplingConfig(1.0, top_p=0.7)) == [False, True, False, True, False]
    assert kept(SamplingConfig(1.0, top_p=0.71)) == [False, True, False, True, True]


def test_rows_filter_each_by_its_own_settings():
    logits = jnp.concatenate([LOGITS] * 3)
    rows = RowSampling.of([SamplingConfig(1.0, top_k=2), SamplingConfig(1.0, top_p=0.71), SamplingConfig(0.5)])
    got = np.isfinite(np.asarray(filtered_logits(logits, rows))).tolist()
    assert got == [[False, True, False, True, False], [False, True, False, True, True], [True] * 5]


def test_samples_follow_the_tempered_distribution():
    """20,000 output positions of one row, each its own draw."""
    n = 20000
    rows = RowSampling.uniform(SamplingConfig(temperature=0.5), 1)
    draws = select_tokens(jnp.broadcast_to(LOGITS[:, None], (1, n, 5)), request_keys([7]), rows,
                          jnp.arange(n)[None])[0]
    freq = np.bincount(np.asarray(draws), minlength=5) / n
    want = np.asarray(jax.nn.softmax(LOGITS[0] / 0.5))
    np.testing.assert_allclose(freq, want, atol=0.015)  # ~4.5 sigma at n=20000


def test_a_sample_depends_on_its_key_and_position_only():
    """The same request key and output position give the same token wherever the row sits in the batch
    and whatever the other rows sample: what lets a seed fix a request's sample on every path."""
    logits = jax.random.normal(jax.random.key(0), (3, 4, 50)) * 2
    cfg = SamplingConfig(0.9, top_k=20, top_p=0.95)
    keys = request_keys([11, 12, 13])
    positions = jnp.asarray([[0, 1, 2, 3], [5, 6, 7, 8], [0, 1, 2, 3]])
    together = select_tokens(logits, keys, RowSampling.uniform(cfg, 3), positions)
    alone = select_tokens(logits[2:], keys[2:], RowSampling.uniform(cfg, 1), positions[2:])
    assert together[2].tolist() == alone[0].tolist()
    other = select_tokens(logits[2:], keys[:1], RowSampling.uniform(cfg, 1), positions[2:])
    shifted = select_tokens(logits[2:], keys[2:], RowSampling.uniform(cfg, 1), positions[2:] + 100)
    assert other[0].tolist() != alone[0].tolist() and shifted[0].tolist() != alone[0].tolist()


def test_seeds_keep_all_64_bits():
    assert np.array_equal(jax.random.key_data(request_keys([5])[0]), jax.random.key_data(jax.random.key(5)))
    low = jax.random.key_data(request_keys([3])[0])
    assert not np.array_equal(jax.random.key_data(request_keys([3 + (1 << 40)])[0]), low)
    assert seed_words([2**64 - 1]).tolist() == [[2**32 - 1, 2**32 - 1]]
    for bad in (-1, 2**64):
        with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\)"):
            request_keys([bad])[0]


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
