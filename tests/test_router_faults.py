"""The router's bookkeeping at the moments a fault or a short lookahead
leaves the draft ahead of the history, made to happen on purpose: the
transport fails a chosen verification, or the draft's continuations stop
early, around real llama.cpp engines in process. Output must stay the
target's and the session must keep drafting (each path once sent the draft
a Propose it refused, and the session silently lost its speculation)."""
from __future__ import annotations

import asyncio
import logging

import pytest

from specd.draft_worker.engine import DraftModelEngine
from specd.router.clients import LocalWorker
from specd.router.engine import Router
from specd.router.params import GenParams, Result, RouterSettings
from specd.errors import Unavailable
from specd.llama import LlamaConfig
from specd.target_worker.engine import TargetEngine
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def engines(models):
    cfg = dict(n_ctx_seq=512, n_seq=1, n_threads=1)
    t1 = TargetEngine(LlamaConfig(models["target"], **cfg))
    t2 = TargetEngine(LlamaConfig(models["target"], **cfg))
    d = DraftModelEngine(LlamaConfig(models["draft"], **cfg))
    yield t1, t2, d
    for e in (t1, t2, d):
        e.model.close()


class DyingTarget(LocalWorker):
    """A target whose `fail_at`-th verification finds the worker gone: the
    call fails UNAVAILABLE and its KV is lost."""

    def __init__(self, engine, name: str, fail_at: int):
        super().__init__(engine, name)
        self.fail_at, self.verifies = fail_at, 0

    async def _send(self, name: str, **f):
        if name == "verify":
            self.verifies += 1
            if self.verifies == self.fail_at:
                self.engine.clear(-1)
                fut = asyncio.get_running_loop().create_future()
                fut.set_exception(Unavailable(f"{self.name} died"))
                return fut
        return await super()._send(name, **f)


class ShortContinuations(LocalWorker):
    """A draft whose continuations (the drafts made beside a verification,
    asked with n_min 0) stop after two tokens, as a draft does where its
    confidence drops below p_min."""

    async def _send(self, name: str, **f):
        if name == "propose" and f["n_min"] == 0:
            f["n_max"] = min(f["n_max"], 2)
        return await super()._send(name, **f)


async def _run(router: Router, params: GenParams) -> tuple[list[int], Result]:
    await router.start()
    res, toks = Result(), []
    async for step in router.generate(params, res):
        toks += step.tokens
    return toks, res


def _alone(engines, prompt: list[int], n: int) -> list[int]:
    router = Router(LocalWorker(engines[1], "alone"), None, RouterSettings())
    return asyncio.run(_run(router, GenParams(prompt=prompt, max_tokens=n, speculative=False)))[0]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("fail_at", [3, 7])
def test_a_session_keeps_drafting_after_its_target_fails_mid_step(engines, overlap, fail_at, caplog):
    prompt = engines[0].tokenize(PROMPTS[3], True, True)
    alone = _alone(engines, prompt, 64)
    for e in engines:
        e.clear(-1)
    targets = [DyingTarget(engines[0], "t1", fail_at), LocalWorker(engines[1], "t2")]
    router = Router(targets, LocalWorker(engines[2], "draft"),
                    RouterSettings(check_alignment=True, overlap=overlap, adaptive=False, n_max=4))
    with caplog.at_level(logging.WARNING, logger="specd.router"):
        toks, res = asyncio.run(_run(router, GenParams(prompt=prompt, max_tokens=64)))
    assert toks == alone
    assert res.n_failovers == 1
    assert "draft worker failed" not in caplog.text
    assert res.n_drafted >= 3 * (res.n_steps - 2), (res.n_drafted, res.n_steps)


class DyingWhileGoingOn(LocalWorker):
    """A target that dies at the end of its first verification that hands
    its tokens on as it goes (VerifyRequest.stream_every): the tokens it
    handed on reached the router, its answer never does, its KV is lost."""

    def __init__(self, engine, name: str):
        super().__init__(engine, name)
        self.handed_on = 0

    async def _send(self, name: str, **f):
        if name != "verify" or not f.get("stream_every") or self.handed_on:
            return await super()._send(name, **f)
        on_partial = f["on_partial"]

        def count(p):
            self.handed_on += len(p.tokens)
            on_partial(p)
        await (await super()._send(name, **{**f, "on_partial": count}))
        self.engine.clear(-1)
        fut = asyncio.get_running_loop().create_future()
        fut.set_exception(Unavailable(f"{self.name} died"))
        return fut


