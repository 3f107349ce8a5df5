"""One speculative step of a session:

    plan -> draft -> verify -> reconcile -> account

plan: how many drafts to ask for (adaptive speculation weighs acceptance and
load); draft: take the drafts the draft made beside the last verification
(overlap) or propose anew, and let the draft go on past the drafts while the
target verifies them; verify on the target; reconcile: roll both workers
back to the accepted length (checkpoints where partial removal does not
work); account: extend the history, count, time and log the step.

The draft is never made to re-evaluate what it holds (llama.cpp's
TAG_SPEC_AVOID_DRAFT_REEVAL): after a step it keeps id_last and the accepted
drafts, and only the missing tail is sent with the next Propose.
`r` below is the engine.Router the session runs on.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from specd.errors import SpecdError
from specd.router import alignment
from specd.router.params import StepStats
from specd.router.session import Session

log = logging.getLogger("specd.router")


class SessionLoad(NamedTuple):
    """Sessions as adaptive speculation sees them: their recent peaks (RecentPeak)."""

    n_target: int  # on this session's target
    n_all: int  # on every target: the draft's load


class StepLoad(NamedTuple):
    """What Controller.choose / predict weigh besides acceptance and k, in their order."""

    n_sessions: int  # sessions on the session's target (recent peak)
    hidden: float | None  # share of drafting hidden behind verification; None: steady_hidden
    overlap: bool
    n_drafting: int  # all sessions (recent peak)
    lag: int  # tokens the draft must catch up on before drafting
    remaining: int  # tokens the request may still generate
    pending: int  # other sessions' drafts waiting for this target (a model-free drafter's)


@dataclass
class Plan:
    t0: float  # when the step started
    n: int  # len(ctx) at the start: id_last sits at position n - 1
    k: int  # drafts to ask for; 0: the target alone
    n_min: int
    p_min: float
    ckpt: bool  # checkpoint mode
    load: StepLoad
    hidden_now: float  # this step's drafts are hidden only if overlap already made them


@dataclass
class Drafts:
    tokens: list[int] = field(default_factory=list)
    q: list = field(default_factory=list)  # their distributions, when the draft sampled them
    # what the draft holds: over ctx + s.ahead, then ctx + tokens (+ the continuation's)
    held: int = 0
    checkpoint: int | None = None  # the draft's checkpoint handle (checkpoint mode)
    from_ahead: bool = False  # made beside the last verification (overlap)
    seconds: float = 0.0  # wall time of the Propose call, transport included
    compute: float = 0.0  # of which the draft worker computed


class Solo(NamedTuple):
    """How far the target may go on alone after its next token (VerifyRequest)."""

    n_more: int
    stop_on_repeat: int = 0  # until a repeat of this many tokens (an n-gram drafter's match); 0: no such stop
    stream_every: int = 0  # hand the tokens on in groups this large meanwhile (Session.stream); 0: at the end


@dataclass
class Verdict:
    ver: object  # the target's answer: accepted drafts + its own token, their pieces, compute, batch
    checkpoint: asyncio.Future | None  # the target's checkpoint (checkpoint mode)
    seconds: float  # wall time of the Verify call, transport included
    draft_busy: bool

    @property
    def accepted(self) -> int:
        return len(self.ver.tokens) - 1 - self.ver.n_more


def open_hidden(r, ckpt: bool) -> float | None:
    """The hidden share of a step without drafts made ahead: with overlap,
    the share a session drafting k sees (None: adaptive.steady_hidden);
    without (or in checkpoint mode, which has no continuation) none."""
    return None if r.settings.overlap and not ckpt else 0.0


def session_load(r, s: Session) -> SessionLoad:
    now = time.monotonic()
    return SessionLoad(s.tgt.peak.load(s.tgt.n_active, now), r.peak.load(r.targets.n_sessions, now))


async def run(r, s: Session, remaining: int):
    """One step; returns the target's verification (`tokens`: the accepted
    drafts and the target's own next token; `pieces`)."""
    plan = _plan(r, s, remaining)
    if s.n_t < plan.n - 1:  # target lags (after a shift or a repair): decode the gap first
        s.pending_t.append(await s.target.decode(s.seq, s.n_t, s.ctx[s.n_t : plan.n - 1]).issue())
        s.n_t = plan.n - 1
    drafts = await _draft(r, s, plan)
    tgt, pending = s.tgt, len(drafts.tokens) if r.controller.model_free else 0
    tgt.pending_drafts += pending  # sessions choosing now price their drafts beside these
    try:
        cont = await _continuation(r, s, plan, drafts, remaining)
        verdict = await _verify(r, s, plan, drafts, cont, remaining)
    finally:
        tgt.pending_drafts -= pending
    keep = plan.n + len(verdict.ver.tokens) - 1  # positions of the context after this step that are decoded
    await _reconcile_target(s, plan, drafts, verdict, keep)
    c_cont = await _take_continuation(r, s, plan, drafts, verdict, cont)
    await _roll_back_draft(r, s, drafts, keep)
    _count(r, s, drafts, verdict)
    await r.draft.settle(s, wait=r.settings.check_alignment)
    if r.settings.check_alignment:
        await alignment.check(r, s)
    _account(r, s, plan, drafts, verdict, c_cont)
    return verdict.ver


