"""Small helpers shared by the n-gram proposers.

- `as_array`: a private int64 copy of a history (the caller's object is never touched).
- `SeenHistory`: remembers the last history a learner saw, so it can tell an
  extension (new tokens appended) from a truncation / rewrite (llama_memory_seq_rm).
- `DraftFeedback`: remembers the drafts a proposer returned and judges each,
  from a later verified history, by how many of its tokens the target
  accepted (llama.cpp passes that count to common_speculative_accept; our
  callers only pass the history, so we infer it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

_NO_POS = np.empty(0, dtype=np.int64)


def as_array(history: Sequence[int] | np.ndarray) -> np.ndarray:
    """Return a new 1-D int64 array holding the tokens of `history`."""
    return np.array(history, dtype=np.int64).reshape(-1)


def check_range(what: str, value: int, lo: int, hi: int) -> int:
    """Validate an integer parameter the way llama.cpp's argument parser does."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ValueError(f"{what} must be an integer in [{lo}, {hi}], got {value!r}")
    return int(value)


class SeenHistory:
    """The history a learner saw last."""

    def __init__(self) -> None:
        self.tokens = _NO_POS

    def update(self, arr: np.ndarray) -> tuple[int, np.ndarray]:
        """Store `arr`; return (tokens it shares as a prefix with the previous history, previous history).

        keep < len(previous) means the caller removed or rewrote tokens from
        position `keep` on; learners then forget what they learned from them.
        """
        old = self.tokens
        m = min(len(old), len(arr))
        diff = np.flatnonzero(old[:m] != arr[:m])
        keep = int(diff[0]) if diff.size else m
        self.tokens = arr
        return keep, old


class Judged(NamedTuple):
    """What the verified history says of one draft."""

    tag: Any               # proposer-specific: which table entry produced the draft
    accepted: int          # leading draft tokens the verified history holds at their positions


WAIT = object()  # a verdict: the verified history does not tell yet


@dataclass
class _Pending:
    pos: int               # history length when proposed: the position of the draft's first token
    tokens: list[int]
    tag: Any
    base_from: int         # tokens of that history known verified then (== pos unless proposed after drafts)
    base: np.ndarray       # history[base_from:pos]: the unverified tokens the draft continues

    def judge(self, verified: np.ndarray, keep: int) -> Judged | None | object:
        """Judged once `verified` shows where the draft ends; None to forget
        it unjudged; WAIT while the verified history does not tell yet."""
        if keep < self.base_from:
            return None    # the history it was proposed after was removed or rewritten
        seen = verified[self.base_from : min(len(verified), self.pos)]
        if not np.array_equal(seen, self.base[: len(seen)]):
            return None    # proposed after drafts the target rejected: never verified itself
        if len(verified) <= self.pos:
            return WAIT
        got = verified[self.pos : self.pos + len(self.tokens)].tolist()
        n_acc = 0
        for d, a in zip(self.tokens, got):
            if d != a:
                break
            n_acc += 1
        if self.base_from < self.pos and n_acc == 0:
            # a lookahead's first token guesses the target's own next token;
            # when the guess fails the router never sends the rest to verify
            return None
        if n_acc == len(got) < len(self.tokens):
            return WAIT
        return Judged(self.tag, n_acc)


MAX_PENDING = 8  # drafts a proposer keeps waiting for their verdict; older ones are forgotten


class DraftFeedback:
    """The drafts a proposer returned that no verified history judged yet.

    Learners must score drafts on tokens the router verified only: with
    overlap the router asks for a lookahead while the target verifies, and
    the history then holds the proposer's own drafts, which would read as
    accepted. So a draft is judged against the verified history, once that
    shows where the draft ends (its accepted tokens, as llama.cpp's
    common_speculative_accept gets them); a draft proposed after unverified
    tokens is judged only once those are verified and its first token, the
    guess, held. Tokens a later proposal covers were never verified as this
    draft's: they are cut off it."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.pending: list[_Pending] = []

    def add(self, history: np.ndarray, n_verified: int, draft: list[int], tag: Any = None) -> None:
        """A proposal after `history`, of which `n_verified` tokens are
        verified; an empty `draft` only withdraws older drafts' tokens there."""
        pos = len(history)
        kept = []
        for d in self.pending:
            if d.pos < pos:
                d.tokens = d.tokens[: pos - d.pos]
                kept.append(d)
        if draft:
            n_verified = min(n_verified, pos)
            kept.append(_Pending(pos, list(draft), tag, n_verified, history[n_verified:pos].copy()))
        self.pending = kept[-MAX_PENDING:]

    def measure(self, verified: np.ndarray, keep: int) -> list[Judged]:
        """The drafts `verified` (every verified token, oldest first) judges,
        in the order they were proposed. `keep`: tokens it shares with the
        verified history of the last call (SeenHistory.update)."""
        out, waiting = [], []
        for d in self.pending:
            verdict = d.judge(verified, keep)
            if verdict is WAIT:
                waiting.append(d)
            elif verdict is not None:
                out.append(verdict)
        self.pending = waiting
        return out


def verified_part(arr: np.ndarray, n_verified: int | None) -> np.ndarray:
    """The verified prefix of a history (all of it when n_verified is None)."""
    return arr if n_verified is None else arr[: max(0, n_verified)]
