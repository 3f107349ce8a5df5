"""Protobuf <-> plain types, for every servicer and client.

Engines, the router's loop and the in-process LocalWorker speak plain types
(specd.engine, specd.sampling, specd.errors); protobuf exists only at the gRPC
edges, and every conversion between the two is here:

- `*_pb(value)`: a plain value as its message;
- `*_from_pb(message)`: a message as its plain value.

Worker operations (the WorkerOp oneof and the unary RPCs that mirror it) are
named by their WorkerOp field (`decode`, `seq_rm`, ..., `verify`,
`propose`). A client turns an operation's keyword arguments into a WorkerOp
with `op_pb`; the worker reads them back with `args_from_pb` (the engine
method's keyword arguments, `engine_method`), answers with `response_pb` (a
unary RPC) or `result_pb` (Execute), and the client reads the answer with
`result_from_pb`. Errors travel as their SpecdError's code and message.

This module does not import llama_cpp.
"""
from __future__ import annotations

import secrets
from typing import Any

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from specd import errors
from specd.engine import CheckpointInfo, ModelInfo, ProposeResult, SeqState, VerifyPartial, VerifyResult
from specd.router.chat import ChatMessage
from specd.sampling import EXACT, REJECTION, Sampling, TokenDist, dist_of
from specd.v1 import router_pb2 as rpb
from specd.worker.v1 import worker_pb2 as pb

# ---------------------------------------------------------------- status codes
_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def status_code(exc: errors.SpecdError) -> grpc.StatusCode:
    """The gRPC status of an error (SpecdError.code names it)."""
    return grpc.StatusCode[exc.code]


def error_for(code_name: str, message: str) -> errors.SpecdError:
    """The SpecdError of a gRPC status code's name (Internal when none has it)."""
    cls = {c.code: c for c in errors.SpecdError.__subclasses__()}.get(code_name, errors.Internal)
    return cls(message)


def as_error(exc: BaseException) -> errors.SpecdError:
    """An exception as the error a caller sees: a SpecdError as it is, anything
    else (a bug) as INTERNAL naming its type."""
    if isinstance(exc, errors.SpecdError):
        return exc
    return errors.Internal(f"{type(exc).__name__}: {exc}")


def error_pb(exc: errors.SpecdError, op: str | None = None) -> pb.OpError:
    """`op`: the operation's name, put before the message (Execute's results)."""
    message = exc.message if op is None else f"{op}: {exc.message}"
    return pb.OpError(code=status_code(exc).value[0], message=message)


def error_from_pb(e: pb.OpError) -> errors.SpecdError:
    return error_for(_CODE_NAMES.get(e.code, "INTERNAL"), e.message)


def rich_status(exc: errors.SpecdError) -> grpc.Status:
    """The error in gRPC's standard error model (router.proto): a
    google.rpc.Status with a BadRequest naming the wrong field, or a RetryInfo
    saying when a retry may succeed, so a client in any language reads them."""
    status = status_pb2.Status(code=status_code(exc).value[0], message=exc.message)
    if getattr(exc, "field", ""):
        violation = error_details_pb2.BadRequest.FieldViolation(field=exc.field, description=exc.message)
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
    if getattr(exc, "retry_after", 0.0) > 0:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(exc.retry_after * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return rpc_status.to_status(status)


# ------------------------------------------------------------- engine types
def state_pb(s: SeqState) -> pb.SeqState:
    return pb.SeqState(seq_id=s.seq_id, pos_min=s.pos_min, pos_max=s.pos_max, n_tokens=s.n_tokens, token_hash=s.token_hash)


def state_from_pb(s: pb.SeqState) -> SeqState:
    return SeqState(s.seq_id, s.pos_min, s.pos_max, s.n_tokens, s.token_hash)


def checkpoint_pb(c: CheckpointInfo) -> pb.Checkpoint:
    return pb.Checkpoint(handle=c.handle, seq_id=c.seq_id, pos_min=c.pos_min, pos_max=c.pos_max, n_tokens=c.n_tokens, n_bytes=c.n_bytes)


def checkpoint_from_pb(c: pb.Checkpoint) -> CheckpointInfo:
    return CheckpointInfo(c.handle, c.seq_id, c.pos_min, c.pos_max, c.n_tokens, c.n_bytes)


# ModelInfo fields copied as they are; the cost curves are (n_tokens, seconds) pairs
_INFO_FIELDS = ("kind", "description", "architecture", "n_vocab", "vocab_fingerprint", "n_ctx_seq", "n_seq",
                "can_rm_partial", "can_shift", "n_swa", "add_bos", "n_threads", "model_path", "instance_id",
                "match_needs_repeat")
_INFO_COSTS = ("decode_costs", "decode_costs_shared", "prompt_costs")


def model_info_pb(i: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        **{f: getattr(i, f) for f in _INFO_FIELDS},
        **{f: [pb.DecodeCost(n_tokens=n, seconds=t) for n, t in getattr(i, f)] for f in _INFO_COSTS},
        eog_tokens=list(i.eog_tokens), n_threads_batch=i.n_threads_batch or i.n_threads,
    )


# what the public API says of a model (specd.v1.ModelInfo): not the workers'
# timings nor their process ids
_PUBLIC_INFO_FIELDS = tuple(f for f in _INFO_FIELDS if f not in ("instance_id", "match_needs_repeat"))


def messages_from_pb(msgs: rpb.ChatMessages) -> list[ChatMessage]:
    return [ChatMessage(m.role, m.content) for m in msgs.messages]


def public_model_info_pb(i: ModelInfo) -> rpb.ModelInfo:
    return rpb.ModelInfo(**{f: getattr(i, f) for f in _PUBLIC_INFO_FIELDS}, eog_tokens=list(i.eog_tokens))


def model_info_from_pb(i: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        **{f: getattr(i, f) for f in _INFO_FIELDS},
        **{f: tuple((c.n_tokens, c.seconds) for c in getattr(i, f)) for f in _INFO_COSTS},
        eog_tokens=tuple(i.eog_tokens), n_threads_batch=i.n_threads_batch or i.n_threads,
    )


# ----------------------------------------------------------------- sampling
def sampling_pb(s: Sampling) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed)