# ------------------------------------------------------------------ plan
def _plan(r, s: Session, remaining: int) -> Plan:
    t0 = time.perf_counter()
    p, n = s.p, len(s.ctx)
    n_min = p.n_min if p.n_min is not None else r.settings.n_min
    p_min = p.p_min if p.p_min is not None else r.settings.p_min
    k = min(r.n_max(p), r.n_ctx - n, remaining - 1) if s.use_draft else 0
    n_target, n_all = session_load(r, s)
    # drafts the draft made beside the last verification cost this step
    # nothing: priced at the share overlap hides on average, taking 3 of
    # 4 made could look better than taking all 4, which runs faster.
    # Otherwise the share a session drafting k sees (adaptive.steady_hidden)
    ckpt = r.checkpoint_mode
    hidden = 1.0 if s.ahead else open_hidden(r, ckpt)
    load = StepLoad(n_target, hidden, r.settings.overlap, n_all, 0 if s.ahead else n - 1 - s.n_d, remaining,
                    s.tgt.pending_drafts)
    if k > 0 and r.adaptive(p):
        if s.draft_prefill is not None and not s.draft_prefill.done():
            k = 0  # the draft still decodes the prompt: the target goes on alone
        else:
            k = r.controller.choose(s.acc, k, *load)
    return Plan(t0, n, k, n_min, p_min, ckpt, load, 1.0 if s.ahead else 0.0)


# ----------------------------------------------------------------- draft
async def _draft(r, s: Session, plan: Plan) -> Drafts:
    drafts = Drafts(held=s.ahead_held if s.ahead else s.n_d)  # over ctx + s.ahead
    if s.ahead and min(plan.k, len(s.ahead)) >= max(1, plan.n_min):
        await _take_ahead(r, s, plan, drafts)
    elif plan.k >= max(1, plan.n_min):
        await _propose(r, s, plan, drafts)
    s.ahead = []
    return drafts


async def _take_ahead(r, s: Session, plan: Plan, d: Drafts) -> None:
    """Drafted during the last verification, for exactly this context."""
    d.tokens, d.q, d.held = s.ahead[: plan.k], s.ahead_q[: plan.k], s.ahead_held
    if len(d.tokens) < len(s.ahead):
        # the draft also holds the drafts not used: drop them, so it
        # can go on after the last one used while the target verifies
        # (else the next step drafts in the open)
        d.held = plan.n + len(d.tokens) - 1
        try:
            s.pending_d.append(await r.draft.client.seq_rm(s.seq, d.held, -1).issue())
        except SpecdError as exc:
            r.draft.failed(s, exc)  # the drafts stand: the target verifies them
    s.ahead = []
    s.res.n_ahead_used += 1
    d.from_ahead = True


async def _propose(r, s: Session, plan: Plan, d: Drafts) -> None:
    draft = r.draft.client
    if s.ahead:
        # fewer drafts made beside the last verification than n_min:
        # the draft drops them and drafts anew from id_last
        s.n_d = min(s.n_d, plan.n - 1)
        s.pending_d.append(await draft.seq_rm(s.seq, s.n_d, -1).issue())
    ck = None
    try:
        if plan.ckpt:
            ck = await draft.checkpoint_save(s.seq).issue()
        busy = r.targets.busy
        prop = await draft.propose(s.seq, s.n_d, s.ctx[s.n_d :], plan.k, plan.n_min, plan.p_min,
                                   s.p.draft_sampling, s.res.n_generated, target_busy=busy).result()
        d.tokens, d.q = prop.tokens, prop.q
        d.compute = prop.compute_seconds
        if busy:  # the draft's curve is of its base threads (DraftLink.attach); alone it may have run on more
            r.controller.draft.observe(prop.batch_tokens, prop.batch_seconds)
        d.held = prop.state.pos_max + 1
        if ck is not None:
            d.checkpoint = (await ck).handle
    except SpecdError as exc:
        r.draft.failed(s, exc)
        d.tokens, d.checkpoint = [], None
    d.seconds = time.perf_counter() - plan.t0


