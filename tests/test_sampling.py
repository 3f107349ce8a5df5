"""Sampling and acceptance: pure functions, no model."""
import numpy as np
import pytest

from specd.errors import InvalidArgument
import specd.sampling as S
from specd.sampling import Sampling, accept, probabilities, sample, top_probability, uniform


def onehot_logits(rows, n_vocab=16):
    out = np.full((len(rows), n_vocab), -10.0, dtype=np.float32)
    for i, t in enumerate(rows):
        out[i, t] = 10.0
    return out


def test_greedy_accepts_matching_prefix_and_adds_target_token():
    logits = onehot_logits([3, 5, 7, 9])
    assert accept(logits, [3, 5, 7], Sampling(), 0) == [3, 5, 7, 9]
    assert accept(logits, [3, 6, 7], Sampling(), 0) == [3, 5]
    assert accept(logits, [4, 5, 7], Sampling(), 0) == [3]
    assert accept(logits[:1], [], Sampling(), 0) == [3]


def test_uniform_is_deterministic_and_spread():
    xs = [uniform(42, i) for i in range(2000)]
    assert xs == [uniform(42, i) for i in range(2000)]
    assert xs != [uniform(43, i) for i in range(2000)]
    assert 0.0 <= min(xs) and max(xs) < 1.0
    assert abs(np.mean(xs) - 0.5) < 0.03
    assert abs(np.mean(np.array(xs) < 0.1) - 0.1) < 0.03


def test_stochastic_accept_uses_the_token_index_stream():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 32)).astype(np.float32)
    s = Sampling(temperature=1.0, seed=7)
    # what target-only decoding would sample at indexes 10..14
    alone = [sample(logits[i], s, 10 + i) for i in range(5)]
    out = accept(logits, alone[:4], s, 10)
    assert out == alone  # drafts equal to the target's samples are all accepted
    wrong = [(alone[0] + 1) % 32] + alone[1:4]
    assert accept(logits, wrong, s, 10) == [alone[0]]


def test_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float64))
    ids, p = probabilities(logits, Sampling(temperature=1.0, top_k=2))
    assert list(ids) == [0, 1] and np.allclose(p, [0.625, 0.375])
    ids, p = probabilities(logits, Sampling(temperature=1.0, top_p=0.75))
    assert list(ids) == [0, 1]
    ids, p = probabilities(logits, Sampling(temperature=1.0, min_p=0.25))
    assert list(ids) == [0, 1, 2]
    ids, p = probabilities(logits, Sampling(temperature=1.0))
    assert np.allclose(p, [0.5, 0.3, 0.15, 0.05])


def test_sample_frequencies_follow_probabilities():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    s = Sampling(temperature=1.0, seed=1)
    counts = np.bincount([sample(logits, s, i) for i in range(5000)], minlength=3) / 5000
    assert np.allclose(counts, [0.6, 0.3, 0.1], atol=0.03)


def test_top_probability():
    tok, p = top_probability(np.log(np.array([0.2, 0.7, 0.1], dtype=np.float32)))
    assert tok == 1 and abs(p - 0.7) < 1e-5


@pytest.mark.parametrize("field,kw", [("temperature", {"temperature": -0.1}), ("top_k", {"top_k": -1}),
                                      ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("min_p", {"min_p": 1.0})])
def test_validation_names_the_field(field, kw):
    with pytest.raises(InvalidArgument, match=f"sampling.{field}"):
        Sampling(**kw).validate()


@pytest.mark.parametrize("t", [1.4e-45, 1e-30, 9e-6])
def test_a_tiny_temperature_is_greedy_not_nan(t):
    """Found by the generate fuzzer: temperature 1.4e-45 scaled the logits to
    inf and the draft sent NaN probabilities, which the target refused."""
    logits = np.array([[0.5, 2.0, 1.0], [3.0, 0.0, 1.0]], dtype=np.float32)
    s = Sampling(temperature=t, seed=3)
    assert s.greedy
    assert sample(logits[0], s, 0) == 1
    assert S.accept(logits, [1], s, 0) == [1, 0]
    assert S.draft_token(logits[0], s, 0).q is None
