"""The gRPC face of a worker engine: protobuf in, engine call, protobuf out.

All engine calls run on one thread (the engine is not thread-safe and
llama.cpp releases the GIL while it computes), so the event loop stays free
for health checks and new streams. This module does not import llama_cpp.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Callable

import grpc

from specd.engine import CheckpointInfo, ModelInfo, SeqState
from specd.errors import SpecdError, Unimplemented
from specd.sampling import Sampling, TokenDist, dist_of
from specd.scheduler import EngineRunner, QueueBounds, Scheduler, Window, op_key
from specd.v1 import worker_pb2 as pb
from specd.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("specd.worker")

# Execute metadata: the instance the caller attached to (worker.proto)
INSTANCE_KEY = "specd-instance-id"


# ------------------------------------------------------------------ converters
def state_pb(s: SeqState) -> pb.SeqState:
    return pb.SeqState(seq_id=s.seq_id, pos_min=s.pos_min, pos_max=s.pos_max, n_tokens=s.n_tokens, token_hash=s.token_hash)


def checkpoint_pb(c: CheckpointInfo) -> pb.Checkpoint:
    return pb.Checkpoint(handle=c.handle, seq_id=c.seq_id, pos_min=c.pos_min, pos_max=c.pos_max, n_tokens=c.n_tokens, n_bytes=c.n_bytes)


def model_info_pb(i: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        kind=i.kind, description=i.description, architecture=i.architecture, n_vocab=i.n_vocab,
        vocab_fingerprint=i.vocab_fingerprint, n_ctx_seq=i.n_ctx_seq, n_seq=i.n_seq,
        can_rm_partial=i.can_rm_partial, can_shift=i.can_shift, n_swa=i.n_swa,
        eog_tokens=list(i.eog_tokens), add_bos=i.add_bos, n_threads=i.n_threads, model_path=i.model_path,
        decode_costs=[pb.DecodeCost(n_tokens=n, seconds=t) for n, t in i.decode_costs],
        n_threads_batch=i.n_threads_batch or i.n_threads,
        decode_costs_shared=[pb.DecodeCost(n_tokens=n, seconds=t) for n, t in i.decode_costs_shared],
        prompt_costs=[pb.DecodeCost(n_tokens=n, seconds=t) for n, t in i.prompt_costs],
        instance_id=i.instance_id,
    )


def sampling_from_pb(s: pb.SamplingParams) -> Sampling:
    # proto3 defaults: top_p 0 means "unset" = 1.0 (disabled)
    return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0, min_p=s.min_p, seed=s.seed)


def dist_pb(d: TokenDist) -> pb.TokenDistribution:
    return pb.TokenDistribution(ids=d.ids.tolist(), probs=d.probs.tolist())


def dist_from_pb(d: pb.TokenDistribution) -> TokenDist:
    return dist_of(d.ids, d.probs)


def propose_sampling(r: pb.ProposeRequest) -> tuple[Sampling | None, int]:
    """(sampling, sample_index) of a Propose: None when the draft should not sample."""
    return (sampling_from_pb(r.sampling) if r.HasField("sampling") else None), r.sample_index


# ------------------------------------------------------------------ operations
def _decode(e, r: pb.DecodeRequest) -> pb.SeqState:
    e.share_cores(r.draft_busy)
    return state_pb(e.decode(r.seq_id, r.pos, r.tokens))


def _verify(e, r: pb.VerifyRequest) -> pb.VerifyResponse:
    if not hasattr(e, "verify"):
        raise Unimplemented("Verify is served by the target worker only")
    e.share_cores(r.draft_busy)
    res = e.verify(r.seq_id, r.pos, r.tokens, sampling_from_pb(r.sampling), r.sample_index, r.trim,
                   [dist_from_pb(d) for d in r.draft_q])
    return pb.VerifyResponse(tokens=res.tokens, pieces=res.pieces, state=state_pb(res.state),
                             compute_seconds=res.compute_seconds)


def _propose(e, r: pb.ProposeRequest) -> pb.ProposeResponse:
    if not hasattr(e, "propose"):
        raise Unimplemented("Propose is served by the draft worker only")
    res = e.propose(r.seq_id, r.pos, r.tokens, r.n_max, r.n_min, r.p_min, *propose_sampling(r))
    return pb.ProposeResponse(tokens=res.tokens, state=state_pb(res.state), compute_seconds=res.compute_seconds,
                              q=[dist_pb(d) for d in res.q])


def _clear(e, r):
    e.clear(r.seq_id)
    return pb.ClearResponse()


def _drop(e, r):
    e.checkpoint_drop(r.handle)
    return pb.CheckpointDropResponse()


# name of the WorkerOp oneof field -> (engine call, WorkerResult field)
OPS: dict[str, tuple[Callable[[Any, Any], Any], str]] = {
    "decode": (_decode, "state"),
    "seq_rm": (lambda e, r: state_pb(e.seq_rm(r.seq_id, r.p0, r.p1)), "state"),
    "seq_add": (lambda e, r: state_pb(e.seq_add(r.seq_id, r.p0, r.p1, r.delta)), "state"),
    "seq_cp": (lambda e, r: state_pb(e.seq_cp(r.seq_id_src, r.seq_id_dst, r.p0, r.p1)), "state"),
    "checkpoint_save": (lambda e, r: checkpoint_pb(e.checkpoint_save(r.seq_id)), "checkpoint"),
    "checkpoint_restore": (lambda e, r: state_pb(e.checkpoint_restore(r.handle, r.drop)), "state"),
    "checkpoint_drop": (_drop, "done"),
    "get_seq_state": (lambda e, r: state_pb(e.state(r.seq_id)), "state"),
    "clear": (_clear, "done"),
    "verify": (_verify, "verify"),
    "propose": (_propose, "propose"),
}


def _steps(kind: str, e, r):
    """The batchable operations as engine steps (see WorkerEngine.run_batch)."""
    if kind == "decode":
        return e.decode_steps(r.seq_id, r.pos, r.tokens)
    if kind == "verify":
        if not hasattr(e, "verify_steps"):
            raise Unimplemented("Verify is served by the target worker only")
        return e.verify_steps(r.seq_id, r.pos, r.tokens, sampling_from_pb(r.sampling), r.sample_index, r.trim,
                              [dist_from_pb(d) for d in r.draft_q])
    if not hasattr(e, "propose_steps"):
        raise Unimplemented("Propose is served by the draft worker only")
    return e.propose_steps(r.seq_id, r.pos, r.tokens, r.n_max, r.n_min, r.p_min, *propose_sampling(r))


def _result_pb(kind: str, res) -> pb.WorkerResult:
    if kind == "verify":
        return pb.WorkerResult(verify=pb.VerifyResponse(
            tokens=res.tokens, pieces=res.pieces, state=state_pb(res.state), compute_seconds=res.compute_seconds,
            batch_tokens=res.batch_tokens, batch_seconds=res.batch_seconds))
    if kind == "propose":
        return pb.WorkerResult(propose=pb.ProposeResponse(
            tokens=res.tokens, state=state_pb(res.state), compute_seconds=res.compute_seconds,
            batch_tokens=res.batch_tokens, batch_seconds=res.batch_seconds, q=[dist_pb(d) for d in res.q]))
    return pb.WorkerResult(state=state_pb(res))


def _error_pb(kind: str | None, exc: SpecdError) -> pb.WorkerResult:
    return pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode[exc.code].value[0], message=f"{kind}: {exc.message}"))


def run_round(engine, window: Window) -> list[pb.WorkerResult]:
    """One scheduler round on the engine thread: bookkeeping first, then the
    batch's decodes together."""
    out = [_execute_one(engine, op) for op in window.pre]
    kinds = [op.WhichOneof("op") for op in window.batch]
    slots: list[pb.WorkerResult | None] = []
    steps = []
    for kind, op in zip(kinds, window.batch):
        try:
            steps.append(_steps(kind, engine, getattr(op, kind)))
            slots.append(None)
        except SpecdError as exc:
            slots.append(_error_pb(kind, exc))
    engine.share_cores(any(getattr(getattr(op, kind), "draft_busy", False) for kind, op in zip(kinds, window.batch)))
    results = iter(engine.run_batch(steps))
    for kind, slot in zip(kinds, slots):
        if slot is None:
            res = next(results)
            slot = _error_pb(kind, res) if isinstance(res, SpecdError) else _result_pb(kind, res)
        out.append(slot)
    return out


