"""Limits of the public API against real processes: each refusal has the
right status and names its limit, and the router serves normally afterwards.
A request cut by a deadline (the client's or --request-timeout) frees its
sequence on both workers."""
from __future__ import annotations

import concurrent.futures
import time
from types import SimpleNamespace

import grpc
import pytest

from specd.router.engine import Router
from specd.router.params import GenParams
from specd.router.limits import Limits
from specd.config import PROMPT_BYTES_PER_TOKEN
from specd.errors import InvalidArgument
from specd.client import RouterClient, collect, make_request
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc

MAX_PROMPT = 64
MAX_TOKENS = 300
MAX_BYTES = 64 << 10
TIMEOUT = 3.0
N_CTX = 512
# counting: the greedy continuation goes on well past MAX_TOKENS without EOG
LONG = ", ".join(str(i) for i in range(1, 11)) + ","


@pytest.fixture(scope="module")
def limited(cluster_factory):
    # one sequence: a leaked sequence would make every later request wait forever
    return cluster_factory(n_ctx=N_CTX, n_seq=1, router_args=[
        "--max-prompt-tokens", str(MAX_PROMPT), "--max-tokens-limit", str(MAX_TOKENS),
        "--max-message-bytes", str(MAX_BYTES), "--request-timeout", str(TIMEOUT), "--max-queue", "1"])


