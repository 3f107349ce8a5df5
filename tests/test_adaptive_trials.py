"""Adaptive speculation must never lock itself out of drafting (issue #24):
cost curves learn from the batches the router sees, and a load level where
nobody drafts gets bounded trials. Without models: the steps are simulated
on the decode costs the default pair timed on this machine."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from specd.router.adaptive import Controller, round_seconds
from specd.router.costs import CostCurve
from specd.router.load import Trials

MS_TARGET = [(1, 19.6), (2, 22.9), (4, 26.9), (8, 40.5), (16, 50.2), (32, 79.0), (64, 127.6)]
MS_DRAFT = [(1, 7.6), (2, 13.7), (4, 23.7), (8, 42.2), (16, 80.4), (32, 159.4), (64, 320.0)]


def curve(ms_points, dearer_from: int = 0, factor: float = 1.0) -> CostCurve:
    """A curve of these points, batches of `dearer_from` tokens and more
    `factor` times dearer: a calibration disturbed there."""
    return CostCurve([(n, t / 1e3 * (factor if dearer_from and n >= dearer_from else 1.0)) for n, t in ms_points])


TRUE_TARGET, TRUE_DRAFT = curve(MS_TARGET), curve(MS_DRAFT)
NO_TRIALS = dict(new_trials=lambda level: Trials(credit=0.0, share=0.0))


@dataclass
class OneSession:
    """One session generating a long, predictable answer (every draft
    accepted) on a cluster whose real costs are TRUE_*, its draft not
    prefilled (a start where drafting looked like it could not pay)."""

    c: Controller
    prompt: int = 20
    overhead: float = 0.004  # router and RPC per step
    now: float = 100.0  # the controller's clock

    def run(self, steps: int) -> list[int]:
        acc, ks, lag, drafted = self.c.new_session(), [], self.prompt, False
        for i in range(steps):
            load = (1, 1.0 if drafted else 0.5, True, 1, lag, 1000 - i)
            k = self.c.choose(acc, 4, *load)
            n = k + 1
            if k:
                seconds = round_seconds(k, 1, TRUE_TARGET, TRUE_DRAFT, load[1], True) + TRUE_DRAFT(lag)
                self.c.draft.observe(1, TRUE_DRAFT(1))
            else:
                seconds = TRUE_TARGET(1)
            seconds += self.overhead
            self.c.observe_target(n, TRUE_TARGET(n), draft_busy=k > 0)
            self.c.observe_step(acc, k, k)
            predicted = self.c.predict(acc, k, *load[:4], lag=load[4], remaining=load[5], verify_tokens=n)
            self.c.observe_time(1, k > 0, predicted, seconds, n, k > 0, TRUE_TARGET(n))
            self.now += seconds
            drafted, lag = k > 0, 0 if k else lag + 1
            ks.append(k)
        return ks


def session_on(target: CostCurve, **kw) -> OneSession:
    sim = OneSession(Controller(target=target, draft=curve(MS_DRAFT), **kw))
    sim.c.clock = lambda: sim.now
    return sim


def test_a_calibration_saying_batches_are_dear_is_undone_by_a_trial():
    """The target timed every batch of 2 tokens and more five times too dear:
    the model says drafting never pays, and steps of one token never show
    otherwise. The level's first trial (at once) verifies several tokens;
    those batches are cheap, the curve learns it, and drafting goes on."""
    ks = session_on(curve(MS_TARGET, dearer_from=2, factor=5.0)).run(100)
    assert ks[0] == 4  # the trial: at once
    assert sum(k > 0 for k in ks[10:]) >= 0.9 * len(ks[10:]), ks  # and drafting lasts
    # without trials the same start never drafts: the lock-out of issue #24
    assert session_on(curve(MS_TARGET, dearer_from=2, factor=5.0), **NO_TRIALS).run(100) == [0] * 100


def test_a_wrong_curve_is_corrected_by_other_sessions_batches():
    """Without any trial: plain steps whose batches carried another session's
    prompt (6 and 18 tokens) took what they really cost. Three of them
    outvote the disturbed calibration, and drafting pays again."""
    c = Controller(target=curve(MS_TARGET, dearer_from=2, factor=5.0), draft=curve(MS_DRAFT), **NO_TRIALS)
    alone = (1, 0.5, True, 1)
    assert c.choose(None, 4, *alone) == 0
    for i in range(3):
        assert c.choose(None, 4, *alone) == 0, i
        c.observe_target(6, TRUE_TARGET(6))
        c.observe_target(18, TRUE_TARGET(18))
    assert c.choose(None, 4, *alone) == 4
    assert c.target(4) <= TRUE_TARGET(6) and c.target(16) <= TRUE_TARGET(18)


def test_a_calibrated_curve_learns_down_from_most_recent_batches_and_never_up():
    c = curve(MS_TARGET, dearer_from=2, factor=5.0)
    timed = c(4)
    c.observe(5, 0.030)
    c.observe(5, 0.030)
    assert c(4) == timed  # two batches do not outvote the calibration, worth two
    c.observe(5, 0.030)
    assert c(4) == pytest.approx(0.030) and c(2) <= 0.030  # nor is a smaller batch dearer
    assert c(1) == pytest.approx(0.0196)
    d = curve(MS_TARGET)
    for _ in range(20):
        d.observe(8, 0.200)  # under load: Slowdown's business, not the curve's
    assert d(8) == pytest.approx(0.0405)
    for i in range(8):  # a minority of cheaper batches (prompts' fewer rows of logits) moves nothing
        d.observe(8, 0.030 if i % 3 == 0 else 0.041)
    assert d(8) == pytest.approx(0.0405)


def test_verifications_beside_the_draft_teach_the_shared_curve():
    c = Controller(target=curve(MS_TARGET), target_shared=curve(MS_TARGET, dearer_from=2, factor=5.0))
    for _ in range(3):
        c.observe_target(5, 0.030, draft_busy=True)
    assert c.target_shared(4) == pytest.approx(0.030) and c.target(4) == pytest.approx(0.0269)


def test_trials_stay_within_their_share_where_drafting_never_pays():
    """16 sessions: drafting costs what the model says, and that never pays.
    Trial steps: 3 for every 3000 rounds (0.1%)."""
    now = [100.0]
    c = Controller(target=TRUE_TARGET, draft=TRUE_DRAFT, clock=lambda: now[0])
    sessions = [c.new_session() for _ in range(16)]
    load = (16, 0.5, True, 16)
    rounds, trial_steps = 6500, 0
    for r in range(rounds):
        for i, acc in enumerate(sessions):
            lag = (r + 7 * i) % 200  # sessions early in a request (lag <= 64) can take part
            k = c.choose(acc, 4, *load, lag=lag, remaining=100)
            predicted = c.predict(acc, k, *load, lag=lag, remaining=100)
            c.observe_step(acc, k, k // 2)
            c.observe_time(16, k > 0, predicted, predicted + 0.004)
            trial_steps += k > 0
            now[0] += 0.005
    assert trial_steps == c.trial(16).taken  # every step that drafted was a trial's
    assert 6 <= trial_steps <= 0.001 * rounds  # it does try, within its share


def test_a_session_whose_draft_lags_far_does_not_pay_a_trials_catch_up():
    t = Trials()
    assert t.decide(0, 4, 1, lag=500) == 0 and t.taken == 0
    assert t.decide(0, 4, 1, lag=10) == 4  # the next one with a short lag takes the trial
    assert [t.decide(0, 4, 1, lag=10) for _ in range(3)] == [4, 4, 0]
    assert t.decide(3, 4, 1, lag=10) == 3 and not t.due()  # the model drafts: nothing more to earn


def test_a_trial_runs_its_steps_even_when_the_model_drafts_once_in_between():
    # a trial that ended at the first step the model drafts on its own would
    # rest on one or two steps, the first with the draft's catch-up
    t = Trials()
    assert [t.decide(k, 4, 1, lag=0) for k in (0, 1, 0, 0)] == [4, 1, 4, 0]
    assert t.taken == 2 and not t.due()
