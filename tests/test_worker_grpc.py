"""Worker RPCs on a real worker process: llama.cpp's KV semantics, checkpoints,
the ordered Execute pipeline, bad input, health."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.errors import InvalidArgument
from specd.launcher import Proc
from specd.llama import LlamaConfig
from specd.tokens import history_hash
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc
from specd.draft_worker.engine import DraftModelEngine, NgramEngine
from specd.target_worker.engine import TargetEngine

N_SEQ = 3


def start_worker(role: str, model: str, tmp_path, *extra) -> tuple[Proc, str]:
    p = Proc(role, [role, "--model", model, "--port", "0", "--threads", "1", "--n-ctx", "256",
                    "--n-seq", str(N_SEQ), *extra], tmp_path)
    port = p.wait_port(time.monotonic() + 60)
    return p, f"127.0.0.1:{port}"


def wait_serving(address: str, timeout: float = 60) -> list[int]:
    seen = []
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            status = stub.Check(health_pb2.HealthCheckRequest(service="specd.worker.v1.Worker"), timeout=5).status
            if not seen or seen[-1] != status:
                seen.append(status)
            if status == health_pb2.HealthCheckResponse.SERVING:
                return seen
            time.sleep(0.02)
    raise TimeoutError(address)


@pytest.fixture(scope="module")
def target(models, tmp_path_factory):
    proc, address = start_worker("target", models["target"], tmp_path_factory.mktemp("target"), "--threads-batch", "2")
    seen = wait_serving(address)
    ch = grpc.insecure_channel(address)
    yield pb_grpc.WorkerStub(ch), pb_grpc.TargetWorkerStub(ch), seen, proc
    ch.close()
    proc.stop()


@pytest.fixture(autouse=True)
def clean(target):
    target[0].Clear(pb.ClearRequest(seq_id=-1))
    yield


def code_of(fn, *a, **kw):
    with pytest.raises(grpc.RpcError) as err:
        fn(*a, **kw)
    return err.value.code(), err.value.details()


def test_health_goes_serving_after_load(target):
    seen = target[2]
    assert seen[-1] == health_pb2.HealthCheckResponse.SERVING


def test_model_info_reports_the_threads_llama_cpp_uses(target):
    info = target[0].GetModelInfo(pb.GetModelInfoRequest())
    assert (info.n_threads, info.n_threads_batch) == (1, 2)


def test_model_info_carries_a_calibrated_cost_curve(target):
    costs = [(c.n_tokens, c.seconds) for c in target[0].GetModelInfo(pb.GetModelInfoRequest()).decode_costs]
    assert [n for n, _ in costs] == [1, 2, 4, 8, 16, 32, 64]
    seconds = [t for _, t in costs]
    assert seconds[0] > 0 and seconds == sorted(seconds)  # never cheaper for a bigger batch
    assert seconds[-1] > 2 * seconds[0]  # 64 tokens cost more than one on any CPU
    assert "decode cost (tokens: ms): 1: " in target[3].log_path.read_text()
    # a target's prompts the router never prices: not timed (every start pays it)
    assert not target[0].GetModelInfo(pb.GetModelInfoRequest()).prompt_costs


def test_a_draft_drafts_on_every_core_only_while_the_target_waits(models):
    """ProposeRequest.target_busy: a draft with --threads-batch 2 drafts on
    both threads when the target waits for its drafts, and on --threads
    beside a verification (two processes' threads on two cores make
    llama.cpp's spin at every barrier). The drafts are the same either way."""
    from specd.scheduler import Window
    from specd.worker_service import Job, run_round

    engine = DraftModelEngine(LlamaConfig(models["draft"], n_ctx_seq=64, n_seq=1, n_threads=1, n_threads_batch=2))
    prompt = engine.tokenize("The capital of France is", True, False)
    drafts = []
    try:
        for busy, threads in ((False, 2), (True, 1), (False, 2)):
            engine.clear(0)
            op = pb.WorkerOp(propose=pb.ProposeRequest(seq_id=0, pos=0, tokens=prompt, n_max=3, target_busy=busy))
            [res] = run_round(engine, Window(batch=[Job(op)]))
            assert res.WhichOneof("result") == "propose", res
            assert engine.model.threads_now == threads
            drafts.append(list(res.propose.tokens))
    finally:
        engine.model.close()
    assert len(drafts[0]) == 3 and drafts.count(drafts[0]) == 3


def test_calibration_times_steps_with_every_tokens_logits_and_prompts_with_one(models):
    """Drafting and verification want logits for every token, and an output
    row is not free (the Q4_1 draft: 2 tokens 14 ms with one row, 20 with
    two): decode_costs is timed in that shape, prompt_costs (a prompt, a
    draft's catch-up) with the last token's logits."""
    engine = DraftModelEngine(LlamaConfig(models["draft"], n_ctx_seq=64, n_seq=1, n_threads=1))
    calls = []
    decode = engine.model.decode

    def recording(seq_id, pos, tokens, n_logits=1):
        calls.append((len(tokens), n_logits))
        return decode(seq_id, pos, tokens, n_logits)

    engine.model.decode = recording
    try:
        engine.calibrate(max_tokens=8, repeats=2)
        info = engine.info()
    finally:
        engine.model.close()
    assert sorted(set(calls)) == [(1, 1), (2, 1), (2, 2), (4, 1), (4, 4), (8, 1), (8, 8)]
    assert [n for n, _ in engine.decode_costs] == [n for n, _ in engine.prompt_costs] == [1, 2, 4, 8]
    assert info.prompt_costs == engine.prompt_costs and info.decode_costs == engine.decode_costs


def test_decode_rm_add_follow_llama_semantics(target):
    w = target[0]
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    s = w.Decode(pb.DecodeRequest(seq_id=1, pos=0, tokens=toks))
    assert (s.pos_min, s.pos_max, s.n_tokens, s.token_hash) == (0, 7, 8, history_hash(toks))
    s = w.SeqRm(pb.SeqRmRequest(seq_id=1, p0=6, p1=-1))  # [6, inf)
    assert (s.pos_max, s.n_tokens) == (5, 6)
    s = w.SeqRm(pb.SeqRmRequest(seq_id=1, p0=2, p1=4))  # middle [2, 4)
    assert s.n_tokens == 4
    s = w.SeqAdd(pb.SeqAddRequest(seq_id=1, p0=4, p1=-1, delta=-2))
    assert (s.pos_min, s.pos_max) == (0, 3) and s.token_hash == history_hash([1, 2, 5, 6])
    # decoding continues at the shifted end
    s = w.Decode(pb.DecodeRequest(seq_id=1, pos=4, tokens=[9]))
    assert s.token_hash == history_hash([1, 2, 5, 6, 9])
    # other sequences are untouched
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0)).n_tokens == 0


