"""A worker's queues are bounded: operations waiting for a round (all Execute
streams together, --max-queued-ops) and one stream's operations not answered
yet (--max-stream-ops). Past either bound the answer is RESOURCE_EXHAUSTED
naming it, and other streams go on."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from specd.errors import ResourceExhausted
from specd.launcher import Proc
from specd.scheduler import EngineRunner, Scheduler, op_key
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc

MAX_QUEUED = 4
MAX_STREAM = 8
N_PROMPT = 250  # a prefill long enough that the cheap operations sent behind it all arrive while it runs


def test_scheduler_refuses_operations_past_its_queue_bound():
    ran: list[int] = []

    def run_round(engine, window):
        ran.extend(window.items)
        return [f"state of {seq}" for seq in window.items]

    async def main():
        sched = Scheduler(EngineRunner(engine=object()), run_round, lambda seq: op_key("get_seq_state", seq),
                          max_queued=2)
        futs = [sched.submit(seq) for seq in range(3)]  # no round has run yet: all three wait
        got = await asyncio.gather(*futs, return_exceptions=True)
        later = await sched.submit(7)  # room again once the queue has drained
        return got, later

    got, later = asyncio.run(main())
    assert got[:2] == ["state of 0", "state of 1"]
    assert isinstance(got[2], ResourceExhausted) and "max_queued_ops = 2" in got[2].message
    assert later == "state of 7" and ran == [0, 1, 7]  # the refused operation never ran


@pytest.fixture(scope="module")
def worker(models, tmp_path_factory):
    proc = Proc("target", ["target", "--model", models["target"], "--port", "0", "--threads", "1",
                           "--n-ctx", "256", "--n-seq", "2", "--no-calibrate",
                           "--max-queued-ops", str(MAX_QUEUED), "--max-stream-ops", str(MAX_STREAM)],
                tmp_path_factory.mktemp("bounds"))
    try:
        port = proc.wait_port(time.monotonic() + 60)
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.WorkerStub(ch)
        deadline = time.monotonic() + 60
        while True:  # the model loads after the port opens
            try:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(0.1)
        yield stub
        ch.close()
    finally:
        proc.stop()


def prefill_then_states(n_states: int) -> list[pb.WorkerOp]:
    """A long prefill of sequence 0, then cheap operations on it that wait behind it."""
    ops = [pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=0, tokens=[100 + i for i in range(N_PROMPT)]))]
    return ops + [pb.WorkerOp(get_seq_state=pb.GetSeqStateRequest(seq_id=0)) for _ in range(n_states)]


def state_now(stub) -> pb.SeqState:
    (res,) = stub.Execute(iter([pb.WorkerOp(get_seq_state=pb.GetSeqStateRequest(seq_id=0))]), timeout=30)
    return res.state


def test_queue_bound_refuses_only_the_operations_past_it(worker):
    worker.Clear(pb.ClearRequest(seq_id=-1), timeout=30)
    results = list(worker.Execute(iter(prefill_then_states(MAX_STREAM - 1)), timeout=60))
    assert len(results) == MAX_STREAM and results[0].state.n_tokens == N_PROMPT
    refused = [r for r in results[1:] if r.HasField("error")]
    assert refused, "no operation waited past max_queued_ops"
    for r in refused:
        assert r.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert f"max_queued_ops = {MAX_QUEUED}" in r.error.message
    assert all(r.state.n_tokens == N_PROMPT for r in results[1:] if not r.HasField("error"))
    assert state_now(worker).n_tokens == N_PROMPT  # the stream and the worker go on


def test_stream_bound_ends_only_that_stream(worker):
    worker.Clear(pb.ClearRequest(seq_id=-1), timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        list(worker.Execute(iter(prefill_then_states(3 * MAX_STREAM)), timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"max_stream_ops = {MAX_STREAM}" in err.value.details()
    deadline = time.monotonic() + 30
    while state_now(worker).n_tokens != N_PROMPT:  # its prefill still ran; another stream sees it
        assert time.monotonic() < deadline
        time.sleep(0.1)
