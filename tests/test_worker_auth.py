"""API keys on the workers, against real processes (issue #18, item 7).

A worker started with --api-key-file refuses every call without a valid key
with UNAUTHENTICATED, Execute included, and changes nothing; its health
service stays open for probes. The router presents its key (the first of
--worker-api-key-file, else of its own --api-key-file) and serves through
such workers; without the workers' key it never attaches. A bad key file
stops a process with one line naming the flag."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specd.client import RouterClient
from specd.launcher import Proc
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc

KEY = "sk-cluster-1c2d3e4f5a6b"  # first in the file: the key the router presents
SECOND = "sk-cluster-second-7a8b9c"
WRONG = "sk-wrong-0f9e8d7c"
PROMPT = "The capital of France is"
ROLES = ["target", "draft"]
BAD_METADATA = {
    "missing": (),
    "wrong-key": (("authorization", f"Bearer {WRONG}"),),
    "wrong-x-api-key": (("x-api-key", WRONG),),
    "other-scheme": (("authorization", f"Basic {KEY}"),),
}


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("keys")
    (d / "keys.txt").write_text(f"# one Secret for all three\n{KEY}\n{SECOND}\n")
    (d / "second.txt").write_text(f"{SECOND}\n")
    (d / "wrong.txt").write_text(f"{WRONG}\n")
    return d


@pytest.fixture(scope="module")
def locked(cluster_factory, keys):
    """Target, draft and router all started with the same --api-key-file by
    the launcher (ClusterSpec.api_key_file)."""
    return cluster_factory(n_ctx=512, n_seq=2, api_key_file=str(keys / "keys.txt"))


def address_of(cluster, role: str) -> str:
    return f"127.0.0.1:{int(cluster.procs[role].port_file.read_text())}"


def states(stub, n_seq: int, metadata) -> list[tuple]:
    out = []
    for seq in range(n_seq):
        s = stub.GetSeqState(wpb.GetSeqStateRequest(seq_id=seq), timeout=10, metadata=metadata)
        out.append((s.seq_id, s.pos_min, s.pos_max, s.n_tokens, s.token_hash))
    return out


def test_router_presents_its_key_to_the_workers(locked):
    with RouterClient(locked.router_address, api_key=KEY) as client:
        r = client.generate(PROMPT, max_tokens=12)
        assert r.n_generated == 12 and "Paris" in r.text
        assert r.speculative and r.n_drafted > 0  # the draft answered the router's keyed calls too
        assert client.info().draft_up
    with RouterClient(locked.router_address) as client:  # the launcher locked the public API as well
        with pytest.raises(grpc.RpcError) as err:
            client.generate(PROMPT, max_tokens=4)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("role", ROLES)
def test_worker_refuses_calls_without_its_key_and_changes_nothing(locked, role):
    good = (("authorization", f"Bearer {KEY}"),)
    with RouterClient(locked.router_address, api_key=KEY) as client:
        client.generate(PROMPT, max_tokens=8)  # leaves the session's KV in the prompt cache
    with grpc.insecure_channel(address_of(locked, role)) as ch:
        stub = wpb_grpc.WorkerStub(ch)
        before = states(stub, 2, good)
        held = [s for s in before if s[3] > 0]
        assert held, before
        seq, n = held[0][0], held[0][2] + 1
        role_stub = wpb_grpc.TargetWorkerStub(ch) if role == "target" else wpb_grpc.DraftWorkerStub(ch)
        for what, md in BAD_METADATA.items():
            calls = {
                "Clear(-1)": lambda: stub.Clear(wpb.ClearRequest(seq_id=-1), timeout=10, metadata=md),
                "GetModelInfo": lambda: stub.GetModelInfo(wpb.GetModelInfoRequest(), timeout=10, metadata=md),
                "GetSeqState": lambda: stub.GetSeqState(wpb.GetSeqStateRequest(seq_id=seq), timeout=10, metadata=md),
                "Decode": lambda: stub.Decode(wpb.DecodeRequest(seq_id=seq, pos=n, tokens=[42]), timeout=10,
                                              metadata=md),
                "SeqRm": lambda: stub.SeqRm(wpb.SeqRmRequest(seq_id=seq, p0=0, p1=-1), timeout=10, metadata=md),
                "Execute": lambda: list(stub.Execute(iter([wpb.WorkerOp(clear=wpb.ClearRequest(seq_id=-1)),
                                                           wpb.WorkerOp(seq_rm=wpb.SeqRmRequest(seq_id=seq, p0=0,
                                                                                                p1=-1))]),
                                                     timeout=10, metadata=md)),
                "Verify/Propose": (
                    (lambda: role_stub.Verify(wpb.VerifyRequest(seq_id=seq, pos=n, tokens=[42, 43]), timeout=10,
                                              metadata=md)) if role == "target" else
                    (lambda: role_stub.Propose(wpb.ProposeRequest(seq_id=seq, pos=n, tokens=[42], n_max=2),
                                               timeout=10, metadata=md))),
                "reflection": lambda: list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10, metadata=md)),
            }
            for name, call in calls.items():
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, (what, name, err.value)
                assert ("requires an API key" if what in ("missing", "other-scheme") else "not valid") \
                    in err.value.details()
                assert KEY not in err.value.details() and WRONG not in err.value.details()
        assert states(stub, 2, good) == before  # nothing ran
        assert stub.GetModelInfo(wpb.GetModelInfoRequest(), timeout=10, metadata=(("x-api-key", SECOND),)).n_seq == 2
    with RouterClient(locked.router_address, api_key=KEY) as client:
        # the router finds the cache it left, on both workers (alignment check on)
        assert client.generate(PROMPT, max_tokens=8).n_cached > 0
    time.sleep(0.3)  # let the worker's log reach its file
    log = locked.procs[role].log_path.read_text(errors="replace")
    assert "refused /specd.worker.v1.Worker/Clear: missing API key" in log
    for key in (KEY, SECOND, WRONG):
        assert key not in log


@pytest.mark.parametrize("role", ROLES)
def test_worker_health_needs_no_key(locked, role):
    with grpc.insecure_channel(address_of(locked, role)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "specd.worker.v1.Worker"):
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


def _router(locked, tmp_path: Path, *args: str) -> Proc:
    return Proc("router", ["router", "--port", "0", "--http-port", "0", "--target", address_of(locked, "target"),
                           "--draft", address_of(locked, "draft"), *args], tmp_path)


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return r.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("args,message", [
    ((), "this worker requires an API key"),
    (("--worker-api-key-file", "wrong.txt"), "the API key is not valid"),
], ids=["no-key", "wrong-key"])
def test_router_without_the_workers_key_never_attaches(locked, keys, tmp_path, args, message):
    args = tuple(str(keys / a) if a.endswith(".txt") else a for a in args)
    p = _router(locked, tmp_path, *args)
    try:
        address = f"127.0.0.1:{p.wait_port(time.monotonic() + 30)}"
        deadline = time.monotonic() + 30
        while message not in p.log_path.read_text(errors="replace"):
            p.check_alive()
            assert time.monotonic() < deadline, p.log_tail()
            time.sleep(0.1)
        assert not _serving(address)
    finally:
        p.stop()
    assert WRONG not in p.log_path.read_text(errors="replace")


def test_router_presents_worker_api_key_file(locked, keys, tmp_path):
    """--worker-api-key-file: the router presents its first key (here the
    workers' second), and needs none from its own clients. Runs last: one
    router per worker set, so the launcher's router is stopped first."""
    locked.procs["router"].stop()
    p = _router(locked, tmp_path, "--worker-api-key-file", str(keys / "second.txt"))
    try:
        address = f"127.0.0.1:{p.wait_port(time.monotonic() + 30)}"
        deadline = time.monotonic() + 60
        while not _serving(address):
            p.check_alive()
            assert time.monotonic() < deadline, p.log_tail()
            time.sleep(0.1)
        with RouterClient(address) as client:
            r = client.generate(PROMPT, max_tokens=8)
            assert r.n_generated == 8 and r.speculative and r.n_drafted > 0
    finally:
        p.stop()
    assert SECOND not in p.log_path.read_text(errors="replace")


# -------------------------------------------------------------- startup errors
@pytest.mark.parametrize("content,flag,needle", [
    (None, "--api-key-file", "cannot read --api-key-file"),
    ("", "--api-key-file", "holds no key"),
    ("# only a comment\n\n", "--api-key-file", "holds no key"),
    ("sk-caf\u00e9\n", "--api-key-file", "line 1: a key must be printable ASCII"),
], ids=["missing", "empty", "comments-only", "non-ascii"])
def test_bad_worker_key_file_is_a_one_line_error(tmp_path, content, flag, needle):
    path = tmp_path / "keys.txt"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    for args in (["draft", "--ngram", "simple"], ["router", "--target", "127.0.0.1:1"]):
        p = Proc("bad", [*args, "--port", "0", flag, str(path)], tmp_path)
        try:
            code = p.popen.wait(60)
        finally:
            p.stop()
        lines = p.log_path.read_text(errors="replace").strip().splitlines()
        assert code != 0 and len(lines) == 1, lines
        assert lines[0].startswith("specd: ") and flag in lines[0] and needle in lines[0], lines


def test_bad_worker_api_key_file_of_the_router(tmp_path):
    p = Proc("bad", ["router", "--port", "0", "--target", "127.0.0.1:1",
                     "--worker-api-key-file", str(tmp_path / "nope.txt")], tmp_path)
    try:
        code = p.popen.wait(60)
    finally:
        p.stop()
    lines = p.log_path.read_text(errors="replace").strip().splitlines()
    assert code != 0 and lines == [f"specd: cannot read --worker-api-key-file '{tmp_path / 'nope.txt'}': "
                                   f"No such file or directory"], lines


# ------------------------------------------------------------------ specd up
def _children(pid: int) -> dict[str, str]:
    """Role -> gRPC address of the processes `pid` started (from their port files)."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = (d / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        port_file = Path(argv[argv.index("--port-file") + 1])
        out[argv[argv.index("specd") + 1]] = f"127.0.0.1:{int(port_file.read_text())}"
    return out


def test_specd_up_locks_the_workers(keys, tmp_path):
    with open(tmp_path / "up.log", "wb") as err:
        p = subprocess.Popen([sys.executable, "-m", "specd", "up", "--port", "0", "--n-ctx", "512", "--n-seq", "1",
                              "--api-key-file", str(keys / "keys.txt")],
                             stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True,
                             # through to all three: timing decodes at load is not what this tests
                             env={**os.environ, "SPECD_CALIBRATE": "false", "SPECD_ADAPTIVE": "false"})
    try:
        line = p.stdout.readline()  # "[specd up] router listening on HOST:PORT ..." once all three serve
        assert "router listening on" in line, (tmp_path / "up.log").read_text(errors="replace")
        router = re.search(r"listening on (\S+?:\d+)", line).group(1)
        with RouterClient(router, api_key=KEY) as client:
            assert client.generate(PROMPT, max_tokens=6).n_generated == 6
        workers = _children(p.pid)
        assert set(workers) == {"target", "draft", "router"}, workers
        for role in ROLES:
            with grpc.insecure_channel(workers[role]) as ch:
                stub = wpb_grpc.WorkerStub(ch)
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetModelInfo(wpb.GetModelInfoRequest(), timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, role
                assert stub.GetModelInfo(wpb.GetModelInfoRequest(), timeout=10,
                                         metadata=(("authorization", f"Bearer {KEY}"),)).n_seq == 1
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        p.stdout.close()
