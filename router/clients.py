"""Two transports to a worker, one interface for the router's loop.

Every operation method returns an `Op`, a call in two phases: send now,
result later. `fut = await w.seq_rm(...).issue()` sends it and gives the
future of its result, collected later (`res = await fut`);
`res = await w.seq_rm(...).result()` sends it and waits.
Operations run on the worker in the order they were issued, so the loop can
issue a KV operation and the next decode without waiting in between
(pipelining). Results are plain objects
(specd.engine types); failures raise specd.errors.SpecdError.

- `GrpcWorker` speaks to a worker process over one `Execute` stream.
- `LocalWorker` calls an engine in this process on one thread: the same loop
  without gRPC (the in-process reference of the benchmark).
"""
from __future__ import annotations

import asyncio
import collections
import math
import uuid
from functools import partial
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd import codec, errors
from specd.codec import error_for
from specd.engine import ModelInfo, VerifyPartial
from specd.sampling import Sampling
from specd.security import KeyedChannel, api_key_metadata
from specd.worker.v1 import worker_pb2 as pb
from specd.worker.v1 import worker_pb2_grpc as pb_grpc
from specd.ownership import OWNER_KEY
from specd.worker_service import INSTANCE_KEY

# gRPC's reconnect backoff grows to two minutes, and a channel waiting it out
# refuses every call: a worker back from a restart is reconnected within a
# second of answering instead.
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass
class _InFlight:
    """An operation sent on the stream and not answered yet."""

    fut: asyncio.Future
    name: str
    on_partial: Callable[[VerifyPartial], None] | None = None  # a streaming verification's partial results


def _stream_failure(exc: grpc.aio.AioRpcError, message: str) -> errors.SpecdError:
    """What a broken Execute stream means to the router. Operations report
    their own errors inside WorkerResult, so a status on the stream itself is
    the worker refusing the caller (credentials), the worker leased to
    another router (PERMISSION_DENIED: unavailable to this one, as a worker
    that is down), another process answering (ABORTED, worker.proto), or the
    connection gone, whatever code the transport chose for it (a write to a
    killed worker can end INTERNAL)."""
    code = exc.code()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return error_for(code.name, message)
    if code == grpc.StatusCode.ABORTED:
        return errors.WorkerRestarted(message)
    return errors.Unavailable(message)


class Op:
    """One worker operation, not sent yet: a call in two phases. `issue()`
    sends it (in order with the worker's other operations) and returns the
    future of its result, to collect later; `result()` sends it and waits."""

    __slots__ = ("_send",)

    def __init__(self, send):
        # makes the coroutine that sends the operation and returns its future:
        # an Op never issued leaves no coroutine behind
        self._send = send

    async def issue(self) -> asyncio.Future:
        return await self._send()

    async def result(self):
        return await (await self._send())


def _busy_fields(busy: float) -> dict:
    """DecodeRequest's draft_busy and busy_seconds of a busy time in seconds."""
    return {"draft_busy": busy > 0, "busy_seconds": busy if 0 < busy < math.inf else 0.0}