def test_seq_cp_copies_whole_sequences(target):
    w = target[0]
    w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[5, 6, 7]))
    s = w.SeqCp(pb.SeqCpRequest(seq_id_src=0, seq_id_dst=2, p0=-1, p1=-1))
    assert s.seq_id == 2 and s.token_hash == history_hash([5, 6, 7]) and s.pos_max == 2
    code, msg = code_of(w.SeqCp, pb.SeqCpRequest(seq_id_src=0, seq_id_dst=2, p0=1, p1=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "whole sequences" in msg


def test_checkpoint_restores_state_and_logits(target):
    w, t = target[0], target[1]
    prompt = [19556, 28, 957, 1462, 314]
    w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=prompt[:-1]))
    ck = w.CheckpointSave(pb.CheckpointSaveRequest(seq_id=0))
    assert (ck.pos_min, ck.pos_max, ck.n_tokens) == (0, 3, 4) and ck.n_bytes > 0
    first = t.Verify(pb.VerifyRequest(seq_id=0, pos=4, tokens=[prompt[-1], 11, 12, 13], trim=False))
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0)).pos_max == 7
    s = w.CheckpointRestore(pb.CheckpointRestoreRequest(handle=ck.handle, drop=True))
    assert (s.pos_max, s.token_hash) == (3, history_hash(prompt[:-1]))
    again = t.Verify(pb.VerifyRequest(seq_id=0, pos=4, tokens=[prompt[-1]], trim=True))
    assert again.tokens[0] == first.tokens[0]
    code, _ = code_of(w.CheckpointRestore, pb.CheckpointRestoreRequest(handle=ck.handle))
    assert code == grpc.StatusCode.NOT_FOUND


