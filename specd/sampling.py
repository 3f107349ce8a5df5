"""Sampling and draft acceptance on numpy logits. Pure functions, no llama.cpp.

Randomness is counter-based: the i-th generated token of a request is
sampled with the request's noise for index i (`race_noise`), an exponential
number per token id: the token is the one that wins the race of noise over
probability (the Gumbel-max trick). Target-only decoding samples token i
that way; speculative verification samples each position with the noise of
the token it would become, and accepts a draft only when it equals the
sampled token (llama.cpp's common_sampler_sample_and_accept_n). Every output
token is thus what it would be without speculation: the output distribution
is the target's, and a fixed seed gives the same text with or without a
draft ("exact" acceptance).

The draft samples its own distribution q with the same noise. Two
distributions sampled with shared race noise agree at least
(1 - TV) / (1 + TV) of the time (TV their total variation distance), so a
draft close to the target proposes the target's own sample almost as often
as greedy decoding would, whatever the temperature, and the draft's guess of
the token after its drafts (overlap) holds as often.

"rejection" acceptance (speculative sampling) accepts a draft x ~ q with
probability min(1, p/q) and resamples a rejection from the residual
(`accept_rejection`), with streams of their own: the output distribution is
still exactly the target's (acceptance 1 - TV), but a seed's text then
depends on the draft.
"""
from __future__ import annotations

import functools
import hashlib
import struct
from dataclasses import dataclass

import numpy as np

from specd.errors import InvalidArgument

_U64 = (1 << 64) - 1

# How the target accepts sampled drafts (GenerateRequest.speculative.acceptance)
EXACT = "exact"
REJECTION = "rejection"
DEFAULT_ACCEPTANCE = REJECTION


# Temperatures below this sample as greedy (as vLLM's _SAMPLING_EPS): the
# logits scaled by 1/T would overflow float32 (NaN probabilities), and long
# before that the distribution is one-hot but for exact ties.
SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self, prefix: str = "sampling") -> "Sampling":
        """Raise InvalidArgument naming the first bad field."""
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"{prefix}.temperature must be >= 0, got {self.temperature}", field=f"{prefix}.temperature")
        if self.top_k < 0:
            raise InvalidArgument(f"{prefix}.top_k must be >= 0, got {self.top_k}", field=f"{prefix}.top_k")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"{prefix}.top_p must be in (0, 1], got {self.top_p}", field=f"{prefix}.top_p")
        if not (0.0 <= self.min_p < 1.0):
            raise InvalidArgument(f"{prefix}.min_p must be in [0, 1), got {self.min_p}", field=f"{prefix}.min_p")
        return self


def _hash64(seed: int, index: int, prefix: bytes = b"") -> int:
    """A 64-bit hash of (prefix, seed, index): the counter every random number derives from."""
    digest = hashlib.blake2b(prefix + struct.pack("<QQ", seed & _U64, index & _U64), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def uniform(seed: int, index: int) -> float:
    """The index-th number of the seed's stream, uniform in [0, 1)."""
    return (_hash64(seed, index) >> 11) * (1.0 / (1 << 53))


def probabilities(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """Candidate token ids (ascending) and their probabilities after
    temperature, top-k, top-p and min-p, in that order."""
    d = filtered(np.asarray(logits)[None], s)[0]
    return d.ids, d.probs


@dataclass(frozen=True)
class TokenDist:
    """A sparse distribution over token ids: `ids` ascending and distinct,
    `probs` their probabilities (float32), summing to 1."""

    ids: np.ndarray
    probs: np.ndarray

    def at(self, ids) -> np.ndarray:
        """The probabilities of `ids` (0 outside the support)."""
        ids = np.asarray(ids)
        j = np.minimum(np.searchsorted(self.ids, ids), len(self.ids) - 1)
        return np.where(self.ids[j] == ids, self.probs[j], 0.0)

    def race(self, seed: int, index: int) -> int:
        """The token sampled with the request's noise for token `index`:
        argmin of noise / probability, which is distributed as `probs`."""
        with np.errstate(divide="ignore"):
            return int(self.ids[np.argmin(race_noise(seed, index, self.ids) / self.probs)])

    def pick(self, u: float) -> int:
        """The token at u of the cumulative distribution (ids ascending)."""
        cdf = np.cumsum(self.probs, dtype=np.float64)
        i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])


def filtered(logits: np.ndarray, s: Sampling) -> list[TokenDist]:
    """`probabilities` of every row of a (rows, n_vocab) array, in float32
    until the kept candidates are known."""
    x = np.asarray(logits, dtype=np.float32) * np.float32(1.0 / s.temperature)
    mx = x.max(axis=1)
    return [_filter_row(x[r], float(mx[r]), s) for r in range(len(x))]