def sampling_from_pb(s: pb.SamplingParams, random_seed: bool = False) -> Sampling:
    """proto3 zero means unset: top_p 0 is 1.0 (off). An unset seed is 0, or
    with `random_seed` a fresh random one (a request to the router's API)."""
    seed = secrets.randbits(63) if random_seed and not s.HasField("seed") else s.seed
    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0, min_p=s.min_p, seed=seed)


def dist_pb(d: TokenDist) -> pb.TokenDistribution:
    return pb.TokenDistribution(ids=d.ids.tolist(), probs=d.probs.tolist())


def dist_from_pb(d: pb.TokenDistribution) -> TokenDist:
    return dist_of(d.ids, d.probs)


# --------------------------------------------------------- verify, propose
def verify_pb(v: VerifyResult) -> pb.VerifyResponse:
    return pb.VerifyResponse(tokens=v.tokens, pieces=v.pieces, state=state_pb(v.state),
                             compute_seconds=v.compute_seconds, batch_tokens=v.batch_tokens,
                             batch_seconds=v.batch_seconds, n_more=v.n_more)


def verify_from_pb(v: pb.VerifyResponse) -> VerifyResult:
    return VerifyResult(list(v.tokens), list(v.pieces), state_from_pb(v.state), v.compute_seconds, v.batch_tokens,
                        v.batch_seconds, v.n_more)


def partial_pb(p: VerifyPartial) -> pb.WorkerResult:
    return pb.WorkerResult(partial=pb.VerifyPartial(offset=p.offset, tokens=p.tokens, pieces=p.pieces))


def partial_from_pb(p: pb.VerifyPartial) -> VerifyPartial:
    return VerifyPartial(p.offset, list(p.tokens), list(p.pieces))


def propose_pb(p: ProposeResult) -> pb.ProposeResponse:
    return pb.ProposeResponse(tokens=p.tokens, state=state_pb(p.state), compute_seconds=p.compute_seconds,
                              batch_tokens=p.batch_tokens, batch_seconds=p.batch_seconds,
                              q=[dist_pb(d) for d in p.q])


def propose_from_pb(p: pb.ProposeResponse) -> ProposeResult:
    return ProposeResult(list(p.tokens), state_from_pb(p.state), p.compute_seconds, p.batch_tokens, p.batch_seconds,
                         [dist_from_pb(d) for d in p.q])


# -------------------------------------------------------- worker operations
# WorkerOp field -> (request message, WorkerResult field of its answer, unary response)
_OPS: dict[str, tuple[type, str, Any]] = {
    "decode": (pb.DecodeRequest, "state", state_pb),
    "seq_rm": (pb.SeqRmRequest, "state", state_pb),
    "seq_add": (pb.SeqAddRequest, "state", state_pb),
    "seq_cp": (pb.SeqCpRequest, "state", state_pb),
    "checkpoint_save": (pb.CheckpointSaveRequest, "checkpoint", checkpoint_pb),
    "checkpoint_restore": (pb.CheckpointRestoreRequest, "state", state_pb),
    "checkpoint_drop": (pb.CheckpointDropRequest, "done", lambda _: pb.CheckpointDropResponse()),
    "get_seq_state": (pb.GetSeqStateRequest, "state", state_pb),
    "clear": (pb.ClearRequest, "done", lambda _: pb.ClearResponse()),
    "verify": (pb.VerifyRequest, "verify", verify_pb),
    "propose": (pb.ProposeRequest, "propose", propose_pb),
}
OPS = frozenset(_OPS)

def engine_method(op: str) -> str:
    """The WorkerEngine method of an operation."""
    return "state" if op == "get_seq_state" else op


