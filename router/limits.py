"""Per-request limits of the public API, checked before a request takes a
sequence. Each refusal names its limit (the router flag, in snake case).

- max_prompt_tokens: prompts longer than this are INVALID_ARGUMENT (0: the
  context size, which the engine checks anyway).
- max_tokens_limit: a request's max_tokens above this is INVALID_ARGUMENT; a
  request that leaves max_tokens unset gets it as its cap.
- request_timeout: the longest one Generate may run, DEADLINE_EXCEEDED past
  it (applied by the servicer around each step; the client's own gRPC
  deadline always applies too).
- max_stop_strings, max_stop_length: the number of stop strings and the
  characters of each, INVALID_ARGUMENT naming `stop` (each step scans them all).
- max_prompt_bytes: prompt text (or chat messages) longer than this in UTF-8
  bytes is INVALID_ARGUMENT naming the field, before the target tokenizes it
  (0: PROMPT_BYTES_PER_TOKEN per token of max_prompt_tokens or the context).
- max_message_bytes is enforced by gRPC itself (max_receive_message_length,
  RESOURCE_EXHAUSTED); the queue bound (max_queue) by the engine's pool.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Awaitable, Iterable, Sequence, TypeVar

from specd.config import MAX_STOP_LENGTH, MAX_STOP_STRINGS, PROMPT_BYTES_PER_TOKEN
from specd.errors import DeadlineExceeded, InvalidArgument

T = TypeVar("T")


@dataclass
class Limits:
    max_prompt_tokens: int = 0
    max_tokens_limit: int = 0
    request_timeout: float = 0.0
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_length: int = MAX_STOP_LENGTH
    max_prompt_bytes: int = 0

    @classmethod
    def of(cls, cfg) -> "Limits":
        lim = cls(max_prompt_tokens=cfg.max_prompt_tokens, max_tokens_limit=cfg.max_tokens_limit,
                  request_timeout=cfg.request_timeout, max_stop_strings=cfg.max_stop_strings,
                  max_stop_length=cfg.max_stop_length, max_prompt_bytes=cfg.max_prompt_bytes)
        lim.check()
        return lim

    def check(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens_limit", "request_timeout", "max_stop_strings",
                     "max_prompt_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_stop_length < 1:
            raise ValueError(f"max_stop_length must be >= 1, got {self.max_stop_length}")

    def check_stops(self, stops: Sequence[str]) -> None:
        """Refuse too many or too long stop strings (InvalidArgument naming `stop`)."""
        if len(stops) > self.max_stop_strings:
            raise InvalidArgument(f"stop: {len(stops)} stop strings, more than max_stop_strings = "
                                  f"{self.max_stop_strings}", field="stop")
        for i, s in enumerate(stops):
            if len(s) > self.max_stop_length:
                raise InvalidArgument(f"stop[{i}] has {len(s)} characters, more than max_stop_length = "
                                      f"{self.max_stop_length}", field=f"stop[{i}]")

    def prompt_bytes(self, n_ctx: int) -> int:
        """The largest prompt text in bytes, for a router whose sequences hold `n_ctx` tokens."""
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * (self.max_prompt_tokens or n_ctx)

    def check_prompt_text(self, name: str, texts: Iterable[str], n_ctx: int) -> None:
        """Refuse text too long to tokenize as a prompt (InvalidArgument naming
        `name`): a cheap bound before the target tokenizes it under its engine lock."""
        n_bytes, cap = 0, self.prompt_bytes(n_ctx)
        for t in texts:
            n_bytes += len(t.encode("utf-8", "surrogatepass"))  # JSON may carry lone surrogates
            if n_bytes > cap:
                raise InvalidArgument(f"{name}: more than max_prompt_bytes = {cap} bytes of text", field=name)

    def apply(self, p, router) -> None:
        """Check `p` (router.engine.GenParams) against the limits; cap an unset
        max_tokens. Raises InvalidArgument naming the limit."""
        if self.max_prompt_tokens and len(p.prompt) > self.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(p.prompt)} tokens, more than max_prompt_tokens = "
                                  f"{self.max_prompt_tokens}", field="prompt")
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
            raise InvalidArgument(f"max_tokens = {p.max_tokens} is more than max_tokens_limit = {cap}", field="max_tokens")

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
