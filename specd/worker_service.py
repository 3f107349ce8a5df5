"""The gRPC face of a worker engine: protobuf in, engine call, protobuf out.

All engine calls run on one thread (the engine is not thread-safe and
llama.cpp releases the GIL while it computes), so the event loop stays free
for health checks and new streams. This module does not import llama_cpp.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
import uuid
from typing import Any, Callable, NamedTuple

import grpc

from specd import codec
from specd.engine import Steps, VerifyPartial
from specd.errors import InvalidArgument, SpecdError, Unimplemented
from specd.ownership import OWNER_KEY, Ownership
from specd.scheduler import BATCHABLE, EngineRunner, QueueBounds, Scheduler, Window, op_key
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("specd.worker")

# Execute metadata: the instance the caller attached to (worker.proto)
INSTANCE_KEY = "specd-instance-id"

# what a worker without the engine's capability answers (UNIMPLEMENTED)
NOT_TARGET = "Verify is served by the target worker only"
NOT_DRAFT = "Propose is served by the draft worker only"
NO_VOCABULARY = "this worker has no vocabulary"
NO_TEMPLATE = "this worker has no model, hence no chat template"


# ------------------------------------------------------------------ operations
# Every operation, from Execute or from its unary RPC, runs through `_call`
# (or, batched with others, `_steps`) and is answered through the codec:
# Execute's WorkerResult wraps the unary RPC's response (codec.result_pb).
class Job(NamedTuple):
    """An Execute operation as the scheduler queues it, and where a
    verification's partial results go (VerifyRequest.stream_every)."""

    op: pb.WorkerOp
    on_partial: Callable[[VerifyPartial], None] | None = None


def _steps(kind: str, e, r, on_partial: Callable[[VerifyPartial], None] | None = None,
           waiting: Callable[[], bool] | None = None) -> Steps:
    """A batchable operation (decode, verify, propose) as engine steps (see
    WorkerEngine.run_batch); a verification hands its partial results to
    `on_partial` and goes on alone only while `waiting` says no operation
    waits for the next round."""
    if kind == "verify" and not e.capabilities.verifies:
        raise Unimplemented(NOT_TARGET)
    if kind == "propose" and not e.capabilities.proposes:
        raise Unimplemented(NOT_DRAFT)
    if not getattr(r, "busy_seconds", 0.0) >= 0:  # NaN too
        raise InvalidArgument(f"busy_seconds must be a number >= 0, got {r.busy_seconds}", field="busy_seconds")
    args = codec.args_from_pb(kind, r)
    if kind == "verify":
        args.update(on_partial=on_partial, others_waiting=waiting)
    return getattr(e, f"{kind}_steps")(**args)


def _other_busy(r) -> float:
    """For about how long the other worker computes meanwhile, to decode on
    the base threads (DecodeRequest.draft_busy and busy_seconds,
    ProposeRequest.target_busy): 0 not at all, math.inf unknown."""
    if not (getattr(r, "target_busy", False) or getattr(r, "draft_busy", False)):
        return 0.0
    return getattr(r, "busy_seconds", 0.0) or math.inf


def _call(kind: str, e, r):
    """One operation on its own: the engine's plain result. A batchable one
    is a batch of one."""
    if kind in BATCHABLE:
        steps = _steps(kind, e, r)
        e.share_cores(_other_busy(r))
        return e.run_one(steps)
    return getattr(e, codec.engine_method(kind))(**codec.args_from_pb(kind, r))


def _unary_op(kind: str) -> Callable[[Any, Any], Any]:
    """The engine call of an operation's unary RPC, answering its response message."""
    return lambda e, r: codec.response_pb(kind, _call(kind, e, r))


UNARY = {kind: _unary_op(kind) for kind in codec.OPS}


