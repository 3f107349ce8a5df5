"""The admission queue and the prompt cache: sequence ids shared by both
workers, handed to sessions as they come (a bounded wait when all are busy),
each kept with what its last session left on the workers."""
from __future__ import annotations

import asyncio

from specd.errors import ResourceExhausted

# The retry a full queue suggests (google.rpc.RetryInfo): sessions end every
# few seconds under load, so a second later a place has usually opened.
QUEUE_FULL_RETRY_SECONDS = 1.0


class SeqPool:
    """Sequence ids shared by both workers; bounded wait queue.

    A free sequence may still hold what its last session left (prompt cache):
    `cached[seq]` are the tokens the target holds at positions 0.., and the
    draft holds the first `cached_d[seq]` of them."""

    def __init__(self, n_seq: int, max_queue: int):
        self.capacity = n_seq
        self.free = list(range(n_seq - 1, -1, -1))
        self.in_use: set[int] = set()
        self.max_queue = max_queue
        self.waiters: list[asyncio.Future] = []
        self.cached: dict[int, list[int]] = {}
        self.cached_d: dict[int, int] = {}
        self.cached_on: dict[int, object] = {}  # the target worker holding cached[seq]

    def take_cache(self, seq: int) -> tuple[list[int], int]:
        self.cached_on.pop(seq, None)
        return self.cached.pop(seq, []), self.cached_d.pop(seq, 0)

    def drop_target_cache(self, seq: int) -> None:
        """Forget what a target holds of `seq`. What the draft holds stays
        counted (cached_d), so the next session on `seq` clears it there
        before decoding from position 0."""
        self.cached_on.pop(seq, None)
        self.cached.pop(seq, None)

    def forget_target(self, target) -> None:
        """A target worker lost its sequences (down or restarted)."""
        for seq in [q for q, t in self.cached_on.items() if t is target]:
            self.drop_target_cache(seq)

    def shrink(self, n_seq: int) -> None:
        """A worker hosts only ids below `n_seq`: higher ones are never handed
        out again (those running end their session and are dropped)."""
        if n_seq >= self.capacity:
            return
        self.capacity = n_seq
        self.free = [i for i in self.free if i < n_seq]
        for seq in [q for q in {*self.cached, *self.cached_d} if q >= n_seq]:
            self.take_cache(seq)

    def forget_draft(self) -> None:
        """The draft worker lost its sequences (restart): nothing of it is cached."""
        self.cached_d.clear()

    def _best_free(self, prompt: list[int]) -> int:
        """The free sequence sharing the longest prefix with the prompt (as
        llama-server picks a slot); among equals, the one holding least, then
        the lowest id: with a KV stream per sequence, llama.cpp batches in one
        pass only sequences whose ids follow each other, so ids stay dense."""
        best = max(range(len(self.free)), key=lambda i: (
            common_prefix(self.cached.get(self.free[i], ()), prompt), -len(self.cached.get(self.free[i], ())),
            -self.free[i]))
        return self.free.pop(best)

    @property
    def n_running(self) -> int:
        return len(self.in_use)

    async def acquire(self, prompt: list[int] = ()) -> int:
        if self.free:
            seq = self._best_free(list(prompt))
            self.in_use.add(seq)
            return seq
        if len(self.waiters) >= self.max_queue:
            raise ResourceExhausted(f"all sequences are busy and the queue is full (max_queue = {self.max_queue})",
                                    retry_after=QUEUE_FULL_RETRY_SECONDS)
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            seq = await fut
            self.in_use.add(seq)
            return seq
        except asyncio.CancelledError:
            if fut in self.waiters:
                self.waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self.in_use.add(fut.result())
                self.release(fut.result())
            raise

    def release(self, seq: int) -> None:
        self.in_use.discard(seq)
        if seq >= self.capacity:  # the pool shrank while it ran (shrink)
            self.take_cache(seq)
            return
        while self.waiters:
            fut = self.waiters.pop(0)
            if not fut.done():
                fut.set_result(seq)
                return
        self.free.append(seq)


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
