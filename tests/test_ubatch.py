"""specd.ubatch: how llama.cpp splits a batch of sequences into passes
(split_equal, a KV stream per sequence) and the padding that saves passes."""
from __future__ import annotations

import math

from hypothesis import given, strategies as st

from specd.ubatch import DEFAULT_PASS_TOKENS, NO_FILL, Fill, Part, cost, pass_tokens, passes, plan_fill


def test_a_pass_takes_a_run_of_consecutive_ids_and_the_least_they_have_left():
    assert passes([1] * 8) == [8]
    assert passes([1, 5] * 4) == [8, 4, 4, 4, 4]  # the used-up ids in between split the rest
    assert passes([2, 1, 3]) == [3, 1, 2]
    assert passes([1, 1, 0, 1]) == [2, 1]  # an id not in the batch splits it
    assert passes([0, 0, 3]) == [3]
    assert passes([]) == []


@given(st.lists(st.integers(0, 20), max_size=12))
def test_passes_decode_every_token_once(counts):
    out = passes(counts)
    assert sum(out) == sum(counts) and all(n > 0 for n in out)
    assert len(out) <= sum(counts)


def parts(counts, room=100):
    return [Part(s, n, room) for s, n in enumerate(counts) if n]


def test_mixed_draft_lengths_are_padded_into_one_pass():
    fill = plan_fill(parts([1, 5] * 4), set(), 8.0, 512)
    assert fill == Fill({0: 4, 2: 4, 4: 4, 6: 4}, {})
    assert cost([5] * 8, 8.0) < cost([1, 5] * 4, 8.0)


def test_padding_that_costs_more_than_the_passes_it_saves_is_left_out():
    assert plan_fill(parts([17] + [1] * 7), set(), 8.0, 512) == NO_FILL  # 2 passes of 8 and 16 tokens
    assert plan_fill(parts([1, 5] * 4), set(), 0.0, 512) == NO_FILL  # passes cost nothing of their own
    assert plan_fill(parts([1, 5] * 4), set(), 8.0, 30) == NO_FILL  # beyond n_batch
    assert plan_fill(parts([1, 5] * 4, room=0), set(), 8.0, 512) == NO_FILL  # no free positions
    assert plan_fill(parts([3]), set(), 8.0, 512) == NO_FILL


def test_free_ids_between_the_parts_are_filled_only_when_free():
    p = [Part(0, 1, 9), Part(1, 1, 9), Part(3, 1, 9)]
    assert plan_fill(p, {2, 9}, 8.0, 512) == Fill({}, {2: 1})
    assert plan_fill(p, set(), 8.0, 512) == NO_FILL  # 2 holds tokens: two passes it is
    assert plan_fill([Part(0, 2, 9), Part(3, 2, 9)], {1, 2}, 8.0, 512) == Fill({}, {1: 2, 2: 2})


@given(st.lists(st.integers(0, 8), min_size=2, max_size=10), st.sets(st.integers(0, 9)),
       st.floats(0, 30), st.integers(1, 80))
def test_a_fill_never_costs_more_nor_breaks_its_bounds(counts, free, pass_cost, n_batch):
    ps = parts(counts, room=4)
    if sum(p.n_tokens for p in ps) > n_batch or not ps:
        return
    fill = plan_fill(ps, free, pass_cost, n_batch)
    own = {p.seq_id: p.n_tokens for p in ps}
    assert all(0 < n <= 4 and s in own for s, n in fill.pad.items())
    assert all(s in free and s not in own and min(own) < s < max(own) for s in fill.gaps)
    assert sum(own.values()) + fill.n_tokens <= n_batch
    layout = [own.get(s, 0) + fill.pad.get(s, 0) + fill.gaps.get(s, 0) for s in range(min(own), max(own) + 1)]
    plain = [own.get(s, 0) for s in range(min(own), max(own) + 1)]
    assert cost(layout, pass_cost) <= cost(plain, pass_cost)


def test_a_pass_is_worth_the_intercept_of_the_cost_curve_in_tokens():
    assert abs(pass_tokens([(1, 0.021), (64, 0.084)]) - 20.0) < 1e-9
    assert abs(pass_tokens([(1, 0.011), (2, 0.012), (64, 0.074)]) - 10.0) < 1e-9
    assert pass_tokens([]) == DEFAULT_PASS_TOKENS
    assert pass_tokens([(1, 0.02), (8, 0.02)]) == DEFAULT_PASS_TOKENS


def test_a_round_gives_up_cores_only_while_the_other_worker_computes():
    """shared_tokens: the part of a round decoded on the base threads."""
    from specd.ubatch import shared_tokens
    # not busy: every core
    assert shared_tokens(500, 0.0, 0.003, 8) == 0
    # unknown for how long, or no curve to price the round: the whole round, as before
    assert shared_tokens(500, math.inf, 0.003, 8) == 500
    assert shared_tokens(500, 0.05, 0.0, 8) == 500
    # a round that fits in about twice the draft's time is not split (a pass saved)
    assert shared_tokens(30, 0.05, 0.003, 8) == 30
    # a long prompt round beside a short draft operation: only what fits, then every core
    assert shared_tokens(509, 0.09, 0.0035, 8) == 25
    # what is left of the draft's work is worth less than a pass: every core at once
    assert shared_tokens(509, 0.02, 0.0035, 8) == 0


@given(st.integers(0, 2048), st.floats(0, 10), st.floats(1e-5, 0.01), st.floats(0, 64))
def test_the_shared_part_of_a_round_is_within_it(n, left, per_token, pass_cost):
    from specd.ubatch import shared_tokens
    k = shared_tokens(n, left, per_token, pass_cost)
    assert 0 <= k <= max(n, 0)
    if 0 < k < n:  # split: what it takes fits in the draft's time, and is worth a pass
        assert k * per_token <= left and k >= pass_cost
