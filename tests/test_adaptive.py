"""Adaptive speculation and the batching scheduler's windows, without models."""
from __future__ import annotations

import collections
import time

import pytest

from specd.router.adaptive import (Acceptance, Controller, choose_alone, choose_draft_length, expected_tokens,
                                   round_seconds, steady_hidden)
from specd.router.costs import CostCurve
from specd.router.load import RecentPeak, SharedRounds, Trials
from specd.scheduler import op_key, take_window


# ------------------------------------------------------------------ adaptive
def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve([(1, 0.010), (4, 0.016), (16, 0.040)])
    assert c(1) == pytest.approx(0.010)
    assert c(2) == pytest.approx(0.012)  # between 1 and 4
    assert c(10) == pytest.approx(0.028)
    assert c(32) == pytest.approx(0.072)  # the last slope goes on
    assert len(CostCurve()) == 0


def test_cost_curve_keeps_its_calibration_and_learns_without_one():
    c = CostCurve([(1, 0.010), (4, 0.016), (16, 0.040)])
    c.observe(4, 0.032)  # measured under load: the load shows in Slowdown, not here
    assert c(4) == pytest.approx(0.016)
    d = CostCurve(weight=0.5)  # a worker that did not calibrate: observations are the points
    d.observe(8, 0.050)
    d.observe(1, 0.010)
    d.observe(8, 0.070)
    assert d(8) == pytest.approx(0.060) and d(1) == pytest.approx(0.010)


# a target whose cost hardly grows with the batch (a big model on a GPU) and
# one whose cost is proportional to it (compute-bound, as small models on CPU)
FLAT = CostCurve([(1, 0.030), (8, 0.031), (64, 0.036), (512, 0.080)])
PROPORTIONAL = CostCurve([(1, 0.010), (8, 0.080), (64, 0.640)])
CHEAP_DRAFT_POINTS = [(1, 0.002), (16, 0.004)]
CHEAP_DRAFT = CostCurve(CHEAP_DRAFT_POINTS)


def test_flat_target_speculates_fully_and_a_saturated_one_not_at_all():
    assert choose_draft_length(0.8, 6, 1, FLAT, CHEAP_DRAFT) == 6
    assert choose_draft_length(0.8, 6, 16, FLAT, CHEAP_DRAFT) >= 3  # the draft's own cost trims it
    assert choose_draft_length(0.99, 6, 1, PROPORTIONAL, CHEAP_DRAFT) == 0


def test_draft_length_shrinks_with_load_and_poor_acceptance():
    # cost flat up to 8 tokens, then growing: a machine with some spare compute
    knee = CostCurve([(1, 0.030), (8, 0.032), (16, 0.060), (64, 0.220)])
    ks = [choose_draft_length(0.9, 8, b, knee, CHEAP_DRAFT) for b in (1, 2, 4, 8, 16)]
    assert ks[0] >= 4 and ks == sorted(ks, reverse=True) and ks[-1] == 0, ks
    assert choose_draft_length(0.2, 8, 1, knee, CHEAP_DRAFT) < choose_draft_length(0.9, 8, 1, knee, CHEAP_DRAFT)


def test_hidden_drafting_makes_speculation_pay():
    draft = CostCurve([(1, 0.020), (8, 0.090)])
    target = CostCurve([(1, 0.030), (8, 0.040), (64, 0.200)])
    assert choose_draft_length(0.9, 4, 1, target, draft, hidden=0.0, overlap=True) == 0
    assert choose_draft_length(0.9, 4, 1, target, draft, hidden=0.9, overlap=True) >= 1


def test_overlapped_draft_that_cannot_keep_up_is_the_bottleneck():
    # the curves both workers measured on this 2-core machine (1 thread each):
    # the draft's cost grows with its batch almost as fast as the target's
    target = CostCurve([(1, 0.033), (8, 0.070), (64, 0.270)])
    draft = CostCurve([(1, 0.012), (8, 0.068)])
    assert choose_draft_length(0.95, 4, 1, target, draft, hidden=0.9, overlap=True) >= 3
    # 8 sessions: drafting k + 1 tokens for 8 sequences outlasts verifying them,
    # however well overlap hides it
    assert choose_draft_length(0.95, 4, 8, target, draft, hidden=0.9, overlap=True) == 0
    assert round_seconds(2, 8, target, draft, 1.0, overlap=True) == pytest.approx(3 * 0.068)
    assert round_seconds(2, 8, target, draft, 1.0, overlap=False) == pytest.approx(2 * 0.068 + target(24))


