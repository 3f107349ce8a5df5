"""A worker belongs to one router (specd.ownership), and the router follows
its workers' health (router.health): a second router is refused instead of
wiping the first one's sessions; a draining target gets no new sessions;
the router's readiness follows whether a target takes sessions; a router
that stops frees its workers for the one replacing it."""
from __future__ import annotations

import re
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from specd.client import RouterClient, make_request
from specd.errors import PermissionDenied
from specd.launcher import Cluster, ClusterSpec, Proc, wait_serving
from specd.ownership import Ownership
from specd.server import LIVENESS
from tests.conftest import health

PROMPT = "List three benefits of regular exercise:\n1."
MAX_TOKENS = 24


# ------------------------------------------------------------------ the lease
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_first_router_holds_the_lease_while_its_streams_are_open():
    o = Ownership(grace=10.0, clock=Clock())
    o.open("a")
    o.open("a")  # a second stream of the same router
    with pytest.raises(PermissionDenied, match="serves router a, not b"):
        o.open("b")
    o.check(None)  # a caller without a token is not a router
    o.close("a", clean=False)
    with pytest.raises(PermissionDenied):
        o.check("b")  # one stream still open


def test_a_broken_stream_keeps_the_lease_for_the_grace_then_frees_it():
    clock = Clock()
    o = Ownership(grace=10.0, clock=clock)
    o.open("a")
    o.close("a", clean=False)
    clock.now += 9.9
    with pytest.raises(PermissionDenied):
        o.open("b")
    o.open("a")  # the owner comes back within the grace
    o.close("a", clean=False)
    clock.now += 10.1
    o.open("b")
    assert o.owner == "b" and o.held()
    with pytest.raises(PermissionDenied):
        o.open("a")


def test_a_stream_its_router_ends_frees_the_worker_at_once():
    o = Ownership(grace=10.0, clock=Clock())
    o.open("a")
    o.close("a", clean=True)
    assert not o.held()
    o.open("b")
    o.close("a", clean=False)  # a stale close of the old owner changes nothing
    assert o.owner == "b" and o.streams == 1


# ----------------------------------------------------------- real processes
@pytest.fixture(scope="module")
def cell(models):
    """Router A on two targets and a draft, each worker draining 30 s on SIGTERM."""
    spec = ClusterSpec(target_model=models["target"], draft_model=models["draft"], n_ctx=512, n_seq=2,
                       n_targets=2, metrics=True, worker_args=["--drain-seconds", "30"],
                       router_args=["--check-alignment", "--no-adaptive"])
    c = Cluster(spec).start()
    yield c
    for name, p in c.procs.items():  # a draining worker would hold the teardown for its drain
        if name != "router":
            p.popen.kill()
    c.stop()


def address(c: Cluster, name: str) -> str:
    return f"127.0.0.1:{int(c.procs[name].port_file.read_text())}"


def wait_for(what, timeout: float, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what.__doc__ or what}")


def metric(c: Cluster, role: str, name: str) -> float:
    import urllib.request
    text = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics_ports[role]}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def second_router(c: Cluster, name: str) -> Proc:
    targets = ",".join(address(c, n) for n in c.procs if n.startswith("target"))
    return Proc(name, ["router", "--host", "127.0.0.1", "--port", "0", "--target", targets, "--draft",
                       address(c, "draft"), "--check-alignment", "--no-adaptive"], c.workdir)


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_a_second_router_is_refused_and_the_first_serves_on(cell):
    with RouterClient(cell.router_address, timeout=120) as client:
        reference = client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=False)
        stream = client.stub.Generate(make_request(PROMPT, max_tokens=MAX_TOKENS, n_draft=4, adaptive=False),
                                     timeout=120)
        first = next(stream)  # a session is running on the workers
        b = second_router(cell, "router-b")
        try:
            addr_b = f"127.0.0.1:{b.wait_port(time.monotonic() + 30)}"
            wait_for(lambda: "serves router" in b.log_path.read_text(errors="replace"), 30)
            assert health(addr_b) == NOT_SERVING  # not ready: it has no target
            assert health(addr_b, LIVENESS) == SERVING  # but alive: a restart would not help
            rest = [t for r in stream for t in r.token_ids]
            assert list(first.token_ids) + rest == reference.tokens  # nothing was wiped under the session
            again = client.generate(PROMPT, max_tokens=MAX_TOKENS, n_draft=4)
            assert again.tokens == reference.tokens and again.n_drafted > 0  # the draft is still A's
        finally:
            b.stop()
    assert "Traceback" not in b.log_path.read_text(errors="replace")


def test_a_draining_target_gets_no_new_sessions(cell):
    with RouterClient(cell.router_address, timeout=120) as client:
        reference = client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=False)
        assert metric(cell, "router", "specd_target_workers_up") == 2
        cell.procs["target2"].popen.send_signal(signal.SIGTERM)  # drains for 30 s, then stops
        wait_for(lambda: metric(cell, "router", "specd_target_workers_up") == 1, 10)
        assert health(cell.router_address) == SERVING  # the other target takes the sessions
        before = metric(cell, "target2", "specd_worker_decode_batch_size_count")
        outs = [client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=i % 2 == 0) for i in range(4)]
        assert metric(cell, "target2", "specd_worker_decode_batch_size_count") == before
    assert all(o.tokens == reference.tokens for o in outs)


def test_router_readiness_follows_its_targets(cell):
    # target2 drains (the test before); the other target dies: nothing takes sessions
    cell.procs["target"].popen.kill()
    wait_for(lambda: health(cell.router_address) == NOT_SERVING, 10)
    assert health(cell.router_address, LIVENESS) == SERVING
    with RouterClient(cell.router_address, timeout=60) as client:
        with pytest.raises(grpc.RpcError) as e:
            client.generate(PROMPT, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        cell.restart("target", sig=signal.SIGKILL)
        wait_for(lambda: health(cell.router_address) == SERVING, 15)
        reference = client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=False)
        assert client.generate(PROMPT, max_tokens=MAX_TOKENS, n_draft=4).tokens == reference.tokens


def test_a_router_that_stops_frees_its_workers(cell):
    with RouterClient(cell.router_address, timeout=120) as client:
        reference = client.generate(PROMPT, max_tokens=MAX_TOKENS, speculative=False)
    assert cell.procs["router"].stop() == 0  # SIGTERM: it ends its streams, the workers are free at once
    b = second_router(cell, "router-c")
    try:
        addr_b = f"127.0.0.1:{b.wait_port(time.monotonic() + 30)}"
        t0 = time.monotonic()
        wait_serving(addr_b, time.monotonic() + 20, [b])
        assert time.monotonic() - t0 < 8  # no lease to wait out
        with RouterClient(addr_b, timeout=120) as client:
            out = client.generate(PROMPT, max_tokens=MAX_TOKENS, n_draft=4)
        assert out.tokens == reference.tokens and out.n_drafted > 0  # the draft came along
    finally:
        b.stop()
