"""Turn token pieces into streamed text: incremental UTF-8 decoding and stop
strings. Text that may be the start of a stop string is held back until it is
known not to be one."""
from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class Fed:
    """What feeding a step's token pieces gave."""

    text: str  # safe to show now
    n_tokens: int  # pieces used: all of them, or up to the one that completed a stop string


class TextAssembler:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.stopped = False

    def feed_pieces(self, pieces: list[bytes]) -> Fed:
        """Add one step's token pieces one token at a time, so that the token
        completing a stop string is known: it is the last one used. Decoding
        one token at a time is what target-only decoding does, so both modes
        stop at the same token."""
        out: list[str] = []
        while len(out) < len(pieces) and not self.stopped:
            out.append(self.feed(pieces[len(out)]))
        return Fed("".join(out), len(out))

    def feed(self, data: bytes) -> str:
        """Add bytes; return the text that is safe to show now."""
        if self.stopped:
            return ""
        searched = len(self._pending)
        self._pending += self._decoder.decode(data)
        cut = self._first_stop(searched)
        if cut >= 0:
            out, self._pending, self.stopped = self._pending[:cut], "", True
            return out
        n_out = max(0, len(self._pending) - self.hold)
        out, self._pending = self._pending[:n_out], self._pending[n_out:]
        return out

    def flush(self) -> str:
        """The rest of the text once generation has ended."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(b"", final=True)
        out, self._pending = self._pending, ""
        return out

    def _first_stop(self, searched: int) -> int:
        """Where the earliest stop string starts, or -1. The first `searched`
        characters held no stop string before this feed, so a new match ends
        after them: each stop is looked for from its length before that."""
        hits = [i for i in (self._pending.find(s, max(0, searched - len(s) + 1)) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1