def test_without_a_cost_curve_the_request_bound_is_used():
    assert choose_draft_length(0.1, 5, 8, CostCurve([(1, 0.03)]), CostCurve()) == 5


def test_acceptance_learns_and_grows_uncertain_when_not_drafting():
    a = Acceptance(prior=0.5)
    for _ in range(30):
        a.tick()
        a.observe(4, 4)
    assert a.rate > 0.9
    b = Acceptance(prior=0.9)
    for _ in range(30):
        b.tick()
        b.observe(4, 0)
    low = b.optimistic
    assert b.rate < 0.2
    for _ in range(200):  # steps without drafts: the evidence fades, optimism returns
        b.tick(drafted=False)
    assert b.optimistic > low + 0.3


def test_a_poor_draft_is_retried_rarely():
    """A session that drafts whenever its optimistic rate clears what four
    drafts need to pay, with a draft accepted about 0.4 of the time, drafts
    on few steps: each try costs more than the plain steps it replaces."""
    a = Acceptance()
    rng = __import__("random").Random(5)
    drafted = 0
    for _ in range(3000):
        if a.optimistic >= 0.82:
            n = next((i for i in range(4) if rng.random() > 0.4), 4)
            a.tick(True)
            a.observe(4, n)
            drafted += 1
        else:
            a.tick(False)
    assert 0 < drafted < 0.06 * 3000, drafted  # never locked out, rarely paying for it


def test_controller_prior_follows_other_sessions():
    c = Controller()
    s = c.new_session()
    for _ in range(50):
        c.observe_step(s, 4, 1)
    assert c.new_session().prior < 0.6


# ------------------------------------------------------------------ scheduler
def _key(op):
    return op_key(op[0], op[1])


def test_window_batches_distinct_sequences_and_keeps_per_sequence_order():
    q = collections.deque([("verify", 0), ("verify", 1), ("seq_rm", 2), ("decode", 2), ("seq_rm", 0), ("verify", 3)])
    w = take_window(q, _key)
    assert w.pre == [("seq_rm", 2)]
    assert w.batch == [("verify", 0), ("verify", 1), ("decode", 2)]
    assert list(q) == [("seq_rm", 0), ("verify", 3)]  # seq 0 is in the batch: its seq_rm waits
    w = take_window(q, _key)
    assert w.pre == [("seq_rm", 0)] and w.batch == [("verify", 3)] and not q


def test_window_stops_at_a_second_op_on_a_batched_sequence():
    q = collections.deque([("propose", 0), ("propose", 0), ("propose", 1)])
    assert take_window(q, _key).batch == [("propose", 0)]
    assert take_window(q, _key).batch == [("propose", 0), ("propose", 1)]


def test_barriers_run_alone():
    q = collections.deque([("verify", 0), ("checkpoint_restore", None), ("verify", 1)])
    assert take_window(q, _key).items == [("verify", 0)]
    assert take_window(q, _key).items == [("checkpoint_restore", None)]
    q = collections.deque([("clear", -1), ("verify", 1)])
    assert take_window(q, _key).items == [("clear", -1)]


def test_scheduler_waits_for_the_last_batch_to_come_back():
    """Two sequences whose next operations arrive a few ms apart still share
    one round, instead of taking turns in half batches."""
    import asyncio

    from specd.scheduler import EngineRunner, Scheduler

    rounds = []

    def run_round(engine, window):
        rounds.append(sorted(op[1] for op in window.batch))
        time.sleep(0.020)
        return [None] * len(window.items)

    async def main():
        sched = Scheduler(EngineRunner(engine=object()), run_round, _key, gather_max=0.010)
        await asyncio.gather(sched.submit(("verify", 0)), sched.submit(("verify", 1)))
        first = sched.submit(("verify", 0))
        await asyncio.sleep(0.003)  # the other sequence's router turnaround
        await asyncio.gather(first, sched.submit(("verify", 1)))
        # a sequence that does not come back costs one bounded wait
        t0 = time.perf_counter()
        await sched.submit(("verify", 0))
        return time.perf_counter() - t0

    alone = asyncio.run(main())
    assert rounds == [[0, 1], [0, 1], [0]]
    assert alone < 0.25  # 20 ms of work and at most 10 ms of waiting; generous for a loaded machine


