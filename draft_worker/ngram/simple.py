"""`simple`: draft what followed the latest earlier copy of the last n tokens.

Mirrors llama.cpp's COMMON_SPECULATIVE_TYPE_NGRAM_SIMPLE ("ngram-simple",
common_ngram_simple_draft). Stateless: it only scans the history it is given,
so a truncated history can never yield a removed continuation.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specd.tokens import occurrences

from ._history import as_array, check_range

SIZE_N = 12   # --spec-ngram-simple-size-n
SIZE_M = 48   # --spec-ngram-simple-size-m


def draft_simple(history: Sequence[int] | np.ndarray, size_n: int = SIZE_N, size_m: int = SIZE_M) -> list[int]:
    """Draft for `history` (oldest first, ending with id_last) the llama.cpp ngram-simple way.

    Parameters (llama.cpp defaults): size_n = 12 (n-gram looked up: the last
    size_n tokens, id_last included), size_m = 48 (m-gram drafted). Rules kept
    from llama.cpp:
    - nothing unless the history holds more than size_n + size_m + 2 tokens;
    - the match is the latest start j <= len - size_n - 2 (the copy that
      overlaps the key by all but one token is skipped, as in llama.cpp);
    - the draft is what followed the match, at most size_m tokens, never
      reaching id_last; if fewer than size_n tokens are available there is no
      draft (llama.cpp's minimum draft length is size_n).
    Deviation: position 0 may match (llama.cpp uses 0 as its "no match" sentinel).
    """
    arr = history if isinstance(history, np.ndarray) and history.dtype == np.int64 else as_array(history)
    n_tok = len(arr) - 1  # tokens before id_last
    if n_tok <= size_n + size_m + 1:
        return []
    pos = occurrences(arr, arr[-size_n:], n_tok - size_n - 1)
    if pos.size == 0:
        return []
    start = int(pos[-1]) + size_n
    n_copy = min(size_m, n_tok - start)
    if n_copy < size_n:
        return []
    return arr[start : start + n_copy].tolist()


class SimpleProposer:
    """Proposer wrapper of `draft_simple`; observe() and reset() do nothing (no learned state).

    size_n in [1, 1024] (default 12), size_m in [1, 1024] (default 48), as
    llama.cpp's --spec-ngram-simple-size-n / -size-m. (llama.cpp's
    --spec-ngram-simple-min-hits exists but ngram-simple never reads it.)
    """

    name = "simple"

    def __init__(self, size_n: int = SIZE_N, size_m: int = SIZE_M) -> None:
        self.size_n = check_range("size_n", size_n, 1, 1024)
        self.size_m = check_range("size_m", size_m, 1, 1024)
        self.match_needs_repeat = self.size_n  # the key, id_last included, must occur earlier

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        """`n_verified`: unused, nothing is learned."""
        if n_max <= 0:
            return []
        return draft_simple(as_array(history), self.size_n, self.size_m)[:n_max]

    def observe(self, history: Sequence[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def begin(self, n_prompt: int) -> None:
        pass
