"""Continuous batching of a worker's operations.

Operations from every `Execute` stream go into one queue. Each round the
scheduler takes the longest prefix of the queue that it can run as one
batch (`take_window`): decodes, verifications and proposals of distinct
sequences merge into shared llama_decode calls (`WorkerEngine.run_batch`),
as llama.cpp's server batches its slots; cheap bookkeeping of other
sequences runs just before. Operations on one sequence keep their order, and
every stream gets its results in the order it sent its operations. While a
batch computes on the engine thread, what arrives meanwhile queues up for the
next one.

Each sequence's next operation comes back a round trip through the router
after its result. Starting the next round at once would take only the
sequences that missed the last one, and the active sequences would split into
two half batches taking turns, each waiting out the other's. So before a
round the scheduler waits until the sequences of the last two rounds have
sent their next operation, at most `gather_factor` of the last round's duration and
`gather_max` seconds (as vLLM's scheduler delay factor).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from specd.config import MAX_QUEUED_OPS, MAX_STREAM_OPS
from specd.errors import ResourceExhausted, Unavailable

log = logging.getLogger("specd.worker")

# operations that decode and can share a batch with other sequences'
BATCHABLE = frozenset({"decode", "verify", "propose"})
# bookkeeping bound to the sequence named by `seq_id`
SEQ_OPS = frozenset({"seq_rm", "seq_add", "get_seq_state", "checkpoint_save", "clear"})


@dataclass
class Window:
    """One round: `pre` runs first, in order; then `batch` together.
    `waiting`: whether operations wait for the next round (callable from
    the engine thread): a verification going on alone stops for them."""

    pre: list[Any] = field(default_factory=list)
    batch: list[Any] = field(default_factory=list)
    waiting: Callable[[], bool] | None = None

    @property
    def items(self) -> list[Any]:
        return self.pre + self.batch


def op_key(kind: str | None, seq_id: int | None) -> tuple[str, int | None]:
    """How an operation may be reordered: ("batch", seq), ("seq", seq) or
    ("barrier", None) for those that touch unknown or all sequences."""
    if kind in BATCHABLE:
        return "batch", seq_id
    if kind in SEQ_OPS and seq_id is not None and seq_id >= 0:
        return "seq", seq_id
    return "barrier", None


def take_window(queue: collections.deque, key: Callable[[Any], tuple[str, int | None]]) -> Window:
    """Pop the longest prefix of `queue` that runs as one round.

    Batchable operations join the batch if their sequence is not in it yet.
    A bookkeeping operation on a sequence not in the batch runs before the
    batch (sequences are independent, so only per-sequence order matters). A
    barrier runs alone. The first operation that would break per-sequence
    order ends the window.
    """
    w = Window()
    in_batch: set[int | None] = set()
    while queue:
        kind, seq = key(queue[0])
        if kind == "barrier":
            if not w.items:
                w.pre.append(queue.popleft())
            break
        if seq in in_batch:
            break
        if kind == "batch":
            in_batch.add(seq)
            w.batch.append(queue.popleft())
        else:
            w.pre.append(queue.popleft())
    return w


@dataclass(frozen=True)
class QueueBounds:
    """How many operations a worker holds for its callers."""

    queued_ops: int = MAX_QUEUED_OPS  # waiting for a round, all streams together
    stream_ops: int = MAX_STREAM_OPS  # of one Execute stream, not answered yet

    @classmethod
    def of(cls, cfg) -> "QueueBounds":
        return cls(queued_ops=cfg.max_queued_ops, stream_ops=cfg.max_stream_ops)


class EngineRunner:
    """Runs engine calls one at a time, all on one dedicated thread.

    Every llama.cpp call comes from that thread, never from the event loop:
    libgomp keeps a thread team per calling thread, and with two teams it
    counts more threads than cores and stops spinning at its barriers, so
    each of a token's barriers sleeps on a futex (docs/perf, "Where a
    token's time goes"). The loop meanwhile reads what arrives (it joins the
    next round) and answers health checks.
    """

    def __init__(self, engine=None):
        self.engine = engine  # None while the model loads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")

    async def load(self, make_engine: Callable[[], Any]) -> None:
        self.engine = await asyncio.get_running_loop().run_in_executor(self._pool, make_engine)

    async def run(self, fn: Callable[[Any, Any], Any], request) -> Any:
        if self.engine is None:
            raise Unavailable("the worker is still loading its model")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, self.engine, request)

    async def run_beside(self, fn: Callable[[Any, Any], Any], request) -> Any:
        """Calls that only read the model's vocabulary (tokenize, detokenize)
        run on another thread beside the engine's rounds, as llama-server
        tokenizes on its HTTP threads: a request's text is not held up by
        another session's long prompt."""
        if self.engine is None:
            raise Unavailable("the worker is still loading its model")
        return await asyncio.get_running_loop().run_in_executor(None, fn, self.engine, request)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