def test_controller_learns_that_drafting_is_slower_than_modelled_and_tries_again_later():
    now = [100.0]
    c = Controller(target=CostCurve([(1, 0.030), (8, 0.032), (64, 0.220)]), draft=CostCurve(CHEAP_DRAFT_POINTS),
                   clock=lambda: now[0])
    a, b = c.new_session(), c.new_session()
    load = (2, 0.0, True, 2)  # 2 sessions on the target, no overlap hit yet, overlap on, 2 on the draft
    assert c.choose(a, 4, *load) > 0 and c.choose(b, 4, *load) > 0  # the model says drafting pays
    # drafting steps took 4 times what the model said; plain steps as predicted
    for _ in range(6):
        c.observe_time(2, True, c.predict(a, 4, *load), 4 * c.predict(a, 4, *load))
    for _ in range(5):
        c.observe_time(2, False, c.predict(a, 0, *load), c.predict(a, 0, *load))
    assert c.slowdown(2).extras(now[0])[1] > 2 * c.predict(a, 4, *load)
    assert c.choose(a, 4, *load) == 0 and c.choose(b, 4, *load) == 0
    assert c.choose(a, 4, 1, 0.0, True, 1) > 0  # another load level keeps its own figures
    now[0] += 120  # four half-lives: the lesson faded, both try again
    assert c.choose(a, 4, *load) > 0 and c.choose(b, 4, *load) > 0
    # this time drafting is as fast as modelled: the old lesson is gone for good
    for _ in range(3):
        c.observe_time(2, True, c.predict(a, 4, *load), c.predict(a, 4, *load))
    assert abs(c.slowdown(2).extras(now[0])[1]) < 0.2 * c.predict(a, 4, *load)


# decode costs the two workers of the default pair timed on this machine (ms by batch tokens)
TARGET_HERE = [(1, 19.6), (2, 22.9), (4, 26.9), (8, 40.5), (16, 50.2), (32, 79.0), (64, 127.6)]
DRAFT_HERE = [(1, 7.6), (2, 13.7), (4, 23.7), (8, 42.2), (16, 80.4), (32, 159.4), (64, 320.0)]


def no_trials(level: int = 1) -> Trials:
    """What the model alone decides: these tests are about it (trials: test_adaptive_trials.py)."""
    return Trials(credit=0.0, share=0.0)


def controller_here(clock=lambda: 100.0, new_trials=no_trials) -> Controller:
    """A controller with the default pair's curves as timed here."""
    ms = lambda pts: CostCurve([(n, t / 1e3) for n, t in pts])  # noqa: E731
    return Controller(target=ms(TARGET_HERE), draft=ms(DRAFT_HERE), clock=clock, new_trials=new_trials)


def test_a_per_step_overhead_does_not_make_drafting_look_cheap():
    # Under load every step pays the same ~35 ms the model leaves out (router,
    # RPC, the batch gathering). Taken as a factor, plain steps (predicted 45
    # ms, took 80) would look nearly twice as slow as modelled and drafting
    # steps (predicted 430, took 465) barely slower, so drafting would look
    # cheap where it costs a fifth of the throughput. (At 8 sessions these
    # curves say 4 drafts accepted in full do pay, 15.1 against 13.2 tokens/s
    # a session; an average that had not caught up yet once hid that.)
    c = controller_here()
    a = c.new_session()
    load = (12, 0.5, True, 12)
    assert c.choose(None, 4, *load) == 0  # the model alone: drafting cannot pay at 12 sessions
    for _ in range(20):
        for k in (0, 4):
            c.observe_time(12, k > 0, c.predict(a, k, *load), c.predict(a, k, *load) + 0.035)
    assert c.choose(None, 4, *load) == 0 and c.choose(a, 4, *load) == 0
    assert c.choose(None, 4, 1, 0.5, True, 1) > 0  # one session: it does pay


