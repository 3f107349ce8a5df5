"""The router's request loop, independent of the transport.

For each session the router owns the token history and knows how much of it
each worker holds (router/session.py). Every step (router/step.py):

    propose on the draft -> verify on the target -> roll both back to the
    accepted length -> hand the accepted tokens to the caller

and every KV operation is mirrored on both workers. Models that cannot
remove part of a sequence (recurrent / hybrid) run in checkpoint mode: save
before drafting and verifying, restore and re-decode the accepted tokens on
partial acceptance.

The pieces: params.py (settings, a request, its steps and result), pool.py
(sequence ids and the prompt cache), targets.py (the target workers: attach,
watch, failover), draft.py (the draft worker), session.py (one request's
state), step.py (one step), alignment.py (check, context shift, release).
Here: validate a request, take a sequence, prefill the prompt, step until
done, release.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import AsyncIterator, Callable

from specd.engine import MAX_DRAFT, ModelInfo, VerifyResult
from specd.errors import InvalidArgument, SpecdError, Unavailable, WorkerRestarted
from specd.router import alignment, health, step
from specd.router.adaptive import Controller
from specd.router.draft import DraftLink
from specd.router.load import RecentPeak
from specd.router.params import GenParams, Result, RouterSettings, Step, StepStats
from specd.router.pool import SeqPool, common_prefix
from specd.router.session import Session, Streamed
from specd.router.targets import TargetSet

log = logging.getLogger("specd.router")

# A sliding-window cache keeps little history beyond its window: the longest
# tail removal the router relies on is the one a fully rejected draft makes.
SWA_MAX_RM = MAX_DRAFT


class Router:
    def __init__(self, target, draft, settings: RouterSettings):
        """`target`: one worker client or a list (sessions spread over the live
        ones; a session whose target dies resumes on another). `draft`: a
        worker client or None."""
        targets = list(target) if isinstance(target, (list, tuple)) else [target]
        self.targets = TargetSet(targets, self)
        self.draft = DraftLink(draft, self)
        self.settings = settings
        self.step_observers: list[Callable[[StepStats], None]] = []
        # called with "target" or "draft" for every divergence the alignment check finds
        self.divergence_observers: list[Callable[[str], None]] = []
        self.target_info: ModelInfo | None = None  # the model every target serves (TargetSet.attach)
        self.pool: SeqPool | None = None
        self.controller = Controller()
        self.peak = RecentPeak()  # of all sessions: the draft's load as adaptive speculation sees it
        self._followers: list[asyncio.Task] = []  # router.health.follow of each remote worker

    # ---------------------------------------------------------------- start
    async def live_target(self):
        """A target worker that takes new sessions (for tokenizing), waited
        for as a new session waits (TargetSet.wait_open)."""
        await self.targets.wait_open()
        return next(t.client for t in self.targets if t.takes_sessions)

    @property
    def draft_up(self) -> bool:
        """Whether new sessions draft: attached and not draining."""
        return self.draft.up and self.draft.serving

    @property
    def can_serve(self) -> bool:
        """Whether a new request would find a target: what readiness says."""
        return self.pool is not None and self.targets.can_serve

    @property
    def draft_info(self) -> ModelInfo | None:
        return self.draft.info

    async def start(self) -> None:
        """Learn the models; refuse a draft (or further target) whose
        vocabulary differs. Needs one target answering; targets and a draft
        that do not answer are attached later by watchers."""
        self._follow_health()
        await self.targets.start()
        if self.draft.client is not None:
            await self.draft.start()

    def _follow_health(self) -> None:
        """Watch each remote worker's health (router.health); once."""
        if self._followers:
            return
        loop = asyncio.get_running_loop()
        for t in self.targets:
            if getattr(t.client, "channel", None) is not None:
                self._followers.append(loop.create_task(
                    health.follow(t.client.channel, t.name, lambda ok, t=t: self.targets.set_serving(t, ok))))
        d = self.draft
        if getattr(d.client, "channel", None) is not None:
            self._followers.append(loop.create_task(
                health.follow(d.client.channel, "draft", lambda ok: setattr(d, "serving", ok))))

    async def close(self) -> None:
        """Stop watching the workers (the caller closes their clients)."""
        for task in self._followers:
            task.cancel()
        await asyncio.gather(*self._followers, return_exceptions=True)
        self._followers = []

    async def _attach_draft(self) -> None:
        """Attach the draft worker (again): DraftLink.attach."""
        await self.draft.attach()

    def fit_sizes(self) -> None:
        """Context and sequence ids every attached worker can hold."""
        infos = [t.info for t in self.targets if t.info is not None]
        if self.draft_info is not None:
            infos.append(self.draft_info)
        self.n_ctx = min(i.n_ctx_seq for i in infos)
        self.pool.shrink(min(i.n_seq for i in infos))

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
            raise InvalidArgument("prompt must not be empty", field="prompt")
        if len(p.prompt) > self.n_ctx:
            raise InvalidArgument(f"prompt has {len(p.prompt)} tokens; the context of a sequence holds {self.n_ctx}", field="prompt")
        # the length is bounded now; min and max run in C, the loop only names a bad id
        if min(p.prompt) < 0 or max(p.prompt) >= n_vocab:
            i, t = next((i, t) for i, t in enumerate(p.prompt) if not 0 <= t < n_vocab)
            raise InvalidArgument(f"prompt_tokens[{i}] = {t} is not in [0, n_vocab = {n_vocab})", field=f"prompt_tokens[{i}]")
        if p.max_tokens is not None:
            if p.max_tokens <= 0:
                raise InvalidArgument(f"max_tokens must be >= 1, got {p.max_tokens}", field="max_tokens")
            if not self._can_shift(p) and len(p.prompt) + p.max_tokens > self.n_ctx:
                raise InvalidArgument(
                    f"max_tokens = {p.max_tokens} with a prompt of {len(p.prompt)} tokens exceeds the context "
                    f"of a sequence ({self.n_ctx}); lower max_tokens or set context_shift", field="max_tokens")
        p.sampling.validate("sampling")
        if p.n_max is not None and not 1 <= p.n_max <= MAX_DRAFT:
            raise InvalidArgument(f"speculative.n_max must be in [1, {MAX_DRAFT}], got {p.n_max}", field="speculative.n_max")
        n_max = self.n_max(p)
        if p.n_min is not None and not 0 <= p.n_min <= n_max:
            raise InvalidArgument(f"speculative.n_min must be in [0, n_max = {n_max}], got {p.n_min}", field="speculative.n_min")
        if p.p_min is not None and not 0.0 <= p.p_min <= 1.0:
            raise InvalidArgument(f"speculative.p_min must be in [0, 1], got {p.p_min}", field="speculative.p_min")
        if p.n_keep < 0 or p.n_keep >= self.n_ctx // 2:
            raise InvalidArgument(f"n_keep must be in [0, {self.n_ctx // 2}), got {p.n_keep}", field="n_keep")

    def _can_shift(self, p: GenParams) -> bool:
        return p.context_shift and not self.checkpoint_mode and self.target_info.can_shift and (
            self.draft_info is None or self.draft_info.can_shift
        )

    def adaptive(self, p: GenParams) -> bool:
        return p.adaptive if p.adaptive is not None else self.settings.adaptive

    def n_max(self, p: GenParams) -> int:
        return p.n_max if p.n_max is not None else self.settings.n_max

    # -------------------------------------------------------------- generate
    async def generate(self, p: GenParams, result: Result) -> AsyncIterator[Step]:
        """Yield the accepted tokens step by step; fill `result` as it goes.
        Closing the iterator early (cancel, stop string) frees the sequence."""
        s = await self._open(p, result)
        try:
            await self._prompt(s)
            hand = _HandOut(self.eog, result, p.max_tokens if p.max_tokens is not None else self._default_max_tokens(p))
            while True:
                s.stream = Streamed()
                task = asyncio.ensure_future(self._next_step(s, hand.room))
                sent, finish = 0, ""  # of this step's tokens, handed out ahead of its result
                try:
                    # what the target hands on as it goes on alone (Session.stream)
                    while not finish and await _more_streamed(s.stream, task, sent):
                        new = s.stream.tokens[sent:], s.stream.pieces[sent:]
                        sent += len(new[0])
                        out, finish = hand.take(*new)
                        if out:
                            yield out
                    ver = await task
                finally:
                    if not task.done():  # cancelled (client gone, deadline) or closed midway
                        s.step_cut = True
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                if ver is None:  # no position left for id_last, and the context cannot shift
                    result.reason = "length"
                    break
                if not finish:
                    out, finish = hand.take(ver.tokens[sent:], ver.pieces[sent:])
                    if out:
                        yield out
                if finish:
                    result.reason = finish
                    break
        finally:
            # A cancel (client gone, deadline) may land while the release
            # awaits the workers; cut short, it would leave the sequence out
            # of the pool and its KV on the workers. It runs to the end on its
            # own task whatever happens to this one.
            release = asyncio.ensure_future(alignment.release(self, s))
            release.add_done_callback(_log_release_error)
            await asyncio.shield(release)

    async def _open(self, p: GenParams, result: Result) -> Session:
        """A session for a valid request, on a sequence id and a live target."""
        self.validate(p)
        await self.targets.wait_open()  # before queueing for a sequence: fail then if no target comes
        seq = await self.pool.acquire(p.prompt)
        s = Session(seq, p, result)
        try:
            tgt = self.targets.pick(seq)
        except Unavailable:
            self.pool.release(seq)
            raise
        s.place_on(tgt)
        s.wants_draft = self.draft.client is not None and p.speculative is not False
        s.use_draft = s.wants_draft and self.draft_up
        result.speculative = s.with_draft = s.use_draft
        s.d_epoch = self.draft.epoch
        s.acc = self.controller.new_session()
        return s

    async def _prompt(self, s: Session) -> None:
        """Reuse what the prompt cache kept, prefill the rest."""
        t0 = time.perf_counter()
        await self._reuse(s)
        try:
            await self._prefill(s, s.use_draft and self._draft_could_pay(s))
        except SpecdError as exc:
            if not self.targets.lost(s, exc):
                raise
            await self._failover(s, exc)
        s.res.prompt_seconds = time.perf_counter() - t0

    async def _next_step(self, s: Session, room: int):
        """The next step's verification (step.run), after what must come
        first (the draft rejoining, a context shift); None when the context
        is full and cannot shift. A target lost on the way: fail over and
        step again."""
        while True:
            n_before = None
            try:
                if s.t_epoch != s.tgt.epoch:
                    raise WorkerRestarted(f"{s.tgt.name} was attached again: seq {s.seq} is gone from it")
                await self.draft.rejoin(s)
                if len(s.ctx) > self.n_ctx:  # no position left for id_last
                    if not self._can_shift(s.p):
                        return None
                    await alignment.context_shift(self, s)
                n_before = len(s.ctx)
                return await step.run(self, s, room)
            except SpecdError as exc:
                if not self.targets.lost(s, exc):
                    raise  # a deadline, a refusal: this session fails alone
                streamed = s.stream.tokens if n_before is not None else []
                if n_before is not None:
                    # the failed step's tokens were not handed out, but for
                    # those the target handed on as it went: history now; a
                    # draft that failed in the same step stays off (DraftLink.failed)
                    del s.ctx[n_before:]
                    s.ctx += streamed
                await self._failover(s, exc)
                if streamed:  # the step ends with them; the next goes on after them
                    s.res.n_steps += 1
                    return VerifyResult(list(streamed), list(s.stream.pieces), None)

    async def _failover(self, s: Session, exc: SpecdError) -> None:
        await self.targets.failover(s, exc)
        await self.draft.cut_back(s)

    def _default_max_tokens(self, p: GenParams) -> int:
        if self._can_shift(p):
            return self.n_ctx
        return self.n_ctx - len(p.prompt)

    # ---------------------------------------------------------------- prompt
    async def _reuse(self, s: Session) -> None:
        """Prompt cache: keep what the sequence holds of this prompt's prefix
        from its last session (as llama-server's cache_prompt), remove the
        rest on both workers; the prompt's last token is always decoded anew."""
        cached, cached_d = self.pool.take_cache(s.seq)
        if not cached and not cached_d:
            return
        n = common_prefix(cached, s.ctx[:-1]) if self.settings.prompt_cache and not self.checkpoint_mode else 0
        swa = self.target_info.n_swa or (self.draft_info.n_swa if self.draft_info else 0)
        if swa and len(cached) - n > SWA_MAX_RM:
            n = 0  # a sliding-window cache may no longer hold what the positions before n need
        if len(cached) > n:
            s.pending_t.append(await (s.target.seq_rm(s.seq, n, -1) if n else s.target.clear(s.seq)).issue())
        s.n_t = n
        s.res.n_cached = n
        n_d = min(cached_d, n) if s.use_draft else 0
        if cached_d > n_d:
            draft = self.draft.client
            fut = await (draft.seq_rm(s.seq, n_d, -1) if n_d else draft.clear(s.seq)).issue()
            if s.use_draft:
                s.pending_d.append(fut)
            else:
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # the draft may be down
        s.n_d = n_d

    def _draft_could_pay(self, s: Session) -> bool:
        """Whether to prefill the draft: with adaptive speculation, not when
        drafting could not pay at the current load even if every draft were
        accepted (the draft catches up in its first Propose if that changes)."""
        p = s.p
        if not self.adaptive(p):
            return True
        n_target, n_all = step.session_load(self, s)
        return self.controller.choose(None, self.n_max(p), n_target, step.open_hidden(self, self.checkpoint_mode),
                                      self.settings.overlap, n_all) > 0

    async def _prefill(self, s: Session, draft_too: bool = True) -> None:
        """Decode the prompt but its last token on the target and (draft_too)
        the draft at once (what the prompt cache did not keep)."""
        n = len(s.ctx) - 1
        log.debug("prefill seq=%d tokens=%d draft=%s sessions=%d", s.seq, n - s.n_t,
                  "no" if not s.use_draft else ("yes" if draft_too else "later"), self.targets.n_sessions)
        pend_t, pend_d = s.pending_t, s.pending_d
        s.pending_t, s.pending_d = [], []
        if s.use_draft and draft_too and s.n_d < n:
            # beside the target's prefill, unless the prompt cache kept all of it there
            busy = math.inf if s.n_t < n or self.targets.busy else 0.0
            fut = await self.draft.client.decode(s.seq, s.n_d, s.ctx[s.n_d : n], draft_busy=busy).issue()
            if self.adaptive(s.p) and self.targets.n_sessions > 1:
                # under load generation starts without waiting: steps do not draft until it is done
                s.draft_prefill = fut
                s.pending_d.append(fut)
            else:
                pend_d.append(fut)
        if s.n_t < n:
            pend_t.append(await s.target.decode(s.seq, s.n_t, s.ctx[s.n_t : n], draft_busy=self.draft.busy_for()).issue())
        results = await asyncio.gather(*pend_t, *pend_d, return_exceptions=True)
        for r in results[: len(pend_t)]:
            if isinstance(r, BaseException):
                raise r
        s.n_t = n
        if s.use_draft:
            for r in results[len(pend_t) :]:
                if isinstance(r, BaseException):
                    self.draft.failed(s, r)
                    return
            if draft_too:
                s.n_d = n