def refused(address: str, req: rpb.GenerateRequest, timeout: float = 30) -> grpc.RpcError:
    with grpc.insecure_channel(address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(rpb_grpc.RouterStub(ch).Generate(req, timeout=timeout))
    return err.value


def still_serves(address: str) -> None:
    with RouterClient(address, timeout=60) as client:
        r = client.generate("The capital of France is", max_tokens=6)
    assert r.n_generated == 6 and r.text


def worker_states(cluster) -> dict[str, wpb.SeqState]:
    out = {}
    for role in ("target", "draft"):
        port = int(cluster.procs[role].port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            out[role] = wpb_grpc.WorkerStub(ch).GetSeqState(wpb.GetSeqStateRequest(seq_id=0), timeout=10)
    return out


def assert_sequence_freed(cluster) -> None:
    """Both workers hold nothing for the only sequence, and more requests than
    sequences are all served (they would queue forever behind a leaked one)."""
    deadline = time.monotonic() + 15
    while True:
        states = worker_states(cluster)
        if all(s.n_tokens == 0 for s in states.values()):
            break
        assert time.monotonic() < deadline, f"sequence 0 not freed: {states}"
        time.sleep(0.2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with RouterClient(cluster.router_address, timeout=60) as client:
            runs = [pool.submit(client.generate, "The capital of France is", max_tokens=6) for _ in range(2)]
            assert [f.result().n_generated for f in runs] == [6, 6]


def test_max_prompt_tokens(limited):
    err = refused(limited.router_address, make_request([42] * (MAX_PROMPT + 1), max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_prompt_tokens" in err.details() and str(MAX_PROMPT) in err.details()
    # text prompts are counted after tokenization
    err = refused(limited.router_address, make_request("hello " * 200, max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_tokens" in err.details()
    with RouterClient(limited.router_address, timeout=60) as client:  # the limit itself is allowed
        assert client.generate([42] * MAX_PROMPT, max_tokens=2).n_prompt == MAX_PROMPT
    still_serves(limited.router_address)


def test_prompt_text_is_bounded_before_it_is_tokenized(limited):
    # max_prompt_bytes defaults to PROMPT_BYTES_PER_TOKEN per token of max_prompt_tokens: the
    # refusal names the byte bound, so it came before tokenizing (counting tokens names max_prompt_tokens)
    cap = PROMPT_BYTES_PER_TOKEN * MAX_PROMPT
    err = refused(limited.router_address, make_request("é" * (cap // 2 + 1), max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("prompt:") and f"max_prompt_bytes = {cap}" in err.details()
    chat = [{"role": "user", "content": "x" * cap}, {"role": "user", "content": "y"}]
    err = refused(limited.router_address, make_request(chat, max_tokens=4))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("messages:")
    with RouterClient(limited.router_address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as tok:
            client.tokenize("x" * (cap + 1))
        assert tok.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_prompt_bytes" in tok.value.details()
        assert client.tokenize("x" * cap)  # the bound itself is allowed
    still_serves(limited.router_address)


def test_max_tokens_limit(limited):
    err = refused(limited.router_address, make_request("Hello", max_tokens=MAX_TOKENS + 1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens_limit" in err.details() and str(MAX_TOKENS) in err.details()
    still_serves(limited.router_address)


def test_max_message_bytes(limited):
    err = refused(limited.router_address, make_request("x" * (MAX_BYTES + 100), max_tokens=4))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # gRPC's own message: "... larger than max (<size> vs. <max_message_bytes>)"
    assert str(MAX_BYTES) in err.details(), err.details()
    still_serves(limited.router_address)


def test_client_deadline_ends_the_request_and_frees_its_sequence(limited):
    t0 = time.monotonic()
    err = refused(limited.router_address, make_request(LONG, max_tokens=MAX_TOKENS, speculative=True), timeout=1.0)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - t0 < TIMEOUT  # the client's deadline, not the router's request_timeout
    assert_sequence_freed(limited)


def test_request_timeout(limited):
    t0 = time.monotonic()
    err = refused(limited.router_address, make_request(LONG, max_tokens=MAX_TOKENS, speculative=False), timeout=60)
    took = time.monotonic() - t0
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "request_timeout" in err.details() and "3s" in err.details()
    assert TIMEOUT - 0.5 < took < TIMEOUT + 5, took
    assert_sequence_freed(limited)
    still_serves(limited.router_address)


def test_max_queue(limited):
    with RouterClient(limited.router_address, timeout=30) as client, concurrent.futures.ThreadPoolExecutor(1) as ex:
        running = client.stub.Generate(make_request(LONG, max_tokens=MAX_TOKENS, speculative=False), timeout=30)
        assert next(running).token_ids  # holds the only sequence
        queued = client.stub.Generate(make_request("Hello", max_tokens=4), timeout=30)
        waiter = ex.submit(collect, queued)
        time.sleep(0.5)  # the second request is in the queue (max_queue = 1)
        err = refused(limited.router_address, make_request("Hello", max_tokens=4))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in err.details()
        running.cancel()
        assert waiter.result(timeout=30).n_generated == 4  # the queued one runs once the sequence is free
    still_serves(limited.router_address)


class _FakeRouter:
    n_ctx = N_CTX

    def __init__(self, can_shift: bool):
        self.can_shift = can_shift

    def _can_shift(self, p) -> bool:
        return self.can_shift and p.context_shift


def test_max_tokens_limit_caps_an_unset_max_tokens():
    lim = Limits(max_tokens_limit=100)
    p = GenParams(prompt=[1] * 10)
    lim.apply(p, _FakeRouter(False))
    assert p.max_tokens == 100
    # the context ends first: left to the context, not refused for a max_tokens never sent
    p = GenParams(prompt=[1] * (N_CTX - 50))
    lim.apply(p, _FakeRouter(False))
    assert p.max_tokens is None
    # a shifting request would go on forever: capped
    p = GenParams(prompt=[1] * (N_CTX - 50), context_shift=True)
    lim.apply(p, _FakeRouter(True))
    assert p.max_tokens == 100
    with pytest.raises(ValueError, match="request_timeout"):
        Limits(request_timeout=-1).check()


def test_prompt_length_is_checked_before_its_token_ids():
    # a prompt longer than the context is refused for its length, before its ids are looked at
    router = SimpleNamespace(target_info=SimpleNamespace(n_vocab=100), n_ctx=8)
    with pytest.raises(InvalidArgument, match=r"^prompt has 10 tokens"):
        Router.validate(router, GenParams(prompt=[1] * 9 + [-1]))
    with pytest.raises(InvalidArgument, match=r"^prompt_tokens\[2\] = 100 is not in \[0, n_vocab = 100\)"):
        Router.validate(router, GenParams(prompt=[1, 99, 100, -1]))


def test_stop_and_prompt_text_bounds():
    lim = Limits(max_stop_strings=2, max_stop_length=3, max_prompt_tokens=4)
    lim.check_stops(["abc", ""])
    with pytest.raises(InvalidArgument, match=r"^stop: 3 stop strings, more than max_stop_strings = 2"):
        lim.check_stops(["a", "b", "c"])
    with pytest.raises(InvalidArgument, match=r"^stop\[1\] has 4 characters, more than max_stop_length = 3"):
        lim.check_stops(["a", "abcd"])
    # bytes, not characters: "é" is two; 0 derives the bound from the prompt limit
    cap = PROMPT_BYTES_PER_TOKEN * 4
    lim.check_prompt_text("prompt", ["é" * (cap // 2)], n_ctx=N_CTX)
    with pytest.raises(InvalidArgument, match=rf"^messages: more than max_prompt_bytes = {cap} "):
        lim.check_prompt_text("messages", ["é" * (cap // 2), "x"], n_ctx=N_CTX)
    assert Limits().prompt_bytes(N_CTX) == PROMPT_BYTES_PER_TOKEN * N_CTX
    assert Limits(max_prompt_bytes=10).prompt_bytes(N_CTX) == 10
    with pytest.raises(ValueError, match="max_stop_length"):
        Limits(max_stop_length=0).check()
