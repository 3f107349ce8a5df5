"""Per-request limits of the public API, checked before a request takes a
sequence. Each refusal names its limit (the router flag, in snake case).

- max_prompt_tokens: prompts longer than this are INVALID_ARGUMENT (0: the
  context size, which the engine checks anyway).
- max_tokens_limit: a request's max_tokens above this is INVALID_ARGUMENT; a
  request that leaves max_tokens unset gets it as its cap.
- request_timeout: the longest one Generate may run, DEADLINE_EXCEEDED past
  it (applied by the servicer around each step; the client's own gRPC
  deadline always applies too).
- max_message_bytes is enforced by gRPC itself (max_receive_message_length,
  RESOURCE_EXHAUSTED); the queue bound (max_queue) by the engine's pool.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, TypeVar

from specd.errors import DeadlineExceeded, InvalidArgument

T = TypeVar("T")


@dataclass
class Limits:
    max_prompt_tokens: int = 0
    max_tokens_limit: int = 0
    request_timeout: float = 0.0

    @classmethod
    def of(cls, cfg) -> "Limits":
        lim = cls(max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
                  request_timeout=cfg.request_timeout)
        lim.check()
        return lim

    def check(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens_limit", "request_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")

    def apply(self, p, router) -> None:
        """Check `p` (router.engine.GenParams) against the limits; cap an unset
        max_tokens. Raises InvalidArgument naming the limit."""
        if self.max_prompt_tokens and len(p.prompt) > self.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(p.prompt)} tokens, more than max_prompt_tokens = "
                                  f"{self.max_prompt_tokens}")
        cap = self.max_tokens_limit
        if not cap:
            return
        if p.max_tokens is None:
            # Unset means "until the context is full"; the cap bounds it. Where
            # the context ends first (no shifting), leave it to the context so
            # the request is not refused for a max_tokens it did not send.
            if router._can_shift(p) or len(p.prompt) + cap <= router.n_ctx:
                p.max_tokens = cap
        elif p.max_tokens > cap:
            raise InvalidArgument(f"max_tokens = {p.max_tokens} is more than max_tokens_limit = {cap}")

    def deadline(self) -> float | None:
        """The loop time by which a Generate starting now must end."""
        if not self.request_timeout:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

    async def within(self, aw: Awaitable[T], deadline: float | None) -> T:
        """Await `aw`, or raise DeadlineExceeded naming request_timeout once
        `deadline` passes (the awaited work is cancelled and cleans up)."""
        if deadline is None:
            return await aw
        if not hasattr(asyncio, "timeout_at"):  # Python 3.10
            try:
                return await asyncio.wait_for(aw, max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise self._exceeded() from None
        cm = asyncio.timeout_at(deadline)
        try:
            async with cm:
                return await aw
        except TimeoutError:
            if cm.expired():
                raise self._exceeded() from None
            raise

    def _exceeded(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"the request ran longer than request_timeout = {self.request_timeout:g}s")
