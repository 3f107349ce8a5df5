"""Sampling and draft acceptance on numpy logits. Pure functions, no llama.cpp.

Randomness is counter-based: the i-th generated token of a request uses
`uniform(seed, i)`. Target-only decoding samples token i with that number;
speculative verification samples each position with the number of the token
it would become, and accepts a draft only when it equals the sampled token
(llama.cpp's common_sampler_sample_and_accept_n). Every output token is thus
drawn from the target's distribution with the same number it would get
without speculation: the output distribution is the target's, and a fixed
seed gives the same text with or without a draft.
"""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from specd.errors import InvalidArgument

_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validate(self, prefix: str = "sampling") -> "Sampling":
        """Raise InvalidArgument naming the first bad field."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"{prefix}.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidArgument(f"{prefix}.top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidArgument(f"{prefix}.min_p must be in [0, 1), got {self.min_p}")
        return self


def uniform(seed: int, index: int) -> float:
    """The index-th number of the seed's stream, uniform in [0, 1)."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed & _U64, index & _U64), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * (1.0 / (1 << 53))


def probabilities(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """Candidate token ids (ascending) and their probabilities after
    temperature, top-k, top-p and min-p, in that order."""
    x = logits.astype(np.float64) / s.temperature
    n = x.shape[0]
    if 0 < s.top_k < n:
        ids = np.argpartition(-x, s.top_k - 1)[: s.top_k]
    else:
        ids = np.arange(n)
    v = x[ids]
    p = np.exp(v - v.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        n_keep = int(np.searchsorted(cum, s.top_p, side="left")) + 1
        keep = order[:n_keep]
        ids, p = ids[keep], p[keep]
    if s.min_p > 0.0:
        keep = p >= s.min_p * p.max()
        ids, p = ids[keep], p[keep]
    order = np.argsort(ids, kind="stable")
    ids, p = ids[order], p[order]
    return ids, p / p.sum()


def sample(logits: np.ndarray, s: Sampling, u: float) -> int:
    """One token from `logits` (1-D) with the uniform number u."""
    if s.greedy:
        return int(np.argmax(logits))
    ids, p = probabilities(logits, s)
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return int(ids[min(i, len(ids) - 1)])


def accept(logits: np.ndarray, drafts, s: Sampling, sample_index: int) -> list[int]:
    """Given the target's logits (k+1, n_vocab) after [id_last, d0..dk-1],
    return the accepted drafts followed by the target's own next token."""
    k = len(drafts)
    if s.greedy:
        best = np.argmax(logits[: k + 1], axis=1)
        out: list[int] = []
        for i in range(k):
            if int(best[i]) != drafts[i]:
                break
            out.append(int(drafts[i]))
        out.append(int(best[len(out)]))
        return out
    out = []
    for i in range(k + 1):
        tok = sample(logits[i], s, uniform(s.seed, sample_index + i))
        out.append(tok)
        if i == k or tok != drafts[i]:
            break
    return out


def top_probability(logits: np.ndarray) -> tuple[int, float]:
    """The most likely token and its softmax probability."""
    best = int(np.argmax(logits))
    x = logits.astype(np.float64)
    return best, float(1.0 / np.exp(x - x[best]).sum())
