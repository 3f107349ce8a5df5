"""`cache`: n-gram -> next-token counts from three caches, learning across requests.

Mirrors llama.cpp's common_ngram_cache (ngram-cache.cpp) as used by
COMMON_SPECULATIVE_TYPE_NGRAM_CACHE ("ngram-cache") and examples/lookup:
- context: 1..4-grams of this sequence's verified history (per sequence);
- dynamic: what earlier sequences taught (context is merged into it on reset());
- static:  2-grams of a corpus (learn_static(), like llama-lookup-create), used
  to weight candidates and as the last fallback.
A table is a dict {n-gram tuple: {next token: count}}.

What is forgotten and kept: truncating the history to length L removes from
the context the counts of next tokens at position >= L; reset() moves the
context into the dynamic cache and empties it; static and dynamic are never
forgotten. save()/load() write/read static and dynamic (plus the not yet
committed context, merged into dynamic) as a numpy .npz file.
"""
from __future__ import annotations

import os
import tempfile
from typing import Iterable, Sequence

import numpy as np

from ._history import SeenHistory, as_array, check_range, verified_part

Table = dict[tuple[int, ...], dict[int, int]]

NGRAM_MIN, NGRAM_MAX, NGRAM_STATIC = 1, 4, 2   # LLAMA_NGRAM_MIN / _MAX / _STATIC
N_DRAFT = 8                                    # fixed in llama.cpp's create_state_ngram_cache
# min sample size / min percent of the best token, indexed by n-gram size - 1
LAX = ((2, 2, 1, 1), (66, 50, 50, 50))         # context cache
STRICT = ((4, 3, 2, 2), (75, 66, 66, 66))      # dynamic cache
FILE_FORMAT = "specd-ngram-cache-v1"


def count_ngrams(table: Table, tokens: Sequence[int], start: int = 0,
                 sizes: Iterable[int] = range(NGRAM_MIN, NGRAM_MAX + 1), sign: int = 1) -> None:
    """Add (sign=1) or remove (sign=-1) one count per (n-gram, next token) whose next token is at index >= start."""
    sizes = tuple(sizes)
    for i in range(max(start, 1), len(tokens)):
        tok = tokens[i]
        for s in sizes:
            if s > i:
                continue
            key = tuple(tokens[i - s : i])
            part = table.setdefault(key, {})
            left = part.get(tok, 0) + sign
            if left > 0:
                part[tok] = left
            else:
                part.pop(tok, None)
                if not part:
                    del table[key]


def merge(dst: Table, src: Table) -> None:
    """Add every count of src into dst (common_ngram_cache_merge)."""
    for key, part in src.items():
        into = dst.setdefault(key, {})
        for tok, cnt in part.items():
            into[tok] = into.get(tok, 0) + cnt


def _best(part: dict[int, int], weights: dict[int, int]) -> tuple[int, int, int]:
    """(token maximising count * static weight, its count, sum of counts); ties keep the first."""
    best_tok, best_cnt, best_score, total = -1, 0, 0, 0
    for tok, cnt in part.items():
        score = cnt * (100 * weights[tok] if tok in weights else 1)
        if score > best_score:
            best_tok, best_cnt, best_score = tok, cnt, score
        total += cnt
    return best_tok, best_cnt, total


def _try_primary(table: Table, grams: list[tuple[int, ...]], weights: dict[int, int],
                 limits: tuple[tuple[int, ...], tuple[int, ...]]) -> int | None:
    """Longest n-gram first; the first one whose best token passes the size / percent limits wins."""
    min_samples, min_percent = limits
    for gram in reversed(grams):
        part = table.get(gram)
        if not part:
            continue
        tok, cnt, total = _best(part, weights)
        i = len(gram) - 1
        if total >= min_samples[i] and 100 * cnt >= min_percent[i] * total:
            return tok
    return None


def draft_from_caches(history: Sequence[int], n_draft: int, context: Table, dynamic: Table,
                      static: Table) -> list[int]:
    """Draft up to n_draft tokens after `history` (common_ngram_cache_draft): per token try
    context (lax limits), then dynamic (strict limits), then static alone (>= 2 samples, >= 50 %)."""
    if len(history) < NGRAM_STATIC:
        return []
    tail = [int(t) for t in history[-NGRAM_MAX:]]
    out: list[int] = []
    while len(out) < n_draft:
        weights = static.get(tuple(tail[-NGRAM_STATIC:]), {})
        grams = [tuple(tail[-s:]) for s in range(NGRAM_MIN, min(NGRAM_MAX, len(tail)) + 1)]
        tok = _try_primary(context, grams, weights, LAX)
        if tok is None:
            tok = _try_primary(dynamic, grams, weights, STRICT)
        if tok is None and weights:
            best, cnt, total = _best(weights, {})
            tok = best if total >= LAX[0][NGRAM_STATIC - 1] and 100 * cnt >= LAX[1][NGRAM_STATIC - 1] * total else None
        if tok is None:
            break
        out.append(tok)
        tail = (tail + [tok])[-NGRAM_MAX:]
    return out


