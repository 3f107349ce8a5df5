"""Both workers' KV against the router's history, outside the step: check it
(settings.check_alignment) and re-sync a draft found out of step, shift the
context when it is full, and free the sequence at the end (kept for the
prompt cache after a clean finish)."""
from __future__ import annotations

import asyncio
import logging
import math

from specd.engine import SeqState
from specd.errors import FailedPrecondition, Internal, SpecdError
from specd.router.session import Session
from specd.tokens import history_hash

log = logging.getLogger("specd.router")


class Divergence(Internal):
    pass


# `r` below is the engine.Router the session runs on.

async def check(r, s: Session) -> None:
    futs = [await s.target.state(s.seq).issue()]
    if s.use_draft:
        futs.append(await r.draft.client.state(s.seq).issue())
    states = await asyncio.gather(*futs, return_exceptions=True)
    if isinstance(states[0], BaseException):
        raise states[0]
    problem = mismatch(states[0], s.ctx, s.n_t)
    if problem:
        diverged(r, s, "target")
        raise Divergence(f"target worker diverged from the router's history: {problem}")
    if s.use_draft:
        if isinstance(states[1], BaseException):
            r.draft.failed(s, states[1])
            return
        if s.ahead:
            problem = mismatch(states[1], s.ctx + s.ahead, s.ahead_held)
        else:
            problem = mismatch(states[1], s.ctx, s.n_d)
        if problem:
            diverged(r, s, "draft")
            log.error("draft worker diverged (seq %d): %s; re-syncing it from history", s.seq, problem)
            try:
                await resync_draft(r, s)
            except SpecdError as exc:
                r.draft.failed(s, exc)


def diverged(r, s: Session, worker: str) -> None:
    s.res.n_divergences += 1
    for obs in r.divergence_observers:
        obs(worker)


async def resync_draft(r, s: Session) -> None:
    draft = r.draft.client
    await draft.clear(s.seq).result()
    s.n_d, s.ahead = 0, []
    if len(s.ctx) > 1:
        await draft.decode(s.seq, 0, s.ctx[:-1], draft_busy=math.inf if r.targets.busy else 0.0).result()
        s.n_d = len(s.ctx) - 1


def mismatch(state: SeqState, ctx: list[int], n: int) -> str:
    want_min, want_max = (0, n - 1) if n else (-1, -1)
    if (state.pos_min, state.pos_max, state.n_tokens) != (want_min, want_max, n):
        return (f"holds positions [{state.pos_min}, {state.pos_max}] ({state.n_tokens} tokens), "
                f"the router expects [{want_min}, {want_max}] ({n} tokens)")
    if state.token_hash != history_hash(ctx[:n]):
        return f"holds other tokens at positions [0, {n})"
    return ""


# --------------------------------------------------------------- context shift
async def context_shift(r, s: Session) -> None:
    n_keep = max(s.p.n_keep, 0)
    n_past = len(s.ctx) - 1
    n_discard = (n_past - n_keep) // 2
    if n_discard <= 0:
        raise FailedPrecondition("context shift cannot free any position")
    if s.use_draft and s.ahead:  # lookahead drafts do not survive a shift
        s.pending_d.append(await r.draft.client.seq_rm(s.seq, s.n_d, -1).issue())
        s.ahead = []
    workers = [(s.target, "n_t", s.pending_t)]
    if s.use_draft:
        workers.append((r.draft.client, "n_d", s.pending_d))
    for w, attr, pending in workers:
        held = getattr(s, attr)
        if held > n_keep + n_discard:
            pending.append(await w.seq_rm(s.seq, n_keep, n_keep + n_discard).issue())
            pending.append(await w.seq_add(s.seq, n_keep + n_discard, -1, -n_discard).issue())
            setattr(s, attr, held - n_discard)
        elif held > n_keep:
            pending.append(await w.seq_rm(s.seq, n_keep, -1).issue())
            setattr(s, attr, n_keep)
    del s.ctx[n_keep : n_keep + n_discard]
    s.res.n_shifts += 1
    await r.draft.settle(s)


# --------------------------------------------------------------------- release
async def release(r, s: Session) -> None:
    """Free the sequence. After a clean finish both workers keep what
    they hold of the history for the prompt cache (the draft trimmed to a
    prefix of the target's); after a cancel or an error both are cleared."""
    for fut in s.pending_t + s.pending_d:
        if fut.done() and not fut.cancelled():
            fut.exception()  # retrieved: errors here no longer matter
    draft = r.draft.client
    keep = bool(s.res.reason) and r.settings.prompt_cache and not r.checkpoint_mode and not s.step_cut
    n_d = min(s.n_d, s.n_t) if s.use_draft else 0
    if keep:
        futs = [*s.pending_t, *s.pending_d]
        if s.use_draft:
            futs.append(await draft.seq_rm(s.seq, n_d, -1).issue())
        elif s.with_draft:
            futs.append(await draft.clear(s.seq).issue())
    else:
        futs = [await s.target.clear(s.seq).issue()]
        if s.with_draft:
            futs.append(await draft.clear(s.seq).issue())
    try:
        results = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), timeout=10)
        ok = not any(isinstance(x, BaseException) for x in results)
    except Exception:  # the workers may be gone; the sequence is freed all the same
        log.warning("could not clear seq %d on the workers", s.seq)
        ok = False
    s.tgt.n_active -= 1
    if keep and ok:
        r.pool.cached[s.seq] = s.ctx[: s.n_t]
        r.pool.cached_d[s.seq] = n_d
        r.pool.cached_on[s.seq] = s.tgt
    elif keep:  # unknown state: start the next session from empty sequences
        for w in [s.target] + ([draft] if s.with_draft else []):
            fut = await w.clear(s.seq).issue()
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    r.pool.release(s.seq)