# Gaps below the largest scaled logit tried, in turn, for a set of candidates
# that holds what top-k or top-p keeps: a comparison per token instead of a
# partition or a sort of the whole vocabulary. The last resort is everything.
_GAPS = (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0, 24.0, 32.0)


def _within(x: np.ndarray, mx: float, enough) -> np.ndarray:
    """Indexes of x within the first gap of its maximum that is `enough`."""
    for gap in _GAPS:
        idx = np.flatnonzero(x >= mx - gap)
        if enough(idx):
            return idx
    return np.arange(len(x))


def _filter_row(x: np.ndarray, mx: float, s: Sampling) -> TokenDist:
    """One row of `filtered`: x the scaled logits, mx their maximum (which
    every filter keeps)."""
    ids = None  # candidates as indexes into x; None: all
    if 0 < s.top_k < len(x):
        ids = _within(x, mx, lambda idx: len(idx) >= s.top_k)
        if len(ids) > s.top_k:
            ids = ids[np.argpartition(-x[ids], s.top_k - 1)[: s.top_k]]
    if s.top_p < 1.0:
        # top-p's mass is relative to all that top-k left
        z = float(np.exp((x if ids is None else x[ids]) - mx).sum(dtype=np.float64))
        if ids is None:
            ids = _within(x, mx, lambda idx: np.exp(x[idx] - mx).sum(dtype=np.float64) >= s.top_p * z)
        w = np.exp(x[ids] - mx)
        order = np.argsort(-w, kind="stable")
        cum = np.cumsum(w[order], dtype=np.float64)
        ids = ids[order[: min(int(np.searchsorted(cum, s.top_p * z, side="left")) + 1, len(order))]]
    if s.min_p > 0.0:  # p >= min_p * p_max is a threshold on the logits
        cut = mx + float(np.log(s.min_p))
        ids = np.flatnonzero(x >= cut) if ids is None else ids[x[ids] >= cut]
    if ids is None:
        ids, w = np.arange(len(x)), np.exp(x - np.float32(mx))
    else:
        ids = np.sort(ids)
        w = np.exp(x[ids] - np.float32(mx))
    return TokenDist(ids.astype(np.int64, copy=False), w / np.float32(w.sum(dtype=np.float64)))


def sample(logits: np.ndarray, s: Sampling, index: int) -> int:
    """Token `index` of a request from `logits` (1-D), with its noise."""
    if s.greedy:
        return int(np.argmax(logits))
    return filtered(np.asarray(logits)[None], s)[0].race(s.seed, index)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def race_noise(seed: int, index: int, ids: np.ndarray) -> np.ndarray:
    """Exponential(1) numbers for token `index` of the seed's request, one per
    token id in `ids`, each a function of (seed, index, id) alone: the target
    and the draft draw the same number for the same token whatever their
    candidate sets (splitmix64 of a per-index key and the id)."""
    x = np.asarray(ids).astype(np.uint64) * _GOLDEN + np.uint64(_hash64(seed, index, RACE_STREAM))
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    x ^= x >> np.uint64(31)
    u = ((x >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))  # in (0, 1)
    return -np.log(u)


def accept(logits: np.ndarray, drafts, s: Sampling, sample_index: int, draft_q=()) -> list[int]:
    """Given the target's logits (k+1, n_vocab) after [id_last, d0..dk-1],
    return the accepted drafts followed by the target's own next token.
    `draft_q`: the distribution each draft was sampled from (one per draft),
    for speculative sampling; empty: exact match."""
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
    p = filtered(logits[: k + 1], s)
    if len(draft_q):
        return accept_rejection(p, drafts, draft_q, s, sample_index)
    return accept_exact(p, drafts, s, sample_index)


def accept_exact(p: list[TokenDist], drafts, s: Sampling, sample_index: int) -> list[int]:
    """Sample each position from the target's p with its token index's noise
    and keep a draft only when it equals that sample."""
    out = []
    for i, dist in enumerate(p):
        out.append(dist.race(s.seed, sample_index + i))
        if i == len(drafts) or out[-1] != drafts[i]:
            break
    return out