def op_pb(op: str, **args) -> pb.WorkerOp:
    """An operation as a WorkerOp, from the engine method's keyword arguments
    (`draft_busy` too, for decode and verify; `target_busy` for propose)."""
    if args.get("sampling") is not None:
        args["sampling"] = sampling_pb(args["sampling"])
    if "draft_q" in args:
        args["draft_q"] = [dist_pb(d) for d in args["draft_q"]]
    return pb.WorkerOp(**{op: _OPS[op][0](**args)})


# an operation's request -> the engine method's keyword arguments (draft_busy
# and target_busy are for the worker: WorkerEngine.share_cores)
_ARGS: dict[str, Any] = {
    "decode": lambda r: dict(seq_id=r.seq_id, pos=r.pos, tokens=r.tokens),
    "seq_rm": lambda r: dict(seq_id=r.seq_id, p0=r.p0, p1=r.p1),
    "seq_add": lambda r: dict(seq_id=r.seq_id, p0=r.p0, p1=r.p1, delta=r.delta),
    "seq_cp": lambda r: dict(src=r.seq_id_src, dst=r.seq_id_dst, p0=r.p0, p1=r.p1),
    "checkpoint_save": lambda r: dict(seq_id=r.seq_id),
    "checkpoint_restore": lambda r: dict(handle=r.handle, drop=r.drop),
    "checkpoint_drop": lambda r: dict(handle=r.handle),
    "get_seq_state": lambda r: dict(seq_id=r.seq_id),
    "clear": lambda r: dict(seq_id=r.seq_id),
    "verify": lambda r: dict(seq_id=r.seq_id, pos=r.pos, tokens=r.tokens, sampling=sampling_from_pb(r.sampling),
                             sample_index=r.sample_index, trim=r.trim,
                             draft_q=[dist_from_pb(d) for d in r.draft_q], n_more=r.n_more,
                             stop_on_repeat=r.stop_on_repeat, stream_every=r.stream_every),
    # sampling unset: the draft proposes its most likely tokens
    "propose": lambda r: dict(seq_id=r.seq_id, pos=r.pos, tokens=r.tokens, n_max=r.n_max, n_min=r.n_min,
                              p_min=r.p_min, sampling=sampling_from_pb(r.sampling) if r.HasField("sampling") else None,
                              sample_index=r.sample_index),
}


def args_from_pb(op: str, r) -> dict[str, Any]:
    """The engine method's keyword arguments of an operation's request."""
    return _ARGS[op](r)


def response_pb(op: str, result):
    """An operation's result as the response message of its unary RPC."""
    return _OPS[op][2](result)


def result_pb(op: str, result) -> pb.WorkerResult:
    """An operation's result as its WorkerResult (Execute)."""
    field = _OPS[op][1]
    if field == "done":
        return pb.WorkerResult(done=True)
    return pb.WorkerResult(**{field: response_pb(op, result)})


def error_result_pb(exc: errors.SpecdError, op: str | None = None) -> pb.WorkerResult:
    return pb.WorkerResult(error=error_pb(exc, op))


def result_from_pb(res: pb.WorkerResult):
    """A WorkerResult as its plain value (None for `done`); an error raises its SpecdError."""
    which = res.WhichOneof("result")
    if which == "error":
        raise error_from_pb(res.error)
    if which == "state":
        return state_from_pb(res.state)
    if which == "checkpoint":
        return checkpoint_from_pb(res.checkpoint)
    if which == "verify":
        return verify_from_pb(res.verify)
    if which == "propose":
        return propose_from_pb(res.propose)
    return None


# ------------------------------------------------------------- router API
REASONS = {"eog": rpb.FINISH_REASON_EOG, "length": rpb.FINISH_REASON_LENGTH, "stop": rpb.FINISH_REASON_STOP}
_ACCEPTANCE = {rpb.ACCEPTANCE_UNSPECIFIED: None, rpb.ACCEPTANCE_EXACT: EXACT, rpb.ACCEPTANCE_REJECTION: REJECTION}


def acceptance_from_pb(value: int) -> str | None:
    """SpeculativeParams.acceptance as GenParams.acceptance."""
    if value not in _ACCEPTANCE:
        raise errors.InvalidArgument(f"speculative.acceptance: unknown value {value}", field="speculative.acceptance")
    return _ACCEPTANCE[value]


def finish_pb(res) -> rpb.Finish:
    """The router's Result of a request (router.engine.Result) as its Finish."""
    return rpb.Finish(
        reason=REASONS.get(res.reason, rpb.FINISH_REASON_UNSPECIFIED),
        usage=rpb.Usage(prompt_tokens=res.n_prompt, generated_tokens=res.n_generated,
                        drafted_tokens=res.n_drafted, accepted_tokens=res.n_accepted,
                        steps=res.n_steps, context_shifts=res.n_shifts,
                        cached_tokens=res.n_cached),
        timing=rpb.Timing(prompt_seconds=res.prompt_seconds, generation_seconds=res.generation_seconds,
                          draft_compute_seconds=res.draft_compute_seconds,
                          verify_compute_seconds=res.verify_compute_seconds, steps_seconds=res.steps_seconds,
                          critical_compute_seconds=res.critical_compute_seconds),
        speculative=res.speculative,
    )
