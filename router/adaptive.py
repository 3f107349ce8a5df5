"""Adaptive speculation: each step's draft length from acceptance and cost.

Speculation pays when the target has compute to spare and costs when it is
saturated: a batch of B sessions each verifying k drafts is a decode of
B * (k + 1) tokens. Each step the router picks, per session, the k in
[0, n_max] that maximises expected tokens per second of a round:

    E(a, k) = 1 + a + ... + a^k               (tokens a step yields)
    T(k)    = k * t_d + t_t                   (no overlap)
    T(k)    = (1 - h) * k * t_d + max(t_t, (k + 1) * t_d)   (overlap)
    k*      = argmax_k E(a, k) / T(k),        k = 0 is target-only

with t_t = t_target(B * (k + 1)), t_d = t_draft(B), `a` the session's
acceptance rate (a geometric model of how far drafts match, as in the
speculative decoding papers) and `h` the share of steps whose drafts overlap
already made. With overlap the draft drafts the next k + 1 tokens while the
target verifies, on its own compute: a round lasts as long as the slower of
the two, plus the drafting nobody hid. t_target / t_draft are the workers'
measured decode costs: the curve each worker timed when it loaded, refreshed
with the batches the router sees. Pure functions and small classes, so they
are tested without models.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field


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
    piecewise linear through the points measured so far, each an
    exponential moving average; linear beyond the last point."""

    def __init__(self, points=(), weight: float = 0.2):
        self.weight = weight
        self._n: list[int] = []
        self._t: list[float] = []
        for n, t in points:
            self.observe(n, t, weight=1.0)

    def __len__(self) -> int:
        return len(self._n)

    def observe(self, n: int, seconds: float, weight: float | None = None) -> None:
        if n <= 0 or seconds <= 0:
            return
        i = bisect.bisect_left(self._n, n)
        if i < len(self._n) and self._n[i] == n:
            w = self.weight if weight is None else weight
            self._t[i] += w * (seconds - self._t[i])
        else:
            self._n.insert(i, n)
            self._t.insert(i, seconds)

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
    UCB bandits) makes it try drafting again when that could pay."""

    prior: float = 0.8
    prior_weight: float = 2.0
    decay: float = 0.95
    bonus: float = 0.5
    accepted: float = 0.0
    rejected: float = 0.0

    def tick(self) -> None:
        self.accepted *= self.decay
        self.rejected *= self.decay

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
                  hidden: float = 0.0, overlap: bool = False) -> float:
    """T(k): seconds of one step of B sessions drafting k tokens each."""
    b = max(n_sessions, 1)
    t_t = target(b * (k + 1))
    if k <= 0:
        return t_t
    t_d = draft(b)
    if not overlap:
        return k * t_d + t_t
    return (1.0 - hidden) * k * t_d + max(t_t, (k + 1) * t_d)


def choose_draft_length(a: float, n_max: int, n_sessions: int, target: CostCurve, draft: CostCurve,
                        hidden: float = 0.0, overlap: bool = False, margin: float = 0.03) -> int:
    """The k in [0, n_max] with the most expected tokens per second of a
    round; speculation must beat target-only by `margin` to be chosen."""
    if len(target) < 2 or n_max <= 0:  # no idea yet how cost grows with the batch: do not adapt
        return n_max
    best_k = 0
    best = (1.0 + margin) / max(round_seconds(0, n_sessions, target, draft), 1e-9)
    for k in range(1, n_max + 1):
        rate = expected_tokens(a, k) / max(round_seconds(k, n_sessions, target, draft, hidden, overlap), 1e-9)
        if rate > best:
            best_k, best = k, rate
    return best_k


@dataclass
class Controller:
    """What the router keeps for adaptive speculation: both workers' cost
    curves and the acceptance seen across sessions (the prior of a new one)."""

    target: CostCurve = field(default_factory=CostCurve)
    draft: CostCurve = field(default_factory=CostCurve)
    overall: Acceptance = field(default_factory=lambda: Acceptance(decay=0.99))

    def new_session(self) -> Acceptance:
        return Acceptance(prior=self.overall.rate)

    def observe_step(self, acc: Acceptance, n_drafted: int, n_accepted: int) -> None:
        """After every step (n_drafted 0 when it did not draft)."""
        acc.tick()
        acc.observe(n_drafted, n_accepted)
        if n_drafted:
            self.overall.tick()
            self.overall.observe(n_drafted, n_accepted)

    def choose(self, acc: Acceptance, n_max: int, n_sessions: int, hidden: float, overlap: bool) -> int:
        return choose_draft_length(acc.optimistic, n_max, n_sessions, self.target, self.draft, hidden, overlap)