def test_recent_peak_is_the_highest_count_of_the_last_hold_seconds():
    p = RecentPeak(hold=0.3)
    assert p.load(1, 0.0) == 1
    assert p.load(16, 0.1) == 16
    assert p.load(3, 0.2) == 16  # the wave's tail: still loaded
    assert p.load(3, 0.39) == 16
    assert p.load(2, 0.45) == 3  # 16 is past the hold
    assert p.load(2, 0.76) == 2
    assert p.load(5, 0.9) == 5  # rises at once
    assert p.load(1, 10.0) == 1  # long quiet: the real count again


def test_recent_peak_outlasts_a_lull_and_lets_a_lone_session_draft_soon_after_a_wave():
    # halving every 0.5 s, a lone session after a wave of 16 counted as 9
    # down to 2 for 1.6 s (a request and a third of a one-session cell's
    # eight) and did not draft
    p = RecentPeak()
    assert p.load(16, 0.0) == 16
    assert p.load(1, 0.17) == 16  # the gap between a client's requests under load (90th percentile)
    p = RecentPeak()
    assert p.load(2, 0.0) == 2 and p.load(1, 0.08) == 2  # at two sessions (longest gap seen)
    assert p.load(1, 0.5) == 1  # half a second after the wave: alone


def test_other_sessions_prompts_in_the_batch_are_not_taken_for_overhead():
    # a wave of 16 new sessions: their prompts share the verify batches (376
    # tokens, ~1 s); judged against 16 single tokens (50 ms) that second would
    # look like per-step overhead, which drafting seems to amortise
    c = controller_here()
    a = c.new_session()
    load = (16, 0.5, True, 16)
    for _ in range(10):
        c.observe_time(16, False, c.predict(a, 0, *load, verify_tokens=376), c.target(376) + 0.005)
    assert abs(c.slowdown(16).plain) < 0.01
    assert c.choose(None, 4, *load) == 0


def test_plain_steps_waiting_on_another_sessions_drafts_do_not_count():
    # 2 sessions, one drafting: the other's plain steps share its 6-token
    # batches on the target's own threads and take 65 ms against 16 for 2
    # single tokens. Counted as plain overhead, they made drafting look
    # twice as fast as not, and both sessions drafted (0.83x target-only)
    c = controller_here()
    a = c.new_session()
    load = (2, 0.8, True, 2)
    for _ in range(20):
        c.observe_time(2, False, c.predict(a, 0, *load, verify_tokens=6), 0.065, batch_tokens=6)
        c.observe_time(2, False, c.predict(a, 0, *load, verify_tokens=2), 0.065, batch_tokens=2, draft_busy=True)
    assert c.slowdown(2).plain == 0.0
    for _ in range(20):  # steps with only single tokens, the draft idle: those count
        c.observe_time(2, False, c.predict(a, 0, *load, verify_tokens=2), c.target(2) + 0.004, batch_tokens=2)
    assert c.slowdown(2).plain == pytest.approx(0.004)


def test_a_burst_of_slow_plain_steps_does_not_make_plain_steps_look_slow():
    # plain steps take 8 ms beyond the model; a few queue behind another
    # session's prompt and take 60 ms more: the figure stays near 8 ms
    c = controller_here()
    a = c.new_session()
    load = (2, 0.8, True, 2)
    for i in range(60):
        extra = 0.060 if 20 <= i < 35 else 0.008
        c.observe_time(2, False, c.predict(a, 0, *load), c.predict(a, 0, *load) + extra, batch_tokens=2)
    assert c.slowdown(2).plain == pytest.approx(0.008)


def test_overhead_seen_only_on_plain_steps_does_not_start_drafting():
    # 16 sessions, no drafting step seen at this level: steps take 100 ms
    # more than the model says; that would seem to make 4 drafts pay (5
    # tokens for 0.55 + 0.1 s against 1 for 0.05 + 0.1 s), but it says
    # nothing of what drafting would add, and the model says it cannot pay
    c = controller_here()
    a = c.new_session()
    load = (16, 0.5, True, 16)
    for _ in range(30):
        c.observe_time(16, False, c.predict(a, 0, *load), c.predict(a, 0, *load) + 0.100)
    assert c.choose(None, 4, *load) == 0 and c.choose(a, 4, *load) == 0


