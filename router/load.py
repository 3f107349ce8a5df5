"""What load does to a step beyond the cost curves, per load level.

`Slowdown` learns the seconds measured steps take beyond the predicted ones
(router and RPC time, waiting for a batch, processes sharing cores);
`RecentPeak` holds the load a choice should plan for; `Trials` gives a load
level where nobody drafts a short trial now and then, so drafting is never
locked out by one bad estimate.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import NamedTuple


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
class SharedRounds:
    """What the other sessions put in a target batch at one load level,
    beyond one token each: their drafts (and prompts), as a moving average
    per round, and the share of drafted tokens all sessions got accepted.
    A session's drafts join theirs in one batch: when every session copies
    a long match at once, a 48-token draft is not priced beside seven
    single tokens but beside the others' drafts too."""

    weight: float = 0.1  # of the newest round in the averages
    others: float = 0.0  # tokens beyond one a session, from the other sessions
    drafted: float = 0.0
    accepted: float = 0.0

    def observe(self, n_sessions: int, batch_tokens: int, n_drafted: int, n_accepted: int) -> None:
        """One step's verification: its batch had `batch_tokens`, of which
        this session's own were its token and `n_drafted` drafts."""
        if batch_tokens > 0:
            extra = max(batch_tokens - max(n_sessions, 1) - n_drafted, 0)
            self.others += self.weight * (extra - self.others)
        self.drafted += self.weight * (n_drafted - self.drafted)
        self.accepted += self.weight * (n_accepted - self.accepted)

    @property
    def accepted_share(self) -> float:
        return self.accepted / self.drafted if self.drafted > 1e-9 else 0.0

    @property
    def others_yield(self) -> float:
        """Tokens the others' extra batch tokens are expected to yield."""
        return self.others * self.accepted_share

    def beside(self, pending: int, share: float) -> Others:
        """The others' drafts a choice made now is priced beside: the
        average, or the drafts other sessions chose that still wait for
        their verification (`pending` tokens), whichever is more. When
        several sessions find matches at once, the average has not seen
        them yet, and each would be priced as if it drafted alone. Until
        drafts were verified here, they yield `share` a token (the
        session's own acceptance): priced as yielding nothing, they would
        make the batch look so poor that any draft seemed to lift it."""
        tokens = max(self.others, float(pending))
        return Others(tokens, tokens * (self.accepted_share if self.drafted > 1e-9 else share))


class Others(NamedTuple):
    """Other sessions' tokens in a batch beyond one each, and what they are expected to yield."""

    tokens: float
    yield_: float
