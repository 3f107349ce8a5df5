"""Which of a sequence's tokens the router has verified, as a drafter can tell.

A drafter's sequence holds the router's history and, past it, drafts of its
own: the ones it evaluated to find the last (Propose decodes d0 .. dk-2),
and with overlap a lookahead (the router sends dk-1 back as the tail of a
Propose while the target verifies d0 .. dk-1). Learners must only learn from
and judge drafts by verified tokens (draft_worker.ngram), so the n-gram
engine infers them from what each Propose brings:

- a tail token that is not the drafter's own proposal at its position comes
  from the router's history: it and everything before it are verified;
- so does the first token of a lookahead: the router sends it back only as
  the target's own next token, once that guess held;
- a later token of a lookahead comes back when the router drafts on from it:
  its first token, the guess, held, so all up to and including it is verified;
- other own tokens (dk-1 sent back for a lookahead) tell nothing new.

What was verified stays so while the sequence still holds it (a seq_rm, a
shift or a checkpoint restore may take it away).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_NONE = np.zeros(0, dtype=np.int64)


@dataclass
class Proposal:
    start: int  # index of its first token in the sequence's tokens
    tokens: list[int]
    lookahead: bool  # proposed after tokens not verified yet: its first token guesses the target's next

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class VerifiedPrefix:
    """One sequence: the tokens known verified and the proposals past them."""

    def __init__(self) -> None:
        self.tokens = _NONE
        self.proposals: list[Proposal] = []

    def reset(self) -> None:
        self.__init__()

    def update(self, history: np.ndarray, tail_start: int) -> int:
        """After a Propose appended history[tail_start:]: how many tokens of
        `history` (the sequence's tokens, oldest first) are verified."""
        n = _common_prefix(self.tokens, history)
        for j in range(len(history) - 1, tail_start - 1, -1):
            p = next((p for p in self.proposals if p.start <= j < p.end), None)
            if p is None or (p.lookahead and j == p.start) or not _holds(history, p, j):
                n = max(n, j + 1)  # the router's token (see the module's docstring)
                break
            if p.lookahead:
                n = max(n, p.start + 1)  # drafting on from a lookahead: its guess held
        self.tokens = np.array(history[:n], dtype=np.int64)
        self.proposals = [p for p in self.proposals if p.end > n]
        return n

    def proposed(self, start: int, tokens: list[int], n_verified: int) -> None:
        """The drafter proposed `tokens` from index `start`, after a history
        of which `n_verified` tokens were verified; it replaces what earlier
        proposals said from there on."""
        kept = []
        for p in self.proposals:
            if p.start < start:
                p.tokens = p.tokens[: start - p.start]
                kept.append(p)
        if tokens:
            kept.append(Proposal(start, list(tokens), n_verified < start))
        self.proposals = kept


def _holds(history: np.ndarray, p: Proposal, j: int) -> bool:
    """Whether history holds p's tokens from its start through index j."""
    return history[p.start : j + 1].tolist() == p.tokens[: j + 1 - p.start]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m