def test_drafting_is_tried_only_where_the_model_predicts_a_clear_gain():
    now = [100.0]
    c = controller_here(lambda: now[0])
    a = c.new_session()
    four = (4, 1.0, True, 4)
    # 4 sessions: the model predicts ~13% for 1 draft; untried, that is not enough
    assert choose_draft_length(1.0, 4, 4, c.target, c.draft, 1.0, True) > 0
    assert c.choose(None, 4, *four) == 0
    assert c.choose(None, 4, 1, 0.5, True, 1) > 0  # alone: a clear gain, tried
    # once drafting at 4 sessions has been measured as modelled, the small gain is taken
    for _ in range(5):
        c.observe_time(4, True, c.predict(a, 1, *four), c.predict(a, 1, *four))
        c.observe_time(4, False, c.predict(a, 0, *four), c.predict(a, 0, *four))
    assert c.choose(None, 4, *four) > 0
    now[0] += 300  # ten half-lives: untried again
    assert c.choose(None, 4, *four) == 0


def test_pool_hands_out_the_lowest_free_id():
    # with a KV stream per sequence, llama.cpp batches only consecutive ids in one pass
    import asyncio

    from specd.router.pool import SeqPool

    async def main():
        pool = SeqPool(4, max_queue=0)
        got = [await pool.acquire() for _ in range(4)]
        pool.release(0)
        pool.release(2)  # the most recently freed is not the lowest
        return got, await pool.acquire(), await pool.acquire()

    got, first, second = asyncio.run(main())
    assert got == [0, 1, 2, 3] and (first, second) == (0, 2)


def test_each_requests_costly_first_drafting_step_does_not_stop_drafting_alone():
    # one session drafting: every eighth step is a request's first (the
    # draft's prompt, its catch-up: +300 ms), the others take 20 ms beyond
    # the model. An average jumped past what drafting gains after each
    # first step and stopped drafting where it gave 1.7x; the median does not
    c = controller_here()
    a = c.new_session()
    load = (1, 0.9, True, 1)
    for i in range(40):
        c.observe_step(a, 4, 4)
        extra = 0.300 if i % 8 == 0 else 0.020
        c.observe_time(1, True, c.predict(a, 4, *load), c.predict(a, 4, *load) + extra)
    assert c.slowdown(1).drafting == pytest.approx(0.020)
    assert c.choose(a, 4, *load) == 4


def test_plain_batches_slower_than_modelled_are_not_taken_for_overhead():
    # 7 sessions whose ids have holes (others finished): 7 single tokens take
    # two model passes, 58 ms against the model's ~20; the step, 63 ms, has
    # 5 ms of overhead, not 43
    c = controller_here()
    a = c.new_session()
    load = (7, 0.5, True, 7)
    for _ in range(30):
        c.observe_time(7, False, c.predict(a, 0, *load), 0.063, batch_tokens=7, batch_seconds=0.058)
    assert c.slowdown(7).plain == pytest.approx(0.005)


def test_a_drafts_catch_up_is_priced_with_one_row_of_logits():
    """Catching up on a prompt wants the last token's logits; a drafting
    round wants every token's. Priced on the drafting curve, where an
    output row costs the Q4_1 draft 2.5-5 ms, a 32-token catch-up is priced
    with 31 rows it does not compute, enough here to stop drafting."""
    target = CostCurve([(1, 0.016), (2, 0.022), (4, 0.030), (8, 0.047), (16, 0.080), (32, 0.150)])
    # curves CostCheck believes: no batch dearer than its tokens one at a time
    rows = CostCurve([(1, 0.007), (2, 0.016), (4, 0.032), (8, 0.054), (16, 0.110), (32, 0.250)])
    prompt = CostCurve([(1, 0.007), (2, 0.014), (4, 0.026), (8, 0.044), (16, 0.060), (32, 0.090)])
    step = dict(acc=None, n_max=4, n_sessions=1, hidden=1.0, overlap=True, n_drafting=1, lag=32, remaining=24)
    priced_by_rows = Controller(target=target, draft=rows, new_trials=no_trials)
    assert priced_by_rows.choose(**step) == 0
    assert Controller(target=target, draft=rows, draft_prompt=prompt, new_trials=no_trials).choose(**step) == 4
    # the catch-up is the only difference: with nothing to catch up both draft
    assert priced_by_rows.choose(**{**step, "lag": 0}) == 4


