"""Adaptive speculation: each step's draft length from acceptance and cost.

Speculation pays when the target has compute to spare and costs when it is
saturated: a batch of B sessions each verifying k drafts is a decode of
B * (k + 1) tokens. Each step the router picks, per session, the k in
[0, n_max] that maximises expected tokens per second of a round:

    E(a, k) = 1 + a + ... + a^k               (tokens a step yields)
    T(k)    = k * t_d + t_t                   (no overlap)
    T(k)    = (1 - h) * k * t_d + max(t_t, (k + 1) * t_d)   (overlap)
    k*      = argmax_k E(a, k) / T(k),        k = 0 is target-only

with t_t = t_target(B * (k + 1)) for the B sessions on the session's target,
t_d = t_draft(D) for the D sessions sharing the draft, `a` the session's
acceptance rate (a geometric model of how far drafts match, as in the
speculative decoding papers) and `h` the share of steps whose drafts overlap
already made: 1 at a step that has them (their cost is sunk), else a^(k+1),
what a session drafting k at acceptance a sees in steady state
(`steady_hidden`). With overlap
the draft drafts the next k + 1 tokens while the target verifies, on its own
compute: a round lasts as long as the slower of the two, plus the drafting
nobody hid. t_target / t_draft are the curves
each worker timed when it loaded; what they miss under load (`Slowdown`:
router and RPC time, waiting for the batch, processes sharing cores) is
learned from measured step times, per load level, as seconds added to a
step. A draft that fell behind (it is not fed
while a session does not draft, nor prefilled when drafting could not pay)
first decodes what it missed: that cost is spread over the steps left.

A curve timed at start-up can be wrong (the other worker computing on the
same cores while it was timed), and without drafting no multi-token
verification would ever show it: `CostCheck` rejects curves no machine
produces, curves learn from the batches the router sees (`CostCurve`), and a
load level where nobody drafts gets a short trial now and then (`Trials`).
Pure functions and small classes, so they are tested without models.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from specd.router.costs import CostCurve
from specd.router.load import SharedRounds, Slowdown, Trials, level_trials, load_level


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step yields with k drafts accepted independently with
    probability a until the first rejection, plus the target's own token."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Acceptance:
    """A session's acceptance rate: accepted drafts over accepted drafts plus
    rejections (the maximum-likelihood rate of the geometric model), with a
    prior worth `prior_weight` observations. Evidence decays every step,
    drafting or not, so a session that stopped drafting grows uncertain again
    and `optimistic` (the rate plus a bonus that shrinks with evidence, as in
    UCB bandits) makes it try drafting again when that could pay. It fades
    slower on steps without drafts (`decay_idle`): each such try with a poor
    draft costs more than the plain steps it replaces, so tries must be
    rare; a drafting session still follows its rate at `decay`."""

    prior: float = 0.8
    prior_weight: float = 2.0
    decay: float = 0.95
    decay_idle: float = 0.99
    bonus: float = 0.5
    accepted: float = 0.0
    rejected: float = 0.0

    def tick(self, drafted: bool = True) -> None:
        d = self.decay if drafted else self.decay_idle
        self.accepted *= d
        self.rejected *= d

    def observe(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted <= 0:
            return
        self.accepted += n_accepted
        self.rejected += 1 if n_accepted < n_drafted else 0

    @property
    def rate(self) -> float:
        return (self.accepted + self.prior * self.prior_weight) / (
            self.accepted + self.rejected + self.prior_weight)

    @property
    def optimistic(self) -> float:
        return min(1.0, self.rate + self.bonus / (1.0 + self.accepted + self.rejected) ** 0.5)


def steady_hidden(a: float, k: int) -> float:
    """The share of a drafting session's steps whose drafts overlap made
    beside the last verification: those after a step that accepted all k
    drafts and whose continuation guessed the target's own token, k + 1
    matches in a row. A model, not a measured share: a share learned from
    steps is learned only while sessions draft, and one that started or
    fell low priced drafting at a loss, so nobody drafted and it never rose
    again (one session drafted its first request only, at 1.2x the speed of
    the rest)."""
    return min(max(a, 0.0), 1.0) ** (k + 1)


def round_seconds(k: int, n_sessions: int, target: CostCurve, draft: CostCurve,
                  hidden: float = 0.0, overlap: bool = False, n_drafting: int | None = None,
                  verify_tokens: int | None = None, target_shared: CostCurve | None = None) -> float:
    """T(k): seconds of one step of n_sessions sessions on the target, each
    verifying k drafts, while n_drafting sessions (default the same) share
    the draft. `verify_tokens`: the target's batch as it really was.
    `target_shared`: the target's curve while the draft computes beside it
    (workers sharing cores: with overlap the target verifies on its own
    threads, see DecodeRequest.draft_busy)."""
    b = max(n_sessions, 1)
    n_t = verify_tokens if verify_tokens else b * (k + 1)
    if k <= 0:
        return target(n_t)
    t_t = (target_shared if overlap and target_shared else target)(n_t)
    t_d = draft(max(n_drafting if n_drafting is not None else b, 1))
    if not overlap:
        return k * t_d + t_t
    return (1.0 - hidden) * k * t_d + max(t_t, (k + 1) * t_d)


def predicted_seconds(k: int, e: float, n_sessions: int, target: CostCurve, draft: CostCurve,
                      hidden: float = 0.0, overlap: bool = False, n_drafting: int | None = None,
                      lag: int = 0, remaining: int = 0, verify_tokens: int | None = None,
                      target_shared: CostCurve | None = None, catch_up: CostCurve | None = None) -> float:
    """T(k) plus this step's share of catching a lagging draft up (e: the
    tokens a step is expected to yield), priced on `catch_up` (the draft's
    curve with the last token's logits only) when given: a catch-up wants
    one row of logits, where `draft` prices a drafting round's row each."""
    t = round_seconds(k, n_sessions, target, draft, hidden, overlap, n_drafting, verify_tokens, target_shared)
    if k > 0 and lag > 0:
        t += (catch_up if catch_up else draft)(lag) / max(remaining / e, 1.0)
    return t


def choose_draft_length(a: float, n_max: int, n_sessions: int, target: CostCurve, draft: CostCurve,
                        hidden: float | None = 0.0, overlap: bool = False, margin: float = 0.10,
                        n_drafting: int | None = None, lag: int = 0, remaining: int = 0,
                        extra_plain: float = 0.0, extra_drafting: float = 0.0,
                        target_shared: CostCurve | None = None, catch_up: CostCurve | None = None) -> int:
    """The k in [0, n_max] with the most expected tokens per second of a
    round; speculation must beat target-only by `margin` to be chosen. A
    draft `lag` tokens behind must decode them first: that one decode is
    spread over the steps left for `remaining` tokens (all of it when 0).
    `extra_plain` / `extra_drafting`: seconds measured steps without / with
    drafts took beyond the model's prediction. `hidden` None: each k at
    its steady share (`steady_hidden`)."""
    if len(target) < 2 or n_max <= 0:  # no idea yet how cost grows with the batch: do not adapt
        return n_max
    best_k = 0
    best = (1.0 + margin) / max(round_seconds(0, n_sessions, target, draft) + extra_plain, 1e-9)
    for k in range(1, n_max + 1):
        e = expected_tokens(a, k)
        h = steady_hidden(a, k) if hidden is None else hidden
        cost = predicted_seconds(k, e, n_sessions, target, draft, h, overlap, n_drafting, lag, remaining,
                                 target_shared=target_shared, catch_up=catch_up)
        rate = e / max(cost + extra_drafting, 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


def choose_alone(a: float, n_max: int, n_sessions: int, target: CostCurve, margin: float = 0.10,
                 extra_plain: float = 0.0, extra_drafting: float = 0.0, others: float = 0.0,
                 others_yield: float = 0.0) -> int:
    """A draft length for a session whose drafting the others do not share:
    a model-free drafter drafts only where it finds a match, so one
    session's k + 1 tokens go into a batch of the others' tokens (one each,
    plus `others` drafts expected to yield `others_yield`: SharedRounds),
    and slow all of them. The k in [0, n_max] with the most tokens per
    second for all n_sessions together, drafting beating plain by `margin`."""
    if len(target) < 2 or n_max <= 0:  # as choose_draft_length: no idea yet how cost grows
        return n_max
    b = max(n_sessions, 1)
    batch, plain_yield = b + others, b + others_yield
    best_k = 0
    best = (1.0 + margin) * plain_yield / max(target(batch) + extra_plain, 1e-9)
    for k in range(1, n_max + 1):
        rate = (plain_yield - 1 + expected_tokens(a, k)) / max(target(batch + k) + extra_drafting, 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


@dataclass
class Controller:
    """What the router keeps for adaptive speculation: both workers' cost
    curves, the acceptance seen across sessions (the prior of a new one) and
    the slowdown per load level (sessions on the target, in powers of two)."""

    target: CostCurve = field(default_factory=CostCurve)
    draft: CostCurve = field(default_factory=CostCurve)
    target_shared: CostCurve = field(default_factory=CostCurve)  # empty: as `target`
    draft_prompt: CostCurve = field(default_factory=CostCurve)  # a catch-up's price; empty: as `draft`
    overall: Acceptance = field(default_factory=lambda: Acceptance(decay=0.99))
    slowdowns: dict[int, Slowdown] = field(default_factory=dict)
    trials: dict[int, Trials] = field(default_factory=dict)
    rounds: dict[int, SharedRounds] = field(default_factory=dict)
    new_trials: Callable[[int], Trials] = level_trials  # lambda level: Trials(credit=0.0, share=0.0): none
    # how much drafting must be predicted to beat target-only by: with recent
    # evidence at that load level `margin`, without it `untried_margin`. The
    # calibrated model errs one way under load (two processes decoding at
    # once slow each other, which no idle calibration shows), and a trial is
    # not free (the draft first catches up on every context): only a clear
    # predicted gain is worth one.
    margin: float = 0.10
    untried_margin: float = 0.25
    clock: Callable[[], float] = time.monotonic
    # a model-free drafter (DraftLink.attach): under load a session's drafts
    # are priced by what they cost the sessions that do not draft (choose_alone)
    model_free: bool = False

    def new_session(self) -> Acceptance:
        return Acceptance(prior=self.overall.rate)

    def slowdown(self, n_sessions: int) -> Slowdown:
        return self.slowdowns.setdefault(load_level(n_sessions), Slowdown())

    def shared(self, n_sessions: int) -> SharedRounds:
        return self.rounds.setdefault(load_level(n_sessions), SharedRounds())

    def trial(self, n_sessions: int) -> Trials:
        level = load_level(n_sessions)
        if level not in self.trials:
            self.trials[level] = self.new_trials(level)
        return self.trials[level]

    def choose(self, acc: Acceptance | None, n_max: int, n_sessions: int, hidden: float | None, overlap: bool,
               n_drafting: int | None = None, lag: int = 0, remaining: int = 0, pending: int = 0) -> int:
        """A session's draft length this step, a trial step's included
        (`Trials`); acc None asks whether drafting could pay at all now
        (acceptance 1), or a trial is due (so the draft gets the prompt).
        `hidden`: 1 when overlap already made this step's drafts; None: the
        steady share (`steady_hidden`). `pending`: a model-free drafter's
        tokens other sessions chose that wait for this target."""
        a = 1.0 if acc is None else acc.optimistic
        slow = self.slowdown(n_sessions)
        now = self.clock()
        extra_plain, extra_drafting = slow.extras(now)
        w = slow.freshness(now)
        margin = w * self.margin + (1.0 - w) * self.untried_margin
        if self.model_free and n_sessions > 1:
            # the acceptance itself, without the exploration bonus: over long
            # copied runs a token's is 0.94-0.97, and lifted to 1 it priced a
            # 48-token draft as 49 tokens; a session that stopped drafting
            # tries again as its evidence fades to the prior and the load
            # level's slowdown to the model
            rate = 1.0 if acc is None else acc.rate
            others = self.shared(n_sessions).beside(pending, rate)
            k = choose_alone(rate, n_max, n_sessions, self.target, margin,
                             extra_plain, extra_drafting, others.tokens, others.yield_)
        else:
            k = choose_draft_length(a, n_max, n_sessions, self.target, self.draft, hidden, overlap, margin=margin,
                                    n_drafting=n_drafting, lag=lag, remaining=remaining,
                                    extra_plain=extra_plain, extra_drafting=extra_drafting,
                                    target_shared=self.target_shared, catch_up=self.draft_prompt)
        trials = self.trial(n_sessions)
        if acc is None:
            return k or (n_max if trials.due() else 0)
        return trials.decide(k, n_max, n_sessions, lag)

    def observe_target(self, n_tokens: int, seconds: float, draft_busy: bool = False) -> None:
        """A target batch the router saw (a verification's, with whatever
        shared it: other sessions' tokens and prompts). One that ran while
        the draft computed ran on the target's own threads: it prices
        `target_shared`, when the target timed that."""
        (self.target_shared if draft_busy and len(self.target_shared) else self.target).observe(n_tokens, seconds)

    def predict(self, acc: Acceptance | None, k: int, n_sessions: int, hidden: float, overlap: bool,
                n_drafting: int | None = None, lag: int = 0, remaining: int = 0,
                verify_tokens: int | None = None) -> float:
        """The model's seconds for a step drafting k (no measured extras added);
        given the target's real batch (`verify_tokens`), what the model
        expects of that batch, so that other sessions' prompts sharing it
        are not taken for overhead."""
        e = expected_tokens(1.0 if acc is None else acc.rate, k)
        return predicted_seconds(k, e, n_sessions, self.target, self.draft, hidden, overlap, n_drafting, lag,
                                 remaining, verify_tokens, self.target_shared, self.draft_prompt)

    def observe_step(self, acc: Acceptance, n_drafted: int, n_accepted: int) -> None:
        """After every step (n_drafted 0 when it did not draft)."""
        acc.tick(n_drafted > 0)
        acc.observe(n_drafted, n_accepted)
        if n_drafted:
            self.overall.tick()
            self.overall.observe(n_drafted, n_accepted)

    def observe_time(self, n_sessions: int, drafted: bool, predicted: float, seconds: float,
                     batch_tokens: int = 0, draft_busy: bool = False, batch_seconds: float = 0.0) -> None:
        """A step's measured seconds against what `predict` said.

        A step without drafts whose target batch carried more than one token
        per session (others' drafts or prompts: `batch_tokens`), or ran
        while the draft computed (`draft_busy`: the target gave back the
        cores it borrows), waited on work of other sessions. Its time says
        nothing of what a step costs when nobody drafts, so it is not
        counted: one session drafting would make the others' plain steps
        look dear, and drafting look cheap beside them, for every session.

        A plain step is judged against its batch's measured seconds when
        those exceed the model's (`batch_seconds`): with a KV stream per
        sequence, sessions whose ids are not contiguous (those left as
        others finish) take a model pass each. Taken for per-step overhead,
        that would carry to the next, denser, load, make every session draft
        there, and leave no plain step to correct it."""
        if predicted <= 0 or seconds <= 0:
            return
        if not drafted:
            if draft_busy or batch_tokens > n_sessions:
                return
            predicted = max(predicted, batch_seconds)
        extra = min(seconds - predicted, 10.0 * predicted)  # one stalled step must not rule for long
        self.slowdown(n_sessions).observe(extra, drafted, self.clock())
