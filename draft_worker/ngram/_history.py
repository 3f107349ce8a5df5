"""Small helpers shared by the n-gram proposers.

- `as_array`: a private int64 copy of a history (the caller's object is never touched).
- `occurrences`: where an n-gram occurs in a token array (numpy, no Python loop over positions).
- `SeenHistory`: remembers the last history a learner saw, so it can tell an
  extension (new tokens appended) from a truncation / rewrite (llama_memory_seq_rm).
- `DraftFeedback`: remembers the last draft and measures, from a later history,
  how many of its tokens the target accepted (llama.cpp passes that count to
  common_speculative_accept; our callers only pass the history, so we infer it).
"""
from __future__ import annotations

from typing import Any, Sequence

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


def occurrences(arr: np.ndarray, pattern: np.ndarray, last: int) -> np.ndarray:
    """Ascending start positions j in [0, last] with arr[j:j+len(pattern)] == pattern."""
    n = len(pattern)
    last = min(last, len(arr) - n)
    if n == 0 or last < 0:
        return _NO_POS
    cand = np.flatnonzero(arr[: last + 1] == pattern[0])
    for k in range(1, n):
        if cand.size == 0:
            break
        cand = cand[arr[cand + k] == pattern[k]]
    return cand


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


class DraftFeedback:
    """The last draft a proposer returned, and how many of its tokens were accepted."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.pos = -1          # history length when the draft was proposed
        self.draft: list[int] = []
        self.tag: Any = None   # proposer-specific: which table entry produced the draft

    def set(self, pos: int, draft: list[int], tag: Any = None) -> None:
        self.pos, self.draft, self.tag = pos, list(draft), tag

    def measure(self, arr: np.ndarray, keep: int) -> tuple[Any, int, int] | None:
        """(tag, accepted, evidence_end) once tokens after the draft position arrived, else None.

        accepted = how many leading draft tokens the history now holds at the
        drafted positions. evidence_end = first position not used to judge the
        draft. If the history before the draft changed (keep < pos) the draft
        is dropped without feedback.
        """
        if not self.draft:
            return None
        if keep < self.pos:
            self.clear()
            return None
        got = arr[self.pos : self.pos + len(self.draft)].tolist()
        if not got:
            return None
        n_acc = 0
        for d, a in zip(self.draft, got):
            if d != a:
                break
            n_acc += 1
        evidence_end = self.pos + min(n_acc + 1, len(got))
        result = (self.tag, n_acc, evidence_end)
        self.clear()
        return result
