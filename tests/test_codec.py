"""specd.codec: plain values survive the wire, and every field is carried."""
from __future__ import annotations

import dataclasses

import grpc
import numpy as np
import pytest

from specd import codec, errors
from specd.engine import CheckpointInfo, ModelInfo, ProposeResult, SeqState, VerifyResult
from specd.sampling import Sampling, dist_of
from specd.worker.v1 import worker_pb2 as pb

STATE = SeqState(1, 0, 6, 7, "ab12")


def test_model_info_carries_every_field():
    info = ModelInfo(kind="model", description="d", architecture="llama", n_vocab=100, vocab_fingerprint="f",
                     n_ctx_seq=256, n_seq=2, can_rm_partial=True, can_shift=False, n_swa=4, eog_tokens=(2, 3),
                     add_bos=True, n_threads=2, model_path="/m.gguf", decode_costs=((1, 0.5), (2, 0.75)),
                     n_threads_batch=4, decode_costs_shared=((1, 0.25),), prompt_costs=((8, 1.5),),
                     instance_id="abc")
    assert {f.name for f in dataclasses.fields(ModelInfo)} == {*codec._INFO_FIELDS, *codec._INFO_COSTS,
                                                              "eog_tokens", "n_threads_batch"}
    wire = pb.ModelInfo.FromString(codec.model_info_pb(info).SerializeToString())
    assert codec.model_info_from_pb(wire) == info


def test_engine_results_round_trip():
    assert codec.state_from_pb(codec.state_pb(STATE)) == STATE
    ck = CheckpointInfo(5, 1, 0, 6, 7, 1024)
    assert codec.checkpoint_from_pb(codec.checkpoint_pb(ck)) == ck
    v = VerifyResult([4, 5], [b"a", b"b"], STATE, 0.5, 3, 0.25)
    assert codec.result_from_pb(codec.result_pb("verify", v)) == v
    q = [dist_of([3, 9], [0.25, 0.75])]
    p = codec.result_from_pb(codec.result_pb("propose", ProposeResult([9], STATE, 0.5, 1, 0.125, q)))
    assert (p.tokens, p.state, p.batch_tokens, p.batch_seconds) == ([9], STATE, 1, 0.125)
    assert np.array_equal(p.q[0].ids, q[0].ids) and np.allclose(p.q[0].probs, q[0].probs)
    assert codec.result_pb("clear", None) == pb.WorkerResult(done=True)
    assert codec.response_pb("clear", None) == pb.ClearResponse()


def test_sampling_unset_seed_is_zero_or_random():
    s = codec.sampling_from_pb(pb.SamplingParams(temperature=0.5))
    assert s == Sampling(temperature=0.5, top_p=1.0, seed=0)  # proto3 top_p 0: off
    seeds = {codec.sampling_from_pb(pb.SamplingParams(), random_seed=True).seed for _ in range(4)}
    assert len(seeds) > 1
    assert codec.sampling_from_pb(pb.SamplingParams(seed=0), random_seed=True).seed == 0  # set: kept
    full = Sampling(temperature=0.75, top_k=40, top_p=0.875, min_p=0.0625, seed=11)  # float32 on the wire
    assert codec.sampling_from_pb(codec.sampling_pb(full)) == full


def test_requests_read_back_as_the_engine_call():
    args = dict(seq_id=1, pos=4, tokens=[1, 2], n_max=3, n_min=0, p_min=0.0, sampling=Sampling(0.5, seed=2),
                sample_index=6)
    op = codec.op_pb("propose", **dict(args))
    back = codec.args_from_pb("propose", op.propose)
    assert {**back, "tokens": list(back["tokens"])} == args
    assert codec.args_from_pb("propose", pb.ProposeRequest(n_max=1))["sampling"] is None  # unset: greedy drafts
    cp = codec.args_from_pb("seq_cp", pb.SeqCpRequest(seq_id_src=0, seq_id_dst=2, p0=-1, p1=-1))
    assert cp == dict(src=0, dst=2, p0=-1, p1=-1)
    assert "draft_busy" not in codec.args_from_pb("decode", pb.DecodeRequest(draft_busy=True))


@pytest.mark.parametrize("exc", [errors.InvalidArgument("bad"), errors.NotFound("gone"), errors.Unimplemented("no")])
def test_errors_keep_code_and_message(exc):
    res = codec.error_result_pb(exc, "verify")
    assert res.error.code == grpc.StatusCode[exc.code].value[0] and res.error.message == f"verify: {exc.message}"
    with pytest.raises(type(exc)) as err:
        codec.result_from_pb(codec.error_result_pb(exc))
    assert err.value.message == exc.message
    bug = codec.as_error(KeyError("k"))
    assert isinstance(bug, errors.Internal) and bug.message == "KeyError: 'k'"
