"""One request's state on its sequence id, as the router keeps it.

The router owns the token history (`ctx`: the tokens in the context, at
positions 0..len-1; the last one, id_last, is not decoded yet) and knows how
much of it each worker holds (`n_t`, `n_d`), whether the session drafts
(`use_draft`), what the draft computed ahead of the history (overlap), and
which operations it sent and did not collect yet.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from specd.engine import VerifyPartial
from specd.router.params import GenParams, Result
from specd.router.targets import TargetSlot


@dataclass
class Streamed:
    """Tokens of the step under way that the target handed on ahead of its
    result, as it went on alone (VerifyPartial): the request loop passes
    them to the client while the target goes on."""

    tokens: list[int] = field(default_factory=list)
    pieces: list[bytes] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, p: VerifyPartial) -> None:
        if p.offset == len(self.tokens):  # in order; one a worker left out ends the run
            self.tokens += p.tokens
            self.pieces += p.pieces
            self.ready.set()


class Session:
    def __init__(self, seq: int, params: GenParams, result: Result):
        self.seq = seq
        self.tgt: TargetSlot | None = None  # the target worker it runs on (place_on)
        self.t_epoch = 0  # TargetSlot.epoch when this session's KV was put on its target
        self.d_epoch = 0  # DraftLink.epoch when the draft last held this session's tokens
        self.wants_draft = False  # speculation asked for and a draft configured
        # it drafts now: wanted, the draft was up, and it has not failed this session since
        self.use_draft = False
        self.resyncs_d = 0  # times the draft was found holding other positions and caught up from 0
        self.p = params
        self.ctx = list(params.prompt)
        self.n_t = 0  # tokens of ctx the target holds
        self.n_d = 0  # tokens of ctx the draft holds
        # overlap: drafts the draft already computed past ctx (assuming all of
        # the last step was accepted); the draft holds (ctx + ahead)[:ahead_held]
        self.ahead: list[int] = []
        self.ahead_q: list = []  # the distributions of `ahead`, when the draft sampled them
        self.ahead_held = 0
        self.res = result
        result.n_prompt = len(params.prompt)
        self.acc = None  # adaptive speculation: this session's acceptance
        self.draft_prefill = None  # the draft's prompt decode, when generation did not wait for it
        self.with_draft = False  # the draft holds (or held) this sequence
        # pipelined operations not awaited yet, per worker
        self.pending_t: list[asyncio.Future] = []
        self.pending_d: list[asyncio.Future] = []
        self.stream = Streamed()  # of the step under way
        self.step_cut = False  # a step was cancelled midway: what the workers hold is unknown

    @property
    def target(self):
        """The client of the target worker it runs on."""
        return self.tgt.client

    def place_on(self, tgt: TargetSlot) -> None:
        """Run on `tgt` from now (its KV of this session is as new as its epoch)."""
        self.tgt, self.t_epoch = tgt, tgt.epoch
        tgt.n_active += 1

    def drop_pending_t(self) -> None:
        """Cancel what was sent to the target and not answered yet."""
        for fut in self.pending_t:
            if not fut.done():
                fut.cancel()
        self.pending_t = []

    def drop_pending_d(self) -> None:
        """Cancel what was sent to the draft and not answered yet."""
        for fut in self.pending_d:
            if not fut.done():
                fut.cancel()
        self.pending_d = []

    async def collect(self, wait: bool = True) -> BaseException | None:
        """Collect the pipelined operations' results: raise a target's
        failure, return the draft's (it stays pending for the caller to
        drop). Without `wait`, operations still in flight stay pending: a
        later result from the same worker (answers come in order) settles
        them at no cost."""
        if wait:
            await asyncio.gather(*self.pending_t, *self.pending_d, return_exceptions=True)
        still_t = []
        for fut in self.pending_t:
            if not fut.done():
                still_t.append(fut)
            elif not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()
        self.pending_t = still_t
        still_d = []
        for fut in self.pending_d:
            if not fut.done():
                still_d.append(fut)
            elif not fut.cancelled() and fut.exception() is not None:
                return fut.exception()
        self.pending_d = still_d
        return None
