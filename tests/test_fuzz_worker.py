"""Fuzzing the worker's KV operations (hypothesis) against real worker
processes: a target worker on a real llama.cpp model and an n-gram draft
worker, both over gRPC on 127.0.0.1.

Random sequences of decode, seq_rm, seq_add, seq_cp, checkpoint
save/restore/drop and clear, with valid and invalid sequence ids, ranges,
positions, deltas, token ids and handles, go to both workers. After every
operation:

- neither worker crashed;
- a refused operation got the code the worker protocol defines
  (INVALID_ARGUMENT for a bad argument, FAILED_PRECONDITION where the state
  forbids it, OUT_OF_RANGE past the context, NOT_FOUND for an unknown
  checkpoint) and changed nothing;
- what each worker reports for every sequence (positions from llama.cpp's
  memory on the target, token count and (position, token) hash) equals a
  plain Python model of the KV state kept here;
- so the two workers stay aligned with each other.
"""
from __future__ import annotations

import hashlib
import os
import time

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specd.launcher import Proc
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.test_worker_grpc import wait_serving

N_SEQ = 3
N_CTX = 256  # llama.cpp pads a context to a multiple of 256: both workers then hold the same
N_VOCAB = 49152  # SmolLM2's; the n-gram worker is told it with --n-vocab
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
OK = grpc.StatusCode.OK
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
OUT_OF_RANGE, NOT_FOUND = grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def workers(models, tmp_path_factory):
    common = ["--port", "0", "--threads", "1", "--n-ctx", str(N_CTX), "--n-seq", str(N_SEQ)]
    procs = {
        "target": Proc("target", ["target", "--model", models["target"], "--no-calibrate", *common],
                       tmp_path_factory.mktemp("target")),
        "ngram": Proc("draft", ["draft", "--ngram", "simple", "--n-vocab", str(N_VOCAB), *common],
                      tmp_path_factory.mktemp("ngram")),
    }
    channels = {}
    try:
        for name, p in procs.items():
            address = f"127.0.0.1:{p.wait_port(time.monotonic() + 60)}"
            wait_serving(address)
            channels[name] = grpc.insecure_channel(address)
        stubs = {name: pb_grpc.WorkerStub(ch) for name, ch in channels.items()}
        for stub in stubs.values():
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            assert (info.n_ctx_seq, info.n_seq, info.n_vocab, info.can_shift) == (N_CTX, N_SEQ, N_VOCAB, True)
        yield stubs, procs, {name: 0 for name in stubs}  # the highest handle each worker handed out
    finally:
        for ch in channels.values():
            ch.close()
        for p in procs.values():
            p.stop()


# ----------------------------------------------------------------- the model
def kv_hash(seq: dict[int, int]) -> str:
    """specd.tokens.token_hash, written again: blake2b-128 of the int32
    positions then the int32 tokens, in position order."""
    pos = sorted(seq)
    h = hashlib.blake2b(digest_size=16)
    h.update(np.asarray(pos, dtype="<i4").tobytes())
    h.update(np.asarray([seq[p] for p in pos], dtype="<i4").tobytes())
    return h.hexdigest()


