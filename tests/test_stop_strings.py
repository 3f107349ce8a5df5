"""Stop strings on a real cluster: the token ids and usage end at the token
that completed the stop string, with and without speculation alike, and the
router bounds how many stop strings a request has and how long they are."""
from __future__ import annotations

import grpc
import pytest

from specd.client import RouterClient, make_request
from specd.config import MAX_STOP_LENGTH, MAX_STOP_STRINGS
from specd.v1 import router_pb2_grpc as rpb_grpc
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc

COUNTING = "1, 2, 3, 4, 5,"


@pytest.fixture(scope="module")
def stops_cluster(cluster_factory):
    return cluster_factory(n_ctx=512, n_seq=2)


def detokenize(cluster, tokens: list[int]) -> str:
    port = int(cluster.procs["target"].port_file.read_text())
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return wpb_grpc.WorkerStub(ch).Detokenize(wpb.DetokenizeRequest(tokens=tokens), timeout=30).text


def still_serves(address: str) -> None:
    with RouterClient(address, timeout=60) as client:
        r = client.generate("The capital of France is", max_tokens=6)
    assert r.n_generated == 6 and r.text


@pytest.mark.parametrize("stop", [" 8,", " 11,", " 15,"])
def test_tokens_end_at_the_token_completing_the_stop_in_both_modes(stops_cluster, stop):
    with RouterClient(stops_cluster.router_address, timeout=120) as client:
        # n_draft 4 with a draft that is nearly always accepted: steps of about
        # 5 tokens, which run past the stop string's last token
        spec = client.generate(COUNTING, max_tokens=40, stop=[stop], speculative=True, n_draft=4)
        plain = client.generate(COUNTING, max_tokens=40, stop=[stop], speculative=False)
    assert spec.speculative and spec.n_drafted > 0 and not plain.speculative
    assert spec.finish_reason == plain.finish_reason == "stop"
    assert (spec.tokens, spec.text, spec.n_generated) == (plain.tokens, plain.text, plain.n_generated)
    assert spec.n_generated == len(spec.tokens)
    # the last token completes the stop string; the text ends where it starts
    full = detokenize(stops_cluster, spec.tokens)
    assert stop in full and stop not in detokenize(stops_cluster, spec.tokens[:-1])
    assert spec.text == full[: full.index(stop)]


def refused(address: str, **kw) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(rpb_grpc.RouterStub(ch).Generate(make_request(COUNTING, max_tokens=4, **kw), timeout=30))
    return err.value


def test_too_many_or_too_long_stop_strings_are_refused(stops_cluster):
    address = stops_cluster.router_address
    err = refused(address, stop=[f"<{i}>" for i in range(MAX_STOP_STRINGS + 1)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("stop:") and f"max_stop_strings = {MAX_STOP_STRINGS}" in err.details()
    err = refused(address, stop=[" 8,", "x" * (MAX_STOP_LENGTH + 1)])
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("stop[1]") and f"max_stop_length = {MAX_STOP_LENGTH}" in err.details()
    # the limits themselves are allowed, and the router goes on serving
    stops = [" 8,"] + ["x" * MAX_STOP_LENGTH] * (MAX_STOP_STRINGS - 1)
    with RouterClient(address, timeout=60) as client:
        r = client.generate(COUNTING, max_tokens=20, stop=stops)
    assert r.finish_reason == "stop" and " 8," not in r.text
    still_serves(address)