def test_one_slow_drafting_step_on_fresh_evidence_does_not_stop_drafting():
    # a minute without drafting at one session: the first drafting step took
    # 44 ms beyond the model (threads and caches cold). As the only figure
    # at that level it ruled, and drafting stopped for 9 s where it gave 1.7x
    now = [100.0]
    c = controller_here(lambda: now[0])
    a = c.new_session()
    load = (1, 0.0, True, 1)
    assert c.choose(a, 4, *load) > 0
    c.observe_step(a, 4, 4)
    c.observe_time(1, True, c.predict(a, 4, *load), c.predict(a, 4, *load) + 0.044)
    assert c.choose(a, 4, *load) > 0
    # the next steps are as modelled: the slow one fades into the median
    for _ in range(3):
        c.observe_step(a, 4, 4)
        c.observe_time(1, True, c.predict(a, 4, *load), c.predict(a, 4, *load) + 0.002)
    assert c.slowdown(1).extras(now[0])[1] < 0.005 and c.choose(a, 4, *load) > 0
    # the same slowness step after step is believed: here it costs more than drafting gains
    b = c.new_session()
    now[0] += 300  # what drafting showed has faded
    for _ in range(3):
        c.observe_step(b, 4, 4)
        c.observe_time(1, True, c.predict(b, 4, *load), c.predict(b, 4, *load) + 0.044)
    assert c.choose(b, 4, *load) == 0


def test_a_session_prices_overlap_at_its_steady_share():
    """A draft costing 0.7x a target token pays only when overlap hides
    most of its drafting (measured curves of this machine, shape kept).
    Priced at a share learned from past steps, half of them hidden, one
    session never drafted again after its first request, where drafting
    ran 1.2x faster: a session that does not draft teaches no share. A
    step without drafts made ahead prices each k at the share a session
    drafting k sees, a^(k+1), which acceptance alone moves."""
    target = CostCurve([(1, .0198), (2, .0239), (4, .029), (8, .0359), (16, .0492)])
    shared = CostCurve([(1, .0259), (2, .0411), (4, .0497), (8, .066), (16, .0932)])
    draft = CostCurve([(1, .014), (2, .025), (4, .040), (8, .070), (16, .128)])
    no_trials = dict(new_trials=lambda level: Trials(credit=0.0, share=0.0))
    c = Controller(target=target, draft=draft, target_shared=shared, **no_trials)
    assert c.choose(None, 4, 1, 0.5, True, 1) == 0  # what locked one session out
    assert c.choose(None, 4, 1, None, True, 1) > 0  # could pay: every draft accepted, every step hidden
    good, poor = c.new_session(), c.new_session()
    for _ in range(30):
        c.observe_step(good, 4, 4)
        c.observe_step(poor, 4, 1)
    assert c.choose(good, 4, 1, None, True, 1) > 0
    assert c.choose(poor, 4, 1, None, True, 1) == 0  # few steps hidden, and few drafts taken


@pytest.mark.parametrize("k", [1, 2, 4, 8, 16])
def test_steady_hidden_share_falls_with_k_and_rises_with_acceptance(k):
    for a in (0.0, 0.3, 0.7, 0.9):
        h = steady_hidden(a, k)
        assert 0.0 <= h <= 1.0
        assert steady_hidden(a, k + 1) <= h <= steady_hidden(a + 0.1, k)
    assert steady_hidden(1.0, k) == 1.0


# the F32 target's curve as its worker timed it on this 2-core machine
MEASURED_TARGET = CostCurve([(1, .0249), (2, .0261), (4, .0332), (8, .0384), (16, .0509), (32, .0758), (64, .1093)])


