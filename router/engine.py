"""The router's speculative loop, independent of the transport.

For each session the router owns the token history (`ctx`: the tokens in the
context, at positions 0..len-1; the last one, id_last, is not decoded yet) and
knows how much of it each worker holds. Every step:

    propose on the draft -> verify on the target -> roll both back to the
    accepted length -> hand the accepted tokens to the caller

and every KV operation is mirrored on both workers. The draft is never made
to re-evaluate what it holds (llama.cpp's TAG_SPEC_AVOID_DRAFT_REEVAL): after
a step it keeps id_last and the accepted drafts, and only the missing tail is
sent with the next Propose.

Models that cannot remove part of a sequence (recurrent / hybrid) run in
checkpoint mode: save before drafting and verifying, restore and re-decode the
accepted tokens on partial acceptance.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from specd.router.adaptive import Controller, CostCurve, RecentPeak
from specd.engine import ModelInfo, SeqState
from specd.errors import (FailedPrecondition, Internal, InvalidArgument, ResourceExhausted, SpecdError,
                          Unavailable, WorkerRestarted)
from specd.sampling import DEFAULT_ACCEPTANCE, EXACT, Sampling
from specd.tokens import history_hash

log = logging.getLogger("specd.router")

MAX_DRAFT = 64
# a session re-syncs a draft found out of step at most this often, then goes on without it
MAX_DRAFT_RESYNCS = 3
# how long a failed target gets to answer before its sessions move on
REATTACH_SECONDS = 5.0


@dataclass
class RouterSettings:
    n_max: int = 4
    n_min: int = 0
    p_min: float = 0.0
    checkpoint_mode: bool = False  # force checkpoints even where partial removal works
    check_alignment: bool = False
    # draft the next step on the draft worker while the target verifies this one
    overlap: bool = True
    # keep a finished session's KV for a later prompt sharing its prefix
    prompt_cache: bool = True
    # choose each step's draft length from acceptance and load (router/adaptive.py)
    adaptive: bool = True
    max_queue: int = 64
    draft_wait: float = 60.0  # seconds to wait for a loading draft at start before serving target-only


@dataclass
class GenParams:
    """One request, validated, in plain Python."""

    prompt: list[int]
    max_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    speculative: bool | None = None
    n_max: int | None = None
    n_min: int | None = None
    p_min: float | None = None
    adaptive: bool | None = None
    context_shift: bool = False
    n_keep: int = 0
    acceptance: str | None = None  # specd.sampling.EXACT | REJECTION; None: DEFAULT_ACCEPTANCE

    @property
    def draft_sampling(self) -> Sampling | None:
        """The sampling a draft proposes with: the request's when sampled (the
        draft samples with the target's noise, so with either acceptance its
        token is the target's own sample as often as the two agree), else
        None (argmax drafts)."""
        return None if self.sampling.greedy else self.sampling

    @property
    def rejection(self) -> bool:
        """Whether sampled drafts are accepted by speculative sampling (the
        target gets their distributions) rather than by exact match."""
        return not self.sampling.greedy and (self.acceptance or DEFAULT_ACCEPTANCE) != EXACT


@dataclass
class StepStats:
    n_drafted: int
    n_accepted: int
    draft_seconds: float  # wall time of the Propose call, transport included
    verify_seconds: float  # wall time of the Verify call, transport included
    step_seconds: float
    draft_compute: float = 0.0  # of which the draft worker computed
    verify_compute: float = 0.0  # of which the target worker computed
    critical_compute: float = 0.0  # worker compute on the step's critical path


@dataclass
class Step:
    """Tokens accepted in one step (already cut at EOG / max_tokens)."""

    tokens: list[int]
    pieces: list[bytes]


@dataclass
class Result:
    reason: str = ""  # "eog" | "length"
    n_prompt: int = 0
    n_generated: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0
    n_shifts: int = 0
    n_cached: int = 0  # prompt tokens the prompt cache kept
    n_divergences: int = 0
    n_failovers: int = 0  # times the session moved to another target worker
    n_ahead_used: int = 0  # steps whose drafts were computed during the previous verification
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    draft_compute_seconds: float = 0.0
    verify_compute_seconds: float = 0.0
    steps_seconds: float = 0.0
    critical_compute_seconds: float = 0.0
    speculative: bool = False
    accepted_per_pos: list[int] = field(default_factory=list)


class Divergence(Internal):
    pass


class SeqPool:
    """Sequence ids shared by both workers; bounded wait queue.

    A free sequence may still hold what its last session left (prompt cache):
    `cached[seq]` are the tokens the target holds at positions 0.., and the
    draft holds the first `cached_d[seq]` of them."""

    def __init__(self, n_seq: int, max_queue: int):
        self.capacity = n_seq
        self.free = list(range(n_seq - 1, -1, -1))
        self.in_use: set[int] = set()
        self.max_queue = max_queue
        self.waiters: list[asyncio.Future] = []
        self.cached: dict[int, list[int]] = {}
        self.cached_d: dict[int, int] = {}
        self.cached_on: dict[int, object] = {}  # the target worker holding cached[seq]

    def take_cache(self, seq: int) -> tuple[list[int], int]:
        self.cached_on.pop(seq, None)
        return self.cached.pop(seq, []), self.cached_d.pop(seq, 0)

    def drop_target_cache(self, seq: int) -> None:
        """Forget what a target holds of `seq`. What the draft holds stays
        counted (cached_d), so the next session on `seq` clears it there
        before decoding from position 0."""
        self.cached_on.pop(seq, None)
        self.cached.pop(seq, None)

    def forget_target(self, target) -> None:
        """A target worker lost its sequences (down or restarted)."""
        for seq in [q for q, t in self.cached_on.items() if t is target]:
            self.drop_target_cache(seq)

    def shrink(self, n_seq: int) -> None:
        """A worker hosts only ids below `n_seq`: higher ones are never handed
        out again (those running end their session and are dropped)."""
        if n_seq >= self.capacity:
            return
        self.capacity = n_seq
        self.free = [i for i in self.free if i < n_seq]
        for seq in [q for q in {*self.cached, *self.cached_d} if q >= n_seq]:
            self.take_cache(seq)

    def forget_draft(self) -> None:
        """The draft worker lost its sequences (restart): nothing of it is cached."""
        self.cached_d.clear()

    def _best_free(self, prompt: list[int]) -> int:
        """The free sequence sharing the longest prefix with the prompt (as
        llama-server picks a slot); among equals, the one holding least, then
        the lowest id: with a KV stream per sequence, llama.cpp batches in one
        pass only sequences whose ids follow each other, so ids stay dense."""
        best = max(range(len(self.free)), key=lambda i: (
            common_prefix(self.cached.get(self.free[i], ()), prompt), -len(self.cached.get(self.free[i], ())),
            -self.free[i]))
        return self.free.pop(best)

    @property
    def n_running(self) -> int:
        return len(self.in_use)

    async def acquire(self, prompt: list[int] = ()) -> int:
        if self.free:
            seq = self._best_free(list(prompt))
            self.in_use.add(seq)
            return seq
        if len(self.waiters) >= self.max_queue:
            raise ResourceExhausted(f"all sequences are busy and the queue is full (max_queue = {self.max_queue})")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            seq = await fut
            self.in_use.add(seq)
            return seq
        except asyncio.CancelledError:
            if fut in self.waiters:
                self.waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.in_use.add(fut.result())
                self.release(fut.result())
            raise

    def release(self, seq: int) -> None:
        self.in_use.discard(seq)
        if seq >= self.capacity:  # the pool shrank while it ran (shrink)
            self.take_cache(seq)
            return
        while self.waiters:
            fut = self.waiters.pop(0)
            if not fut.done():
                fut.set_result(seq)
                return
        self.free.append(seq)


@dataclass
class TargetSlot:
    """One target worker: several can serve one router (failover, load)."""

    client: object
    name: str
    info: ModelInfo | None = None
    up: bool = False
    n_active: int = 0  # sessions on it
    peak: RecentPeak = field(default_factory=RecentPeak)  # of n_active: the load adaptive speculation sees
    watching: bool = False
    instance: str = ""  # ModelInfo.instance_id of the process attached to
    epoch: int = 0  # counts attaches: each one empties the worker's sequences
    # one re-attach at a time: every session on a restarted worker reports it
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class _Session:
    def __init__(self, seq: int, params: GenParams, result: Result):
        self.seq = seq
        self.tgt: TargetSlot | None = None
        self.target = None  # self.tgt.client
        self.t_epoch = 0  # TargetSlot.epoch when this session's KV was put on its target
        self.d_epoch = 0  # Router.draft_epoch when the draft last held this session's tokens
        self.wants_draft = False  # speculation asked for and a draft configured
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
        self.hidden = 0.0  # share of drafting that overlap hid behind verification
        self.with_draft = False  # the draft holds (or held) this sequence
        # pipelined operations not awaited yet, per worker
        self.pending_t: list[asyncio.Future] = []
        self.pending_d: list[asyncio.Future] = []


class Router:
    def __init__(self, target, draft, settings: RouterSettings):
        """`target`: one worker client or a list (sessions spread over the live
        ones; a session whose target dies resumes on another)."""
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        self.targets = [TargetSlot(c, getattr(c, "name", f"target {i}")) for i, c in enumerate(targets)]
        self.draft = draft
        self.settings = settings
        self.step_observers: list[Callable[[StepStats], None]] = []
        # called with "target" or "draft" for every divergence the alignment check finds
        self.divergence_observers: list[Callable[[str], None]] = []
        self.target_info: ModelInfo | None = None
        self.draft_info: ModelInfo | None = None
        self.draft_up = False
        # counts draft (re)attaches: each empties the draft, so a session
        # holding an older epoch starts the draft over from position 0
        self.draft_epoch = 0
        self.pool: SeqPool | None = None
        self.controller = Controller()
        self.peak = RecentPeak()  # of all sessions: the draft's load as adaptive speculation sees it

    # ---------------------------------------------------------------- start
    @property
    def target(self):
        """A live target worker (for tokenizing)."""
        return next((t.client for t in self.targets if t.up), self.targets[0].client)

    async def start(self) -> None:
        """Learn the models; refuse a draft (or further target) whose
        vocabulary differs. Needs one target answering; targets and a draft
        that do not answer are attached later by watchers."""
        first_error = None
        for t in self.targets:
            if t.up:
                continue
            try:
                await self._attach_target(t)
            except FailedPrecondition:
                raise
            except SpecdError as exc:
                first_error = first_error or exc
        if not any(t.up for t in self.targets):
            raise first_error
        for t in self.targets:
            if not t.up:
                log.warning("%s unavailable, serving with the others until it answers", t.name)
                self._watch(t)
        if self.draft is not None:
            deadline = time.monotonic() + self.settings.draft_wait
            while True:
                try:
                    await self._attach_draft()
                    break
                except FailedPrecondition:
                    raise
                except SpecdError as exc:
                    if time.monotonic() >= deadline:
                        log.warning("draft worker unavailable, decoding target-only until it answers: %s", exc)
                        self._watcher = asyncio.get_running_loop().create_task(self._watch_draft())
                        break
                    await asyncio.sleep(0.2)

    async def _attach_target(self, t: TargetSlot) -> None:
        """Attach (or re-attach) a target process: every target serves the
        same model, so failover replays give the same text."""
        info = await t.client.model_info()
        if self.target_info is None:
            self.target_info = info
            self.eog = frozenset(info.eog_tokens)
            self.pool = SeqPool(info.n_seq, self.settings.max_queue)
            self.controller.target = CostCurve(info.decode_costs)
            self.controller.target_shared = CostCurve(info.decode_costs_shared)
        else:
            check_same_model(self.target_info, info, "target")
        if t.instance and info.instance_id != t.instance:
            # said whichever way the loss was found: a refused call, a broken channel or the watcher
            log.warning("%s restarted (instance %s, was %s): its sequences and prompt cache are gone",
                        t.name, info.instance_id, t.instance)
        t.client.expect_instance(info.instance_id)
        t.epoch += 1  # before the clear: sessions from before it must replay
        await _done(t.client.clear(-1))  # start from empty sequences whatever came before
        self.pool.forget_target(t)
        t.info, t.instance, t.up = info, info.instance_id, True
        self._fit_sizes()

    def _fit_sizes(self) -> None:
        """Context and sequence ids every attached worker can hold."""
        infos = [t.info for t in self.targets if t.info is not None]
        if self.draft_info is not None:
            infos.append(self.draft_info)
        self.n_ctx = min(i.n_ctx_seq for i in infos)
        self.pool.shrink(min(i.n_seq for i in infos))

    async def _target_failed(self, t: TargetSlot, exc: SpecdError, epoch: int) -> None:
        """A session's call to `t` (attached at `epoch`) failed with `exc`:
        its sequences are gone or unknown. Try to attach it again at once (a
        restarted worker is alive and empty, a broken stream may just need a
        new one); else watch it until it answers. Every session on it
        reports the failure; only the first acts."""
        async with t.lock:
            if t.epoch != epoch or not t.up:
                return  # re-attached or marked down already
            t.up = False
            self.pool.forget_target(t)
            try:
                await asyncio.wait_for(self._attach_target(t), REATTACH_SECONDS)
                log.warning("%s failed (%s): re-attached, its sessions replay their history", t.name, exc)
                return
            except (SpecdError, asyncio.TimeoutError) as err:
                log.warning("%s failed (%s) and does not answer: %s", t.name, exc, err or "timed out")
                t.up = False
            self._watch(t)

    def _watch(self, t: TargetSlot) -> None:
        if not t.watching:
            t.watching = True
            asyncio.get_running_loop().create_task(self._watch_target(t))

    async def _watch_target(self, t: TargetSlot, interval: float = 2.0) -> None:
        try:
            while not t.up:
                await asyncio.sleep(interval)
                if t.n_active:  # sessions still on it (a slow call, not a dead worker) must move or end first
                    continue
                try:
                    await self._attach_target(t)
                    log.info("%s attached", t.name)
                except FailedPrecondition as exc:
                    log.error("%s refused: %s", t.name, exc)
                    return
                except SpecdError:
                    pass
        finally:
            t.watching = False

    def _pick_target(self, seq: int) -> TargetSlot:
        """The least busy live target; the one holding this sequence's prompt
        cache when it is about as free."""
        live = [t for t in self.targets if t.up]
        if not live:
            raise Unavailable("no target worker is available")
        best = min(live, key=lambda t: t.n_active)
        holder = self.pool.cached_on.get(seq)
        if holder in live and holder.n_active <= best.n_active + 1:
            return holder
        if holder is not None:  # the cache stays behind on the other worker: drop it there
            self.pool.drop_target_cache(seq)
            if holder.up:
                asyncio.get_running_loop().create_task(_quiet(holder.client.clear(seq)))
        return best

    async def _attach_draft(self) -> None:
        info = await self.draft.model_info()
        check_vocab(self.target_info, info)
        if self.draft_info is not None and info.instance_id != self.draft_info.instance_id:
            log.warning("draft worker restarted (instance %s, was %s): sessions start it over from position 0",
                        info.instance_id, self.draft_info.instance_id)
        self.draft.expect_instance(info.instance_id)
        # before the clear: a session that sees the new epoch sends its next
        # operation after the clear on the same ordered stream
        self.draft_epoch += 1
        await _done(self.draft.clear(-1))
        self.draft_info = info
        self.pool.forget_draft()
        self.controller.draft = CostCurve(info.decode_costs)
        self.controller.draft_prompt = CostCurve(info.prompt_costs)
        self._fit_sizes()
        self.draft_up = True

    async def _watch_draft(self, interval: float = 2.0) -> None:
        first = True
        while not self.draft_up:
            # a restarted draft answers at once; a dead one is asked every interval
            await asyncio.sleep(0.05 if first else interval)
            first = False
            try:
                await self._attach_draft()
                log.info("draft worker attached")
            except FailedPrecondition as exc:
                log.error("draft worker refused: %s", exc)
                return
            except SpecdError:
                pass

    @property
    def checkpoint_mode(self) -> bool:
        if self.settings.checkpoint_mode:
            return True
        infos = [self.target_info] + ([self.draft_info] if self.draft_info else [])
        return not all(i.can_rm_partial for i in infos)

    # ----------------------------------------------------------- validation
    def validate(self, p: GenParams) -> None:
        n_vocab = self.target_info.n_vocab
        if not p.prompt:
            raise InvalidArgument("prompt must not be empty")
        if len(p.prompt) > self.n_ctx:
            raise InvalidArgument(f"prompt has {len(p.prompt)} tokens; the context of a sequence holds {self.n_ctx}")
        # the length is bounded now; min and max run in C, the loop only names a bad id
        if min(p.prompt) < 0 or max(p.prompt) >= n_vocab:
            i, t = next((i, t) for i, t in enumerate(p.prompt) if not 0 <= t < n_vocab)
            raise InvalidArgument(f"prompt_tokens[{i}] = {t} is not in [0, n_vocab = {n_vocab})")
        if p.max_tokens is not None:
            if p.max_tokens <= 0:
                raise InvalidArgument(f"max_tokens must be >= 1, got {p.max_tokens}")
            if not self._can_shift(p) and len(p.prompt) + p.max_tokens > self.n_ctx:
                raise InvalidArgument(
                    f"max_tokens = {p.max_tokens} with a prompt of {len(p.prompt)} tokens exceeds the context "
                    f"of a sequence ({self.n_ctx}); lower max_tokens or set context_shift"
                )
        p.sampling.validate("sampling")
        if p.n_max is not None and not 1 <= p.n_max <= MAX_DRAFT:
            raise InvalidArgument(f"speculative.n_max must be in [1, {MAX_DRAFT}], got {p.n_max}")
        n_max = self._n_max(p)
        if p.n_min is not None and not 0 <= p.n_min <= n_max:
            raise InvalidArgument(f"speculative.n_min must be in [0, n_max = {n_max}], got {p.n_min}")
        if p.p_min is not None and not 0.0 <= p.p_min <= 1.0:
            raise InvalidArgument(f"speculative.p_min must be in [0, 1], got {p.p_min}")
        if p.n_keep < 0 or p.n_keep >= self.n_ctx // 2:
            raise InvalidArgument(f"n_keep must be in [0, {self.n_ctx // 2}), got {p.n_keep}")

    def _can_shift(self, p: GenParams) -> bool:
        return p.context_shift and not self.checkpoint_mode and self.target_info.can_shift and (
            self.draft_info is None or self.draft_info.can_shift
        )

    # -------------------------------------------------------------- generate
    async def generate(self, p: GenParams, result: Result) -> AsyncIterator[Step]:
        """Yield the accepted tokens step by step; fill `result` as it goes.
        Closing the iterator early (cancel, stop string) frees the sequence."""
        self.validate(p)
        if not any(t.up for t in self.targets):
            raise Unavailable("no target worker is available")
        seq = await self.pool.acquire(p.prompt)
        s = _Session(seq, p, result)
        try:
            s.tgt = self._pick_target(seq)
        except Unavailable:
            self.pool.release(seq)
            raise
        s.target, s.t_epoch = s.tgt.client, s.tgt.epoch
        s.tgt.n_active += 1
        s.wants_draft = self.draft is not None and p.speculative is not False
        use_draft = s.wants_draft and self.draft_up
        result.speculative = s.with_draft = use_draft
        s.d_epoch = self.draft_epoch
        s.acc = self.controller.new_session()
        s.hidden = 0.5 if self.settings.overlap else 0.0
        try:
            t0 = time.perf_counter()
            use_draft = await self._reuse(s, use_draft)
            try:
                use_draft = await self._prefill(s, use_draft, use_draft and self._draft_could_pay(s))
            except SpecdError as exc:
                if not self._target_lost(s, exc):
                    raise
                use_draft = await self._failover(s, exc, use_draft)
            result.prompt_seconds = time.perf_counter() - t0
            t_gen = time.perf_counter()
            limit = p.max_tokens if p.max_tokens is not None else self._default_max_tokens(p)
            while True:
                n_before = None
                try:
                    if s.t_epoch != s.tgt.epoch:
                        raise WorkerRestarted(f"{s.tgt.name} was attached again: seq {s.seq} is gone from it")
                    use_draft = await self._rejoin_draft(s, use_draft)
                    if len(s.ctx) > self.n_ctx:  # no position left for id_last
                        if not self._can_shift(p):
                            result.reason = "length"
                            break
                        use_draft = await self._context_shift(s, use_draft)
                    n_before = len(s.ctx)
                    out, pieces, use_draft = await self._step(s, use_draft, limit - result.n_generated)
                except SpecdError as exc:
                    if not self._target_lost(s, exc):
                        raise  # a deadline, a refusal: this session fails alone
                    if n_before is not None:
                        del s.ctx[n_before:]  # the failed step's tokens were not handed out
                    use_draft = await self._failover(s, exc, use_draft)
                    continue
                out, pieces, finish = self._cut(out, pieces, limit - result.n_generated)
                result.n_generated += len(out)
                result.generation_seconds = time.perf_counter() - t_gen
                if finish == "eog":  # counted as generated, not shown
                    out, pieces = out[:-1], pieces[:-1]
                if out:
                    yield Step(out, pieces)
                if finish:
                    result.reason = finish
                    break
        finally:
            # A cancel (client gone, deadline) may land while the release
            # awaits the workers; cut short, it would leave the sequence out
            # of the pool and its KV on the workers. It runs to the end on its
            # own task whatever happens to this one.
            release = asyncio.ensure_future(self._release(s, use_draft))
            release.add_done_callback(_log_release_error)
            await asyncio.shield(release)

    def _cut(self, out: list[int], pieces: list[bytes], room: int) -> tuple[list[int], list[bytes], str]:
        """Cut a step's tokens after an end-of-generation token or at max_tokens."""
        finish = ""
        for i, t in enumerate(out):
            if t in self.eog:
                out, pieces, finish = out[: i + 1], pieces[: i + 1], "eog"
                break
        if len(out) > room:
            return out[:room], pieces[:room], "length"
        if len(out) == room and not finish:
            finish = "length"
        return out, pieces, finish

    def _default_max_tokens(self, p: GenParams) -> int:
        if self._can_shift(p):
            return self.n_ctx
        return self.n_ctx - len(p.prompt)

    async def _reuse(self, s: _Session, use_draft: bool) -> bool:
        """Prompt cache: keep what the sequence holds of this prompt's prefix
        from its last session (as llama-server's cache_prompt), remove the
        rest on both workers; the prompt's last token is always decoded anew."""
        cached, cached_d = self.pool.take_cache(s.seq)
        if not cached and not cached_d:
            return use_draft
        n = common_prefix(cached, s.ctx[:-1]) if self.settings.prompt_cache and not self.checkpoint_mode else 0
        swa = self.target_info.n_swa or (self.draft_info.n_swa if self.draft_info else 0)
        if swa and len(cached) - n > MAX_DRAFT:
            n = 0  # a sliding-window cache may no longer hold what the positions before n need
        if len(cached) > n:
            s.pending_t.append(await (s.target.seq_rm(s.seq, n, -1) if n else s.target.clear(s.seq)))
        s.n_t = n
        s.res.n_cached = n
        n_d = min(cached_d, n) if use_draft else 0
        if cached_d > n_d:
            fut = await (self.draft.seq_rm(s.seq, n_d, -1) if n_d else self.draft.clear(s.seq))
            if use_draft:
                s.pending_d.append(fut)
            else:
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # the draft may be down
        s.n_d = n_d
        return use_draft

    def _adaptive(self, p) -> bool:
        return p.adaptive if p.adaptive is not None else self.settings.adaptive

    def _n_max(self, p) -> int:
        return p.n_max if p.n_max is not None else self.settings.n_max

    def _draft_busy(self) -> bool:
        """Whether the draft computes for some session right now: the
        target's next batch then leaves it its cores (DecodeRequest.draft_busy)."""
        return getattr(self.draft, "computing", 0) > 0

    def _n_sessions(self) -> int:
        return sum(t.n_active for t in self.targets)

    def _load(self, s: _Session) -> tuple[int, int]:
        """(sessions on this session's target, all sessions) as adaptive
        speculation sees them: their recent peaks (RecentPeak)."""
        now = time.monotonic()
        return s.tgt.peak.load(s.tgt.n_active, now), self.peak.load(self._n_sessions(), now)

    def _draft_could_pay(self, s: _Session) -> bool:
        """Whether to prefill the draft: with adaptive speculation, not when
        drafting could not pay at the current load even if every draft were
        accepted (the draft catches up in its first Propose if that changes)."""
        p = s.p
        if not self._adaptive(p):
            return True
        n_target, n_all = self._load(s)
        return self.controller.choose(None, self._n_max(p), n_target, s.hidden, self.settings.overlap, n_all) > 0

    async def _prefill(self, s: _Session, use_draft: bool, draft_too: bool = True) -> bool:
        """Decode the prompt but its last token on the target and (draft_too)
        the draft at once (what the prompt cache did not keep)."""
        n = len(s.ctx) - 1
        log.debug("prefill seq=%d tokens=%d draft=%s sessions=%d", s.seq, n - s.n_t,
                  "no" if not use_draft else ("yes" if draft_too else "later"), self._n_sessions())
        pend_t, pend_d = s.pending_t, s.pending_d
        s.pending_t, s.pending_d = [], []
        if use_draft and draft_too and s.n_d < n:
            fut = await self.draft.decode(s.seq, s.n_d, s.ctx[s.n_d : n])
            if self._adaptive(s.p) and self._n_sessions() > 1:
                # under load generation starts without waiting: steps do not draft until it is done
                s.draft_prefill = fut
                s.pending_d.append(fut)
            else:
                pend_d.append(fut)
        if s.n_t < n:
            pend_t.append(await s.target.decode(s.seq, s.n_t, s.ctx[s.n_t : n], draft_busy=self._draft_busy()))
        results = await asyncio.gather(*pend_t, *pend_d, return_exceptions=True)
        for r in results[: len(pend_t)]:
            if isinstance(r, BaseException):
                raise r
        s.n_t = n
        if use_draft:
            for r in results[len(pend_t) :]:
                if isinstance(r, BaseException):
                    return self._draft_failed(s, r)
            if draft_too:
                s.n_d = n
        return use_draft

    # ------------------------------------------------------------------ step
    async def _step(self, s: _Session, use_draft: bool, remaining: int) -> tuple[list[int], list[bytes], bool]:
        t0 = time.perf_counter()
        p, seq, ctx = s.p, s.seq, s.ctx
        n = len(ctx)
        ckpt = self.checkpoint_mode
        n_max = self._n_max(p)
        n_min = p.n_min if p.n_min is not None else self.settings.n_min
        p_min = p.p_min if p.p_min is not None else self.settings.p_min
        k = min(n_max, self.n_ctx - n, remaining - 1) if use_draft else 0
        n_target, n_all = self._load(s)
        # drafts the draft made beside the last verification cost this step
        # nothing: priced at the share overlap hides on average, taking 3 of
        # 4 made could look better than taking all 4, which runs faster
        hidden = 1.0 if s.ahead else s.hidden
        load = (n_target, hidden, self.settings.overlap, n_all, 0 if s.ahead else n - 1 - s.n_d, remaining)
        if k > 0 and self._adaptive(p):
            if s.draft_prefill is not None and not s.draft_prefill.done():
                k = 0  # the draft still decodes the prompt: the target goes on alone
            else:
                k = self.controller.choose(s.acc, k, *load)
        hidden_now = 1.0 if s.ahead else 0.0  # this step's drafts are hidden only if overlap already made them

        if s.n_t < n - 1:  # target lags (after a shift or a repair): decode the gap first
            s.pending_t.append(await s.target.decode(seq, s.n_t, ctx[s.n_t : n - 1]))
            s.n_t = n - 1

        drafts: list[int] = []
        q: list = []  # the drafts' distributions, when the draft sampled them
        held_d = s.ahead_held if s.ahead else s.n_d  # over ctx + s.ahead
        ck_d = cont = None
        ahead_used = False
        t_draft = c_draft = c_cont = 0.0
        if s.ahead and min(k, len(s.ahead)) >= max(1, n_min):
            # drafted during the last verification, for exactly this context
            drafts, q, held_d = s.ahead[:k], s.ahead_q[:k], s.ahead_held
            if len(drafts) < len(s.ahead):
                # the draft also holds the drafts not used: drop them, so it
                # can go on after the last one used while the target verifies
                # (else the next step drafts in the open)
                held_d = n + len(drafts) - 1
                try:
                    s.pending_d.append(await self.draft.seq_rm(seq, held_d, -1))
                except SpecdError as exc:
                    use_draft = self._draft_failed(s, exc)  # the drafts stand: the target verifies them
            s.ahead = []
            s.res.n_ahead_used += 1
            ahead_used = True
        elif k >= max(1, n_min):
            if s.ahead:
                # fewer drafts made beside the last verification than n_min:
                # the draft drops them and drafts anew from id_last
                s.n_d = min(s.n_d, n - 1)
                s.pending_d.append(await self.draft.seq_rm(seq, s.n_d, -1))
            try:
                if ckpt:
                    ck_d = await self.draft.checkpoint_save(seq)
                prop = await _done(self.draft.propose(seq, s.n_d, ctx[s.n_d :], k, n_min, p_min, p.draft_sampling,
                                                      s.res.n_generated))
                drafts, q = prop.tokens, prop.q
                c_draft = prop.compute_seconds
                self.controller.draft.observe(prop.batch_tokens, prop.batch_seconds)
                held_d = prop.state.pos_max + 1
                if ck_d is not None:
                    ck_d = (await ck_d).handle
            except SpecdError as exc:
                use_draft = self._draft_failed(s, exc)
                drafts, ck_d = [], None
            t_draft = time.perf_counter() - t0
        s.ahead = []

        # Overlap: while the target verifies, let the draft continue after the
        # last draft as if all were accepted; its first token guesses the
        # target's own next token. Only proposals: the target verifies them.
        next_k = min(max(k, 1), self.n_ctx - (n + len(drafts) + 1), remaining - len(drafts) - 2)
        if (self.settings.overlap and use_draft and drafts and not ckpt and next_k >= 1
                and held_d == n + len(drafts) - 1):
            # its first token guesses the one after the drafts: sample index n_generated + len(drafts)
            cont = await self.draft.propose(seq, held_d, drafts[-1:], next_k + 1, 0, p_min, p.draft_sampling,
                                            s.res.n_generated + len(drafts))

        t1 = time.perf_counter()
        ck_t = (await s.target.checkpoint_save(seq)) if ckpt and drafts else None
        draft_busy = self._draft_busy()
        try:
            # without a distribution for every draft (n-gram, exact acceptance), exact match
            ver = await _done(s.target.verify(seq, n - 1, [ctx[-1]] + drafts, p.sampling, s.res.n_generated,
                                              not ckpt, draft_busy=draft_busy,
                                              draft_q=q if p.rejection and len(q) == len(drafts) else ()))
        except BaseException:
            if cont is not None:  # its result no longer matters; the failover trims the draft
                cont.add_done_callback(_consume)
            raise
        out = ver.tokens
        t_verify = time.perf_counter() - t1
        self.controller.observe_target(ver.batch_tokens, ver.batch_seconds, draft_busy)
        a = len(out) - 1
        keep = n + a  # positions of the context after this step that are decoded: id_last + accepted drafts

        if ck_t is not None:
            handle = (await ck_t).handle
            if a < len(drafts):
                s.pending_t.append(await s.target.checkpoint_restore(handle, drop=True))
                s.pending_t.append(await s.target.decode(seq, n - 1, [ctx[-1]] + drafts[:a]))
            else:
                s.pending_t.append(await s.target.checkpoint_drop(handle))
        s.n_t = keep

        if cont is not None:
            try:
                c = await cont
            except SpecdError as exc:
                use_draft = self._draft_failed(s, exc)
            else:
                c_cont = c.compute_seconds
                self.controller.draft.observe(c.batch_tokens, c.batch_seconds)
                held_d = c.state.pos_max + 1  # over ctx + drafts + c.tokens
                if a == len(drafts) and c.tokens and c.tokens[0] == out[-1]:
                    # guessed right: ctx + out + c.tokens[1:] is what the draft holds a prefix of
                    s.ahead, s.ahead_q, s.ahead_held = c.tokens[1:], c.q[1:], held_d
                    s.n_d = min(held_d, n + len(out))

        if use_draft and not s.ahead and held_d > s.n_d:
            keep_d = min(held_d, keep)
            if ck_d is not None:
                if held_d > keep_d:
                    s.pending_d.append(await self.draft.checkpoint_restore(ck_d, drop=True))
                else:
                    s.pending_d.append(await self.draft.checkpoint_drop(ck_d))
                    s.n_d = keep_d
            else:
                if held_d > keep_d:
                    s.pending_d.append(await self.draft.seq_rm(seq, keep_d, -1))
                s.n_d = keep_d

        ctx.extend(out)
        self.controller.observe_step(s.acc, len(drafts), a)
        if drafts:
            s.hidden += 0.2 * ((1.0 if ahead_used else 0.0) - s.hidden)
            s.res.n_drafted += len(drafts)
            s.res.n_accepted += a
            while len(s.res.accepted_per_pos) < len(drafts):
                s.res.accepted_per_pos.append(0)
            for i in range(a):
                s.res.accepted_per_pos[i] += 1
        s.res.n_steps += 1

        use_draft = await self._settle(s, use_draft, wait=self.settings.check_alignment)
        if self.settings.check_alignment:
            use_draft = await self._check_alignment(s, use_draft)
        critical = c_draft + max(ver.compute_seconds, c_cont)  # the continuation runs beside the verification
        stats = StepStats(len(drafts), a, t_draft, t_verify, time.perf_counter() - t0, c_draft + c_cont,
                          ver.compute_seconds, critical)
        s.res.critical_compute_seconds += critical
        s.res.draft_compute_seconds += c_draft + c_cont
        s.res.verify_compute_seconds += ver.compute_seconds
        s.res.steps_seconds += stats.step_seconds
        # what the model says this very step should have taken, with the
        # target's batch as it was and a lagging draft's catch-up paid in full
        # at the load it really had (choices use the recent peak: RecentPeak)
        n_target, n_all = s.tgt.n_active, self._n_sessions()
        predicted = self.controller.predict(s.acc, k, n_target, hidden_now, load[2], n_all, load[4],
                                            verify_tokens=ver.batch_tokens)
        self.controller.observe_time(n_target, k > 0, predicted, stats.step_seconds, ver.batch_tokens, draft_busy,
                                     ver.batch_seconds)
        for obs in self.step_observers:
            obs(stats)
        if log.isEnabledFor(logging.DEBUG):
            slow = self.controller.slowdown(n_target)
            log.debug("step seq=%d mode=%s sessions=%d load=%d k=%d accepted=%d ahead=%d step_ms=%.0f draft_ms=%.0f "
                      "verify_ms=%.0f verify_batch=%d verify_batch_ms=%.0f predicted_ms=%.0f extra_ms=%.0f/%.0f", seq,
                      "adaptive" if self._adaptive(p) and s.with_draft else ("fixed" if s.with_draft else "target"),
                      s.tgt.n_active, load[0], len(drafts), a, ahead_used, stats.step_seconds * 1e3, t_draft * 1e3, t_verify * 1e3,
                      ver.batch_tokens, ver.batch_seconds * 1e3, predicted * 1e3, *(x * 1e3 for x in slow.extras(time.monotonic())))
        return out, ver.pieces, use_draft

    def _target_lost(self, s: _Session, exc: SpecdError) -> bool:
        """Whether `exc` means the session's KV on its target is gone (the
        worker is down or restarted), so that replaying the history on a
        live target is the way on; any other error fails the session."""
        return isinstance(exc, Unavailable) or s.t_epoch != s.tgt.epoch

    async def _failover(self, s: _Session, exc: SpecdError, use_draft: bool) -> bool:
        """The session's target lost its sequence: continue on a live target
        (the same one once re-attached after a restart) by replaying the
        history (same output: greedy is deterministic and sampling uses the
        token index's random number). No live target: the request fails."""
        while True:
            old = s.tgt
            await self._target_failed(old, exc, s.t_epoch)
            live = [t for t in self.targets if t.up]
            if not live:
                raise exc if isinstance(exc, Unavailable) else Unavailable(f"no target worker is available: {exc}")
            for fut in s.pending_t:
                if not fut.done():
                    fut.cancel()
            s.pending_t = []
            old.n_active -= 1
            s.tgt = min(live, key=lambda t: t.n_active)
            s.target, s.t_epoch = s.tgt.client, s.tgt.epoch
            s.tgt.n_active += 1
            log.warning("%s failed for seq %d, resuming on %s: %s", old.name, s.seq,
                        "another target" if s.tgt is not old else "it", exc)
            s.res.n_failovers += 1
            s.n_t = s.res.n_cached = 0  # the replay decodes the whole history
            try:
                n = len(s.ctx) - 1
                if n:
                    await _done(s.target.decode(s.seq, 0, s.ctx[:n]))
                s.n_t = n
                break
            except SpecdError as again:
                if not self._target_lost(s, again):
                    raise
                exc = again
        if use_draft:
            # the failed step may have left drafts, a lookahead or a
            # continuation past the history on the draft: cut it back
            s.ahead = []
            s.n_d = min(s.n_d, len(s.ctx) - 1)
            try:
                await _done(self.draft.seq_rm(s.seq, s.n_d, -1))
            except SpecdError as err:
                use_draft = self._draft_failed(s, err)
        return use_draft

    async def _rejoin_draft(self, s: _Session, use_draft: bool) -> bool:
        """The draft was (re)attached since this session last used it, so it
        holds nothing of the session: draft again from position 0 (the next
        Propose catches up on the whole history)."""
        if not s.wants_draft or not self.draft_up or s.d_epoch == self.draft_epoch:
            return use_draft
        for fut in s.pending_d:
            if not fut.done():
                fut.cancel()
        s.pending_d = []
        if s.d_epoch == -1:  # diverged, not attached again: empty the sequence first
            s.pending_d.append(await self.draft.clear(s.seq))
        s.d_epoch = self.draft_epoch
        s.n_d, s.ahead, s.ahead_held, s.draft_prefill = 0, [], 0, None
        s.with_draft = True
        return True

    async def _settle(self, s: _Session, use_draft: bool, wait: bool = True) -> bool:
        """Collect the pipelined operations' results. A target failure fails the
        request; a draft failure only turns the draft off for this session.
        Without `wait`, operations still in flight stay pending: a later result
        from the same worker (answers come in order) settles them at no cost."""
        if wait:
            await asyncio.gather(*s.pending_t, *s.pending_d, return_exceptions=True)
        still_t = []
        for fut in s.pending_t:
            if not fut.done():
                still_t.append(fut)
            elif not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()
        s.pending_t = still_t
        still_d = []
        for fut in s.pending_d:
            if not fut.done():
                still_d.append(fut)
            elif not fut.cancelled() and fut.exception() is not None:
                return self._draft_failed(s, fut.exception())
        s.pending_d = still_d
        return use_draft

    def _draft_failed(self, s: _Session, exc: BaseException) -> bool:
        """Degrade to target-only decoding: the request goes on without the
        draft. If the draft was attached again since this session last used
        it (which clears it), the failure is that attach's: the session
        rejoins from position 0 at its next step (_rejoin_draft)."""
        if s.d_epoch != self.draft_epoch:
            log.info("draft worker attached again under seq %d: it drafts anew from position 0", s.seq)
        elif isinstance(exc, FailedPrecondition) and s.resyncs_d < MAX_DRAFT_RESYNCS:
            # the draft holds other positions than the router knows (changed
            # behind its back): a divergence, repaired from the history
            log.error("draft worker diverged (seq %d): %s; re-syncing it from history", s.seq, exc)
            self._diverged(s, "draft")
            s.resyncs_d += 1
            s.d_epoch = -1  # _rejoin_draft catches it up from 0 at the next step
        else:
            log.warning("draft worker failed for seq %d, continuing target-only: %s", s.seq, exc)
        if isinstance(exc, Unavailable) and self.draft_up and s.d_epoch == self.draft_epoch:
            # the worker itself is gone, stuck or restarted: new sessions go
            # target-only until the watcher attaches it again
            self.draft_up = False
            self._watcher = asyncio.get_running_loop().create_task(self._watch_draft())
        for fut in s.pending_d:
            if not fut.done():
                fut.cancel()
        s.pending_d = []
        return False

    # ------------------------------------------------------------- alignment
    async def _check_alignment(self, s: _Session, use_draft: bool) -> bool:
        futs = [await s.target.state(s.seq)]
        if use_draft:
            futs.append(await self.draft.state(s.seq))
        states = await asyncio.gather(*futs, return_exceptions=True)
        if isinstance(states[0], BaseException):
            raise states[0]
        problem = _mismatch(states[0], s.ctx, s.n_t)
        if problem:
            self._diverged(s, "target")
            raise Divergence(f"target worker diverged from the router's history: {problem}")
        if use_draft:
            if isinstance(states[1], BaseException):
                return self._draft_failed(s, states[1])
            if s.ahead:
                problem = _mismatch(states[1], s.ctx + s.ahead, s.ahead_held)
            else:
                problem = _mismatch(states[1], s.ctx, s.n_d)
            if problem:
                self._diverged(s, "draft")
                log.error("draft worker diverged (seq %d): %s; re-syncing it from history", s.seq, problem)
                try:
                    await self._resync_draft(s)
                except SpecdError as exc:
                    return self._draft_failed(s, exc)
        return use_draft

    def _diverged(self, s: _Session, worker: str) -> None:
        s.res.n_divergences += 1
        for obs in self.divergence_observers:
            obs(worker)

    async def _resync_draft(self, s: _Session) -> None:
        await _done(self.draft.clear(s.seq))
        s.n_d, s.ahead = 0, []
        if len(s.ctx) > 1:
            await _done(self.draft.decode(s.seq, 0, s.ctx[:-1]))
            s.n_d = len(s.ctx) - 1

    # --------------------------------------------------------- context shift
    async def _context_shift(self, s: _Session, use_draft: bool) -> bool:
        n_keep = max(s.p.n_keep, 0)
        n_past = len(s.ctx) - 1
        n_discard = (n_past - n_keep) // 2
        if n_discard <= 0:
            raise FailedPrecondition("context shift cannot free any position")
        if use_draft and s.ahead:  # lookahead drafts do not survive a shift
            s.pending_d.append(await self.draft.seq_rm(s.seq, s.n_d, -1))
            s.ahead = []
        workers = [(s.target, "n_t", s.pending_t)]
        if use_draft:
            workers.append((self.draft, "n_d", s.pending_d))
        for w, attr, pending in workers:
            held = getattr(s, attr)
            if held > n_keep + n_discard:
                pending.append(await w.seq_rm(s.seq, n_keep, n_keep + n_discard))
                pending.append(await w.seq_add(s.seq, n_keep + n_discard, -1, -n_discard))
                setattr(s, attr, held - n_discard)
            elif held > n_keep:
                pending.append(await w.seq_rm(s.seq, n_keep, -1))
                setattr(s, attr, n_keep)
        del s.ctx[n_keep : n_keep + n_discard]
        s.res.n_shifts += 1
        return await self._settle(s, use_draft)

    async def _release(self, s: _Session, use_draft: bool) -> None:
        """Free the sequence. After a clean finish both workers keep what
        they hold of the history for the prompt cache (the draft trimmed to a
        prefix of the target's); after a cancel or an error both are cleared."""
        for fut in s.pending_t + s.pending_d:
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: errors here no longer matter
        keep = bool(s.res.reason) and self.settings.prompt_cache and not self.checkpoint_mode
        n_d = min(s.n_d, s.n_t) if use_draft else 0
        if keep:
            futs = [*s.pending_t, *s.pending_d]
            if use_draft:
                futs.append(await self.draft.seq_rm(s.seq, n_d, -1))
            elif s.with_draft:
                futs.append(await self.draft.clear(s.seq))
        else:
            futs = [await s.target.clear(s.seq)]
            if s.with_draft:
                futs.append(await self.draft.clear(s.seq))
        try:
            results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout=10)
            ok = not any(isinstance(r, BaseException) for r in results)
        except Exception:  # the workers may be gone; the sequence is freed all the same
            log.warning("could not clear seq %d on the workers", s.seq)
            ok = False
        s.tgt.n_active -= 1
        if keep and ok:
            self.pool.cached[s.seq] = s.ctx[: s.n_t]
            self.pool.cached_d[s.seq] = n_d
            self.pool.cached_on[s.seq] = s.tgt
        elif keep:  # unknown state: start the next session from empty sequences
            for w in [s.target] + ([self.draft] if s.with_draft else []):
                fut = await w.clear(s.seq)
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.pool.release(s.seq)