def _to_arrays(table: Table, prefix: str) -> dict[str, np.ndarray]:
    rows = [(key, tok, cnt) for key, part in table.items() for tok, cnt in part.items()]
    keys = np.full((len(rows), NGRAM_MAX), -1, dtype=np.int32)
    for r, (key, _, _) in enumerate(rows):
        keys[r, : len(key)] = key
    return {
        f"{prefix}_keys": keys,
        f"{prefix}_lens": np.array([len(k) for k, _, _ in rows], dtype=np.int8),
        f"{prefix}_tokens": np.array([t for _, t, _ in rows], dtype=np.int32),
        f"{prefix}_counts": np.array([c for _, _, c in rows], dtype=np.int64),
    }


def _from_arrays(data, prefix: str) -> Table:
    keys, lens = data[f"{prefix}_keys"], data[f"{prefix}_lens"]
    toks, counts = data[f"{prefix}_tokens"], data[f"{prefix}_counts"]
    if not (len(keys) == len(lens) == len(toks) == len(counts)) or (len(keys) and keys.shape[1] != NGRAM_MAX):
        raise ValueError(f"corrupt n-gram cache file: bad {prefix} arrays")
    if len(lens) and (lens.min() < NGRAM_MIN or lens.max() > NGRAM_MAX or counts.min() < 1):
        raise ValueError(f"corrupt n-gram cache file: bad {prefix} values")
    table: Table = {}
    for row, n, tok, cnt in zip(keys.tolist(), lens.tolist(), toks.tolist(), counts.tolist()):
        table.setdefault(tuple(row[:n]), {})[tok] = cnt
    return table


class CacheProposer:
    """Three-cache drafter.

    Parameters (llama.cpp defaults): n-gram sizes 1..4 for context and dynamic
    (fixed, LLAMA_NGRAM_MIN/MAX), 2 for static (LLAMA_NGRAM_STATIC), n_draft = 8
    tokens per draft ([1, 1024]); acceptance limits LAX / STRICT as above.
    cache_path: a file written by save() to load now (a missing file starts empty).
    Deviation: the context is updated with every new token (llama.cpp's server
    path misses n-grams that straddle two updates).
    """

    name = "cache"
    match_needs_repeat = 0  # its static cache comes from a file

    def __init__(self, n_draft: int = N_DRAFT, cache_path: str | os.PathLike | None = None) -> None:
        self.n_draft = check_range("n_draft", n_draft, 1, 1024)
        self.static: Table = {}
        self.dynamic: Table = {}
        self.context: Table = {}
        self._seen = SeenHistory()
        if cache_path is not None and os.path.exists(cache_path):
            self.load(cache_path)

    def _sync(self, arr: np.ndarray) -> None:
        keep, old = self._seen.update(arr)
        if keep < len(old):
            count_ngrams(self.context, old.tolist(), start=keep, sign=-1)
        if len(arr) > keep:
            count_ngrams(self.context, arr.tolist(), start=keep)

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        """Draft after `history`; only its first `n_verified` tokens (all
        when None) are verified, and only those are counted in the context."""
        arr = as_array(history)
        self._sync(verified_part(arr, n_verified))
        if n_max <= 0:
            return []
        return draft_from_caches(arr[-NGRAM_MAX:].tolist(), min(self.n_draft, n_max),
                                 self.context, self.dynamic, self.static)

    def observe(self, history: Sequence[int]) -> None:
        self._sync(as_array(history))

    def begin(self, n_prompt: int) -> None:
        """Nothing to do: the prompt's n-grams are learned as observe() sees them."""

    def reset(self) -> None:
        """End the sequence: merge its context into the dynamic cache, then forget it."""
        merge(self.dynamic, self.context)
        self.context = {}
        self._seen = SeenHistory()

    def learn_static(self, tokens: Sequence[int]) -> None:
        """Add the 2-grams of a corpus to the static cache (what llama-lookup-create builds)."""
        count_ngrams(self.static, as_array(tokens).tolist(), sizes=(NGRAM_STATIC,))

    def save(self, path: str | os.PathLike) -> None:
        """Write static and dynamic (+ the uncommitted context) to `path` atomically."""
        dynamic: Table = {k: dict(v) for k, v in self.dynamic.items()}
        merge(dynamic, self.context)
        arrays = {"format": np.array(FILE_FORMAT), **_to_arrays(self.static, "static"),
                  **_to_arrays(dynamic, "dynamic")}
        folder = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ngram-cache-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez_compressed(f, **arrays)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def load(self, path: str | os.PathLike) -> None:
        """Replace static and dynamic with the ones saved in `path` (the context is untouched)."""
        with np.load(path, allow_pickle=False) as data:
            if "format" not in data.files or str(data["format"]) != FILE_FORMAT:
                raise ValueError(f"{os.fspath(path)!r} is not a {FILE_FORMAT} file")
            static, dynamic = _from_arrays(data, "static"), _from_arrays(data, "dynamic")
        self.static, self.dynamic = static, dynamic
