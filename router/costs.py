"""Cost curves: seconds a worker's llama_decode takes for n tokens.

Each worker times its curve when it loads (ModelInfo.decode_costs);
`CostCheck` rejects curves no machine produces (timed while the other
worker computed on the same cores), and `CostCurve` learns from the batches
the router sees, so a wrong start-up timing does not steer adaptive
speculation for long.
"""
from __future__ import annotations

import bisect
import collections
import statistics
from dataclasses import dataclass


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