def _op_key(op: pb.WorkerOp):
    kind = op.WhichOneof("op")
    return op_key(kind, getattr(getattr(op, kind), "seq_id", None) if kind else None)


def op_tokens(op: pb.WorkerOp) -> int:
    """Tokens an operation decodes (0 for pure KV bookkeeping)."""
    which = op.WhichOneof("op")
    if which in ("decode", "verify", "propose"):
        return len(getattr(op, which).tokens)
    return 0


async def _unary(runner: EngineRunner, fn, request, context: grpc.aio.ServicerContext, beside: bool = False):
    try:
        return await (runner.run_beside(fn, request) if beside else runner.run(fn, request))
    except SpecdError as exc:
        await context.abort(grpc.StatusCode[exc.code], exc.message)
    except Exception as exc:  # a bug must not take the worker down
        log.exception("engine call failed")
        await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")


def _execute_one(engine, op: pb.WorkerOp) -> pb.WorkerResult:
    which = op.WhichOneof("op")
    if which is None:
        return pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message="op: no operation set"))
    fn, field = OPS[which]
    try:
        out = fn(engine, getattr(op, which))
    except SpecdError as exc:
        return pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode[exc.code].value[0], message=f"{which}: {exc.message}"))
    except Exception as exc:
        log.exception("engine call %s failed", which)
        return pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode.INTERNAL.value[0], message=f"{which}: {type(exc).__name__}: {exc}"))
    if field == "done":
        return pb.WorkerResult(done=True)
    return pb.WorkerResult(**{field: out})


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runner: EngineRunner, batch_wait: float = 0.010, bounds: QueueBounds = QueueBounds()):
        self.runner = runner
        self.batch_wait = batch_wait
        self.bounds = bounds
        self.scheduler: Scheduler | None = None  # made on first use, on the server's event loop
        self.instance_id = uuid.uuid4().hex

    async def GetModelInfo(self, request, context):
        info = await _unary(self.runner, lambda e, r: model_info_pb(e.info()), request, context)
        info.instance_id = self.instance_id
        return info

    async def Decode(self, request, context):
        return await _unary(self.runner, OPS["decode"][0], request, context)

    async def SeqRm(self, request, context):
        return await _unary(self.runner, OPS["seq_rm"][0], request, context)

    async def SeqAdd(self, request, context):
        return await _unary(self.runner, OPS["seq_add"][0], request, context)

    async def SeqCp(self, request, context):
        return await _unary(self.runner, OPS["seq_cp"][0], request, context)

    async def CheckpointSave(self, request, context):
        return await _unary(self.runner, OPS["checkpoint_save"][0], request, context)

    async def CheckpointRestore(self, request, context):
        return await _unary(self.runner, OPS["checkpoint_restore"][0], request, context)

    async def CheckpointDrop(self, request, context):
        return await _unary(self.runner, _drop, request, context)

    async def GetSeqState(self, request, context):
        return await _unary(self.runner, OPS["get_seq_state"][0], request, context)

    async def Clear(self, request, context):
        return await _unary(self.runner, _clear, request, context)

    async def Tokenize(self, request, context):
        def fn(e, r):
            if not hasattr(e, "tokenize"):
                raise Unimplemented("this worker has no vocabulary")
            return pb.TokenizeResponse(tokens=e.tokenize(r.text, r.add_special, r.parse_special))

        return await _unary(self.runner, fn, request, context, beside=True)

    async def Detokenize(self, request, context):
        def fn(e, r):
            if not hasattr(e, "detokenize"):
                raise Unimplemented("this worker has no vocabulary")
            return pb.DetokenizeResponse(text=e.detokenize(r.tokens))

        return await _unary(self.runner, fn, request, context, beside=True)

    async def ApplyChatTemplate(self, request, context):
        def fn(e, r):
            if not hasattr(e, "apply_chat_template"):
                raise Unimplemented("this worker has no model, hence no chat template")
            text = e.apply_chat_template([(m.role, m.content) for m in r.messages], r.add_generation_prompt)
            # as llama-server tokenizes a rendered chat: BOS as the model asks, special tokens parsed
            return pb.ApplyChatTemplateResponse(text=text, tokens=e.tokenize(text, True, True))

        return await _unary(self.runner, fn, request, context)

    async def Execute(self, request_iterator, context):
        """Ops go to the shared scheduler as they arrive (so they can batch with
        other streams' and sequences'); results go back in this stream's order."""
        expected = dict(context.invocation_metadata() or ()).get(INSTANCE_KEY)
        if expected is not None and expected != self.instance_id:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"this worker is instance {self.instance_id}, not {expected}: it restarted and "
                                f"holds none of the sequences the caller knew")
        if self.scheduler is None:
            self.scheduler = Scheduler(self.runner, run_round, _op_key, op_tokens, gather_max=self.batch_wait,
                                       max_queued=self.bounds.queued_ops)
        results: asyncio.Queue = asyncio.Queue()

        async def write_results() -> None:
            while True:
                fut = await results.get()
                if fut is None:
                    return
                try:
                    res = await fut
                except SpecdError as exc:
                    res = pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode[exc.code].value[0], message=exc.message))
                except Exception as exc:
                    log.exception("operation failed")
                    res = pb.WorkerResult(error=pb.OpError(code=grpc.StatusCode.INTERNAL.value[0],
                                                           message=f"{type(exc).__name__}: {exc}"))
                await context.write(res)

        writer = asyncio.get_running_loop().create_task(write_results())
        try:
            while True:
                op = await context.read()
                if op is grpc.aio.EOF:
                    break
                if results.qsize() >= self.bounds.stream_ops:
                    # answers go back in order, so refusing one operation would
                    # still queue its answer: a caller this far behind its
                    # results is not reading them, and only ending its stream
                    # bounds what it holds here
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"{results.qsize()} operations of this stream are not answered yet "
                                        f"(max_stream_ops = {self.bounds.stream_ops}): read the results")
                results.put_nowait(self.scheduler.submit(op))
            results.put_nowait(None)
            await writer
        finally:
            writer.cancel()


