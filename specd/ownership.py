"""Which router a worker belongs to.

A router owns its workers' sequences: it clears them all when it attaches
and keeps every KV operation mirrored. A second router on the same worker
would wipe the first one's sessions, so a router names itself on every
Execute stream (metadata `specd-owner`) and the worker keeps a lease for
the first one: held while that router has a stream open, and for
`grace` seconds after its last stream broke (a connection that drops comes
back within it). A stream the owner ends itself (the router shut down)
frees the worker at once. Any other router is refused until then.

Calls without an owner token (tools, tests injecting faults) are not
routers and are neither refused nor take the lease.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from specd.errors import PermissionDenied

OWNER_KEY = "specd-owner"
# long enough for a router to reopen a broken stream, short enough that a
# router replacing a crashed one waits only seconds for its workers
LEASE_GRACE_SECONDS = 10.0


@dataclass
class Ownership:
    grace: float = LEASE_GRACE_SECONDS
    clock: Callable[[], float] = field(default=time.monotonic)
    owner: str = ""
    streams: int = 0  # the owner's open Execute streams
    until: float = 0.0  # with no stream open: the lease lasts until then

    def held(self) -> bool:
        return bool(self.owner) and (self.streams > 0 or self.clock() < self.until)

    def check(self, owner: str | None) -> None:
        """Refuse `owner` (None: a caller without a token) while another
        router holds the lease."""
        if owner and owner != self.owner and self.held():
            raise PermissionDenied(
                f"this worker serves router {self.owner}, not {owner}: one router owns a worker's sequences "
                f"(give each router its own workers); a lease ends {self.grace:g}s after its owner's streams close")

    def open(self, owner: str | None) -> None:
        """An Execute stream of `owner` starts: take or keep the lease."""
        if not owner:
            return
        self.check(owner)
        if owner != self.owner:
            self.owner, self.streams = owner, 0
        self.streams += 1

    def close(self, owner: str | None, clean: bool) -> None:
        """An Execute stream of `owner` ended; `clean`: the router closed it
        (free the worker with its last stream), else it broke (keep the
        lease for `grace` seconds)."""
        if not owner or owner != self.owner or self.streams == 0:
            return
        self.streams -= 1
        if self.streams == 0:
            self.until = 0.0 if clean else self.clock() + self.grace
            if clean:
                self.owner = ""
