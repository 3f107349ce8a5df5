"""A draft far behind catches up in one Propose, whatever its n_batch: the
worker decodes a tail longer than n_batch in chunks of n_batch (as llama.cpp
splits a batch into ubatches), all or nothing. Real draft model; the
end-to-end test runs real worker processes under a router in this process."""
from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from specd.draft_worker.engine import DraftModelEngine
from specd.router.clients import GrpcWorker
from specd.router.engine import Router
from specd.router.params import GenParams, Result, RouterSettings
from specd.errors import ResourceExhausted
from specd.llama import DecodeError, LlamaConfig
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.test_worker_grpc import start_worker, wait_serving

N_BATCH = 8
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
        "a goldsmith from Mainz, combined movable metal type with an oil-based ink and a wooden press")


@pytest.fixture(scope="module")
def draft_proc(models, tmp_path_factory):
    proc, address = start_worker("draft", models["draft"], tmp_path_factory.mktemp("draft"),
                                 "--n-batch", str(N_BATCH), "--no-calibrate")
    wait_serving(address)
    yield address
    proc.stop()


def test_propose_with_a_tail_longer_than_n_batch(draft_proc):
    with grpc.insecure_channel(draft_proc) as ch:
        w, d = pb_grpc.WorkerStub(ch), pb_grpc.DraftWorkerStub(ch)
        w.Clear(pb.ClearRequest(seq_id=-1), timeout=10)
        toks = list(w.Tokenize(pb.TokenizeRequest(text=TEXT, add_special=True), timeout=10).tokens)
        assert len(toks) > 4 * N_BATCH
        cut = (len(toks) - 1) // N_BATCH * N_BATCH  # where the worker's last chunk starts
        far = d.Propose(pb.ProposeRequest(seq_id=0, pos=0, tokens=toks, n_max=4), timeout=30)
        # the same tokens in two calls that each fit n_batch: the same llama_decode batches
        w.Decode(pb.DecodeRequest(seq_id=1, pos=0, tokens=toks[:cut]), timeout=30)
        near = d.Propose(pb.ProposeRequest(seq_id=1, pos=cut, tokens=toks[cut:], n_max=4), timeout=30)
        assert len(far.tokens) == 4 and list(far.tokens) == list(near.tokens)
        assert (far.state.n_tokens, far.state.token_hash) == (near.state.n_tokens, near.state.token_hash)
        assert far.state.n_tokens == len(toks) + 3


@pytest.fixture(scope="module")
def engine(models):
    e = DraftModelEngine(LlamaConfig(models["draft"], n_ctx_seq=256, n_seq=2, n_threads=1, n_batch=N_BATCH))
    yield e
    e.model.close()


def failing_decode(engine, fail_at: int):
    """engine.model.decode raising DecodeError on its `fail_at`-th call, as
    llama_decode does when it finds no room for a batch."""
    real, calls = engine.model.decode, [0]

    def decode(*args, **kw):
        calls[0] += 1
        if calls[0] == fail_at:
            raise DecodeError("llama_decode returned 1 (injected)")
        return real(*args, **kw)
    return decode


@pytest.mark.parametrize("fail_at", [3, 6])  # a chunk of the tail; a draft token after it
def test_a_failed_chunk_leaves_the_sequence_as_before(engine, monkeypatch, fail_at):
    engine.clear(-1)
    toks = engine.tokenize(TEXT, True, True)[:4 * N_BATCH + 3]  # 5 chunks, then 3 draft tokens
    engine.decode(0, 0, toks[:5])
    before = engine.state(0)
    with monkeypatch.context() as m:
        m.setattr(engine.model, "decode", failing_decode(engine, fail_at))
        with pytest.raises(ResourceExhausted):
            engine.propose(0, 5, toks[5:], 4, 0, 0.0)
    assert engine.state(0) == before
    assert (engine.model.seq_pos_min(0), engine.model.seq_pos_max(0)) == (0, 4)  # llama.cpp's memory too
    again = engine.propose(0, 5, toks[5:], 4, 0, 0.0)
    engine.decode(1, 0, toks[:5])
    ref = engine.propose(1, 5, toks[5:], 4, 0, 0.0)  # the same calls, never failed
    assert again.tokens == ref.tokens and again.state.token_hash == ref.state.token_hash


def test_router_drafts_with_a_draft_far_behind(models, draft_proc, tmp_path):
    # the draft skips the prompt (adaptive speculation does when drafting
    # would not pay at the load of the moment): its first Propose carries
    # the whole prompt, more than its n_batch, and used to be refused, which
    # turned speculation off for the session
    proc, target = start_worker("target", models["target"], tmp_path, "--no-calibrate")
    try:
        wait_serving(target)

        async def main():
            t, d = GrpcWorker(target, "target"), GrpcWorker(draft_proc, "draft")
            try:
                router = Router(t, d, RouterSettings(adaptive=False, check_alignment=True))
                await router.start()
                router._draft_could_pay = lambda s: False  # no prefill on the draft
                prompt = await t.tokenize(TEXT, True, True)
                out = []
                for speculative in (True, False):
                    res, toks = Result(), []
                    async for step in router.generate(GenParams(prompt=prompt, max_tokens=32, n_max=4,
                                                                speculative=speculative), res):
                        toks += step.tokens
                    out.append((toks, res))
                return out
            finally:
                await t.close()
                await d.close()

        (spec, res), (plain, _) = asyncio.run(main())
        assert res.speculative and res.n_drafted > 0 and res.n_accepted > 0, res
        assert spec == plain
        assert res.n_divergences == 0
    finally:
        proc.stop()


def test_other_sequences_decode_between_the_chunks_of_a_long_decode(engine):
    # a catch-up goes n_batch tokens a round: a sequence drafting meanwhile
    # need not wait for all of it
    engine.clear(-1)
    toks = np.asarray(engine.tokenize(TEXT, True, True)[:3 * N_BATCH], dtype=np.int32)
    batches = []  # (tokens, sequences) of every llama_decode
    engine.on_decode = lambda n, seconds, n_seqs, threads: batches.append((n, n_seqs))
    try:
        out = engine.run_batch([engine.decode_steps(0, 0, toks), engine.propose_steps(1, 0, toks[:2], 2, 0, 0.0)])
    finally:
        engine.on_decode = None
    assert (out[0].n_tokens, out[1].state.n_tokens) == (3 * N_BATCH, 3)
    assert max(n for n, _ in batches) == N_BATCH
    assert batches[-1] == (N_BATCH, 1)  # the catch-up's last chunk comes after the other's drafting