def test_verify_trims_rejected_drafts(target):
    w, t = target[0], target[1]
    prompt = [19556, 28, 957, 1462, 314]
    w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=prompt[:-1]))
    greedy = t.Verify(pb.VerifyRequest(seq_id=0, pos=4, tokens=[prompt[-1]], trim=True)).tokens[0]
    w.SeqRm(pb.SeqRmRequest(seq_id=0, p0=4, p1=-1))
    wrong = (greedy + 1) % 49152
    r = t.Verify(pb.VerifyRequest(seq_id=0, pos=4, tokens=[prompt[-1], greedy, wrong, 7], trim=True))
    assert r.tokens[0] == greedy and len(r.tokens) == 2  # one draft accepted, then the target's token
    assert r.state.pos_max == 5 and r.state.token_hash == history_hash(prompt + [greedy])
    assert len(r.pieces) == len(r.tokens)
    text = w.Detokenize(pb.DetokenizeRequest(tokens=list(r.tokens))).text
    assert b"".join(r.pieces).decode() == text and text


BAD = [
    ("Decode", pb.DecodeRequest(seq_id=N_SEQ, pos=0, tokens=[1]), grpc.StatusCode.INVALID_ARGUMENT, "seq_id"),
    ("Decode", pb.DecodeRequest(seq_id=0, pos=0, tokens=[]), grpc.StatusCode.INVALID_ARGUMENT, "tokens"),
    ("Decode", pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 49152]), grpc.StatusCode.INVALID_ARGUMENT, "tokens[1]"),
    ("Decode", pb.DecodeRequest(seq_id=0, pos=-1, tokens=[1]), grpc.StatusCode.INVALID_ARGUMENT, "pos"),
    ("Decode", pb.DecodeRequest(seq_id=0, pos=3, tokens=[1] * 254), grpc.StatusCode.OUT_OF_RANGE, "n_ctx_seq"),
    ("SeqRm", pb.SeqRmRequest(seq_id=0, p0=5, p1=2), grpc.StatusCode.INVALID_ARGUMENT, "p1"),
    ("SeqAdd", pb.SeqAddRequest(seq_id=0, p0=0, p1=-1, delta=-5), grpc.StatusCode.INVALID_ARGUMENT, "delta"),
    # int32 extremes: the shifted positions are computed without wrapping
    ("SeqAdd", pb.SeqAddRequest(seq_id=0, p0=1, p1=-1, delta=(1 << 31) - 1), grpc.StatusCode.INVALID_ARGUMENT,
     "delta = 2147483647 would move position 2 past n_ctx_seq"),
    ("SeqAdd", pb.SeqAddRequest(seq_id=0, p0=1, p1=(1 << 31) - 1, delta=-(1 << 31)), grpc.StatusCode.INVALID_ARGUMENT,
     "would move position 1 below 0"),
    ("SeqCp", pb.SeqCpRequest(seq_id_src=0, seq_id_dst=0, p0=-1, p1=-1), grpc.StatusCode.INVALID_ARGUMENT, "seq_id_dst"),
    ("CheckpointDrop", pb.CheckpointDropRequest(handle=999999), grpc.StatusCode.NOT_FOUND, "999999"),
]


@pytest.mark.parametrize("method,request_,code,word", BAD, ids=[f"{m}-{w[:24]}" for m, _, _, w in BAD])
def test_bad_input_changes_nothing(target, method, request_, code, word):
    w = target[0]
    w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2, 3]))
    before = w.GetSeqState(pb.GetSeqStateRequest(seq_id=0))
    got, msg = code_of(getattr(w, method), request_)
    assert got == code and word in msg
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0)) == before


INT32_EDGE = [
    ("seq_add", (0, 2, -1, 1 << 31), "delta"),
    ("seq_add", (0, 2, -1, -(1 << 31) - 1), "delta"),
    ("seq_add", (0, 1 << 31, -1, 1), "p0"),
    ("seq_add", (0, 0, 1 << 40, -1), "p1"),
    ("seq_rm", (0, 1 << 31, -1), "p0"),  # ctypes would wrap it to -2**31: "from 0", removing everything
    ("seq_rm", (0, 1, 1 << 70), "p1"),
    ("seq_cp", (0, 1, -(1 << 31) - 1, -1), "p0"),
    ("decode", (1, 1 << 32, [1]), "pos"),
]


@pytest.mark.parametrize("op,args,field", INT32_EDGE, ids=[f"{o}-{f}-{i}" for i, (o, _, f) in enumerate(INT32_EDGE)])
def test_values_past_int32_are_invalid_argument_in_process(engine, op, args, field):
    """In process (the router's LocalWorker) nothing stops a Python int past
    int32 before llama.cpp's C API, where ctypes would wrap it silently."""
    engine.clear(-1)
    engine.decode(0, 0, [1, 2, 3, 4, 5])
    before = engine.state(0), engine.state(1)
    with pytest.raises(InvalidArgument) as err:
        getattr(engine, op)(*args)
    assert err.value.message.startswith(f"{field} = ") and "int32" in err.value.message
    # neither the bookkeeping nor llama.cpp's memory moved
    assert (engine.state(0), engine.state(1)) == before
    assert (engine.model.seq_pos_min(0), engine.model.seq_pos_max(0)) == (0, 4)