def _log_release_error(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("releasing a sequence failed", exc_info=task.exception())


class _HandOut:
    """A request's tokens on their way to the caller: cut after an
    end-of-generation token or at max_tokens, counted and timed."""

    def __init__(self, eog: frozenset[int], result: Result, limit: int):
        self.eog, self.result, self.limit = eog, result, limit
        self.t0 = time.perf_counter()

    @property
    def room(self) -> int:
        return self.limit - self.result.n_generated

    def take(self, tokens: list[int], pieces: list[bytes]) -> tuple[Step | None, str]:
        """The Step to yield (None: nothing to show) and the finish reason, if these tokens end the request."""
        out, pieces, finish = self._cut(tokens, pieces, self.room)
        self.result.n_generated += len(out)
        self.result.generation_seconds = time.perf_counter() - self.t0
        if finish == "eog":  # counted as generated, not shown
            out, pieces = out[:-1], pieces[:-1]
        return (Step(out, pieces) if out else None), finish

    def _cut(self, out: list[int], pieces: list[bytes], room: int) -> tuple[list[int], list[bytes], str]:
        """Cut tokens after an end-of-generation token or at max_tokens."""
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


async def _more_streamed(stream: Streamed, task: asyncio.Future, sent: int) -> bool:
    """Wait for tokens of the step under way beyond `sent` (True) or for
    the step's end (False: its result has them all)."""
    while len(stream.tokens) <= sent:
        if task.done():
            return False
        stream.ready.clear()
        wake = asyncio.ensure_future(stream.ready.wait())
        try:
            await asyncio.wait((task, wake), return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
    return not task.done()
