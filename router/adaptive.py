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
already made (1 at a step that has them: their cost is sunk). With overlap
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

import bisect
import collections
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class CostCheck:
    """What a curve of decode costs (batch tokens, seconds) must look like to
    be believed: a batch is not cheaper than a smaller one (by more than
    `slack`, timing noise), and not dearer than decoding it as smaller
    batches one after another (by more than `margin`). A disturbance only
    adds time; when it hits some batch sizes and not others it breaks one of
    these (a 2-token batch timed while the other worker calibrated on the
    same cores looked five times dearer than one token). Workers time again
    when a curve fails; the router believes only `repair`ed curves."""

    margin: float = 0.15
    slack: float = 0.10

    def problems(self, points) -> list[str]:
        """Each pair of batch sizes that breaks the rules, worded for a log."""
        pts = sorted(points)
        out = []
        for j, (n, t) in enumerate(pts):
            for m, u in pts[:j]:
                if t < u * (1.0 - self.slack):
                    out.append(f"{n} tokens {t * 1e3:.1f} ms < {m} tokens {u * 1e3:.1f} ms")
                elif t > self._cap(n, m, u):
                    out.append(f"{n} tokens {t * 1e3:.1f} ms > {-(-n // m)} x {m} tokens {u * 1e3:.1f} ms "
                               f"+ {self.margin:.0%}")
        return out

    def repair(self, points) -> tuple[tuple[int, float], ...]:
        """The curve lowered until it passes: each size no dearer than any
        bigger one, nor than smaller batches one after another. Only lowers,
        since disturbances only add time; leaves a curve that passes as it
        is, up to `slack`."""
        pts = sorted(points)
        n = [x for x, _ in pts]
        t = [y for _, y in pts]
        for i in range(len(t) - 2, -1, -1):
            t[i] = min(t[i], t[i + 1])
        for j in range(1, len(t)):
            t[j] = min([t[j]] + [self._cap(n[j], n[i], t[i]) for i in range(j)])
        return tuple(zip(n, t))

    def _cap(self, n: int, m: int, u: float) -> float:
        return -(-n // m) * u * (1.0 + self.margin)


COST_CHECK = CostCheck()


def expected_tokens(a: float, k: int) -> float:
    """Tokens one step yields with k drafts accepted independently with
    probability a until the first rejection, plus the target's own token."""
    if k <= 0:
        return 1.0
    a = min(max(a, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class CostCurve:
    """Seconds of one decode as a function of the tokens in the batch:
    piecewise linear through the points the worker timed when it loaded,
    linear beyond the last. Those points are taken on an idle worker, both
    workers alike, so the two curves compare fairly; what the machine adds
    under load shows in the measured step times (`Slowdown`). A worker that
    did not calibrate gets the decodes the router sees as its points.

    A calibrated curve is believed once `CostCheck.repair`ed, and learns
    downwards only: a batch of n tokens the router saw take s seconds says
    the biggest timed size not above n costs at most s. Each point is the
    median of its last `window` such figures, capped at the calibration,
    with the calibration counted `prior` times, so it moves only when most
    recent batches were cheaper (some are, by their shape: prompts want
    fewer rows of logits) and never above what was timed (load shows in
    `Slowdown`)."""

    def __init__(self, points=(), weight: float = 0.2, window: int = 8, prior: int = 2):
        self.weight = weight
        self._n: list[int] = []
        self._t: list[float] = []
        for n, t in points:
            self._add(n, t, 1.0)
        self.calibrated = len(self._n) >= 2
        if self.calibrated:
            self._t = [t for _, t in COST_CHECK.repair(zip(self._n, self._t))]
        self._timed = list(self._t)
        self._learned = list(self._t)
        self._prior = prior
        self._seen = [collections.deque(maxlen=window) for _ in self._n]

    def __len__(self) -> int:
        return len(self._n)

    def _add(self, n: int, seconds: float, weight: float) -> None:
        if n <= 0 or seconds <= 0:
            return
        i = bisect.bisect_left(self._n, n)
        if i < len(self._n) and self._n[i] == n:
            self._t[i] += weight * (seconds - self._t[i])
        else:
            self._n.insert(i, n)
            self._t.insert(i, seconds)

    def observe(self, n: int, seconds: float) -> None:
        """A batch of n tokens the router saw take `seconds`."""
        if not self.calibrated:
            self._add(n, seconds, self.weight)
            return
        i = bisect.bisect_right(self._n, n) - 1
        if i < 0 or seconds <= 0:
            return
        self._seen[i].append(min(seconds, self._timed[i]))
        self._learned[i] = statistics.median_high([self._timed[i]] * self._prior + list(self._seen[i]))
        self._t = [t for _, t in COST_CHECK.repair(zip(self._n, self._learned))]

    def __call__(self, n: float) -> float:
        if not self._n:
            return 0.0
        if len(self._n) == 1:
            return self._t[0]
        i = bisect.bisect_left(self._n, n)
        if i < len(self._n) and self._n[i] == n:
            return self._t[i]
        if i == 0:
            i = 1
        elif i == len(self._n):
            i = len(self._n) - 1
        n0, n1, t0, t1 = self._n[i - 1], self._n[i], self._t[i - 1], self._t[i]
        slope = max((t1 - t0) / (n1 - n0), 0.0)
        return max(t0 + slope * (n - n0), 1e-9)


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
                        hidden: float = 0.0, overlap: bool = False, margin: float = 0.10,
                        n_drafting: int | None = None, lag: int = 0, remaining: int = 0,
                        extra_plain: float = 0.0, extra_drafting: float = 0.0,
                        target_shared: CostCurve | None = None, catch_up: CostCurve | None = None) -> int:
    """The k in [0, n_max] with the most expected tokens per second of a
    round; speculation must beat target-only by `margin` to be chosen. A
    draft `lag` tokens behind must decode them first: that one decode is
    spread over the steps left for `remaining` tokens (all of it when 0).
    `extra_plain` / `extra_drafting`: seconds measured steps without / with
    drafts took beyond the model's prediction."""
    if len(target) < 2 or n_max <= 0:  # no idea yet how cost grows with the batch: do not adapt
        return n_max
    best_k = 0
    best = (1.0 + margin) / max(round_seconds(0, n_sessions, target, draft) + extra_plain, 1e-9)
    for k in range(1, n_max + 1):
        e = expected_tokens(a, k)
        cost = predicted_seconds(k, e, n_sessions, target, draft, hidden, overlap, n_drafting, lag, remaining,
                                 target_shared=target_shared, catch_up=catch_up)
        rate = e / max(cost + extra_drafting, 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


@dataclass
class Slowdown:
    """Seconds measured steps took beyond the predicted ones at one load
    level, for steps that drafted and steps that did not: the median of the
    last `window` of each, so that a burst of steps queued behind a prompt
    or a draft's catch-up does not make every step look slow (a moving
    average let such bursts make sessions draft at a loss, or stop drafting
    where it paid). What a request's first drafting step adds (the draft's
    catch-up) the model prices itself (`lag`).
    Added, not multiplied: what the model leaves out is mostly a per-step
    cost (router and RPC time, waiting for the batch to gather), and as a
    factor the plain steps' large share of it would make drafting steps,
    whose prediction is long, look cheap.

    Both figures count only while drafting steps at this level are recent:
    a per-step cost seen on plain steps alone says nothing of what drafting
    would add there, yet would make drafting look like it amortises that
    cost (under heavy load every session would then draft at once, at a
    loss). So they fade, with `half_life` seconds since the
    last drafting step, back to the model as calibrated: a load level where
    the model says drafting cannot pay never drafts; one where it can is
    tried again once what drafting showed there has faded."""

    stamp: float | None = None  # time of the last drafting step
    half_life: float = 30.0
    window: int = 64
    prior_steps: float = 2.0  # the calibrated model's word, worth this many measured steps
    recent_plain: collections.deque = field(default_factory=collections.deque)
    recent_drafting: collections.deque = field(default_factory=collections.deque)

    @property
    def plain(self) -> float:
        return statistics.median(self.recent_plain) if self.recent_plain else 0.0

    @property
    def drafting(self) -> float:
        return statistics.median(self.recent_drafting) if self.recent_drafting else 0.0

    def observe(self, extra: float, drafted: bool, now: float) -> None:
        if drafted:
            if self.freshness(now) < 0.5:  # what drafting showed here has faded: start over
                self.recent_drafting.clear()
            recent, self.stamp = self.recent_drafting, now
        else:
            recent = self.recent_plain
        recent.append(extra)
        while len(recent) > self.window:
            recent.popleft()

    def freshness(self, now: float) -> float:
        if self.stamp is None:
            return 0.0
        return 0.5 ** (max(now - self.stamp, 0.0) / self.half_life)

    def extras(self, now: float) -> tuple[float, float]:
        """(plain, drafting) seconds to add to the model's steps now: each
        median weighed against the model as calibrated (which adds nothing)
        by how many steps it rests on, so that one step does not rule: the
        first drafting step after a pause runs cold, and alone it would
        stop drafting where drafting pays."""
        w = self.freshness(now)
        return (w * self._weight(self.recent_plain) * self.plain,
                w * self._weight(self.recent_drafting) * self.drafting)

    def _weight(self, recent: collections.deque) -> float:
        return len(recent) / (len(recent) + self.prior_steps)


@dataclass
class RecentPeak:
    """A session count that rises at once and falls `hold` seconds late: the
    highest count of the last `hold` seconds. Speculation decides on it, so
    the gap between two requests of a client (another session alone for a
    moment) does not start drafting, and the draft's catch-up on its
    context, just before the load is back. `hold` outlasts such gaps and
    no more: a peak that decays slowly instead keeps a lone session left
    after a wave of load from drafting for a good part of its requests.
    Past the hold the session count is what it is; a session that drafts
    while the load comes back stops at its next step, and its draft's
    catch-up is priced (`lag`)."""

    hold: float = 0.3
    # (seconds when seen, count), counts falling: the window's maxima (the
    # router notes the count at every step of every session)
    recent: collections.deque = field(default_factory=collections.deque)

    def load(self, n: int, now: float) -> int:
        """Note the current count `n`; the load to decide on."""
        r = self.recent
        while r and r[-1][1] <= n:
            r.pop()
        r.append((now, n))
        while r[0][0] < now - self.hold:
            r.popleft()
        return r[0][1]


@dataclass
class Trials:
    """One load level's trials of drafting where the model says it does not
    pay. The model rests on curves timed once at start-up; where nobody
    drafts, no verification of several tokens shows a wrong one, and a
    wrong "never pays" would last for good. So a level where nobody drafts
    earns trial steps at `share` of its rounds (its steps over its
    sessions: a trial step slows the batch every session's step shares)
    and, once it holds `steps` of them, drafts that many steps at the
    request's bound (the first at once alone: `level_trials`). A trial's
    steps cost the others several rounds (the first pays the draft's
    catch-up while the target gives it a core), so they are rare. Drafting the model
    chose counts as one of a running trial's steps (a trial ends after its
    steps, not at the first the model drafts on its own, which alone says
    little) and, outside one, spends what was earned (its evidence is
    fresh). Only sessions whose
    draft lags at most `max_lag` tokens take part: a trial must not pay a
    long catch-up. So trial steps never exceed `steps` + `share` of the
    rounds."""

    steps: int = 3
    share: float = 0.001
    max_lag: int = 64
    credit: float | None = None  # trial steps earned; None: a trial's worth, the first at once
    left: int = 0  # steps of the running trial
    taken: int = 0  # trial steps so far

    def __post_init__(self) -> None:
        if self.credit is None:
            self.credit = float(self.steps)

    def due(self) -> bool:
        return self.left > 0 or self.credit >= self.steps

    def decide(self, k: int, n_max: int, n_sessions: int, lag: int) -> int:
        """A session's draft length this step: the model's `k`, or `n_max` for a trial step."""
        if k == 0:
            self.credit = min(self.credit + self.share / max(n_sessions, 1), float(self.steps))
            if lag > self.max_lag or not self.due():
                return 0
            if self.left == 0:
                self.left, self.credit = self.steps, self.credit - self.steps
            self.taken += 1
            k = n_max
        elif self.left == 0:
            self.credit = 0.0
        self.left = max(self.left - 1, 0)
        return k


def level_trials(level: int) -> Trials:
    """A load level's Trials. Alone the first comes at once: a lone session
    that never drafts is what a wrong curve shows first (issue #24), and
    nobody waits on its trial. Under load the first is earned like the rest,
    as a fresh router's trial at every level cost a short load benchmark
    some throughput where drafting does not pay."""
    return Trials() if level == 1 else Trials(credit=0.0)


def load_level(n_sessions: int) -> int:
    """Sessions on the target in powers of two: what a Controller keeps its
    figures and trials per."""
    return max(n_sessions, 1).bit_length()


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

    def new_session(self) -> Acceptance:
        return Acceptance(prior=self.overall.rate)

    def slowdown(self, n_sessions: int) -> Slowdown:
        return self.slowdowns.setdefault(load_level(n_sessions), Slowdown())

    def trial(self, n_sessions: int) -> Trials:
        level = load_level(n_sessions)
        if level not in self.trials:
            self.trials[level] = self.new_trials(level)
        return self.trials[level]

    def choose(self, acc: Acceptance | None, n_max: int, n_sessions: int, hidden: float, overlap: bool,
               n_drafting: int | None = None, lag: int = 0, remaining: int = 0) -> int:
        """A session's draft length this step, a trial step's included
        (`Trials`); acc None asks whether drafting could pay at all now
        (acceptance 1), or a trial is due (so the draft gets the prompt)."""
        a = 1.0 if acc is None else acc.optimistic
        slow = self.slowdown(n_sessions)
        now = self.clock()
        extra_plain, extra_drafting = slow.extras(now)
        w = slow.freshness(now)
        k = choose_draft_length(a, n_max, n_sessions, self.target, self.draft, hidden, overlap,
                                margin=w * self.margin + (1.0 - w) * self.untried_margin,
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