@pytest.fixture(scope="module")
def engine(models):
    e = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=256, n_seq=2, n_threads=1))
    yield e
    e.model.close()


def test_bad_verify_and_wrong_position(target):
    w, t = target[0], target[1]
    w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2, 3]))
    code, msg = code_of(t.Verify, pb.VerifyRequest(seq_id=0, pos=5, tokens=[4]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "next position is 3" in msg
    code, msg = code_of(t.Verify, pb.VerifyRequest(seq_id=0, pos=3, tokens=[4], sampling=pb.SamplingParams(temperature=-1)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in msg
    code, msg = code_of(t.Verify, pb.VerifyRequest(seq_id=0, pos=3, tokens=[4], n_more=2, stop_on_repeat=-1))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "stop_on_repeat" in msg
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0)).pos_max == 2  # nothing decoded


def test_an_empty_sequence_takes_position_0_only(target):
    """A router that believes the worker holds a prefix it lost (a restart)
    must be refused, not have its tokens decoded without their context."""
    w = target[0]
    code, msg = code_of(w.Decode, pb.DecodeRequest(seq_id=1, pos=7, tokens=[4, 5]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "is empty" in msg and "next position is 0" in msg
    code, _ = code_of(target[1].Verify, pb.VerifyRequest(seq_id=1, pos=3, tokens=[4]))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=1)).n_tokens == 0


def test_a_stream_meant_for_another_worker_process_is_refused(target):
    w = target[0]
    info = w.GetModelInfo(pb.GetModelInfoRequest())
    assert len(info.instance_id) >= 16 and info.instance_id == w.GetModelInfo(pb.GetModelInfoRequest()).instance_id
    ops = [pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2]))]
    with pytest.raises(grpc.RpcError) as err:
        list(w.Execute(iter(ops), metadata=(("specd-instance-id", "an-older-process"),), timeout=30))
    assert err.value.code() == grpc.StatusCode.ABORTED and "restarted" in err.value.details()
    assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0)).n_tokens == 0  # nothing ran
    ok = list(w.Execute(iter(ops), metadata=(("specd-instance-id", info.instance_id),), timeout=30))
    assert ok[0].state.n_tokens == 2


def test_execute_pipeline_keeps_order_and_reports_errors(target):
    w = target[0]
    ops = [
        pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2, 3, 4])),
        pb.WorkerOp(seq_rm=pb.SeqRmRequest(seq_id=0, p0=2, p1=-1)),
        pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=9, tokens=[5])),  # wrong position
        pb.WorkerOp(decode=pb.DecodeRequest(seq_id=0, pos=2, tokens=[5])),
        pb.WorkerOp(),  # no operation
        pb.WorkerOp(get_seq_state=pb.GetSeqStateRequest(seq_id=0)),
        pb.WorkerOp(propose=pb.ProposeRequest(seq_id=0, pos=3, tokens=[1], n_max=2)),
    ]
    results = list(w.Execute(iter(ops), timeout=30))
    kinds = [r.WhichOneof("result") for r in results]
    assert kinds == ["state", "state", "error", "state", "error", "state", "error"]
    assert results[2].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert results[5].state.token_hash == history_hash([1, 2, 5])
    assert results[6].error.code == grpc.StatusCode.UNIMPLEMENTED.value[0]


def test_worker_survives_a_burst_of_garbage(target):
    w = target[0]
    for i in range(50):
        try:
            w.Decode(pb.DecodeRequest(seq_id=i % 7 - 2, pos=i * 37 % 300 - 5, tokens=[i * 9973 % 60000 - 100]))
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.OUT_OF_RANGE)
    assert target[3].popen.poll() is None
    w.Clear(pb.ClearRequest(seq_id=-1))
    assert w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[1])).n_tokens == 1


@pytest.fixture(scope="module")
def draft(models, tmp_path_factory):
    proc, address = start_worker("draft", models["draft"], tmp_path_factory.mktemp("draft"))
    wait_serving(address)
    ch = grpc.insecure_channel(address)
    yield pb_grpc.WorkerStub(ch), pb_grpc.DraftWorkerStub(ch), ch
    ch.close()
    assert proc.stop() == 0  # SIGTERM: graceful, exit code 0


