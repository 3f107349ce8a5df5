"""The n-gram draft worker (`specd draft --ngram`) over gRPC: it validates
token ids like the model workers do, although it has no vocabulary of its
own, and the router holds it to the target's vocabulary size when given one."""
from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from specd.router.compat import check_vocab
from specd.engine import ModelInfo
from specd.errors import FailedPrecondition
from specd.launcher import Cluster, ClusterSpec, Proc, ProcessDied
from specd.tokens import history_hash
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc
from tests.test_worker_grpc import wait_serving

N_VOCAB = 49152  # SmolLM2's


def start_ngram(tmp_path, *extra, spec: str = "simple") -> tuple[Proc, str]:
    p = Proc("draft", ["draft", "--ngram", spec, "--port", "0", "--n-ctx", "256", "--n-seq", "2", *extra], tmp_path)
    address = f"127.0.0.1:{p.wait_port(time.monotonic() + 60)}"
    wait_serving(address)
    return p, address


def code_of(fn, req):
    with pytest.raises(grpc.RpcError) as err:
        fn(req, timeout=10)
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("n_vocab", [0, N_VOCAB])
def test_ngram_worker_refuses_negative_and_out_of_vocabulary_ids(tmp_path, n_vocab):
    proc, address = start_ngram(tmp_path, *(["--n-vocab", str(n_vocab)] if n_vocab else []))
    try:
        with grpc.insecure_channel(address) as ch:
            w, d = pb_grpc.WorkerStub(ch), pb_grpc.DraftWorkerStub(ch)
            assert w.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).n_vocab == n_vocab
            w.Decode(pb.DecodeRequest(seq_id=0, pos=0, tokens=[1, 2, 3]), timeout=10)
            before = w.GetSeqState(pb.GetSeqStateRequest(seq_id=0), timeout=10)
            bad = [
                (w.Decode, pb.DecodeRequest(seq_id=0, pos=3, tokens=[4, -1]), "tokens[1] = -1"),
                (w.Decode, pb.DecodeRequest(seq_id=0, pos=3, tokens=[-(1 << 31)]), "tokens[0]"),
                (d.Propose, pb.ProposeRequest(seq_id=0, pos=3, tokens=[-7], n_max=2), "tokens[0] = -7"),
                (w.Decode, pb.DecodeRequest(seq_id=1, pos=0, tokens=[5, 6, -2]), "tokens[2]"),
            ]
            if n_vocab:
                bad += [
                    (w.Decode, pb.DecodeRequest(seq_id=0, pos=3, tokens=[N_VOCAB]), f"n_vocab = {N_VOCAB}"),
                    (d.Propose, pb.ProposeRequest(seq_id=0, pos=3, tokens=[1, N_VOCAB + 5], n_max=2), "tokens[1]"),
                ]
            for fn, req, word in bad:
                code, msg = code_of(fn, req)
                assert code == grpc.StatusCode.INVALID_ARGUMENT and word in msg, (req, code, msg)
                # a refused request changes nothing
                assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=0), timeout=10) == before
                assert w.GetSeqState(pb.GetSeqStateRequest(seq_id=1), timeout=10).n_tokens == 0
            if not n_vocab:  # no vocabulary given: any non-negative id is a token
                s = w.Decode(pb.DecodeRequest(seq_id=0, pos=3, tokens=[N_VOCAB, (1 << 31) - 1]), timeout=10)
                assert s.token_hash == history_hash([1, 2, 3, N_VOCAB, (1 << 31) - 1])
            assert proc.popen.poll() is None
    finally:
        assert proc.stop() == 0


L, K, X, Y = list(range(100, 112)), [1, 2, 3], list(range(10, 18)), list(range(20, 28))


class Drafter:
    """The calls a router makes on the draft worker for one sequence, as
    router/engine.py makes them with overlap."""

    def __init__(self, w, d, seq: int = 0):
        self.w, self.d, self.seq = w, d, seq
        self.held = 0  # tokens of the history the worker holds

    def propose(self, pos: int, tokens: list[int], n_max: int = 4) -> list[int]:
        r = self.d.Propose(pb.ProposeRequest(seq_id=self.seq, pos=pos, tokens=tokens, n_max=n_max), timeout=10)
        return list(r.tokens)

    def step_rejected(self, tail: list[int], target_says: int) -> list[int]:
        """Propose after the tail, draft on beside the verification (the
        lookahead), then the target rejects the first draft: cut both back."""
        n = self.held + len(tail)
        drafts = self.propose(self.held, tail)
        assert drafts
        self.propose(n + len(drafts) - 1, drafts[-1:])  # the lookahead: drafts[-1] is not verified
        self.w.SeqRm(pb.SeqRmRequest(seq_id=self.seq, p0=n, p1=-1), timeout=10)
        self.held = n
        return [target_says]