def accept_rejection(p: list[TokenDist], drafts, q: list[TokenDist], s: Sampling, sample_index: int) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): keep
    d_i ~ q_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection draw from normalise(max(0, p_i - q_i)) instead; after k
    acceptances draw the bonus token from p_k. Each output token then
    follows p. The accept test and the residual draw have streams of their
    own, independent of the noise the drafts were sampled with; the bonus
    token uses the token index's noise, as target-only sampling does (so a
    draft's guess of it, made with the same noise, holds as often as p and
    q agree)."""
    accept_seed = stream_seed(s.seed, ACCEPT_STREAM)
    out = []
    for i, x in enumerate(drafts):
        px, qx = float(p[i].at(x)), float(q[i].at(x))
        if uniform(accept_seed, sample_index + i) * qx < px:
            out.append(int(x))
            continue
        out.append(residual(p[i], q[i]).pick(uniform(stream_seed(s.seed, RESIDUAL_STREAM), sample_index + i)))
        return out
    out.append(p[len(drafts)].race(s.seed, sample_index + len(drafts)))
    return out


def residual(p: TokenDist, q: TokenDist) -> TokenDist:
    """normalise(max(0, p - q)), on p's support. When p and q agree to the
    last bit there is nothing left, and a rejection only came from rounding:
    p itself is then the limit."""
    r = np.maximum(p.probs - q.at(p.ids), 0.0)
    total = r.sum()
    return TokenDist(p.ids, r / total) if total > 0.0 else p


# Streams derived from a request's seed, independent of it and of each other:
# the sampling noise, the target's accept tests and its residual draws.
RACE_STREAM = b"race"
ACCEPT_STREAM = b"accept"
RESIDUAL_STREAM = b"residual"


@functools.lru_cache(maxsize=1024)
def stream_seed(seed: int, stream: bytes) -> int:
    """The seed of a named stream derived from a request's seed."""
    digest = hashlib.blake2b(stream + struct.pack("<Q", seed & _U64), digest_size=8).digest()
    return int.from_bytes(digest, "little")


# The largest support a draft's q may have: the draft samples from its
# filtered distribution cut to its Q_MAX_SUPPORT most likely tokens and
# renormalised, and returns exactly that q (float32 on the wire). The cut
# changes how often drafts are accepted, never the output distribution.
Q_MAX_SUPPORT = 1024


@dataclass(frozen=True)
class DraftToken:
    """The draft's next token, its confidence (the probability p_min is
    compared with) and, when sampled, the distribution it was drawn from."""

    token: int
    confidence: float
    q: TokenDist | None = None


def draft_token(logits: np.ndarray, s: Sampling | None, index: int) -> DraftToken:
    """The draft's token at the request's token `index`: its most likely token
    without sampling (or greedy), else a sample from its own filtered
    distribution (capped at Q_MAX_SUPPORT) with the noise the target samples
    that index with (`race_noise`)."""
    if s is None or s.greedy:
        tok, p = top_probability(logits)
        return DraftToken(tok, p)
    q = draft_distribution(logits, s)
    return DraftToken(q.race(s.seed, index), float(q.probs.max()), q)


def draft_distribution(logits: np.ndarray, s: Sampling) -> TokenDist:
    """The draft's q: its filtered distribution, capped, with the float32
    probabilities it is sent as (so both sides hold the same numbers)."""
    d = filtered(np.asarray(logits)[None], s)[0]
    ids, w = d.ids, d.probs
    if len(ids) > Q_MAX_SUPPORT:
        top = _within(np.log(w), float(np.log(w.max())), lambda idx: len(idx) >= Q_MAX_SUPPORT)
        top = np.sort(top[np.argpartition(-w[top], Q_MAX_SUPPORT - 1)[:Q_MAX_SUPPORT]])
        ids, w = ids[top], w[top]
    return dist_of(ids, w)


def dist_of(ids, probs) -> TokenDist:
    """A TokenDist from ids and (float32) weights as sent on the wire."""
    w = np.asarray(probs, dtype=np.float32)
    return TokenDist(np.asarray(ids, dtype=np.int64), w / np.float32(w.sum(dtype=np.float64)))


def check_draft_q(q, drafts, n_vocab: int) -> None:
    """Raise InvalidArgument unless `q` holds one valid distribution per draft
    (or none), each giving its draft a positive probability."""
    if len(q) and len(q) != len(drafts):
        raise InvalidArgument(f"draft_q must have one entry per draft ({len(drafts)}) or none, got {len(q)}", field="draft_q")
    for i, (d, x) in enumerate(zip(q, drafts)):
        ids, w = d.ids, d.probs
        if not 0 < len(ids) <= Q_MAX_SUPPORT or len(w) != len(ids):
            raise InvalidArgument(f"draft_q[{i}] must have 1..{Q_MAX_SUPPORT} ids and as many probs", field=f"draft_q[{i}]")
        if ids[0] < 0 or ids[-1] >= n_vocab or np.any(np.diff(ids) <= 0):
            raise InvalidArgument(f"draft_q[{i}].ids must be ascending, distinct and in [0, {n_vocab})", field=f"draft_q[{i}].ids")
        if not np.all(np.isfinite(w)) or np.any(w < 0):
            raise InvalidArgument(f"draft_q[{i}].probs must be finite and >= 0", field=f"draft_q[{i}].probs")
        if d.at(x) <= 0.0:
            raise InvalidArgument(f"draft_q[{i}] gives its draft {x} no probability", field=f"draft_q[{i}]")


def top_probability(logits: np.ndarray) -> tuple[int, float]:
    """The most likely token and its softmax probability."""
    best = int(np.argmax(logits))
    x = logits.astype(np.float64)
    return best, float(1.0 / np.exp(x - x[best]).sum())