def run_round(engine, window: Window) -> list[pb.WorkerResult]:
    """One scheduler round (of Jobs) on the engine thread: bookkeeping
    first, then the batch's decodes together."""
    out = [_execute_one(engine, job.op) for job in window.pre]
    ops = [job.op for job in window.batch]
    kinds = [op.WhichOneof("op") for op in ops]
    slots: list[pb.WorkerResult | None] = []
    steps = []
    for kind, job in zip(kinds, window.batch):
        try:
            steps.append(_steps(kind, engine, getattr(job.op, kind), job.on_partial, window.waiting))
            slots.append(None)
        except SpecdError as exc:
            slots.append(codec.error_result_pb(exc, kind))
    engine.share_cores(max((_other_busy(getattr(op, kind)) for kind, op, slot in zip(kinds, ops, slots)
                            if slot is None), default=0.0))
    results = iter(engine.run_batch(steps))
    for kind, slot in zip(kinds, slots):
        if slot is None:
            res = next(results)
            slot = codec.error_result_pb(res, kind) if isinstance(res, SpecdError) else codec.result_pb(kind, res)
        out.append(slot)
    return out


def _op_key(job: Job):
    kind = job.op.WhichOneof("op")
    return op_key(kind, getattr(getattr(job.op, kind), "seq_id", None) if kind else None)


def _owner(context: grpc.aio.ServicerContext) -> str | None:
    return dict(context.invocation_metadata() or ()).get(OWNER_KEY)


async def _unary(runner: EngineRunner, fn, request, context: grpc.aio.ServicerContext, beside: bool = False,
                 ownership: Ownership | None = None):
    """`ownership`: given for a call that changes sequences, which another
    router than the worker's owner may not make."""
    try:
        if ownership is not None:
            ownership.check(_owner(context))
        return await (runner.run_beside(fn, request) if beside else runner.run(fn, request))
    except SpecdError as exc:
        await context.abort(codec.status_code(exc), exc.message)
    except Exception as exc:  # a bug must not take the worker down
        log.exception("engine call failed")
        err = codec.as_error(exc)
        await context.abort(codec.status_code(err), err.message)


def _execute_one(engine, op: pb.WorkerOp) -> pb.WorkerResult:
    which = op.WhichOneof("op")
    if which is None:
        return codec.error_result_pb(InvalidArgument("no operation set"), "op")
    try:
        res = _call(which, engine, getattr(op, which))
    except SpecdError as exc:
        return codec.error_result_pb(exc, which)
    except Exception as exc:
        log.exception("engine call %s failed", which)
        return codec.error_result_pb(codec.as_error(exc), which)
    return codec.result_pb(which, res)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, runner: EngineRunner, batch_wait: float = 0.010, bounds: QueueBounds = QueueBounds(),
                 ownership: Ownership | None = None):
        self.runner = runner
        self.batch_wait = batch_wait
        self.bounds = bounds
        self.ownership = ownership or Ownership()
        self.scheduler: Scheduler | None = None  # made on first use, on the server's event loop
        self.instance_id = uuid.uuid4().hex

    async def GetModelInfo(self, request, context):
        info = await _unary(self.runner, lambda e, r: codec.model_info_pb(e.info()), request, context)
        info.instance_id = self.instance_id
        return info

    async def Decode(self, request, context):
        return await _unary(self.runner, UNARY["decode"], request, context, ownership=self.ownership)

    async def SeqRm(self, request, context):
        return await _unary(self.runner, UNARY["seq_rm"], request, context, ownership=self.ownership)

    async def SeqAdd(self, request, context):
        return await _unary(self.runner, UNARY["seq_add"], request, context, ownership=self.ownership)

    async def SeqCp(self, request, context):
        return await _unary(self.runner, UNARY["seq_cp"], request, context, ownership=self.ownership)

    async def CheckpointSave(self, request, context):
        return await _unary(self.runner, UNARY["checkpoint_save"], request, context, ownership=self.ownership)

    async def CheckpointRestore(self, request, context):
        return await _unary(self.runner, UNARY["checkpoint_restore"], request, context, ownership=self.ownership)

    async def CheckpointDrop(self, request, context):
        return await _unary(self.runner, UNARY["checkpoint_drop"], request, context, ownership=self.ownership)

    async def GetSeqState(self, request, context):
        return await _unary(self.runner, UNARY["get_seq_state"], request, context)

    async def Clear(self, request, context):
        return await _unary(self.runner, UNARY["clear"], request, context, ownership=self.ownership)

    async def Tokenize(self, request, context):
        def fn(e, r):
            if not e.capabilities.vocabulary:
                raise Unimplemented(NO_VOCABULARY)
            return pb.TokenizeResponse(tokens=e.tokenize(r.text, r.add_special, r.parse_special))

        return await _unary(self.runner, fn, request, context, beside=True)

    async def Detokenize(self, request, context):
        def fn(e, r):
            if not e.capabilities.vocabulary:
                raise Unimplemented(NO_VOCABULARY)
            return pb.DetokenizeResponse(text=e.detokenize(r.tokens))

        return await _unary(self.runner, fn, request, context, beside=True)

    async def ApplyChatTemplate(self, request, context):
        def fn(e, r):
            if not e.capabilities.chat_template:
                raise Unimplemented(NO_TEMPLATE)
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
        owner = _owner(context)
        try:
            self.ownership.open(owner)
        except SpecdError as exc:
            await context.abort(codec.status_code(exc), exc.message)
        clean = False
        try:
            clean = await self._execute(context)
        finally:
            self.ownership.close(owner, clean)

    async def _execute(self, context) -> bool:
        """Run the stream's operations; True when the caller ended it."""
        if self.scheduler is None:
            self.scheduler = Scheduler(self.runner, run_round, _op_key, gather_max=self.batch_wait,
                                       max_queued=self.bounds.queued_ops)
        results: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def write_results() -> None:
            while True:
                item = await results.get()
                if item is None:
                    return
                fut, partials = item
                if partials is not None:
                    await _forward_partials(context, fut, partials)
                try:
                    res = await fut
                except SpecdError as exc:
                    res = codec.error_result_pb(exc)
                except Exception as exc:
                    log.exception("operation failed")
                    res = codec.error_result_pb(codec.as_error(exc))
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
                partials = _partials_of(op)
                on_partial = None if partials is None else functools.partial(loop.call_soon_threadsafe,
                                                                             partials.put_nowait)
                results.put_nowait((self.scheduler.submit(Job(op, on_partial)), partials))
            results.put_nowait(None)
            await writer
            return True
        finally:
            writer.cancel()