def test_tokens_handed_on_before_a_target_died_stay_the_answers_and_it_goes_on_after_them(engines):
    """The client may already hold tokens of the step that failed: they are
    history then, and the other target goes on after them, so the answer is
    the target's alone, with nothing said twice or left out."""
    prompt = engines[0].tokenize(PROMPTS[3], True, True)
    alone = _alone(engines, prompt, 40)
    for e in engines:
        e.clear(-1)
    dying = DyingWhileGoingOn(engines[0], "t1")
    router = Router([dying, LocalWorker(engines[1], "t2")], None,
                    RouterSettings(check_alignment=True, solo_tokens=12, stream_tokens=4))
    toks, res = asyncio.run(_run(router, GenParams(prompt=prompt, max_tokens=40, speculative=False)))
    assert dying.handed_on >= 8  # two groups of the 12 reached the router before the answer was lost
    assert toks == alone
    assert res.n_failovers == 1 and res.n_generated == 40


def test_a_lookahead_shorter_than_n_min_is_dropped_and_drafting_goes_on(engines, caplog):
    prompt = engines[0].tokenize(PROMPTS[0], True, True)
    alone = _alone(engines, prompt, 48)
    for e in engines:
        e.clear(-1)
    router = Router(LocalWorker(engines[0], "target"), ShortContinuations(engines[2], "draft"),
                    RouterSettings(check_alignment=True, overlap=True, adaptive=False, n_max=4))
    with caplog.at_level(logging.WARNING, logger="specd.router"):
        toks, res = asyncio.run(_run(router, GenParams(prompt=prompt, max_tokens=48, n_min=2)))
    assert toks == alone
    assert "draft worker failed" not in caplog.text
    assert res.n_drafted >= 2 * (res.n_steps - 2), (res.n_drafted, res.n_steps)


def test_the_context_is_the_smallest_of_every_worker_the_draft_included(engines, models):
    small = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=256, n_seq=1, n_threads=1))
    try:
        router = Router([LocalWorker(engines[0], "t512"), LocalWorker(small, "t256")],
                        LocalWorker(engines[2], "draft"), RouterSettings())
        asyncio.run(router.start())
        assert router.n_ctx == 256  # the draft's attach once reset it from the first target alone
    finally:
        small.model.close()


def test_a_pool_shrunk_under_running_sessions_never_hands_out_the_ids_it_lost():
    from specd.router.pool import SeqPool

    async def main():
        pool = SeqPool(4, max_queue=4)
        held = [await pool.acquire() for _ in range(3)]
        assert sorted(held) == [0, 1, 2] and pool.n_running == 3
        pool.shrink(2)  # a worker with 2 sequences attached
        waiter = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0)
        pool.release(2)  # not handed to the waiter: the worker has no id 2
        await asyncio.sleep(0)
        assert not waiter.done() and pool.n_running == 2
        pool.release(1)
        assert await waiter == 1
        pool.release(0)
        pool.release(1)
        assert sorted(pool.free) == [0, 1] and pool.n_running == 0

    asyncio.run(main())


class ReattachingDraft(LocalWorker):
    """Its `at`-th proposal makes the router attach the draft again, as its
    watcher does once a draft that stopped answering is back: the attach
    clears every sequence while this session is drafting."""

    def __init__(self, engine, name: str, at: int):
        super().__init__(engine, name)
        self.at, self.proposals, self.router = at, 0, None

    async def _send(self, name: str, **f):
        if name == "propose":
            self.proposals += 1
            if self.proposals == self.at:
                await self.router._attach_draft()
        return await super()._send(name, **f)


def test_a_draft_attached_again_under_a_drafting_session_is_caught_up_not_lost(engines, caplog):
    prompt = engines[0].tokenize(PROMPTS[0], True, True)
    alone = _alone(engines, prompt, 48)
    for e in engines:
        e.clear(-1)
    draft = ReattachingDraft(engines[2], "draft", at=5)
    router = Router(LocalWorker(engines[0], "target"), draft,
                    RouterSettings(check_alignment=True, overlap=False, adaptive=False, n_max=4))
    draft.router = router
    with caplog.at_level(logging.WARNING, logger="specd.router"):
        toks, res = asyncio.run(_run(router, GenParams(prompt=prompt, max_tokens=48)))
    assert toks == alone
    assert draft.proposals > 5 and res.n_divergences == 0
    assert "draft worker failed" not in caplog.text and "diverged" not in caplog.text
    # the proposal the attach cleared away is lost; every other step drafts
    assert res.n_drafted >= 3 * (res.n_steps - 3), (res.n_drafted, res.n_steps)
