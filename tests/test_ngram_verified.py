"""Which tokens of an n-gram drafter's sequence the router verified
(draft_worker.verified), inferred from the Propose calls router/engine.py
makes, with and without overlap; no model needed."""
from __future__ import annotations

import numpy as np

from specd.draft_worker.verified import VerifiedPrefix

H = list(range(100, 110))  # the prompt: id_last is its last token
D = [1, 2, 3, 4]           # drafts of a main Propose
C = [5, 6, 7]              # the lookahead drafted beside their verification


class Drafter:
    """A sequence as the n-gram engine keeps it: the tokens it holds and what it proposed."""

    def __init__(self):
        self.v = VerifiedPrefix()
        self.held: list[int] = []

    def propose(self, pos: int, tail: list[int], drafts: list[int]) -> int:
        """A Propose at `pos` with `tail` answered with `drafts`: how many tokens are verified."""
        assert pos == len(self.held)
        self.held += tail
        n = self.v.update(np.array(self.held), pos)
        self.v.proposed(len(self.held), drafts, n)
        self.held += drafts[:-1]  # the engine decodes d0 .. dk-2
        return n

    def seq_rm(self, p0: int) -> None:
        del self.held[p0:]


def test_main_propose_after_the_router_history_is_verified():
    d = Drafter()
    assert d.propose(0, H, D) == 10
    # all accepted, the target adds 9 (no overlap): the tail is [d3, 9]
    assert d.propose(13, [D[-1], 9], D) == 15


def test_lookahead_tail_is_the_drafters_own_and_tells_nothing():
    d = Drafter()
    d.propose(0, H, D)
    assert d.propose(13, D[-1:], C) == 10  # D is being verified: not verified yet


def test_rejected_draft_then_the_targets_token_verifies_up_to_it():
    d = Drafter()
    d.propose(0, H, D)
    d.propose(13, D[-1:], C)
    d.seq_rm(12)  # the target accepted d0 d1 and said 50 at position 12
    assert d.propose(12, [50], D) == 13


def test_lookahead_guess_held():
    d = Drafter()
    d.propose(0, H, D)
    d.propose(13, D[-1:], C)  # C[0] guesses the target's token after D
    # all of D accepted and the target said C[0]: the router drafts on from
    # C[1:] and sends the last one it uses back as the next lookahead's tail
    assert d.propose(16, [7], [8, 9]) == 15
    # ... which the target rejects at 6: its token at 15 shows where that ended
    d.seq_rm(15)
    assert d.propose(15, [60], D) == 16


def test_lookahead_guess_failed_or_held_without_drafts():
    for said in (70, C[0]):  # C[0] held, but no drafts after it were left to use
        d = Drafter()
        d.propose(0, H, D)
        d.propose(13, D[-1:], C)
        d.seq_rm(14)  # all of D accepted; the lookahead goes
        assert d.propose(14, [said], D) == 15, said


def test_fewer_lookahead_drafts_used_than_made():
    d = Drafter()
    d.propose(0, H, D)
    d.propose(13, D[-1:], C + [8])  # the draft holds 5 6 7
    # the guess 5 held; the router verifies C[1:2] only, so the draft drops
    # 6 7 and drafts on after 6, which it gets back as the tail
    d.seq_rm(15)
    assert d.propose(15, [6], [9, 10]) == 15
    d.seq_rm(15)  # 6 rejected: the target said 11 at 15
    assert d.propose(15, [11], D) == 16


def test_removed_verified_tokens_are_no_longer_verified():
    d = Drafter()
    d.propose(0, H, D)
    d.seq_rm(5)  # a context shift, a new session on the sequence ...
    assert d.propose(5, [40, 41], D) == 7