def test_draft_worker_proposes_and_keeps_contract(draft):
    w, d, ch = draft
    w.Clear(pb.ClearRequest(seq_id=-1))
    prompt = [19556, 28, 957, 1462, 314]
    r = d.Propose(pb.ProposeRequest(seq_id=0, pos=0, tokens=prompt, n_max=4))
    assert len(r.tokens) == 4
    # holds the tail and d0..d2: the last draft is not evaluated
    assert r.state.token_hash == history_hash(prompt + list(r.tokens[:3]))
    code, msg = code_of(d.Propose, pb.ProposeRequest(seq_id=0, pos=8, tokens=[1], n_max=0))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "n_max" in msg
    code, _ = code_of(pb_grpc.TargetWorkerStub(ch).Verify, pb.VerifyRequest(seq_id=0, pos=8, tokens=[1]))
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert w.GetModelInfo(pb.GetModelInfoRequest()).kind == "model"


def _populated(msg) -> set[str]:
    return {f.name for f, _ in msg.ListFields()}


def _unary_and_execute(w, unary, kind: str, request, prompt: list[int]):
    """The answer of the unary RPC and of Execute to `request`, each on a
    sequence 0 holding `prompt`."""
    answers = []
    for call in (lambda: unary(request, timeout=30),
                 lambda: list(w.Execute(iter([pb.WorkerOp(**{kind: request})]), timeout=30))[0]):
        w.Clear(pb.ClearRequest(seq_id=0))
        w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=prompt))
        answers.append(call())
    one, res = answers
    assert res.WhichOneof("result") == kind, res
    return one, getattr(res, kind)


def test_unary_verify_answers_as_execute(target):
    """Verify and an Execute verify are one path: the same input gets the same
    answer, batch_tokens and batch_seconds included (timings may differ)."""
    w, t = target[0], target[1]
    prompt = [19556, 28, 957, 1462, 314]
    request = pb.VerifyRequest(seq_id=0, pos=4, tokens=[prompt[-1], 11, 12], trim=True, draft_busy=True,
                               sampling=pb.SamplingParams(temperature=0.8, seed=5))
    one, streamed = _unary_and_execute(w, t.Verify, "verify", request, prompt[:-1])
    assert {"tokens", "pieces", "state", "compute_seconds", "batch_tokens", "batch_seconds"} <= _populated(one)
    assert _populated(one) == _populated(streamed)
    assert (one.tokens, one.pieces, one.state) == (streamed.tokens, streamed.pieces, streamed.state)
    assert one.batch_tokens == streamed.batch_tokens == 3


def test_unary_propose_answers_as_execute(draft):
    w, d, _ = draft
    prompt = [19556, 28, 957, 1462, 314]
    request = pb.ProposeRequest(seq_id=0, pos=4, tokens=[prompt[-1]], n_max=3,
                                sampling=pb.SamplingParams(temperature=1.0, seed=7), sample_index=2)
    one, streamed = _unary_and_execute(w, d.Propose, "propose", request, prompt[:-1])
    assert {"tokens", "state", "compute_seconds", "batch_tokens", "batch_seconds", "q"} <= _populated(one)
    assert _populated(one) == _populated(streamed)
    assert (one.tokens, one.state, one.q) == (streamed.tokens, streamed.state, streamed.q)
    assert one.batch_tokens == streamed.batch_tokens == 1  # the last draft's decode


@pytest.mark.parametrize("cls", [TargetEngine, DraftModelEngine, NgramEngine])
def test_engines_declare_what_they_serve(cls):
    """The servicer answers UNIMPLEMENTED by an engine's declared capabilities:
    each must match the methods the engine has."""
    caps = cls.capabilities
    assert caps.verifies == hasattr(cls, "verify_steps") == hasattr(cls, "verify")
    assert caps.proposes == hasattr(cls, "propose_steps") == hasattr(cls, "propose")
    assert caps.vocabulary == hasattr(cls, "tokenize") == hasattr(cls, "detokenize")
    assert caps.chat_template == hasattr(cls, "apply_chat_template")


@pytest.mark.parametrize("flag,value", [("--threads", "0"), ("--threads-batch", "-1"), ("--threads", "two")])
def test_thread_flags_refuse_bad_values_naming_the_flag(flag, value):
    p = subprocess.run([sys.executable, "-m", "specd", "target", flag, value], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and f"argument {flag}:" in p.stderr, p.stderr