def test_a_model_free_drafters_long_match_is_priced_by_what_it_costs_the_others():
    """Eight n-gram sessions on copy-heavy prompts: a 48-token match goes
    into a batch of the other seven's single tokens, 56 tokens where a
    plain round has 8, and slows all of them; priced as if every session
    drafted alike, with the acceptance lifted to 1 by the exploration
    bonus, specd drafted 1071 tokens at 8 sessions and ran at 0.89x of
    itself without drafting. Priced by all sessions' tokens per second,
    a round of one long match does not pay once the load level has shown
    what such steps add; good acceptance still drafts on a fresh model,
    and poorer acceptance drafts shorter."""
    ks = [choose_alone(a, 48, 8, MEASURED_TARGET) for a in (0.8, 0.9, 0.95)]
    assert 0 < ks[0] <= ks[1] <= ks[2] < 48, ks
    assert choose_alone(0.967, 48, 8, MEASURED_TARGET, extra_plain=0.007, extra_drafting=0.11) == 0
    assert choose_alone(0.5, 48, 8, MEASURED_TARGET) == 0


def test_a_model_free_match_is_priced_beside_the_others_drafts_in_the_same_batch():
    """Eight sessions copying the same kind of text find matches at once:
    each 45-token draft went into a batch of 194 tokens (581 ms) where
    choose_alone saw 8 + 45, and specd with map-k4v ran at 0.8x of itself
    without drafting. With the others' drafts in the batch (SharedRounds),
    a match that pays beside seven single tokens does not beside seven
    long drafts; with none, the choice is as before."""
    alone = choose_alone(0.9, 48, 8, MEASURED_TARGET)
    assert alone > 0
    assert choose_alone(0.9, 48, 8, MEASURED_TARGET, others=0.0, others_yield=0.0) == alone
    assert choose_alone(0.9, 48, 8, MEASURED_TARGET, others=7 * 45, others_yield=7 * 13) == 0


def test_shared_rounds_learn_the_others_tokens_and_forget_them_when_nobody_drafts():
    r = SharedRounds()
    for _ in range(60):  # a session drafting 45 in rounds of 194 tokens, 13 accepted
        r.observe(8, 194, 45, 13)
    assert 135 < r.others < 141 and 0.28 * r.others < r.others_yield < 0.30 * r.others
    for _ in range(60):  # everyone plain again: drafting is priced alone once more
        r.observe(8, 8, 0, 0)
    assert r.others < 1.0
    assert r.others_yield < 0.3


def test_a_match_found_while_others_drafts_wait_for_their_batch_is_priced_beside_them():
    """A load level's first rounds: eight sessions find matches at once and
    SharedRounds has seen none of it yet. The drafts chosen before a choice
    and not yet verified (StepLoad.pending) are what it will share a
    batch with; once they are verified, the choice is as before."""
    c = Controller(target=MEASURED_TARGET, draft=CostCurve(), model_free=True,
                   new_trials=lambda level: Trials(credit=0.0, share=0.0))
    acc = Acceptance(prior=0.97)
    alone = c.choose(acc, 48, 8, None, True, 8)
    assert alone > 0
    assert c.choose(acc, 48, 8, None, True, 8, pending=7 * 45) == 0
    assert c.choose(acc, 48, 8, None, True, 8, pending=0) == alone
    shared = SharedRounds(others=100.0, drafted=40.0, accepted=10.0)
    assert shared.beside(20, 0.9) == (100.0, 25.0) and shared.beside(300, 0.9) == (300.0, 75.0)
    assert SharedRounds().beside(40, 0.9) == (40.0, 36.0)  # nothing verified yet: as the session's own


def test_under_load_a_model_free_session_drafts_by_its_acceptance_not_its_bonus():
    no_trials = dict(new_trials=lambda level: Trials(credit=0.0, share=0.0))
    acc = Acceptance(prior=0.97)
    for _ in range(3):  # long copied runs: 31 of 32 drafts, then a miss
        acc.tick()
        acc.observe(32, 31)
    assert acc.optimistic == 1.0 and acc.rate < 0.98
    free = Controller(target=MEASURED_TARGET, draft=CostCurve(), model_free=True, **no_trials)
    model = Controller(target=MEASURED_TARGET, draft=CostCurve(), **no_trials)
    assert model.choose(acc, 48, 8, None, True, 8) == 48
    assert 0 < free.choose(acc, 48, 8, None, True, 8) < 48
    assert free.choose(acc, 48, 1, None, True, 1) == model.choose(acc, 48, 1, None, True, 1)  # alone: as before
