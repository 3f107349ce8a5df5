"""Turn token pieces into streamed text: incremental UTF-8 decoding and stop
strings. Text that may be the start of a stop string is held back until it is
known not to be one."""
from __future__ import annotations

import codecs


class TextAssembler:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self.stopped = False

    def feed(self, data: bytes) -> str:
        """Add bytes; return the text that is safe to show now."""
        if self.stopped:
            return ""
        self._pending += self._decoder.decode(data)
        cut = self._first_stop()
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

    def _first_stop(self) -> int:
        hits = [i for i in (self._pending.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else -1
