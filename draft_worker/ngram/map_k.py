"""`map-k` and `map-k4v`: n-gram -> m-gram lookup that learns draft lengths.

A port of llama.cpp's common_ngram_map (common/ngram-map.cpp), as used by
COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K ("ngram-map-k", key_only) and
COMMON_SPECULATIVE_TYPE_NGRAM_MAP_K4V ("ngram-map-k4v", up to 4 values per
key). `NgramMap` keeps the same state and takes the same steps (begin, draft,
accept), so fed the same calls it drafts the same tokens: the test replays
traces recorded from llama.cpp's own code (scripts/ngram_parity/).

llama.cpp's choices kept on purpose, since users compare the two:
- a match is looked up in a 2^18-slot hash table of positions that only
  fills empty slots: the earliest indexed copy of a key wins (collisions
  included), and keys starting in the prompt's last size_n + size_m tokens
  are never indexed;
- map-k4v counts the values after a key from its last lookup's position on,
  that position again included, and drafts the tokens after the match even
  when another value won the count (the winner only gives the length cap).
`NgramMapProposer` adapts it to specd's proposer interface: begin(n_prompt)
as llama.cpp's (the draft worker calls it with what it decoded before a
request's first proposal); a truncated history also forgets what started in
the removed tokens (and, unlike llama.cpp, anything that would read them);
accept() gets each draft's accepted count from the verified history
(DraftFeedback).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specd.tokens import occurrences

from ._history import DraftFeedback, SeenHistory, as_array, check_range, verified_part

SIZE_N = 12          # --spec-ngram-map-k[4v]-size-n
SIZE_M = 48          # --spec-ngram-map-k[4v]-size-m
MIN_HITS = 1         # --spec-ngram-map-k[4v]-min-hits
MAX_VALUES = 4       # COMMON_NGRAM_MAX_VALUES
MAX_COUNT = 16380    # COMMON_NGRAM_MAX_VALUE_COUNT
HASH_SLOTS = 1 << 18  # COMMON_NGRAM_HASH_MAP_SIZE
LCG_FACTOR = np.uint32(2654435761)


class MapValue:
    """common_ngram_map_value: an m-gram seen after a key."""

    __slots__ = ("idx", "num", "n_accepted")

    def __init__(self, size_m: int) -> None:
        self.idx = 0               # where the m-gram starts in the history (0: slot unused)
        self.num = 0               # times it followed the key, as counted
        self.n_accepted = size_m   # tokens the target accepted of its last draft


class MapKey:
    """common_ngram_map_key: a key n-gram that was looked up."""

    __slots__ = ("idx", "stat_idx", "num", "values")

    def __init__(self, idx: int, size_m: int) -> None:
        self.idx = idx             # where the key was first matched
        self.stat_idx = 0          # values are counted up to here
        self.num = 0               # lookups of the key
        self.values = [MapValue(size_m) for _ in range(MAX_VALUES)]


def ngram_hashes(arr: np.ndarray, starts: np.ndarray, n: int) -> np.ndarray:
    """common_ngram_map_hash of the n-grams at `starts`: LCG over uint32, as llama.cpp."""
    h = np.zeros(len(starts), dtype=np.uint32)
    for k in range(n):
        h = h * LCG_FACTOR + arr[starts + k].astype(np.uint32)
    return h


class NgramMap:
    """common_ngram_map with common_ngram_map_begin / _draft / _accept."""

    def __init__(self, size_n: int, size_m: int, key_only: bool, min_hits: int) -> None:
        self.n, self.m = size_n, size_m
        self.key_only, self.min_hits = key_only, min_hits
        self.keys: dict[tuple[int, ...], MapKey] = {}
        self.slots: dict[int, int] = {}    # hash % HASH_SLOTS -> position (key_map; absent = 0)
        self.key_map_last_idx = 0
        self.size_last_begin = 0
        self.idx_last_check = 0
        self.last: MapValue | None = None  # the value the last draft came from

    def begin(self, size_begin: int, safe_end: int | None = None) -> None:
        """A new prompt of `size_begin` tokens. `safe_end`: tokens from there
        on were changed, so nothing that reads them is kept (specd's addition)."""
        n, m = self.n, self.m
        cleanup = self.size_last_begin
        if cleanup > size_begin:
            cleanup = size_begin - n - m if size_begin > n + m else 0
        if safe_end is not None:
            cleanup = min(cleanup, max(0, safe_end - n - m))
        if size_begin < self.idx_last_check or safe_end is not None:
            self.slots = {s: j for s, j in self.slots.items() if j < cleanup}
            self.key_map_last_idx = cleanup - 1 if cleanup > 0 else 0
            self._forget_keys(cleanup)
        self.idx_last_check = size_begin
        self.size_last_begin = size_begin

    def _forget_keys(self, cleanup: int) -> None:
        for tokens, key in list(self.keys.items()):
            if key.idx >= cleanup:
                del self.keys[tokens]
            elif not self.key_only:
                # used slots are a prefix (filled in order): keep it so, the freed ones at the end
                kept = [v for v in key.values if 0 < v.idx < cleanup]
                key.values = kept + [MapValue(0) for _ in range(MAX_VALUES - len(kept))]
                if key.values[0].idx == 0:
                    del self.keys[tokens]

    def draft(self, inp: np.ndarray, sampled: int, index: bool = True) -> list[int]:
        """The draft after `inp` + `sampled` (inp: the tokens before it).
        index=False leaves the hash table as it is (a lookahead's inp holds drafts)."""
        self.last = None
        n, m = self.n, self.m
        cur_len = len(inp)
        if cur_len < 2 * n + m:
            return []
        self.idx_last_check = cur_len
        key = np.append(inp[cur_len - n + 1 :], np.int64(sampled))
        match_pos = self._find(inp, key)
        if index:
            self._index(inp)
        if match_pos == 0:
            return []
        key_t = tuple(key.tolist())
        entry = self.keys.get(key_t)
        if entry is None:
            entry = self.keys[key_t] = MapKey(match_pos, m)
        entry.num = min(entry.num + 1, MAX_COUNT)
        if self.key_only:
            value = entry.values[0]
        else:
            if entry.num < self.min_hits:
                return []
            value = self._count_values(inp, key, entry, match_pos)
            if value is None:
                return []
        self.last = value
        return inp[match_pos + n : match_pos + n + min(m, value.n_accepted)].tolist()

    def fork(self, key: tuple[int, ...]) -> "NgramMap":
        """A copy to draft `key` on without changing this map: the hash table
        is shared (to be drafted on with index=False), the key's entry copied."""
        out = NgramMap(self.n, self.m, self.key_only, self.min_hits)
        out.slots, out.key_map_last_idx = self.slots, self.key_map_last_idx
        out.size_last_begin, out.idx_last_check = self.size_last_begin, self.idx_last_check
        if key in self.keys:
            out.keys[key] = _copy_key(self.keys[key])
        return out

    def accept(self, n_accepted: int) -> None:
        if self.last is not None:
            self.last.n_accepted = n_accepted

    def _find(self, inp: np.ndarray, key: np.ndarray) -> int:
        """The key's position: its hash slot if that holds it, else the latest
        copy among positions not yet indexed; 0 for none."""
        n, m = self.n, self.m
        cur_len = len(inp)
        slot = int(ngram_hashes(key, np.zeros(1, dtype=np.int64), n)[0]) % HASH_SLOTS
        idx = self.slots.get(slot, 0)
        if idx != 0 and idx < cur_len - n - m - 1 and np.array_equal(inp[idx : idx + n], key):
            return idx
        for lo, hi in self._unindexed(cur_len):
            pos = occurrences(inp, key, hi)
            pos = pos[pos > lo]
            if pos.size:
                return int(pos[-1])
        return 0

    def _unindexed(self, cur_len: int) -> list[tuple[int, int]]:
        """The ranges (lo, hi] of positions to index, in llama.cpp's order:
        the prompt's, then the generated tokens'."""
        n, m = self.n, self.m
        out = []
        if self.size_last_begin > n + m + 1:
            out.append((self.key_map_last_idx, self.size_last_begin - n - m - 1))
        out.append((max(self.size_last_begin, self.key_map_last_idx), cur_len - n - m - 1))
        return [(lo, hi) for lo, hi in out if hi > lo]

    def _index(self, inp: np.ndarray) -> None:
        """Put the new positions in the hash table, latest first; a slot keeps its first position."""
        for lo, hi in self._unindexed(len(inp)):
            starts = np.arange(hi, lo, -1, dtype=np.int64)
            for slot, j in zip((ngram_hashes(inp, starts, self.n) % HASH_SLOTS).tolist(), starts.tolist()):
                self.slots.setdefault(slot, j)
        self.key_map_last_idx = max(len(inp) - self.n - self.m - 1, self.key_map_last_idx)

    def _count_values(self, inp: np.ndarray, key: np.ndarray, entry: MapKey, match_pos: int) -> MapValue | None:
        """Count the m-grams after the key's copies in [stat_idx, match_pos];
        the most frequent if it is at least twice the others together."""
        m = self.m
        pos = occurrences(inp, key, match_pos)
        for i in pos[pos >= entry.stat_idx].tolist():
            start = i + self.n
            for v in entry.values:
                if v.idx == 0:
                    v.idx, v.num, v.n_accepted = start, 0, m
                elif not np.array_equal(inp[start : start + m], inp[v.idx : v.idx + m]):
                    continue
                v.num = min(v.num + 1, MAX_COUNT)
                break
        entry.stat_idx = match_pos
        best = max(range(MAX_VALUES), key=lambda s: (entry.values[s].num, -s))
        top = entry.values[best].num
        others = sum(v.num for v in entry.values) - top
        if others > 0 and top < 2 * others:
            return None
        return entry.values[best]


class NgramMapProposer:
    """map-k (key_only=True) or map-k4v (key_only=False).

    Parameters, with llama.cpp's defaults for both types: size_n = 12 (key
    n-gram, [1, 1024]), size_m = 48 (value m-gram = max draft, [1, 1024]),
    min_hits = 1 (>= 1; map-k ignores it, as llama.cpp does).
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
        self.map = NgramMap(self.size_n, self.size_m, self.key_only, self.min_hits)
        self._seen = SeenHistory()
        self._feedback = DraftFeedback()
        self._prompt: int | None = None

    def begin(self, n_prompt: int) -> None:
        """A request starts; its first n_prompt tokens are the prompt
        (llama.cpp's common_speculative_begin). Taken at the next observe."""
        self._prompt = max(0, int(n_prompt))

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        """Draft after `history`; only its first `n_verified` tokens (all
        when None) are verified, and only those are indexed and judge drafts.
        A draft after unverified tokens (a lookahead) looks the table up
        without changing it."""
        arr = as_array(history)
        verified = verified_part(arr, n_verified)
        self.observe(verified)
        draft: list[int] = []
        value = None
        if n_max > 0 and len(arr) > 0:
            if len(verified) == len(arr):
                draft = self.map.draft(arr[:-1], int(arr[-1]))[:n_max]
                value = self.map.last
            else:
                draft = self._lookahead(arr)[:n_max]
        self._feedback.add(arr, len(verified), draft, value)
        return draft

    def _lookahead(self, arr: np.ndarray) -> list[int]:
        """What draft() would propose, changing nothing (llama.cpp never drafts after a draft)."""
        key = tuple(arr[len(arr) - self.size_n :].tolist())
        return self.map.fork(key).draft(arr[:-1], int(arr[-1]), index=False)

    def observe(self, history: Sequence[int]) -> None:
        arr = as_array(history)
        keep, old = self._seen.update(arr)
        prompt, self._prompt = self._prompt, None
        if keep < len(old):
            self.map.begin(keep if prompt is None else prompt, safe_end=keep)
        elif prompt is not None:
            self.map.begin(prompt)
        elif len(old) == 0 and len(arr) > 0:
            self.map.begin(len(arr) - 1)     # no prompt told: every token before the first id_last
        for judged in self._feedback.measure(arr, keep):
            if judged.tag is not None:
                judged.tag.n_accepted = judged.accepted


def _copy_key(key: MapKey) -> MapKey:
    out = MapKey(key.idx, 0)
    out.stat_idx, out.num = key.stat_idx, key.num
    for dst, src in zip(out.values, key.values):
        dst.idx, dst.num, dst.n_accepted = src.idx, src.num, src.n_accepted
    return out