def register_worker(server: grpc.aio.Server, runner: EngineRunner, role: str, batch_wait: float = 0.010,
                    bounds: QueueBounds = QueueBounds()) -> list[str]:
    """Add the Worker service and the role's own service; return their names."""
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, batch_wait, bounds), server)
    names = [pb.DESCRIPTOR.services_by_name["Worker"].full_name]
    if role == "target":
        pb_grpc.add_TargetWorkerServicer_to_server(TargetServicer(runner), server)
        names.append(pb.DESCRIPTOR.services_by_name["TargetWorker"].full_name)
    else:
        pb_grpc.add_DraftWorkerServicer_to_server(DraftServicer(runner), server)
        names.append(pb.DESCRIPTOR.services_by_name["DraftWorker"].full_name)
    return names


class TargetServicer(pb_grpc.TargetWorkerServicer):
    def __init__(self, runner: EngineRunner):
        self.runner = runner

    async def Verify(self, request, context):
        return await _unary(self.runner, _verify, request, context)


class DraftServicer(pb_grpc.DraftWorkerServicer):
    def __init__(self, runner: EngineRunner):
        self.runner = runner

    async def Propose(self, request, context):
        return await _unary(self.runner, _propose, request, context)


async def serve_worker(cfg, make_engine: Callable[[], Any]) -> None:
    """Listen (NOT_SERVING), load the engine, serve until SIGTERM."""
    from specd.metrics import WorkerPrometheus
    from specd.security import server_credentials_of, worker_interceptors
    from specd.server import run_until_stopped, start_metrics, start_server

    runner = EngineRunner()

    def register(server):
        return register_worker(server, runner, cfg.role, cfg.batch_wait_ms / 1e3, QueueBounds.of(cfg))

    life = await start_server(cfg.host, cfg.port, register, cfg.port_file,
                              credentials=server_credentials_of(cfg), interceptors=worker_interceptors(cfg))
    metrics = WorkerPrometheus()
    start_metrics(cfg.metrics_port, metrics.registry, cfg.host)
    life.install_signal_handlers()
    loader = asyncio.ensure_future(runner.load(make_engine))
    stop = asyncio.ensure_future(life.stopping.wait())
    await asyncio.wait([loader, stop], return_when=asyncio.FIRST_COMPLETED)
    if loader.done():
        loader.result()  # a model that cannot load ends the process with its error
        metrics.attach(runner.engine)
        await life.set_serving(True)
        log.info("%s worker ready: %s", cfg.role, runner.engine.info().description)
    await run_until_stopped(life, cfg.grace_seconds, drain=cfg.drain_seconds)
    runner.shutdown()