def _partials_of(op: pb.WorkerOp) -> asyncio.Queue | None:
    """Where a streaming verification's partial results wait for their
    turn in the stream (at most one per stream_every of its n_more tokens)."""
    if op.WhichOneof("op") == "verify" and op.verify.stream_every > 0 and op.verify.n_more > 0:
        return asyncio.Queue()
    return None


async def _forward_partials(context, fut: asyncio.Future, partials: asyncio.Queue) -> None:
    """Write the oldest unanswered operation's partial results until it is
    answered; any still queued then are left out (its answer has them)."""
    while not fut.done():
        get = asyncio.ensure_future(partials.get())
        await asyncio.wait((fut, get), return_when=asyncio.FIRST_COMPLETED)
        if get.done():
            await context.write(codec.partial_pb(get.result()))
        else:
            get.cancel()


def register_worker(server: grpc.aio.Server, runner: EngineRunner, role: str, batch_wait: float = 0.010,
                    bounds: QueueBounds = QueueBounds()) -> list[str]:
    """Add the Worker service and the role's own service; return their names."""
    ownership = Ownership()
    pb_grpc.add_WorkerServicer_to_server(WorkerServicer(runner, batch_wait, bounds, ownership), server)
    names = [pb.DESCRIPTOR.services_by_name["Worker"].full_name]
    if role == "target":
        pb_grpc.add_TargetWorkerServicer_to_server(TargetServicer(runner, ownership), server)
        names.append(pb.DESCRIPTOR.services_by_name["TargetWorker"].full_name)
    else:
        pb_grpc.add_DraftWorkerServicer_to_server(DraftServicer(runner, ownership), server)
        names.append(pb.DESCRIPTOR.services_by_name["DraftWorker"].full_name)
    return names


class TargetServicer(pb_grpc.TargetWorkerServicer):
    def __init__(self, runner: EngineRunner, ownership: Ownership):
        self.runner = runner
        self.ownership = ownership

    async def Verify(self, request, context):
        return await _unary(self.runner, UNARY["verify"], request, context, ownership=self.ownership)


class DraftServicer(pb_grpc.DraftWorkerServicer):
    def __init__(self, runner: EngineRunner, ownership: Ownership):
        self.runner = runner
        self.ownership = ownership

    async def Propose(self, request, context):
        return await _unary(self.runner, UNARY["propose"], request, context, ownership=self.ownership)


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
