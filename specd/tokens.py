"""Token bookkeeping shared by workers and router.

`SeqTokens` mirrors, for one sequence, which token sits at which position, and
changes exactly as llama.cpp's memory does under seq_rm / seq_add / seq_cp.
`token_hash` is the fingerprint both sides compare in the alignment check.
`occurrences` finds an n-gram in a history: the n-gram drafters' lookup, and
the target's check of when such a drafter can match (`ends_in_repeat`).
"""
from __future__ import annotations

import hashlib

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


def token_hash(positions: np.ndarray, tokens: np.ndarray) -> str:
    """Hash of (position, token) pairs in position order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(np.ascontiguousarray(positions, dtype="<i4").tobytes())
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def history_hash(tokens) -> str:
    """Hash of a history held at positions 0 .. n-1."""
    toks = np.asarray(tokens, dtype=np.int32)
    return token_hash(np.arange(len(toks), dtype=np.int32), toks)


def range_mask(pos: np.ndarray, p0: int, p1: int) -> np.ndarray:
    """Positions in [p0, p1); p0 < 0 means from 0, p1 < 0 means to the end."""
    lo = 0 if p0 < 0 else p0
    mask = pos >= lo
    if p1 >= 0:
        mask &= pos < p1
    return mask


_NO_POS = np.empty(0, dtype=np.int64)


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


def ends_in_repeat(history: np.ndarray, n: int) -> bool:
    """Whether the last n tokens of `history` also occur at an earlier start
    (so at most len - n - 1): what an n-gram drafter's match needs."""
    return 0 < n < len(history) and occurrences(history, history[-n:], len(history) - n - 1).size > 0


class SeqTokens:
    """(position, token) pairs of one sequence, kept sorted by position."""

    __slots__ = ("pos", "tok")

    def __init__(self, pos: np.ndarray = _EMPTY, tok: np.ndarray = _EMPTY):
        self.pos = pos
        self.tok = tok

    def copy(self) -> "SeqTokens":
        return SeqTokens(self.pos.copy(), self.tok.copy())

    def __len__(self) -> int:
        return len(self.pos)

    @property
    def pos_min(self) -> int:
        return int(self.pos[0]) if len(self.pos) else -1

    @property
    def pos_max(self) -> int:
        return int(self.pos[-1]) if len(self.pos) else -1

    def append(self, pos: int, tokens) -> None:
        toks = np.asarray(tokens, dtype=np.int32)
        self.pos = np.concatenate([self.pos, np.arange(pos, pos + len(toks), dtype=np.int32)])
        self.tok = np.concatenate([self.tok, toks])

    def rm(self, p0: int, p1: int) -> None:
        keep = ~range_mask(self.pos, p0, p1)
        self.pos, self.tok = self.pos[keep], self.tok[keep]

    def add(self, p0: int, p1: int, delta: int) -> None:
        mask = range_mask(self.pos, p0, p1)
        pos = self.pos.copy()
        pos[mask] += delta
        order = np.argsort(pos, kind="stable")
        self.pos, self.tok = pos[order], self.tok[order]

    def shifted_positions(self, p0: int, p1: int, delta: int) -> np.ndarray:
        """The positions in [p0, p1) moved by delta, as int64 (no wrapping)."""
        mask = range_mask(self.pos, p0, p1)
        return self.pos[mask].astype(np.int64) + delta

    def clear(self) -> None:
        self.pos, self.tok = _EMPTY, _EMPTY

    def hash(self) -> str:
        return token_hash(self.pos, self.tok)

    def tokens(self) -> np.ndarray:
        return self.tok