class Model:
    """What a worker holds: per sequence {position: token}; checkpoints.

    Checkpoints have handles of our own, 1, 2, .. in each example: a worker
    numbers them over its lifetime, so the test maps ours to each worker's
    (`worker_handle`) and never sends one of our numbers as a worker's."""

    def __init__(self):
        self.seqs: list[dict[int, int]] = [{} for _ in range(N_SEQ)]
        self.ckpts: dict[int, tuple[int, dict[int, int]]] = {}  # our handle -> (seq_id, tokens)
        self.next_handle = 1

    def gone(self) -> list[int]:
        """Our handles of checkpoints saved in this example and dropped since."""
        return [h for h in range(1, self.next_handle) if h not in self.ckpts]

    @staticmethod
    def in_range(p: int, p0: int, p1: int) -> bool:
        return p >= max(p0, 0) and (p1 < 0 or p < p1)

    def seq_ok(self, seq_id: int) -> bool:
        return 0 <= seq_id < N_SEQ

    def next_pos(self, seq_id: int) -> int:
        s = self.seqs[seq_id] if self.seq_ok(seq_id) else {}
        return max(s) + 1 if s else 0

    # each returns the status the workers must answer, applying the op when OK
    def decode(self, seq_id, pos, tokens):
        if not self.seq_ok(seq_id) or not tokens or any(not 0 <= t < N_VOCAB for t in tokens) or pos < 0:
            return INVALID
        s = self.seqs[seq_id]
        if pos != self.next_pos(seq_id):  # an empty sequence takes position 0 only
            return PRECONDITION
        if pos + len(tokens) > N_CTX:
            return OUT_OF_RANGE
        s.update({pos + i: t for i, t in enumerate(tokens)})
        return OK

    def seq_rm(self, seq_id, p0, p1):
        if not self.seq_ok(seq_id) or (p0 >= 0 and p1 >= 0 and p1 < p0):
            return INVALID
        s = self.seqs[seq_id]
        for p in [p for p in s if self.in_range(p, p0, p1)]:
            del s[p]
        return OK

    def seq_add(self, seq_id, p0, p1, delta):
        if not self.seq_ok(seq_id) or (p0 >= 0 and p1 >= 0 and p1 < p0):
            return INVALID
        s = self.seqs[seq_id]
        moving = {p: t for p, t in s.items() if self.in_range(p, p0, p1)}
        moved = {p + delta: t for p, t in moving.items()}
        if any(p < 0 or p >= N_CTX for p in moved):
            return INVALID
        staying = {p: t for p, t in s.items() if p not in moving}
        if set(staying) & set(moved):
            return PRECONDITION
        self.seqs[seq_id] = {**staying, **moved}
        return OK

    def seq_cp(self, src, dst, p0, p1):
        if not self.seq_ok(src) or not self.seq_ok(dst) or src == dst or p0 > 0 or p1 >= 0:
            return INVALID
        self.seqs[dst] = dict(self.seqs[src])
        return OK

    def checkpoint_save(self, seq_id):
        if not self.seq_ok(seq_id):
            return INVALID, None
        h = self.next_handle
        self.next_handle += 1
        self.ckpts[h] = (seq_id, dict(self.seqs[seq_id]))
        return OK, h

    def checkpoint_restore(self, h, drop):
        if h not in self.ckpts:
            return NOT_FOUND
        seq_id, toks = self.ckpts[h]
        self.seqs[seq_id] = dict(toks)
        if drop:
            del self.ckpts[h]
        return OK

    def checkpoint_drop(self, h):
        if h not in self.ckpts:
            return NOT_FOUND
        del self.ckpts[h]
        return OK

    def clear(self, seq_id):
        if seq_id != -1 and not self.seq_ok(seq_id):
            return INVALID
        for i in range(N_SEQ) if seq_id == -1 else [seq_id]:
            self.seqs[i] = {}
            for h in [h for h, (s, _) in self.ckpts.items() if s == i]:
                del self.ckpts[h]
        return OK

    def state(self, seq_id: int) -> tuple:
        s = self.seqs[seq_id]
        return (seq_id, min(s), max(s), len(s), kv_hash(s)) if s else (seq_id, -1, -1, 0, kv_hash({}))


