"""Model-free n-gram draft proposers, after llama.cpp's `--spec-type ngram-*` drafters.

Names (PROPOSER_NAMES) and the llama.cpp type each mirrors:
  simple  -> ngram-simple   (simple.SimpleProposer)
  map-k   -> ngram-map-k    (map_k.NgramMapProposer, key_only=True)
  map-k4v -> ngram-map-k4v  (map_k.NgramMapProposer, key_only=False)
  mod     -> ngram-mod      (mod.ModProposer)
  cache   -> ngram-cache    (cache.CacheProposer)
A spec such as "map-k,cache" builds a ChainProposer: the first member with a
non-empty draft wins, in the order given (llama.cpp uses a fixed priority order
simple, map-k, map-k4v, mod, cache whatever order the names come in).

Each member takes llama.cpp's parameters after its name, `:key=value` each,
keys named as llama.cpp's flags (--spec-ngram-simple-size-n ->
`simple:size-n=3`): PARAMETERS lists them. "map-k:size-n=3:size-m=16,cache"
is a chain of a tuned map-k and a default cache.
"""
from __future__ import annotations

import os
from typing import Protocol, Sequence, runtime_checkable

from ._history import as_array
from .cache import CacheProposer
from .map_k import NgramMapProposer
from .mod import ModProposer, ModTable
from .simple import SimpleProposer

PROPOSER_NAMES: tuple[str, ...] = ("simple", "map-k", "map-k4v", "mod", "cache")

# spec key -> constructor argument, per proposer (llama.cpp's --spec-ngram-<name>-<key>)
_MAP_K = {"size-n": "size_n", "size-m": "size_m", "min-hits": "min_hits"}
PARAMETERS: dict[str, dict[str, str]] = {
    "simple": {"size-n": "size_n", "size-m": "size_m"},
    "map-k": _MAP_K,
    "map-k4v": _MAP_K,
    "mod": {"n-match": "n_match", "n-min": "n_min", "n-max": "n_max"},
    "cache": {},
}

__all__ = [
    "PROPOSER_NAMES", "PARAMETERS", "Proposer", "ChainProposer", "make_proposer",
    "SimpleProposer", "NgramMapProposer", "ModProposer", "ModTable", "CacheProposer",
]


@runtime_checkable
class Proposer(Protocol):
    name: str
    # a draft needs the history's last this many tokens to occur before at an
    # earlier start (ModelInfo.match_needs_repeat); 0: it may come without
    match_needs_repeat: int

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        """history = every token id the sequence holds, oldest first, ending
        with the last one to draft after. Its first n_verified tokens (all
        when None) are verified by the router; the rest are the proposer's
        own drafts, which it drafts after but must not learn from or judge
        its drafts by. Return at most n_max proposed token ids (may be
        empty). Must not mutate history."""
        ...

    def observe(self, history: Sequence[int]) -> None:
        """history = every token the router verified, oldest first; learners update here."""
        ...

    def reset(self) -> None:
        """Forget per-sequence learned state (a new sequence starts)."""
        ...

    def begin(self, n_prompt: int) -> None:
        """A request starts: the history's first n_prompt tokens are its
        prompt (llama.cpp's common_speculative_begin); before its first proposal."""
        ...


class ChainProposer:
    """Proposes with the first member that returns a non-empty draft; observe/reset go to all."""

    def __init__(self, members: Sequence[Proposer]) -> None:
        if not members:
            raise ValueError("a proposer chain needs at least one member")
        self.members = tuple(members)
        self.name = ",".join(m.name for m in self.members)
        # a repeat of n tokens is one of every shorter run: the shortest key is what the chain needs
        needs = [m.match_needs_repeat for m in self.members]
        self.match_needs_repeat = 0 if 0 in needs else min(needs)

    def propose(self, history: Sequence[int], n_max: int, n_verified: int | None = None) -> list[int]:
        arr = as_array(history)  # convert once; members copy it again cheaply
        out: list[int] = []
        for member in self.members:
            # members after the winner propose nothing here (n_max 0): a draft
            # they made earlier is then not judged by tokens that were not theirs
            draft = member.propose(arr, 0 if out else n_max, n_verified)
            if len(draft) and not out:
                out = [int(t) for t in draft[:n_max]]
        return out

    def observe(self, history: Sequence[int]) -> None:
        arr = as_array(history)
        for member in self.members:
            member.observe(arr)

    def reset(self) -> None:
        for member in self.members:
            member.reset()

    def begin(self, n_prompt: int) -> None:
        for member in self.members:
            member.begin(n_prompt)


def _build(name: str, params: dict[str, int], cache_path: str | os.PathLike | None) -> Proposer:
    if name == "simple":
        return SimpleProposer(**params)
    if name in ("map-k", "map-k4v"):
        return NgramMapProposer(key_only=name == "map-k", **params)
    if name == "mod":
        return ModProposer(**params)
    return CacheProposer(cache_path=cache_path)


def _parse_member(member: str, spec: str) -> tuple[str, dict[str, int]]:
    """"name:key=value:..." -> (name, constructor arguments)."""
    name, *pairs = [part.strip() for part in member.split(":")]
    if name not in PROPOSER_NAMES:
        raise ValueError(f"unknown n-gram proposer {name!r} in spec {spec!r}; "
                         f"allowed names: {', '.join(PROPOSER_NAMES)}")
    allowed = PARAMETERS[name]
    params: dict[str, int] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip()
        if key not in allowed:
            keys = ", ".join(allowed) or "none"
            raise ValueError(f"n-gram proposer {name!r} has no parameter {key!r} (in spec {spec!r}); "
                             f"its parameters: {keys}")
        try:
            if not eq:
                raise ValueError
            params[allowed[key]] = int(value)
        except ValueError:
            raise ValueError(f"n-gram parameter {name}:{key} must be an integer, got {value.strip()!r} "
                             f"(in spec {spec!r})") from None
    return name, params


def make_proposer(spec: str, *, cache_path: str | os.PathLike | None = None) -> Proposer:
    """Build the proposer for `spec`: one member or a comma-separated chain,
    each a name of PROPOSER_NAMES with optional `:key=value` parameters
    (PARAMETERS; llama.cpp's defaults otherwise). cache_path is loaded by the
    `cache` member (ignored when there is none). Unknown, empty or repeated
    names, unknown keys and values out of range raise ValueError."""
    if not isinstance(spec, str):
        raise ValueError(f"proposer spec must be a string, got {type(spec).__name__}")
    parts = spec.split(",")
    members = [_parse_member(part, spec) for part in parts]
    names = [name for name, _ in members]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"n-gram proposer {repeated[0]!r} appears twice in spec {spec!r}; "
                         f"allowed names: {', '.join(PROPOSER_NAMES)}")
    built = []
    for part, (name, params) in zip(parts, members):
        try:
            built.append(_build(name, params, cache_path))
        except ValueError as exc:
            raise ValueError(f"n-gram proposer {part.strip()!r}: {exc}") from None
    return built[0] if len(built) == 1 else ChainProposer(built)