class Scheduler:
    """The queue of operations in flight and the loop that runs them in rounds.

    `run_round(engine, window)` returns one result per `window.items`;
    `key(op)` classifies an operation (see op_key). At most `max_queued`
    operations wait for a round.
    """

    def __init__(self, runner: EngineRunner, run_round, key,
                 gather_max: float = 0.010, gather_factor: float = 0.2, max_queued: int = MAX_QUEUED_OPS):
        self.runner = runner
        self.max_queued = max_queued
        self.gather_max = gather_max
        self.gather_factor = gather_factor
        self._last_batches: collections.deque = collections.deque(maxlen=2)  # sequences of the last rounds' batches
        self._last_seconds = 0.0
        self.run_round = run_round
        self.key = key
        self.queue: collections.deque = collections.deque()  # (op, future)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.rounds = 0
        self.batched_ops = 0

    def submit(self, op) -> asyncio.Future:
        """The future of `op`'s result. Past max_queued it has already failed
        with ResourceExhausted: the caller answers it in its place in the
        stream, and nothing queued is touched."""
        fut = asyncio.get_running_loop().create_future()
        if len(self.queue) >= self.max_queued:
            fut.set_exception(ResourceExhausted(
                f"the worker's queue is full: {len(self.queue)} operations wait (max_queued_ops = {self.max_queued})"))
            return fut
        self.queue.append((op, fut))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        return fut

    def waiting(self) -> bool:
        """Whether operations wait for a round; read from the engine thread
        (a deque's length is read atomically)."""
        return len(self.queue) > 0

    def _missing(self) -> bool:
        """Whether a sequence of the last two batches has not sent its next
        operation yet (two: sequences that took turns in half batches)."""
        expected = set().union(*self._last_batches)
        if len(expected) < 2:
            return False
        queued = {self.key(op)[1] for op, _ in self.queue}
        return not expected <= queued

    async def _gather(self) -> None:
        wait = min(self.gather_max, self.gather_factor * self._last_seconds)
        deadline = time.monotonic() + wait
        while wait > 0 and self._missing():
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), deadline - time.monotonic())
            except asyncio.TimeoutError:
                return
            if time.monotonic() >= deadline:
                return

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.queue:
                await asyncio.sleep(0)  # operations that already arrived join this round
                await self._gather()
                taken = take_window(self.queue, lambda item: self.key(item[0]))
                window = Window([op for op, _ in taken.pre], [op for op, _ in taken.batch], self.waiting)
                t0 = time.monotonic()
                try:
                    results = await self.runner.run(self.run_round, window)
                except Exception as exc:  # loading, or a bug: every operation of the round gets it
                    results = [exc] * len(window.items)
                self._last_seconds = time.monotonic() - t0
                if window.batch:
                    self._last_batches.append({self.key(op)[1] for op in window.batch})
                self.rounds += 1
                self.batched_ops += len(window.batch)
                for (_, fut), res in zip(taken.items, results):
                    if not fut.done():
                        if isinstance(res, BaseException):
                            fut.set_exception(res)
                        else:
                            fut.set_result(res)
