"""`map-k` and `map-k4v`: n-gram -> m-gram lookup that learns draft lengths.

Mirrors llama.cpp's common_ngram_map (ngram-map.cpp) as used by
COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K ("ngram-map-k", key_only) and
COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V ("ngram-map-k4v", up to 4 values per key).

What is learned (per sequence): for every (key, value) that produced a draft,
how many of its tokens the target accepted last time (judged on verified
tokens only, DraftFeedback); the next draft from that entry is cut to that
length (0 disables the entry, as in llama.cpp).
On truncation of the history to length L, entries whose evidence lies at
position >= L are forgotten; entries judged entirely before L are kept.
reset() forgets everything. The value statistics themselves (which m-grams
follow a key, and how often) are recomputed from the history given, so they
never include removed tokens.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from specd.tokens import occurrences

from ._history import DraftFeedback, SeenHistory, as_array, check_range, verified_part

SIZE_N = 12          # --spec-ngram-map-k[4v]-size-n
SIZE_M = 48          # --spec-ngram-map-k[4v]-size-m
MIN_HITS = 1         # --spec-ngram-map-k[4v]-min-hits
MAX_VALUES = 4       # COMMON_NGRAM_MAX_VALUES


class MapMatch(NamedTuple):
    start: int                 # index in the history where the drafted m-gram starts
    key: tuple[int, ...]       # the key n-gram (last size_n tokens)
    value: tuple[int, ...]     # the chosen m-gram; () in key-only mode


def find_map_draft(arr: np.ndarray, size_n: int, size_m: int, min_hits: int, key_only: bool) -> MapMatch | None:
    """Pick the m-gram to draft after the last size_n tokens of `arr`, or None.

    Key occurrences count only where a full m-gram and one more token follow
    (start j <= len - size_n - size_m - 2), and drafting needs
    len - 1 >= 2 * size_n + size_m (both as in llama.cpp). Hits = number of
    such occurrences; fewer than min_hits -> None.
    key_only: the m-gram after the latest occurrence.
    otherwise: the first MAX_VALUES distinct m-grams after the occurrences (in
    order of first appearance) are counted; the most frequent is drafted unless
    the others together reach more than half its count
    (count_best < 2 * count_others -> None).
    Deviations from llama.cpp: hits count occurrences, not lookups of the key;
    the drafted tokens are the chosen value's (llama.cpp copies the tokens after
    the latest occurrence even when another value won); position 0 may match.
    """
    n_hist = len(arr)
    if n_hist - 1 < 2 * size_n + size_m:
        return None
    key = arr[n_hist - size_n :]
    pos = occurrences(arr, key, n_hist - size_n - size_m - 2)
    if pos.size == 0 or pos.size < min_hits:
        return None
    key_t = tuple(key.tolist())
    if key_only:
        return MapMatch(int(pos[-1]) + size_n, key_t, ())
    grams = arr[(pos + size_n)[:, None] + np.arange(size_m)]
    _, first, counts = np.unique(grams, axis=0, return_index=True, return_counts=True)
    slots = np.argsort(first, kind="stable")[:MAX_VALUES]
    first, counts = first[slots], counts[slots]
    best = int(np.argmax(counts))
    others = int(counts.sum()) - int(counts[best])
    if others > 0 and counts[best] < 2 * others:
        return None
    start = int(pos[first[best]]) + size_n
    return MapMatch(start, key_t, tuple(arr[start : start + size_m].tolist()))


class NgramMapProposer:
    """map-k (key_only=True) or map-k4v (key_only=False).

    Parameters, with llama.cpp's defaults for both types: size_n = 12 (key
    n-gram, [1, 1024]), size_m = 48 (value m-gram = max draft, [1, 1024]),
    min_hits = 1 (>= 1; llama.cpp ignores it for map-k, here it applies to
    both, which changes nothing at the default).
    """

    def __init__(self, key_only: bool = True, size_n: int = SIZE_N, size_m: int = SIZE_M,
                 min_hits: int = MIN_HITS) -> None:
        self.key_only = bool(key_only)
        self.name = "map-k" if self.key_only else "map-k4v"
        self.size_n = check_range("size_n", size_n, 1, 1024)
        self.size_m = check_range("size_m", size_m, 1, 1024)
        self.min_hits = check_range("min_hits", min_hits, 1, 1 << 30)
        self.match_needs_repeat = self.size_n  # the key must occur earlier
        self.reset()

    def reset(self) -> None:
        # (key, value) -> (accepted tokens at its last draft, end of the evidence for it)
        self.accepted: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}
        self._seen = SeenHistory()
        self._feedback = DraftFeedback()

    def _sync(self, arr: np.ndarray) -> int:
        keep, old = self._seen.update(arr)
        if keep < len(old):
            self.accepted = {k: v for k, v in self.accepted.items() if v[1] <= keep}
        return keep

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        """Draft after `history`; only its first `n_verified` tokens (all
        when None) are verified, and only those teach and judge."""
        arr = as_array(history)
        verified = verified_part(arr, n_verified)
        self.observe(verified)
        draft: list[int] = []
        ident = None
        match = find_map_draft(arr, self.size_n, self.size_m, self.min_hits, self.key_only) if n_max > 0 else None
        if match is not None:
            ident = (match.key, match.value)
            cap = self.accepted.get(ident, (self.size_m, 0))[0]
            draft = arr[match.start : match.start + min(self.size_m, cap, n_max)].tolist()
        self._feedback.add(arr, len(verified), draft, ident)
        return draft

    def observe(self, history: Sequence[int]) -> None:
        arr = as_array(history)
        for judged in self._feedback.measure(arr, self._sync(arr)):
            self.accepted[judged.tag] = (judged.accepted, judged.evidence_end)
