"""The target workers of one router: several can serve it (failover, load),
all the same model. Attach them, watch the ones that do not answer, pick one
for a new session, and move a session whose target failed to a live one."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from specd.engine import ModelInfo
from specd.errors import FailedPrecondition, SpecdError, Unavailable
from specd.router.compat import check_same_model
from specd.router.costs import CostCurve
from specd.router.load import RecentPeak
from specd.router.pool import SeqPool

log = logging.getLogger("specd.router")

# how long a failed target gets to answer before its sessions move on
REATTACH_SECONDS = 5.0


@dataclass
class TargetSlot:
    """One target worker: several can serve one router (failover, load)."""

    client: object
    name: str
    info: ModelInfo | None = None
    up: bool = False
    # its health (router.health): False while it drains or loads; it then
    # keeps the sessions it has and gets no new ones
    serving: bool = True
    n_active: int = 0  # sessions on it
    peak: RecentPeak = field(default_factory=RecentPeak)  # of n_active: the load adaptive speculation sees
    # a model-free drafter's tokens its sessions chose and it has not yet
    # verified (step.run): what a choice made now will share a batch with
    pending_drafts: int = 0
    watching: bool = False
    instance: str = ""  # ModelInfo.instance_id of the process attached to
    epoch: int = 0  # counts attaches: each one empties the worker's sequences
    # one re-attach at a time: every session on a restarted worker reports it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def takes_sessions(self) -> bool:
        """Attached and not draining: new sessions may go to it."""
        return self.up and self.serving


class TargetSet:
    """The router's target slots, iterable. `router` (engine.Router): the
    first attach teaches it the model (target_info, eog, pool, the
    controller's target curves); every attach re-fits its sizes."""

    def __init__(self, clients: list, router):
        self.slots = [TargetSlot(c, getattr(c, "name", f"target {i}")) for i, c in enumerate(clients)]
        self.router = router
        self._change = asyncio.Event()  # set, and replaced, when a target may have started taking sessions
        self._waiting = 0  # new sessions in wait_open

    def __iter__(self):
        return iter(self.slots)

    @property
    def n_sessions(self) -> int:
        return sum(t.n_active for t in self.slots)

    @property
    def busy(self) -> bool:
        """Whether some target computes for the router right now: the draft
        then leaves it the cores it would borrow (ProposeRequest.target_busy)."""
        return any(getattr(t.client, "computing", 0) > 0 for t in self.slots)

    async def start(self) -> None:
        """Attach every target; refuse one serving another model. Needs one
        answering; the others are attached later by watchers."""
        first_error = None
        for t in self.slots:
            if t.up:
                continue
            try:
                await self.attach(t)
            except FailedPrecondition:
                raise
            except SpecdError as exc:
                first_error = first_error or exc
        if not any(t.up for t in self.slots):
            raise first_error
        for t in self.slots:
            if not t.up:
                log.warning("%s unavailable, serving with the others until it answers", t.name)
                self.watch(t)

    async def attach(self, t: TargetSlot) -> None:
        """Attach (or re-attach) a target process: every target serves the
        same model, so failover replays give the same text."""
        r = self.router
        info = await t.client.model_info()
        if r.target_info is None:
            r.target_info = info
            r.eog = frozenset(info.eog_tokens)
            r.pool = SeqPool(info.n_seq, r.settings.max_queue)
            r.controller.target = CostCurve(info.decode_costs)
            r.controller.target_shared = CostCurve(info.decode_costs_shared)
        else:
            check_same_model(r.target_info, info, "target")
        if t.instance and info.instance_id != t.instance:
            # said whichever way the loss was found: a refused call, a broken channel or the watcher
            log.warning("%s restarted (instance %s, was %s): its sequences and prompt cache are gone",
                        t.name, info.instance_id, t.instance)
        t.client.expect_instance(info.instance_id)
        t.epoch += 1  # before the clear: sessions from before it must replay
        await t.client.clear(-1).result()  # start from empty sequences whatever came before
        r.pool.forget_target(t)
        t.info, t.instance, t.up = info, info.instance_id, True
        r.fit_sizes()
        self._changed()

    def set_serving(self, t: TargetSlot, serving: bool) -> None:
        """`t`'s health as its watcher (router.health.follow) sees it."""
        t.serving = serving
        self._changed()

    def _changed(self) -> None:
        self._change.set()
        self._change = asyncio.Event()

    async def failed(self, t: TargetSlot, exc: SpecdError, epoch: int) -> None:
        """A session's call to `t` (attached at `epoch`) failed with `exc`:
        its sequences are gone or unknown. Try to attach it again at once (a
        restarted worker is alive and empty, a broken stream may just need a
        new one); else watch it until it answers. Every session on it
        reports the failure; only the first acts."""
        async with t.lock:
            if t.epoch != epoch or not t.up:
                return  # re-attached or marked down already
            t.up = False
            self.router.pool.forget_target(t)
            try:
                await asyncio.wait_for(self.attach(t), REATTACH_SECONDS)
                log.warning("%s failed (%s): re-attached, its sessions replay their history", t.name, exc)
                return
            except (SpecdError, asyncio.TimeoutError) as err:
                log.warning("%s failed (%s) and does not answer: %s", t.name, exc, err or "timed out")
                t.up = False
            self.watch(t)

    def watch(self, t: TargetSlot) -> None:
        if not t.watching:
            t.watching = True
            asyncio.get_running_loop().create_task(self._watch(t))

    async def _watch(self, t: TargetSlot, interval: float = 2.0) -> None:
        try:
            while not t.up:
                await asyncio.sleep(interval)
                if t.n_active:  # sessions still on it (a slow call, not a dead worker) must move or end first
                    continue
                try:
                    await self.attach(t)
                    log.info("%s attached", t.name)
                except FailedPrecondition as exc:
                    log.error("%s refused: %s", t.name, exc)
                    return
                except SpecdError:
                    pass
        finally:
            t.watching = False

    @property
    def can_serve(self) -> bool:
        """Whether a new session would find a target."""
        return any(t.takes_sessions for t in self.slots)

    async def wait_open(self) -> None:
        """Return once some target takes new sessions. An attached one that
        does not now (draining before a restart, loading after one, or its
        health connection being made again) gets up to settings.target_wait;
        then, with none attached, or beyond max_queue sessions waiting, the
        session fails Unavailable."""
        loop = asyncio.get_running_loop()
        settings = self.router.settings
        deadline = loop.time() + settings.target_wait
        while not self.can_serve:
            left = deadline - loop.time()
            if left <= 0 or not any(t.up for t in self.slots) or self._waiting >= settings.max_queue:
                self.open_to_new()  # raises, saying why
            self._waiting += 1
            try:
                await asyncio.wait_for(self._change.wait(), left)
            except asyncio.TimeoutError:
                pass
            finally:
                self._waiting -= 1

    def open_to_new(self) -> list[TargetSlot]:
        """The targets a new session may go to; Unavailable when none."""
        live = [t for t in self.slots if t.takes_sessions]
        if not live:
            if any(t.up for t in self.slots):
                raise Unavailable("no target worker takes new sessions: every one is draining or restarting")
            raise Unavailable("no target worker is available")
        return live

    def pick(self, seq: int) -> TargetSlot:
        """The least busy live target; the one holding this sequence's prompt
        cache when it is about as free."""
        pool = self.router.pool
        live = self.open_to_new()
        best = min(live, key=lambda t: t.n_active)
        holder = pool.cached_on.get(seq)
        if holder in live and holder.n_active <= best.n_active + 1:
            return holder
        if holder is not None:  # the cache stays behind on the other worker: drop it there
            pool.drop_target_cache(seq)
            if holder.up:
                asyncio.get_running_loop().create_task(_quiet(holder.client.clear(seq)))
        return best

    @staticmethod
    def lost(s, exc: SpecdError) -> bool:
        """Whether `exc` means the session's KV on its target is gone (the
        worker is down or restarted), so that replaying the history on a
        live target is the way on; any other error fails the session."""
        return isinstance(exc, Unavailable) or s.t_epoch != s.tgt.epoch

    async def failover(self, s, exc: SpecdError) -> None:
        """The session's (router.session.Session) target lost its sequence:
        continue on a live target (the same one once re-attached after a
        restart) by replaying the history (same output: greedy is
        deterministic and sampling uses the token index's random number).
        No live target: the request fails. The draft is the caller's."""
        while True:
            old = s.tgt
            await self.failed(old, exc, s.t_epoch)
            # a draining target takes a moved session only when no other can
            live = [t for t in self.slots if t.takes_sessions] or [t for t in self.slots if t.up]
            if not live:
                raise exc if isinstance(exc, Unavailable) else Unavailable(f"no target worker is available: {exc}")
            s.drop_pending_t()
            old.n_active -= 1
            s.place_on(min(live, key=lambda t: t.n_active))
            log.warning("%s failed for seq %d, resuming on %s: %s", old.name, s.seq,
                        "another target" if s.tgt is not old else "it", exc)
            s.res.n_failovers += 1
            s.n_t = s.res.n_cached = 0  # the replay decodes the whole history
            try:
                n = len(s.ctx) - 1
                if n:
                    await s.target.decode(s.seq, 0, s.ctx[:n]).result()
                s.n_t = n
                return
            except SpecdError as again:
                if not self.lost(s, again):
                    raise
                exc = again


async def _quiet(op) -> None:
    """Run an operation (router.clients.Op) whose result does not matter."""
    try:
        await op.result()
    except (SpecdError, asyncio.CancelledError):
        pass