# -------------------------------------------------------------- strategies
EXTREMES = [INT32_MIN, INT32_MIN + 1, -(1 << 20), (1 << 20), INT32_MAX - 1, INT32_MAX]


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Mostly in [lo, hi], sometimes an int32 extreme."""
    return st.one_of(st.integers(lo, hi), st.integers(lo, hi), st.integers(lo, hi), st.sampled_from(EXTREMES))


seq_ids = st.one_of(st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1), st.integers(0, N_SEQ - 1),
                    st.sampled_from([-2, -1, N_SEQ, N_SEQ + 1, INT32_MAX, INT32_MIN]))
tokens = st.lists(st.one_of(st.integers(0, 60), st.integers(0, 60), st.integers(0, N_VOCAB - 1),
                            st.sampled_from([-1, N_VOCAB, N_VOCAB + 1, INT32_MIN, INT32_MAX])),
                  min_size=0, max_size=6)
positions = ints(-3, N_CTX + 3)
deltas = ints(-N_CTX - 2, N_CTX + 2)

KINDS = ["decode"] * 5 + ["seq_rm"] * 2 + ["seq_add"] * 3 + ["seq_cp", "save", "save", "restore", "restore", "drop",
                                                             "clear", "state"]


def draw_op(data, model: Model) -> tuple:
    kind = data.draw(st.sampled_from(KINDS), label="kind")
    if kind == "decode":
        seq_id = data.draw(seq_ids, label="seq_id")
        # mostly the next position, so that sequences grow
        nxt = model.next_pos(seq_id)
        pos = data.draw(st.one_of(st.just(nxt), st.just(nxt), st.just(nxt), st.just(nxt + 1),
                                  st.just(nxt - 1), positions), label="pos")
        return kind, seq_id, pos, data.draw(tokens, label="tokens")
    if kind in ("seq_rm", "seq_add"):
        seq_id = data.draw(seq_ids, label="seq_id")
        p0 = data.draw(st.one_of(st.just(-1), positions), label="p0")
        p1 = data.draw(st.one_of(st.just(-1), positions), label="p1")
        if kind == "seq_rm":
            return kind, seq_id, p0, p1
        return kind, seq_id, p0, p1, data.draw(deltas, label="delta")
    if kind == "seq_cp":
        p0 = data.draw(st.sampled_from([-1, -1, -1, 0, 1, 5, INT32_MIN]), label="p0")
        p1 = data.draw(st.sampled_from([-1, -1, -1, 0, 3, INT32_MAX]), label="p1")
        return kind, data.draw(seq_ids, label="src"), data.draw(seq_ids, label="dst"), p0, p1
    if kind == "save":
        return kind, data.draw(seq_ids, label="seq_id")
    if kind in ("restore", "drop"):
        # drawn from this example's own checkpoints only (live, then dropped)
        # and handles no worker has handed out (NEVER_ISSUED): what a worker
        # numbered before this example must not decide what is drawn
        known, gone = sorted(model.ckpts), model.gone()
        choices = [st.sampled_from(known)] * 2 if known else []
        choices += [st.sampled_from(gone)] if gone else []
        h = data.draw(st.one_of(*choices, st.sampled_from(NEVER_ISSUED)), label="handle")
        if kind == "drop":
            return kind, h
        return kind, h, data.draw(st.booleans(), label="drop")
    if kind == "clear":
        return kind, data.draw(st.one_of(st.just(-1), seq_ids), label="seq_id")
    return kind, data.draw(seq_ids, label="seq_id")


# handles no worker has handed out when they are sent: workers number from 1;
# NEXT_HANDLE stands for the one the worker will hand out next
NEXT_HANDLE = -1
NEVER_ISSUED = [0, NEXT_HANDLE, 10**6, (1 << 64) - 1]


def worker_handle(handles: dict[int, int], issued: int, h: int) -> int:
    """The worker's handle for `h`: ours mapped (`handles`), NEXT_HANDLE one
    past the highest it handed out (`issued`), the other NEVER_ISSUED as they are."""
    if h == NEXT_HANDLE:
        return issued + 1
    return handles.get(h, h)


def call(stub, handles: dict[int, int], issued: int, op: tuple):
    """Run one op on a worker; return (status code, response)."""
    kind = op[0]
    try:
        if kind == "decode":
            r = stub.Decode(pb.DecodeRequest(seq_id=op[1], pos=op[2], tokens=op[3]), timeout=30)
        elif kind == "seq_rm":
            r = stub.SeqRm(pb.SeqRmRequest(seq_id=op[1], p0=op[2], p1=op[3]), timeout=30)
        elif kind == "seq_add":
            r = stub.SeqAdd(pb.SeqAddRequest(seq_id=op[1], p0=op[2], p1=op[3], delta=op[4]), timeout=30)
        elif kind == "seq_cp":
            r = stub.SeqCp(pb.SeqCpRequest(seq_id_src=op[1], seq_id_dst=op[2], p0=op[3], p1=op[4]), timeout=30)
        elif kind == "save":
            r = stub.CheckpointSave(pb.CheckpointSaveRequest(seq_id=op[1]), timeout=30)
        elif kind == "restore":
            r = stub.CheckpointRestore(
                pb.CheckpointRestoreRequest(handle=worker_handle(handles, issued, op[1]), drop=op[2]), timeout=30)
        elif kind == "drop":
            r = stub.CheckpointDrop(pb.CheckpointDropRequest(handle=worker_handle(handles, issued, op[1])), timeout=30)
        elif kind == "clear":
            r = stub.Clear(pb.ClearRequest(seq_id=op[1]), timeout=30)
        else:
            r = stub.GetSeqState(pb.GetSeqStateRequest(seq_id=op[1]), timeout=30)
    except grpc.RpcError as exc:
        return exc.code(), exc.details()
    return OK, r


def expect(model: Model, op: tuple):
    """Status the op must get, applying it to the model; for a save, the new handle."""
    kind = op[0]
    if kind == "decode":
        return model.decode(*op[1:]), None
    if kind == "seq_rm":
        return model.seq_rm(*op[1:]), None
    if kind == "seq_add":
        return model.seq_add(*op[1:]), None
    if kind == "seq_cp":
        return model.seq_cp(*op[1:]), None
    if kind == "save":
        return model.checkpoint_save(op[1])
    if kind == "restore":
        return model.checkpoint_restore(op[1], op[2]), None
    if kind == "drop":
        return model.checkpoint_drop(op[1]), None
    if kind == "clear":
        return model.clear(op[1]), None
    return (OK if model.seq_ok(op[1]) else INVALID), None


# ------------------------------------------------------------------- test
STATS = {"examples": 0, "ops": 0}


# about 0.2 s an example on 2 shared cores; SPECD_FUZZ_EXAMPLES runs more
@settings(max_examples=int(os.environ.get("SPECD_FUZZ_EXAMPLES", "150")), deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_random_kv_operations_match_a_model_on_target_and_ngram(workers, data):
    stubs, procs, issued = workers
    model = Model()
    for name, stub in stubs.items():  # every example starts from empty workers
        stub.Clear(pb.ClearRequest(seq_id=-1), timeout=30)  # also drops every checkpoint
        for i in range(N_SEQ):
            s = stub.GetSeqState(pb.GetSeqStateRequest(seq_id=i), timeout=30)
            assert (s.seq_id, s.pos_min, s.pos_max, s.n_tokens, s.token_hash) == model.state(i), name
    handles = {name: {} for name in stubs}  # our handle -> the worker's
    n_ops = data.draw(st.integers(1, 40), label="n_ops")
    STATS["examples"] += 1
    for step in range(n_ops):
        op = draw_op(data, model)
        want, new_handle = expect(model, op)
        for name, stub in stubs.items():
            got, res = call(stub, handles[name], issued[name], op)
            assert procs[name].popen.poll() is None, f"{name} died on {op}"
            assert got == want, f"step {step}: {op} on {name}: {got.name} ({res if got != OK else ''}), " \
                                f"the model says {want.name}"
            if got == INVALID and op[0] not in ("restore", "drop"):
                # the message names what is wrong
                assert any(w in res for w in ("seq_id", "tokens", "pos", "p0", "p1", "delta", "n_vocab")), res
            if new_handle is not None:
                assert res.handle > issued[name], "a worker hands out each handle once"
                handles[name][new_handle] = issued[name] = res.handle
                assert (res.seq_id, res.n_tokens) == (op[1], len(model.seqs[op[1]]))
        # after every op both workers hold exactly what the model says, for every sequence
        for name, stub in stubs.items():
            for i in range(N_SEQ):
                s = stub.GetSeqState(pb.GetSeqStateRequest(seq_id=i), timeout=30)
                got_state = (s.seq_id, s.pos_min, s.pos_max, s.n_tokens, s.token_hash)
                assert got_state == model.state(i), f"step {step} after {op}: {name} seq {i}"
        STATS["ops"] += 1


def test_fuzz_summary_and_workers_alive(workers):
    """Runs after the fuzz test (file order): both workers still serve."""
    stubs, procs, _ = workers
    for name, stub in stubs.items():
        assert procs[name].popen.poll() is None
        stub.Clear(pb.ClearRequest(seq_id=-1), timeout=30)
        assert stub.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2, 3]), timeout=30).n_tokens == 3
    print(f"\nfuzzed {STATS['examples']} examples, {STATS['ops']} operations on each worker")
