"""`mod`: a fixed-size hash table from n-gram to the token that followed it.

Mirrors llama.cpp's common_ngram_mod (ngram-mod.cpp) as used by
COMMON_SPECULATIVE_TYPE_NGRAM_MOD ("ngram-mod"). Slot of an n-gram t0..tn-1:
h = 0; h = h * 6364136223846793005 + t_i (mod 2**64) for each token; slot = h % size.
A slot holds the last next-token written to it (collisions overwrite; a lookup
does not check the n-gram), -1 when empty.

What is learned and what is kept:
- the table outlives reset() (in llama.cpp it is shared by all sequences and
  kept across requests); clear() empties it. It is emptied automatically when
  more than a quarter of it is used, or after 5 drafts in a row of which less
  than a quarter was accepted (both llama.cpp rules).
- only verified tokens (`n_verified` of propose(); all that observe() gets)
  are added to the table and judge drafts (DraftFeedback);
- when the history is truncated to length L, the slots written by n-grams whose
  next token sat at position >= L are emptied (if they still hold that token),
  then slots that kept history also maps to are refilled from it; everything
  else, including what earlier sequences taught the table, is kept.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ._history import DraftFeedback, SeenHistory, as_array, check_range, verified_part

N_MATCH = 24               # --spec-ngram-mod-n-match
N_MAX = 64                 # --spec-ngram-mod-n-max
N_MIN = 48                 # --spec-ngram-mod-n-min
TABLE_SIZE = 4 * 1024 * 1024
EMPTY = -1
HASH_MUL = 6364136223846793005
_MASK = (1 << 64) - 1
MAX_OCCUPANCY = 0.25       # table reset threshold
LOW_ACCEPT = 0.25          # a draft is "low" when accepted / drafted < this ...
LOW_STREAK = 5             # ... and this many low drafts in a row reset the table


class ModTable:
    """The hash table of n-grams of length n (state: one int32 numpy array)."""

    def __init__(self, n: int, size: int = TABLE_SIZE) -> None:
        self.n = n
        self.entries = np.full(size, EMPTY, dtype=np.int32)
        self.used = 0

    @property
    def occupancy(self) -> float:
        return self.used / len(self.entries)

    def clear(self) -> None:
        self.entries.fill(EMPTY)
        self.used = 0

    def slots(self, arr: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Slots of the n-grams arr[s : s + n] for every s in starts."""
        u = arr.astype(np.uint64)
        h = np.zeros(len(starts), dtype=np.uint64)
        mul = np.uint64(HASH_MUL)
        for k in range(self.n):
            h = h * mul + u[starts + k]
        return (h % np.uint64(len(self.entries))).astype(np.int64)

    def add(self, arr: np.ndarray, starts: np.ndarray) -> None:
        """Write arr[s + n] into the slot of arr[s : s + n], in order of s (later writes win)."""
        if len(starts) == 0:
            return
        slots = self.slots(arr, starts)[::-1]
        slots, last = np.unique(slots, return_index=True)  # the last write to each slot
        targets = arr[starts[::-1][last] + self.n]
        self.used += int(np.count_nonzero(self.entries[slots] == EMPTY))
        self.entries[slots] = targets

    def forget(self, arr: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """Empty the slots these n-grams wrote that still hold their next token; return them."""
        if len(starts) == 0:
            return np.empty(0, dtype=np.int64)
        slots = self.slots(arr, starts)
        gone = np.unique(slots[self.entries[slots] == arr[starts + self.n]])
        self.entries[gone] = EMPTY
        self.used -= len(gone)
        return gone

    def draft(self, window: Sequence[int], limit: int) -> list[int]:
        """Follow the table from the n-gram `window` for at most `limit` tokens (stop at an empty slot)."""
        size, n = len(self.entries), self.n
        drop = pow(HASH_MUL, n - 1, 1 << 64)  # weight of the oldest token in the hash
        win = [int(t) & _MASK for t in window]
        h = 0
        for t in win:
            h = (h * HASH_MUL + t) & _MASK
        out: list[int] = []
        for i in range(limit):
            tok = int(self.entries[h % size])
            if tok == EMPTY:
                break
            out.append(tok)
            t_new = tok & _MASK
            h = ((h - win[i] * drop) * HASH_MUL + t_new) & _MASK
            win.append(t_new)
        return out


class ModProposer:
    """Hash-table drafter.

    Parameters (llama.cpp defaults): n_match = 24 (n-gram size, [1, 1024]),
    n_max = 64 (longest draft, [0, 1024]), n_min = 48 (a draft that stops
    earlier is dropped, [0, 1024]), table_size = 4 Mi slots (16 MiB). Pass
    `table` to share one ModTable between proposers (llama.cpp shares it
    between all sequences); make_proposer gives each proposer its own.
    Deviation: n-grams are added eagerly on every call (llama.cpp batches them
    by 32 tokens), and the pair (n-gram, id_last) is added too.
    """

    name = "mod"
    match_needs_repeat = 0  # its table holds what earlier requests of the sequence taught it

    def __init__(self, n_match: int = N_MATCH, n_max: int = N_MAX, n_min: int = N_MIN,
                 table_size: int = TABLE_SIZE, table: ModTable | None = None) -> None:
        self.n_match = check_range("n_match", n_match, 1, 1024)
        self.n_max = check_range("n_max", n_max, 0, 1024)
        self.n_min = check_range("n_min", n_min, 0, 1024)
        if table is not None and table.n != self.n_match:
            raise ValueError(f"table n-gram size {table.n} != n_match {self.n_match}")
        self.table = table if table is not None else ModTable(self.n_match, check_range("table_size", table_size, 1, 1 << 32))
        self.reset()

    def begin(self, n_prompt: int) -> None:
        """Nothing to do: the prompt's n-grams are learned as observe() sees them."""

    def reset(self) -> None:
        """Start a new sequence: forget its history and acceptance streak; keep the table."""
        self._seen = SeenHistory()
        self._added = 0          # n-grams starting at [0, _added) are in the table
        self._feedback = DraftFeedback()
        self._n_low = 0
        if self.table.occupancy > MAX_OCCUPANCY:
            self.table.clear()

    def clear(self) -> None:
        """Empty the table and start a new sequence."""
        self.table.clear()
        self.reset()

    def _sync(self, arr: np.ndarray) -> int:
        keep, old = self._seen.update(arr)
        n = self.n_match
        if keep < len(old):
            lo = max(0, keep - n)  # first n-gram whose next token was removed
            gone = self.table.forget(old, np.arange(lo, self._added))
            if gone.size and lo > 0:
                kept = np.arange(lo)
                self.table.add(arr, kept[np.isin(self.table.slots(arr, kept), gone)])
            self._added = min(self._added, lo)
        self._ingest(arr)
        return keep

    def _ingest(self, arr: np.ndarray) -> None:
        end = len(arr) - self.n_match
        if end > self._added:
            self.table.add(arr, np.arange(self._added, end))
            self._added = end
            if self.table.occupancy > MAX_OCCUPANCY:
                self.table.clear()
                self.table.add(arr, np.arange(end))

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        arr = as_array(history)
        verified = verified_part(arr, n_verified)
        self._judge(verified, self._sync(verified))
        draft: list[int] = []
        if n_max > 0 and len(arr) >= self.n_match:
            limit = min(self.n_max, max(self.n_min, n_max))
            draft = self.table.draft(arr[-self.n_match :].tolist(), limit)
            draft = [] if len(draft) < limit and len(draft) < self.n_min else draft[:n_max]
        self._feedback.add(arr, len(verified), draft, len(draft))
        return draft

    def observe(self, history: Sequence[int]) -> None:
        arr = as_array(history)
        self._judge(arr, self._sync(arr))

    def _judge(self, verified: np.ndarray, keep: int) -> None:
        """Count the drafts the verified history judges (llama.cpp's accept):
        a run of LOW_STREAK drafts mostly rejected empties the table."""
        for judged in self._feedback.measure(verified, keep):
            if judged.accepted >= LOW_ACCEPT * judged.tag:  # tag: the draft's length
                self._n_low = 0
                continue
            self._n_low += 1
            if self._n_low >= LOW_STREAK:
                self.table.clear()
                self._n_low = 0
                self._added = 0
                self._ingest(verified)
