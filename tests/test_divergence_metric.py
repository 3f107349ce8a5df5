"""A draft worker whose sequence changes behind the router's back: with
--check-alignment the router finds the divergence, re-syncs the draft from
its history, serves the same tokens as the target alone, and counts it in
specd_router_divergences_total{worker="draft"} on its /metrics endpoint."""
from __future__ import annotations

import grpc

from specd.client import RouterClient, collect, make_request
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc
from tests.leaks import worker_address
from tests.test_operations import scrape, value

PROMPT = "Here is a list of the planets of the solar system, with one fact about each:\n1."
MAX_TOKENS = 96


def divergences(cluster) -> dict[str, float]:
    m = scrape(cluster.metrics_ports["router"])
    return {w: value(m, "specd_router_divergences_total", worker=w) for w in ("target", "draft")}


def test_draft_divergence_is_repaired_and_counted(cluster_factory):
    c = cluster_factory(n_ctx=1024, n_seq=1, metrics=True)  # --check-alignment is on (conftest)
    assert divergences(c) == {"target": 0, "draft": 0}  # both series exist before any divergence
    with RouterClient(c.router_address, timeout=120) as client:
        reference = client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=False)
        clean = client.generate(PROMPT, max_tokens=MAX_TOKENS, n_draft=4)
        assert clean.tokens == reference.tokens and clean.n_drafted > 0
        assert divergences(c) == {"target": 0, "draft": 0}  # a normal speculative request diverges nowhere

        with grpc.insecure_channel(worker_address(c, "draft")) as ch:
            draft = wpb_grpc.WorkerStub(ch)
            stream = client.stub.Generate(make_request(PROMPT, max_tokens=MAX_TOKENS, n_draft=4, adaptive=False),
                                          timeout=120)
            first = next(stream)
            # the session's sequence (the only one) loses everything on the draft,
            # which the router does not know
            held = draft.GetSeqState(wpb.GetSeqStateRequest(seq_id=0), timeout=10)
            assert held.n_tokens > 0
            draft.Clear(wpb.ClearRequest(seq_id=0), timeout=10)
            rest = collect(stream)

    assert list(first.token_ids) + rest.tokens == reference.tokens
    assert rest.finish_reason == reference.finish_reason and len(reference.tokens) >= 40
    assert rest.n_drafted > clean.n_drafted // 2  # drafting went on after the re-sync
    d = divergences(c)
    assert d["draft"] >= 1 and d["target"] == 0, d
