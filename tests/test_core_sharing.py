"""Sharing two cores between the workers: the target decodes on --threads
only while the draft is expected to compute (DecodeRequest.busy_seconds,
which the router's DraftLink estimates from the draft's cost curves), so a
short draft operation does not keep a long prompt batch off half the cores."""
from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

from specd.llama import LlamaConfig
from specd.router.adaptive import Controller
from specd.router.clients import _Ops
from specd.router.costs import CostCurve
from specd.router.draft import BUSY_MARGIN, DraftLink
from specd.scheduler import Window
from specd.target_worker.engine import TargetEngine
from specd.worker.v1 import worker_pb2 as pb
from specd.worker_service import Job, run_round


def test_a_target_gives_up_a_core_only_while_the_draft_is_expected_to_compute(models):
    """DecodeRequest.busy_seconds: a round of prompt decodes sent while the
    draft computes for a short while decodes on --threads only what fits in
    that while, then on every thread; without an estimate the whole round
    leaves the draft its core, and with the draft idle none of it does. The
    tokens decoded are the same either way."""
    engine = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=4, n_threads=1, n_threads_batch=2))
    calls = []
    engine.on_decode = lambda n, seconds, seqs, threads: calls.append((n, seqs, threads))
    try:
        engine.calibrate(max_tokens=32, repeats=1)
        n_pass, (n_top, t_top) = engine.pass_tokens, engine.decode_costs_shared[-1]
        per_token = t_top / n_top
        prompt = engine.tokenize("The capital of France is Paris, and the capital of Italy is Rome.", True, False)[:12]
        fits = max(n_pass, 12) + 1.5  # more than a pass and one prompt's worth, less than two prompts
        assert 2 * fits * per_token < 4 * len(prompt) * per_token, "the round must be worth splitting"
        rounds = {}
        for name, busy, seconds in (("idle", False, 0.0), ("short", True, fits * per_token), ("unknown", True, 0.0)):
            for seq in range(4):
                engine.clear(seq)
            calls.clear()
            ops = [pb.WorkerOp(decode=pb.DecodeRequest(seq_id=seq, pos=0, tokens=prompt, draft_busy=busy,
                                                       busy_seconds=seconds)) for seq in range(4)]
            results = run_round(engine, Window(batch=[Job(op) for op in ops]))
            assert [r.state.n_tokens for r in results] == [len(prompt)] * 4
            rounds[name] = list(calls)
    finally:
        engine.model.close()
    assert {threads for _, _, threads in rounds["idle"]} == {2}
    assert {threads for _, _, threads in rounds["unknown"]} == {1}
    first, *rest = rounds["short"]
    assert first == (len(prompt), 1, 1)  # one prompt while the draft computes
    assert rest and rest[-1][2] == 2 and sum(n for n, _, _ in rest) >= 3 * len(prompt)



class HeldOps(_Ops):
    """The router's operation methods over a send whose results come when the test sets them."""

    def __init__(self):
        self.sent: list[tuple[str, asyncio.Future]] = []

    async def _send(self, name: str, **fields) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.sent.append((name, fut))
        return fut


def test_the_router_prices_what_the_draft_has_to_compute():
    draft, prompt = CostCurve([(1, 0.010), (64, 0.200)]), CostCurve([(1, 0.010), (64, 0.100)])

    async def main():
        client = HeldOps()
        link = DraftLink(client, SimpleNamespace(controller=Controller(draft=draft, draft_prompt=prompt)))
        assert link.busy_for() == 0.0  # idle
        await client.decode(0, 0, list(range(32))).issue()  # a catch-up: priced as a prompt
        m = BUSY_MARGIN
        assert 0.9 * m * prompt(32) < link.busy_for() <= m * prompt(32)
        await client.propose(1, 0, [5], n_max=4, n_min=0, p_min=0.0).issue()  # after it: four decodes more
        assert m * (prompt(32) + 3.9 * draft(1)) < link.busy_for() <= m * (prompt(32) + 4 * draft(1))
        for _, fut in client.sent:
            fut.set_result(None)
        await asyncio.sleep(0)
        assert link.busy_for() == 0.0
        # busy past the estimate: about a token more; then idle again starts afresh
        await client.decode(0, 32, [7]).issue()
        time.sleep(m * prompt(1) + 0.005)
        assert link.busy_for() == draft(1)
        client.sent[-1][1].set_result(None)
        await asyncio.sleep(0)
        await client.decode(0, 33, [8, 9]).issue()
        assert link.busy_for() <= m * prompt(2)
        # no curves (a draft that did not calibrate): unknown, the target gives up its core as before
        link.router.controller = Controller()
        assert link.busy_for() == math.inf

    asyncio.run(main())


def test_a_bad_busy_time_is_refused_by_name_and_decodes_nothing(models):
    """busy_seconds below 0 or NaN: that operation fails naming the field;
    the others of its round decode as usual."""
    engine = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=2, n_threads=1, n_threads_batch=2))
    try:
        prompt = engine.tokenize("The capital of France is", True, False)
        for bad in (-1.0, math.nan):
            for seq in range(2):
                engine.clear(seq)
            ops = [pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=0, tokens=prompt, draft_busy=True, busy_seconds=bad)),
                   pb.WorkerOp(decode=pb.DecodeRequest(seq_id=1, pos=0, tokens=prompt, draft_busy=True, busy_seconds=0.05))]
            refused, fine = run_round(engine, Window(batch=[Job(op) for op in ops]))
            assert refused.WhichOneof("result") == "error" and "busy_seconds" in refused.error.message
            assert engine.state(0).n_tokens == 0
            assert fine.state.n_tokens == len(prompt)
    finally:
        engine.model.close()