def test_mod_drafter_resets_after_drafts_rejected_beside_lookaheads(tmp_path):
    # with overlap every Propose after a draft is a lookahead whose history
    # holds that draft unverified: the n-gram learners judged the draft on it
    # (all accepted), and `mod` never emptied its table after a streak of
    # rejected drafts, as llama.cpp's ngram-mod does
    proc, address = start_ngram(tmp_path, spec="mod:n-match=3:n-min=1:n-max=4")
    try:
        with grpc.insecure_channel(address) as ch:
            w, d = pb_grpc.WorkerStub(ch), pb_grpc.DraftWorkerStub(ch)
            router = Drafter(w, d)
            router.propose(0, [70, 71, 72] + Y)  # an earlier session teaches the table 70 71 72 -> Y
            w.Clear(pb.ClearRequest(seq_id=0), timeout=10)  # the table outlives a session
            tail = L + K + X + K
            for r in range(5):
                tail = router.step_rejected(tail, 500 + r) + K  # plain steps bring K again
            router.propose(router.held, tail)  # judges the 5th rejected draft
            w.Clear(pb.ClearRequest(seq_id=0), timeout=10)
            assert Drafter(w, d).propose(0, [61, 70, 71, 72]) == [], "5 rejected drafts in a row empty the table"
            assert proc.popen.poll() is None
    finally:
        assert proc.stop() == 0


def _info(n_vocab: int, fingerprint: str = "", path: str = "") -> ModelInfo:
    return ModelInfo(kind="model" if fingerprint else "ngram", description="ngram:simple", architecture="",
                     n_vocab=n_vocab, vocab_fingerprint=fingerprint, n_ctx_seq=256, n_seq=1, can_rm_partial=True,
                     can_shift=True, n_swa=0, eog_tokens=(), add_bos=False, n_threads=1, model_path=path)


def test_check_vocab_holds_an_ngram_drafter_to_its_vocabulary_size():
    target = _info(N_VOCAB, "f" * 64, "target.gguf")
    check_vocab(target, _info(0))  # no vocabulary: any target
    check_vocab(target, _info(N_VOCAB))
    with pytest.raises(FailedPrecondition, match="vocabular"):
        check_vocab(target, _info(1000))
    with pytest.raises(FailedPrecondition):  # a model's fingerprint must still match
        check_vocab(target, _info(N_VOCAB, "0" * 64, "other.gguf"))


def test_router_refuses_an_ngram_drafter_of_another_vocabulary_size(models):
    spec = ClusterSpec(target_model=models["target"], ngram="simple", ngram_in_router=False, n_ctx=256, n_seq=1,
                       draft_args=["--n-vocab", "1000"])
    with pytest.raises(ProcessDied) as err:
        Cluster(spec).start(timeout=120)
    assert "router exited" in str(err.value) and "n_vocab 1000" in str(err.value)


def test_a_reused_workdir_old_port_file_is_not_read_as_the_new_port(tmp_path):
    # a previous run left its port file behind; the new process must be
    # reached at its own port, not at the dead one (this hung `Cluster(workdir=...)`)
    (tmp_path / "draft.port").write_text("1")
    proc, address = start_ngram(tmp_path)
    try:
        assert not address.endswith(":1")
    finally:
        proc.stop()


@pytest.mark.parametrize("args,message", [
    (["--ngram", "simple", "--draft", "127.0.0.1:1"], "--draft and --ngram exclude each other"),
    (["--ngram", "simple:size-n=0"], "--ngram simple:size-n=0"),
    (["--ngram", "nonsense"], "--ngram nonsense"),
])
def test_router_refuses_a_bad_in_process_ngram_drafter_naming_the_flag(tmp_path, args, message):
    """router --ngram: a bad spec or a second drafter ends the router at start
    with a message naming the flag, before it listens."""
    proc = subprocess.run([sys.executable, "-m", "specd", "router", "--target", "127.0.0.1:1", "--port", "0",
                           "--http-port", "0", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


def test_the_ngram_engine_tells_map_k_where_the_prompt_ends():
    """What the router decodes before a request's first proposal is its
    prompt (llama.cpp's common_speculative_begin): map-k searches the
    prompt before the tokens the target generated alone since."""
    from specd.draft_worker.engine import NgramEngine

    L, K, X, Y = list(range(100, 112)), [1, 2, 3], list(range(10, 18)), list(range(20, 28))
    prompt, alone = L + K + X, K + Y + [7] + K
    told = NgramEngine("map-k:size-n=3:size-m=4", 1, 512)
    told.decode(0, 0, prompt[:-1])                   # the prefill: all but the last token
    res = told.propose(0, len(prompt) - 1, prompt[-1:] + alone, 4, 0, 0.0)
    assert told.proposers[0].map.size_last_begin == len(prompt)
    assert res.tokens == X[:4]                       # K's copy in the prompt
    untold = NgramEngine("map-k:size-n=3:size-m=4", 1, 512)
    res = untold.propose(0, 0, prompt + alone, 4, 0, 0.0)
    assert res.tokens == Y[:4]                       # all of it taken for the prompt: the latest copy
    told.clear(0)
    assert 0 not in told.prompts