async def _continuation(r, s: Session, plan: Plan, drafts: Drafts, remaining: int) -> asyncio.Future | None:
    """Overlap: while the target verifies, let the draft continue after the
    last draft as if all were accepted; its first token guesses the
    target's own next token. Only proposals: the target verifies them."""
    n, tokens = plan.n, drafts.tokens
    next_k = min(max(plan.k, 1), r.n_ctx - (n + len(tokens) + 1), remaining - len(tokens) - 2)
    if (r.settings.overlap and s.use_draft and tokens and not plan.ckpt and next_k >= 1
            and drafts.held == n + len(tokens) - 1):
        # its first token guesses the one after the drafts: sample index n_generated + len(drafts)
        # beside the verification sent next: on the draft's base threads
        return await r.draft.client.propose(s.seq, drafts.held, tokens[-1:], next_k + 1, 0, plan.p_min,
                                            s.p.draft_sampling, s.res.n_generated + len(tokens),
                                            target_busy=True).issue()
    return None


# ---------------------------------------------------------------- verify
def solo_tokens(r, plan: Plan, n_drafts: int, remaining: int, match_needs_repeat: int = 0,
                stop_strings: bool = False) -> Solo:
    """Tokens the target may generate on its own after its next one: in a
    step without drafts, up to solo_tokens in all (stream_tokens with
    `stop_strings`), within max_tokens and the context (each but the last
    is decoded), handed on every stream_tokens. A drafter that was asked
    and had nothing (an n-gram drafter without a match) may have some after
    any next token: the target goes on only while none can come, which it
    tells when the drafter's matches need a repeat of the last
    `match_needs_repeat` tokens; otherwise that step stays one token long."""
    if n_drafts or (plan.k and not match_needs_repeat):
        return Solo(0)
    group = r.settings.stream_tokens
    per_call = min(group, r.settings.solo_tokens) if stop_strings else r.settings.solo_tokens
    n_more = max(0, min(per_call - 1, remaining - 1, r.n_ctx - plan.n))
    return Solo(n_more, match_needs_repeat if plan.k and n_more else 0, group if n_more + 1 > group else 0)


async def _verify(r, s: Session, plan: Plan, drafts: Drafts, cont: asyncio.Future | None, remaining: int) -> Verdict:
    p, tokens, q = s.p, drafts.tokens, drafts.q
    solo = solo_tokens(r, plan, len(tokens), remaining, r.draft.match_needs_repeat if s.use_draft else 0,
                       p.stop_strings)
    t1 = time.perf_counter()
    ck_t = (await s.target.checkpoint_save(s.seq).issue()) if plan.ckpt and tokens else None
    draft_busy = r.draft.busy_for()
    try:
        # without a distribution for every draft (n-gram, exact acceptance), exact match
        ver = await s.target.verify(s.seq, plan.n - 1, [s.ctx[-1]] + tokens, p.sampling, s.res.n_generated,
                                    not plan.ckpt, draft_busy=draft_busy,
                                    draft_q=q if p.rejection and len(q) == len(tokens) else (),
                                    n_more=solo.n_more, stop_on_repeat=solo.stop_on_repeat,
                                    stream_every=solo.stream_every,
                                    on_partial=s.stream.take if solo.stream_every else None).result()
    except BaseException:
        if cont is not None:  # its result no longer matters; the failover trims the draft
            cont.add_done_callback(_consume)
        raise
    seconds = time.perf_counter() - t1
    r.controller.observe_target(ver.batch_tokens, ver.batch_seconds, draft_busy > 0)
    return Verdict(ver, ck_t, seconds, draft_busy > 0)


# ------------------------------------------------------------- reconcile
async def _reconcile_target(s: Session, plan: Plan, drafts: Drafts, verdict: Verdict, keep: int) -> None:
    if verdict.checkpoint is not None:
        handle = (await verdict.checkpoint).handle
        a = verdict.accepted
        if a < len(drafts.tokens):
            s.pending_t.append(await s.target.checkpoint_restore(handle, drop=True).issue())
            s.pending_t.append(await s.target.decode(s.seq, plan.n - 1, [s.ctx[-1]] + drafts.tokens[:a]).issue())
        else:
            s.pending_t.append(await s.target.checkpoint_drop(handle).issue())
    s.n_t = keep


async def _take_continuation(r, s: Session, plan: Plan, drafts: Drafts, verdict: Verdict,
                             cont: asyncio.Future | None) -> float:
    """The continuation's result: a lookahead for the next step when the
    target took every draft and its own token is the continuation's first.
    Returns the draft's compute seconds for it."""
    if cont is None:
        return 0.0
    try:
        c = await cont
    except SpecdError as exc:
        r.draft.failed(s, exc)
        return 0.0
    r.controller.draft.observe(c.batch_tokens, c.batch_seconds)
    drafts.held = c.state.pos_max + 1  # over ctx + drafts + c.tokens
    out = verdict.ver.tokens
    if verdict.accepted == len(drafts.tokens) and c.tokens and c.tokens[0] == out[-1]:
        # guessed right: ctx + out + c.tokens[1:] is what the draft holds a prefix of
        s.ahead, s.ahead_q, s.ahead_held = c.tokens[1:], c.q[1:], drafts.held
        s.n_d = min(drafts.held, plan.n + len(out))
    return c.compute_seconds