class _Ops:
    """The operation methods, written once over `_send(op_name, **fields)`
    (a coroutine that sends and returns the result's future); each returns
    an `Op`. `computing`: decodes, verifications and proposals sent and not
    answered yet (whether the worker is busy computing for the router)."""

    computing = 0
    # called with (operation, fields) as a computing operation is sent (DraftLink prices it)
    on_compute: Callable[[str, dict], None] | None = None

    def _track(self, fut: asyncio.Future) -> asyncio.Future:
        self.computing += 1

        def done(_):
            self.computing -= 1
        fut.add_done_callback(done)
        return fut

    async def _send_tracked(self, name: str, **fields) -> asyncio.Future:
        if self.on_compute is not None:
            self.on_compute(name, fields)
        return self._track(await self._send(name, **fields))

    def decode(self, seq_id: int, pos: int, tokens, draft_busy: float = 0.0) -> Op:
        """`draft_busy`: for about how many seconds the other worker computes
        meanwhile (0: not; math.inf: unknown; DecodeRequest.busy_seconds)."""
        return Op(partial(self._send_tracked, "decode", seq_id=seq_id, pos=pos, tokens=tokens,
                          **_busy_fields(draft_busy)))

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> Op:
        return Op(partial(self._send, "seq_rm", seq_id=seq_id, p0=p0, p1=p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> Op:
        return Op(partial(self._send, "seq_add", seq_id=seq_id, p0=p0, p1=p1, delta=delta))

    def checkpoint_save(self, seq_id: int) -> Op:
        return Op(partial(self._send, "checkpoint_save", seq_id=seq_id))

    def checkpoint_restore(self, handle: int, drop: bool = False) -> Op:
        return Op(partial(self._send, "checkpoint_restore", handle=handle, drop=drop))

    def checkpoint_drop(self, handle: int) -> Op:
        return Op(partial(self._send, "checkpoint_drop", handle=handle))

    def state(self, seq_id: int) -> Op:
        return Op(partial(self._send, "get_seq_state", seq_id=seq_id))

    def clear(self, seq_id: int) -> Op:
        return Op(partial(self._send, "clear", seq_id=seq_id))

    def verify(self, seq_id: int, pos: int, tokens, sampling: Sampling, sample_index: int, trim: bool,
               draft_busy: float = 0.0, draft_q=(), n_more: int = 0, stop_on_repeat: int = 0,
               stream_every: int = 0, on_partial: Callable[[VerifyPartial], None] | None = None) -> Op:
        """`draft_q`: the drafts' distributions (ProposeResult.q) for speculative
        sampling; `n_more`: tokens the target may generate on its own after
        its next, until a repeat of the last `stop_on_repeat` tokens if not 0,
        handed to `on_partial` every `stream_every` tokens as they come."""
        return Op(partial(self._send_tracked, "verify", seq_id=seq_id, pos=pos, tokens=tokens, sampling=sampling,
                          sample_index=sample_index, trim=trim, **_busy_fields(draft_busy),
                          draft_q=list(draft_q), n_more=n_more, stop_on_repeat=stop_on_repeat,
                          stream_every=stream_every if on_partial else 0, on_partial=on_partial))

    def propose(self, seq_id: int, pos: int, tokens, n_max: int, n_min: int, p_min: float,
                sampling: Sampling | None = None, sample_index: int = 0, target_busy: bool = False) -> Op:
        """`sampling`: sample the drafts (and return their q) for the request's
        token `sample_index` on; None: the draft's most likely tokens.
        `target_busy`: the target computes meanwhile (ProposeRequest.target_busy)."""
        extra = {} if sampling is None else {"sampling": sampling, "sample_index": sample_index}
        return Op(partial(self._send_tracked, "propose", seq_id=seq_id, pos=pos, tokens=tokens, n_max=n_max,
                                     n_min=n_min, p_min=p_min, target_busy=target_busy, **extra))


class GrpcWorker(_Ops):
    """A worker process reached over gRPC; hot-path calls share one stream."""

    def __init__(self, address: str, name: str, channel: grpc.aio.Channel | None = None, timeout: float = 30.0,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "",
                 api_key: str | None = None, owner: str = ""):
        """`credentials` (specd.security.channel_credentials): TLS, with a
        client certificate for workers that require one (mTLS); None: plaintext.
        `server_name`: the name to expect in the worker's certificate when it
        is not the host of `address`. `api_key`: sent with every Worker call,
        for workers started with --api-key-file. `owner`: the router's id,
        which leases the worker to it (specd.ownership); a new one by default."""
        self.address = address
        self.owner = owner or uuid.uuid4().hex
        self.name = name
        self.timeout = timeout
        options = list(CHANNEL_OPTIONS)
        if channel is None and credentials is not None:
            if server_name:
                options.append(("grpc.ssl_target_name_override", server_name))
            channel = grpc.aio.secure_channel(address, credentials, options=options)
        self.channel = channel or grpc.aio.insecure_channel(address, options=options)
        # the key rides on every call made through the stub, Execute streams included
        keyed = KeyedChannel(self.channel, api_key_metadata(api_key)) if api_key else self.channel
        self._stub = pb_grpc.WorkerStub(keyed)
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._call = None
        self._head_timer: asyncio.TimerHandle | None = None
        # ModelInfo.instance_id the router attached to; streams carry it so a
        # restarted worker refuses them (worker.proto, Execute)
        self.instance_id = ""

    # ---------------------------------------------------------------- unary
    async def model_info(self) -> ModelInfo:
        return codec.model_info_from_pb(await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest()))

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        r = await self._unary(self._stub.Tokenize, pb.TokenizeRequest(text=text, add_special=add_special, parse_special=parse_special))
        return list(r.tokens)

    async def detokenize(self, tokens) -> str:
        return (await self._unary(self._stub.Detokenize, pb.DetokenizeRequest(tokens=tokens))).text

    async def apply_chat_template(self, messages) -> list[int]:
        """Token ids of `messages` (router.chat.ChatMessage) rendered with the
        worker's chat template, ending with the assistant's turn opened."""
        request = pb.ApplyChatTemplateRequest(add_generation_prompt=True, messages=[
            pb.ChatMessage(role=m.role, content=m.content) for m in messages])
        return list((await self._unary(self._stub.ApplyChatTemplate, request)).tokens)

    async def _unary(self, method, request):
        try:
            return await method(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise error_for(exc.code().name, f"{self.name} worker at {self.address}: {exc.details()}") from None

    # --------------------------------------------------------------- stream
    def expect_instance(self, instance_id: str) -> None:
        """Streams opened from now on are for this worker process only."""
        if instance_id != self.instance_id:
            self.instance_id = instance_id
            if self._call is not None:
                self._call.cancel()  # a stream to another process must not carry on
                self._reader = None  # the next operation opens a stream that says which process

    async def _send(self, name: str, on_partial=None, **fields) -> asyncio.Future:
        op = codec.op_pb(name, **fields)
        if self._reader is None or self._reader.done():
            self._open()
        fut = asyncio.get_running_loop().create_future()
        # gRPC allows one write in flight per stream: sessions hand their
        # operations to the stream's writer, which keeps their order
        self._pending.append(_InFlight(fut, name, on_partial))
        self._outbox.put_nowait(op)
        if len(self._pending) == 1:
            self._arm()
        return fut

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            pass
        except Exception:  # the stream is broken: cancelling it makes the reader fail what is pending
            call.cancel()

    # The worker answers a stream's operations in order, so the oldest one
    # unanswered is the one it works on (or waits behind in its batch). Its
    # deadline starts when it becomes the oldest: an operation queued behind
    # another session's long prompt is not charged for it, and a late one
    # fails alone while the stream and every other session go on.
    def _arm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if self._pending:
            self._head_timer = asyncio.get_running_loop().call_later(self.timeout, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if not self._pending:
            return
        head = self._pending[0]
        if not head.fut.done():
            head.fut.set_exception(errors.DeadlineExceeded(
                f"{self.name} worker at {self.address}: {head.name} took longer than {self.timeout:g}s"))
            head.fut.exception()  # the owner may be gone
        asyncio.get_running_loop().create_task(self._probe(self._call))
        self._arm()  # keep watching while no answer comes

    async def _probe(self, call) -> None:
        """No answer for a whole deadline: a worker whose server no longer
        answers its health check is stuck or gone, so drop the stream (every
        pending operation fails UNAVAILABLE, and the router fails over). A
        busy worker answers from its event loop while its model computes."""
        try:
            await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=self.timeout)
        except grpc.aio.AioRpcError:
            if call is not None and call is self._call:
                call.cancel()

    def _open(self) -> None:
        metadata = ((OWNER_KEY, self.owner),) + (((INSTANCE_KEY, self.instance_id),) if self.instance_id else ())
        call = self._call = self._stub.Execute(metadata=metadata)
        if self._writer is not None:
            self._writer.cancel()
        self._outbox = asyncio.Queue()
        # each stream answers its own operations: a closing stream's reader
        # fails only what was sent on it
        self._pending = collections.deque()
        self._arm()  # nothing is in flight on the new stream yet
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write(call, self._outbox))
        self._reader = loop.create_task(self._read(call, self._pending))

    async def _read(self, call, pending: collections.deque) -> None:
        try:
            while True:
                res = await call.read()
                if res is grpc.aio.EOF:
                    break
                if res.WhichOneof("result") == "partial":  # the oldest operation goes on: not its answer
                    if pending and pending[0].on_partial is not None:
                        if pending is self._pending:
                            self._arm()
                        pending[0].on_partial(codec.partial_from_pb(res.partial))
                    continue
                fut = pending.popleft().fut
                if pending is self._pending:
                    self._arm()
                if fut.done():  # cancelled or expired
                    continue
                try:
                    fut.set_result(codec.result_from_pb(res))
                except errors.SpecdError as exc:
                    fut.set_exception(exc)
            failure: errors.SpecdError = errors.Unavailable(f"{self.name} worker at {self.address} closed the stream")
        except grpc.aio.AioRpcError as exc:
            failure = _stream_failure(exc, f"{self.name} worker at {self.address}: {exc.details()}")
        except asyncio.CancelledError:
            failure = errors.Unavailable(f"{self.name} worker connection closed")
        if pending is self._pending and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        while pending:
            fut = pending.popleft().fut
            if not fut.done():
                fut.set_exception(failure)
                fut.exception()  # mark retrieved: the owner may be gone

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        if self._call is not None:
            # end the stream rather than cancel it: the worker then frees its
            # lease at once (specd.ownership) for the router that replaces this one
            try:
                await asyncio.wait_for(self._call.done_writing(), 1.0)
                if self._reader is not None:
                    await asyncio.wait_for(asyncio.shield(self._reader), 1.0)
            except Exception:  # a broken stream or a worker that does not answer: cancel it
                pass
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        await self.channel.close()


class LocalWorker(_Ops):
    """An engine in this process, called on one thread in issue order."""

    def __init__(self, engine, name: str):
        self.engine = engine
        self.name = name
        self.address = "in-process"
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"local-{name}")

    async def model_info(self) -> ModelInfo:
        return await self._call(lambda: self.engine.info())

    def expect_instance(self, instance_id: str) -> None:
        """One process: the engine cannot restart under the router."""

    async def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return await self._call(lambda: self.engine.tokenize(text, add_special, parse_special))

    async def detokenize(self, tokens) -> str:
        return await self._call(lambda: self.engine.detokenize(tokens))

    async def apply_chat_template(self, messages) -> list[int]:
        def fn():
            text = self.engine.apply_chat_template([(m.role, m.content) for m in messages], True)
            return self.engine.tokenize(text, True, True)
        return await self._call(fn)

    def _call(self, fn) -> asyncio.Future:
        return asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def _send(self, name: str, **f) -> asyncio.Future:
        f.pop("draft_busy", None)  # one process: nothing to share cores with
        f.pop("busy_seconds", None)
        f.pop("target_busy", None)
        if f.get("on_partial") is not None:  # called on the engine's thread: hand it to the loop
            f["on_partial"] = partial(asyncio.get_running_loop().call_soon_threadsafe, f["on_partial"])
        method = codec.engine_method(name)
        return self._call(lambda: getattr(self.engine, method)(**f))

    async def close(self) -> None:
        self._pool.shutdown(wait=True)