def _log_release_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("releasing a sequence failed", exc_info=task.exception())


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a result nobody waits for (no 'never retrieved' warning)."""
    if not fut.cancelled():
        fut.exception()


async def _quiet(issue) -> None:
    """Issue an operation whose result does not matter."""
    try:
        await (await issue)
    except (SpecdError, asyncio.CancelledError):
        pass


async def _done(issue):
    """Issue an operation and wait for its result."""
    return await (await issue)


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _mismatch(state: SeqState, ctx: list[int], n: int) -> str:
    want_min, want_max = (0, n - 1) if n else (-1, -1)
    if (state.pos_min, state.pos_max, state.n_tokens) != (want_min, want_max, n):
        return (f"holds positions [{state.pos_min}, {state.pos_max}] ({state.n_tokens} tokens), "
                f"the router expects [{want_min}, {want_max}] ({n} tokens)")
    if state.token_hash != history_hash(ctx[:n]):
        return f"holds other tokens at positions [0, {n})"
    return ""


def check_same_model(first: ModelInfo, other: ModelInfo, role: str) -> None:
    """Targets must be one model: a session that fails over replays its
    history on another and must get the same text."""
    check_vocab(first, other, role)
    if (other.architecture, other.description) != (first.architecture, first.description):
        raise FailedPrecondition(
            f"the {role} model {other.model_path or other.description!r} ({other.description}) is not the model "
            f"the router serves ({first.description}); every target worker must load the same model"
        )


def check_vocab(target: ModelInfo, draft: ModelInfo, role: str = "draft") -> None:
    """The draft must tokenize like the target. Model-free drafters have no
    vocabulary: only the size they were given (--n-vocab), if any, must match."""
    if not draft.vocab_fingerprint:
        mismatch = draft.n_vocab not in (0, target.n_vocab)
    else:
        mismatch = draft.n_vocab != target.n_vocab or draft.vocab_fingerprint != target.vocab_fingerprint
    if mismatch:
        raise FailedPrecondition(
            f"the {role} model {draft.model_path or draft.description!r} (n_vocab {draft.n_vocab}) does not share "
            f"the vocabulary of the target model {target.model_path or target.description!r} "
            f"(n_vocab {target.n_vocab}); speculative decoding needs identical vocabularies"
        )
