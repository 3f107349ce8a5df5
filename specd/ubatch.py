"""How a batch of several sequences becomes model passes, and the padding
that makes it fewer.

With a KV stream per sequence, llama.cpp splits a batch with `split_equal`
(sequential): a pass (ubatch) takes the run of sequences with consecutive
ids that still have tokens, starting at the lowest, and the same number of
tokens from each, the least any of them has left. Eight sessions verifying
1 and 5 tokens in turn (ids 0..7) are then five passes: 8 tokens, then 4
each of ids 1, 3, 5 and 7 alone. A pass has a fixed cost (every layer's
weights are read, threads meet at barriers) worth several tokens on a CPU,
so padding sequences with throwaway tokens (no logits, removed right after)
to one length can make the batch one pass and cheaper. Ids in between that
hold nothing can be filled the same way. `plan_fill` picks the cheapest such
layout; pure, so it is tested without a model.
"""
from __future__ import annotations

from typing import NamedTuple


def passes(counts: list[int]) -> list[int]:
    """Tokens of each pass llama.cpp makes of a batch whose sequences decode
    counts[i] tokens, counts indexed by seq_id from the lowest (0: that id
    is not in the batch)."""
    left = list(counts)
    out = []
    start = 0
    while True:
        while start < len(left) and left[start] == 0:
            start += 1
        if start == len(left):
            return out
        end = start
        while end < len(left) and left[end] > 0:
            end += 1
        m = min(left[start:end])
        for i in range(start, end):
            left[i] -= m
        out.append(m * (end - start))


class Part(NamedTuple):
    """One sequence of a batch as the planner sees it."""

    seq_id: int
    n_tokens: int
    room: int  # throwaway tokens it can take after its own (free positions; 0: none)


class Fill(NamedTuple):
    """Throwaway tokens to decode: `pad[seq_id]` after a part's own tokens
    (removed right after), `gaps[seq_id]` for an id between the parts that
    holds nothing (emptied right after)."""

    pad: dict[int, int]
    gaps: dict[int, int]

    @property
    def n_tokens(self) -> int:
        return sum(self.pad.values()) + sum(self.gaps.values())


NO_FILL = Fill({}, {})


def cost(counts: list[int], pass_tokens: float) -> float:
    """A layout's cost in tokens: each pass `pass_tokens` plus its tokens."""
    p = passes(counts)
    return len(p) * pass_tokens + sum(p)


def plan_fill(parts: list[Part], free_gaps: set[int], pass_tokens: float, n_batch: int) -> Fill:
    """The throwaway tokens that make the batch cheapest: every part with
    room padded up to a common length L (one of the parts' lengths), ids in
    free_gaps between the parts filled to L, or nothing. A pass is worth
    `pass_tokens` tokens; the batch stays within n_batch."""
    if len(parts) < 2:
        return NO_FILL
    lo = min(p.seq_id for p in parts)
    hi = max(p.seq_id for p in parts)
    own = {p.seq_id: p.n_tokens for p in parts}
    real = sum(own.values())

    def layout(fill: Fill) -> list[int]:
        return [own.get(s, 0) + fill.pad.get(s, 0) + fill.gaps.get(s, 0) for s in range(lo, hi + 1)]

    best, best_cost = NO_FILL, cost(layout(NO_FILL), pass_tokens)
    gaps_between = sorted(s for s in free_gaps if lo < s < hi and s not in own)
    for length in sorted(set(own.values())):
        pad = {p.seq_id: min(length - p.n_tokens, p.room) for p in parts if p.n_tokens < length and p.room > 0}
        for gaps in ({}, {s: length for s in gaps_between}):
            fill = Fill(pad, gaps)
            if fill.n_tokens == 0 or real + fill.n_tokens > n_batch:
                continue
            c = cost(layout(fill), pass_tokens)
            if c < best_cost:
                best, best_cost = fill, c
    return best


def shared_tokens(n_tokens: int, busy_left: float, seconds_per_token: float, pass_tokens: float) -> int:
    """Of a round's `n_tokens` still to decode, how many to decode first on
    the base threads, while the other worker still computes for `busy_left`
    seconds (math.inf: unknown) at `seconds_per_token` there: all of them
    when they take at most about twice that (splitting would cost a pass
    for little), none when what is left is worth less than a pass, else
    what fits in it; the rest then gets every core."""
    if busy_left <= 0 or n_tokens <= 0:
        return 0
    if busy_left == float("inf") or seconds_per_token <= 0 or n_tokens * seconds_per_token <= 2 * busy_left:
        return n_tokens
    fit = int(busy_left / seconds_per_token)
    return fit if fit >= pass_tokens else 0


# What a pass is worth in tokens without a calibrated curve: about what the
# default target's curve gives here (docs/batching.md).
DEFAULT_PASS_TOKENS = 8.0


def pass_tokens(costs) -> float:
    """A pass's fixed cost in tokens from a decode cost curve ((tokens,
    seconds) of one sequence's batches): t(n) = a + b n through its smallest
    and largest batch, a / b."""
    pts = sorted(costs)
    if len(pts) < 2 or pts[-1][0] == pts[0][0]:
        return DEFAULT_PASS_TOKENS
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    b = (t1 - t0) / (n1 - n0)
    if b <= 0:
        return DEFAULT_PASS_TOKENS
    return max(t0 - b * n0, 0.0) / b