async def _roll_back_draft(r, s: Session, drafts: Drafts, keep: int) -> None:
    if not (s.use_draft and not s.ahead and drafts.held > s.n_d):
        return
    draft = r.draft.client
    keep_d = min(drafts.held, keep)
    if drafts.checkpoint is not None:
        if drafts.held > keep_d:
            s.pending_d.append(await draft.checkpoint_restore(drafts.checkpoint, drop=True).issue())
        else:
            s.pending_d.append(await draft.checkpoint_drop(drafts.checkpoint).issue())
            s.n_d = keep_d
    else:
        if drafts.held > keep_d:
            s.pending_d.append(await draft.seq_rm(s.seq, keep_d, -1).issue())
        s.n_d = keep_d


# --------------------------------------------------------------- account
def _count(r, s: Session, drafts: Drafts, verdict: Verdict) -> None:
    out, a, n_drafts = verdict.ver.tokens, verdict.accepted, len(drafts.tokens)
    s.ctx.extend(out)
    r.controller.observe_step(s.acc, n_drafts, a)
    if n_drafts:
        s.res.n_drafted += n_drafts
        s.res.n_accepted += a
    s.res.n_steps += 1


def _account(r, s: Session, plan: Plan, drafts: Drafts, verdict: Verdict, c_cont: float) -> None:
    ver, res = verdict.ver, s.res
    critical = drafts.compute + max(ver.compute_seconds, c_cont)  # the continuation runs beside the verification
    stats = StepStats(len(drafts.tokens), verdict.accepted, drafts.seconds, verdict.seconds,
                      time.perf_counter() - plan.t0, drafts.compute + c_cont, ver.compute_seconds, critical)
    res.critical_compute_seconds += critical
    res.draft_compute_seconds += drafts.compute + c_cont
    res.verify_compute_seconds += ver.compute_seconds
    res.steps_seconds += stats.step_seconds
    # what the model says this very step should have taken, with the
    # target's batch as it was and a lagging draft's catch-up paid in full
    # at the load it really had (choices use the recent peak: RecentPeak)
    n_target, n_all = s.tgt.n_active, r.targets.n_sessions
    n_drafts = len(drafts.tokens)
    if r.controller.model_free:  # only a model-free drafter's choice reads it (Controller.choose)
        r.controller.shared(n_target).observe(n_target, ver.batch_tokens, n_drafts, verdict.accepted)
    predicted = r.controller.predict(s.acc, n_drafts or plan.k, n_target, plan.hidden_now, plan.load.overlap, n_all,
                                     plan.load.lag, verify_tokens=ver.batch_tokens)
    # a step that asked for drafts and got none (an n-gram drafter without
    # a match) is neither: counted as drafting, its cheap one-token steps
    # drowned what verifying 48 drafts beside 7 sessions really cost, and
    # eight sessions drafted at a loss. A step the target went on alone in
    # counts as that many plain steps sharing one round trip.
    if n_drafts or not plan.k:
        r.controller.observe_time(n_target, n_drafts > 0, predicted, stats.step_seconds / (1 + ver.n_more),
                                  ver.batch_tokens, verdict.draft_busy, ver.batch_seconds)
    for obs in r.step_observers:
        obs(stats)
    if log.isEnabledFor(logging.DEBUG):
        _log_step(r, s, plan, drafts, verdict, stats, predicted)


def _log_step(r, s: Session, plan: Plan, drafts: Drafts, verdict: Verdict, stats: StepStats,
              predicted: float) -> None:
    ver = verdict.ver
    slow = r.controller.slowdown(s.tgt.n_active)
    log.debug("step seq=%d mode=%s sessions=%d load=%d asked=%d k=%d accepted=%d more=%d ahead=%d step_ms=%.0f "
              "draft_ms=%.0f "
              "verify_ms=%.0f verify_batch=%d verify_batch_ms=%.0f predicted_ms=%.0f extra_ms=%.0f/%.0f", s.seq,
              "adaptive" if r.adaptive(s.p) and s.with_draft else ("fixed" if s.with_draft else "target"),
              s.tgt.n_active, plan.load.n_sessions, plan.k, len(drafts.tokens), verdict.accepted, ver.n_more,
              drafts.from_ahead,
              stats.step_seconds * 1e3, drafts.seconds * 1e3, verdict.seconds * 1e3, ver.batch_tokens,
              ver.batch_seconds * 1e3, predicted * 1e3, *(x * 1e3 for x in slow.extras(time.monotonic())))


def _consume(fut: asyncio.Future) -> None:
    """Retrieve a result nobody waits for (no 'never retrieved' warning)."""
    if not fut.cancelled():
        fut.exception()
