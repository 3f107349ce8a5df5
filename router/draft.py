"""The draft worker of one router, when it has one: attach it (waiting a
while for one still loading), watch it while it does not answer, and what a
session does when the draft fails it or comes back. A draft failure never
fails a request: the session goes on target-only."""
from __future__ import annotations

import asyncio
import logging
import math
import time

from specd.engine import ModelInfo
from specd.model_engine import ModelEngine
from specd.errors import FailedPrecondition, SpecdError, Unavailable
from specd.router.alignment import diverged
from specd.router.compat import check_vocab
from specd.router.costs import CostCurve
from specd.router.session import Session

log = logging.getLogger("specd.router")

# a session re-syncs a draft found out of step at most this often, then goes on without it
MAX_DRAFT_RESYNCS = 3
# the draft's curves are timed on an idle machine, and two processes computing
# at once slow each other: its work is priced this much longer, erring towards
# the target leaving it its core (as it did for a whole batch before estimates)
BUSY_MARGIN = 1.5


class DraftLink:
    """`client`: the draft worker (None: the router has no draft).
    `router` (engine.Router): an attach checks the draft against its
    target_info, forgets the pool's draft cache, gives the controller the
    draft's curves and re-fits the router's sizes."""

    def __init__(self, client, router):
        self.client = client
        self.router = router
        self.info: ModelInfo | None = None
        self.up = False
        self.serving = True  # its health (router.health): new sessions skip a draining draft
        # counts (re)attaches: each empties the draft, so a session
        # holding an older epoch starts the draft over from position 0
        self.epoch = 0
        self.watcher: asyncio.Task | None = None
        self._busy_until = 0.0  # time.monotonic() when what was sent to the draft should be computed
        if client is not None:
            client.on_compute = self._priced

    @property
    def busy(self) -> bool:
        """Whether the draft computes for some session right now: the
        target's next batch then leaves it its cores (DecodeRequest.draft_busy).
        A model-free drafter takes microseconds a proposal, so the target
        never gives up a core for it."""
        if self.info is not None and self.info.kind != ModelEngine.kind:
            return False
        return getattr(self.client, "computing", 0) > 0

    def busy_for(self) -> float:
        """About how many seconds the draft still computes what was sent to
        it (DecodeRequest.busy_seconds): 0 when it is not busy, math.inf
        when its curves cannot tell."""
        if not self.busy:
            return 0.0
        c = self.router.controller
        if not len(c.draft):
            return math.inf
        # past the estimate but not answered yet: about a token more
        return max(self._busy_until - time.monotonic(), c.draft(1))

    def _priced(self, op: str, fields: dict) -> None:
        """Add an operation sent to the draft to what it has to compute: a
        decode (a catch-up) priced as a prompt, a proposal as its catch-up
        and one decode per draft."""
        c = self.router.controller
        prompt = c.draft_prompt if len(c.draft_prompt) else c.draft
        n = len(fields.get("tokens", ()))
        if op == "propose":
            seconds = (prompt(n - 1) if n > 1 else 0.0) + fields.get("n_max", 1) * c.draft(1)
        else:
            seconds = prompt(n)
        seconds *= BUSY_MARGIN
        now = time.monotonic()
        start = max(self._busy_until, now) if self.client.computing else now
        self._busy_until = start + seconds

    @property
    def match_needs_repeat(self) -> int:
        """What the drafter's matches need (ModelInfo.match_needs_repeat); 0 while it is down."""
        return self.info.match_needs_repeat if self.up and self.info is not None else 0

    async def start(self) -> None:
        """Attach the draft, waiting up to settings.draft_wait for one still
        loading; then decode target-only until a watcher attaches it."""
        deadline = time.monotonic() + self.router.settings.draft_wait
        while True:
            try:
                await self.attach()
                break
            except FailedPrecondition:
                raise
            except SpecdError as exc:
                if time.monotonic() >= deadline:
                    log.warning("draft worker unavailable, decoding target-only until it answers: %s", exc)
                    self.watch()
                    break
                await asyncio.sleep(0.2)

    async def attach(self) -> None:
        r = self.router
        info = await self.client.model_info()
        check_vocab(r.target_info, info)
        if self.info is not None and info.instance_id != self.info.instance_id:
            log.warning("draft worker restarted (instance %s, was %s): sessions start it over from position 0",
                        info.instance_id, self.info.instance_id)
        self.client.expect_instance(info.instance_id)
        # before the clear: a session that sees the new epoch sends its next
        # operation after the clear on the same ordered stream
        self.epoch += 1
        await self.client.clear(-1).result()
        self.info = info
        r.pool.forget_draft()
        # drafts are mostly made beside a verification, on the draft's base
        # threads: a draft that borrows more while the target waits is priced
        # as it runs beside it, which errs towards drafting less
        r.controller.draft = CostCurve(info.decode_costs_shared or info.decode_costs)
        r.controller.draft_prompt = CostCurve(info.prompt_costs)
        r.controller.model_free = info.kind != ModelEngine.kind
        r.fit_sizes()
        self.up = True

    def watch(self) -> None:
        self.watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self, interval: float = 2.0) -> None:
        first = True
        while not self.up:
            # a restarted draft answers at once; a dead one is asked every interval
            await asyncio.sleep(0.05 if first else interval)
            first = False
            try:
                await self.attach()
                log.info("draft worker attached")
            except FailedPrecondition as exc:
                log.error("draft worker refused: %s", exc)
                return
            except SpecdError:
                pass

    # ------------------------------------------------------------ per session
    def failed(self, s: Session, exc: BaseException) -> None:
        """Degrade to target-only decoding: the request goes on without the
        draft. If the draft was attached again since this session last used
        it (which clears it), the failure is that attach's: the session
        rejoins from position 0 at its next step (rejoin)."""
        if s.d_epoch != self.epoch:
            log.info("draft worker attached again under seq %d: it drafts anew from position 0", s.seq)
        elif isinstance(exc, FailedPrecondition) and s.resyncs_d < MAX_DRAFT_RESYNCS:
            # the draft holds other positions than the router knows (changed
            # behind its back): a divergence, repaired from the history
            log.error("draft worker diverged (seq %d): %s; re-syncing it from history", s.seq, exc)
            diverged(self.router, s, "draft")
            s.resyncs_d += 1
            s.d_epoch = -1  # rejoin catches it up from 0 at the next step
        else:
            log.warning("draft worker failed for seq %d, continuing target-only: %s", s.seq, exc)
        if isinstance(exc, Unavailable) and self.up and s.d_epoch == self.epoch:
            # the worker itself is gone, stuck or restarted: new sessions go
            # target-only until the watcher attaches it again
            self.up = False
            self.watch()
        s.drop_pending_d()
        s.use_draft = False

    async def settle(self, s: Session, wait: bool = True) -> None:
        """Collect the session's pipelined operations (Session.collect). A
        target failure fails the request; a draft failure only turns the
        draft off for this session."""
        exc = await s.collect(wait)
        if exc is not None:
            self.failed(s, exc)

    async def rejoin(self, s: Session) -> None:
        """The draft was (re)attached since this session last used it, so it
        holds nothing of the session: draft again from position 0 (the next
        Propose catches up on the whole history)."""
        if not s.wants_draft or not self.up or s.d_epoch == self.epoch:
            return
        s.drop_pending_d()
        if s.d_epoch == -1:  # diverged, not attached again: empty the sequence first
            s.pending_d.append(await self.client.clear(s.seq).issue())
        s.d_epoch = self.epoch
        s.n_d, s.ahead, s.ahead_held, s.draft_prefill = 0, [], 0, None
        s.with_draft = True
        s.use_draft = True

    async def cut_back(self, s: Session) -> None:
        """After a failover: the failed step may have left drafts, a
        lookahead or a continuation past the history on the draft: cut it back."""
        if not s.use_draft:
            return
        s.ahead = []
        s.n_d = min(s.n_d, len(s.ctx) - 1)
        try:
            await self.client.seq_rm(s.seq, s.n_d, -1).result()
        except SpecdError as err:
            self.failed(s, err)
