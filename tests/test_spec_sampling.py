"""Speculative sampling (issue #20): the acceptor on synthetic distributions
against the exact formulas, its losslessness on real model logits with a
draft unlike the target (and that a biased acceptor fails the same test),
the fast filters against the straightforward ones, and one end-to-end run
through the router."""
from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest

import specd.sampling as S
from specd.errors import InvalidArgument
from specd.sampling import Sampling, TokenDist, accept_rejection, dist_of, uniform

ALPHA = 0.01  # family-wise significance of each statistical test below


def chi2_pvalue(counts: dict[int, int], p: TokenDist) -> float:
    """Goodness of fit of token counts to p (Pearson, bins with an expected
    count under 5 pooled; Wilson-Hilferty's approximation of the tail).
    A token outside p's support gives 0."""
    n = sum(counts.values())
    if any(p.at(t) <= 0.0 for t in counts):
        return 0.0
    exp = {int(t): n * float(w) for t, w in zip(p.ids, p.probs)}
    big = [t for t, e in exp.items() if e >= 5.0]
    obs = [counts.get(t, 0) for t in big]
    ex = [exp[t] for t in big]
    rest_e = n - sum(ex)
    if rest_e >= 5.0:
        obs.append(n - sum(obs))
        ex.append(rest_e)
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, ex))
    df = len(ex) - 1
    if df < 1:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def draws(p: TokenDist, q: TokenDist, s: Sampling, n: int, bonus: TokenDist | None = None) -> tuple[dict, int]:
    """n speculative draws of one position: x ~ q with the noise the draft
    samples with (the token index's, shared with the target), then the
    acceptor. Returns the counts of the first output token and how many
    drafts were accepted."""
    counts: dict[int, int] = {}
    n_acc = 0
    for i in range(n):
        x = q.race(s.seed, i)
        out = accept_rejection([p, bonus or p], [x], [q], s, i)
        n_acc += len(out) == 2
        counts[out[0]] = counts.get(out[0], 0) + 1
    return counts, n_acc


# ------------------------------------------------------------ synthetic
P = dist_of([0, 1, 2, 3, 4], [0.40, 0.25, 0.20, 0.10, 0.05])
Q = dist_of([0, 1, 2, 3, 5], [0.10, 0.45, 0.20, 0.05, 0.20])


def test_acceptance_rate_and_output_follow_the_exact_formulas():
    s = Sampling(temperature=1.0, seed=3)
    n = 20000
    counts, n_acc = draws(P, Q, s, n)
    alpha = float(np.minimum(P.probs, Q.at(P.ids)).sum())  # sum min(p, q) = 0.60
    assert alpha == pytest.approx(0.60)
    assert abs(n_acc / n - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / n)
    assert chi2_pvalue(counts, P) > ALPHA / 2
    assert 5 not in counts  # q's token the target never samples is always rejected
    r = S.residual(P, Q)
    assert np.allclose(r.probs, [0.75, 0, 0, 0.125, 0.125])  # max(0, p - q) = .3, 0, 0, .05, .05


def test_chained_positions_follow_the_target():
    """Two drafts where position 1's p and q depend on token 0: the joint
    output of the first two tokens must be p0(a) p1(b | a)."""
    s = Sampling(temperature=1.0, seed=11)
    p0, q0 = dist_of([0, 1, 2], [0.5, 0.3, 0.2]), dist_of([0, 1, 2], [0.2, 0.5, 0.3])
    p1 = {a: dist_of([0, 1, 2], w) for a, w in enumerate([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])}
    q1 = {a: dist_of([0, 1, 2], w) for a, w in enumerate([[0.3, 0.3, 0.4], [0.3, 0.3, 0.4], [0.5, 0.4, 0.1]])}
    p2 = dist_of([0, 1], [0.5, 0.5])
    counts: dict[int, int] = {}
    n = 20000
    for i in range(n):
        x0 = q0.race(s.seed, 3 * i)
        x1 = q1[x0].race(s.seed, 3 * i + 1)
        out = accept_rejection([p0, p1[x0], p2], [x0, x1], [q0, q1[x0]], s, 3 * i)
        if len(out) == 1:  # rejected at 0: the next token comes from p1 of what was chosen
            out.append(p1[out[0]].pick(uniform(s.seed + 1, i)))
        counts[3 * out[0] + out[1]] = counts.get(3 * out[0] + out[1], 0) + 1
    joint = dist_of(range(9), [p0.probs[a] * p1[a].probs[b] for a in range(3) for b in range(3)])
    assert chi2_pvalue(counts, joint) > ALPHA / 2


def test_shared_noise_couples_the_draft_with_the_target():
    """Sampled with the same noise, the draft's token is the target's own
    sample at least (1 - TV) / (1 + TV) of the time, each side still follows
    its own distribution, and the bonus token the draft guesses (overlap) is
    right as often; with independent numbers they agree only sum p q."""
    s = Sampling(temperature=1.0, seed=21)
    n = 20000
    x = [Q.race(s.seed, i) for i in range(n)]
    y = [P.race(s.seed, i) for i in range(n)]
    tv = 1.0 - float(np.minimum(P.probs, Q.at(P.ids)).sum())  # 0.40
    agree = float(np.mean(np.array(x) == np.array(y)))
    assert agree >= (1 - tv) / (1 + tv) - 4 * math.sqrt(0.25 / n)
    assert agree > float(np.sum(P.probs * Q.at(P.ids))) + 0.1  # independent draws: 0.25
    assert chi2_pvalue(dict(zip(*np.unique(x, return_counts=True))), Q) > ALPHA / 4
    assert chi2_pvalue(dict(zip(*np.unique(y, return_counts=True))), P) > ALPHA / 4
    # exact acceptance takes the coupled draft exactly when it is the target's sample
    out = [S.accept_exact([P, P], [x[i]], s, i) for i in range(2000)]
    assert all(o[0] == y[i] and (len(o) == 2) == (x[i] == y[i]) for i, o in enumerate(out))


def test_noise_depends_on_seed_index_and_token_only():
    ids = np.array([0, 5, 49151])
    a = S.race_noise(4, 9, ids)
    assert np.array_equal(a, S.race_noise(4, 9, np.array([49151, 0, 5]))[[1, 2, 0]])
    assert not np.array_equal(a, S.race_noise(4, 10, ids)) and not np.array_equal(a, S.race_noise(5, 9, ids))
    e = S.race_noise(1, 2, np.arange(20000))
    assert np.all(e > 0) and abs(e.mean() - 1.0) < 0.05  # Exponential(1)


def test_identical_p_and_q_accept_everything():
    s = Sampling(temperature=1.0, seed=5)
    counts, n_acc = draws(P, P, s, 2000)
    assert n_acc == 2000


def test_greedy_ignores_draft_q_and_exact_stays_exact():
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]], dtype=np.float32))
    q = [dist_of([0], [1.0])]
    assert S.accept(logits, [0], Sampling(), 0, q) == [1]
    s = Sampling(temperature=1.0, seed=9)
    assert S.accept(logits, [1], s, 4) == S.accept_exact(S.filtered(logits, s), [1], s, 4)


def test_draft_distribution_is_capped_and_what_the_draft_samples():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=5000).astype(np.float32)
    s = Sampling(temperature=1.0, seed=2)
    q = S.draft_distribution(logits, s)
    assert len(q.ids) == S.Q_MAX_SUPPORT and np.all(np.diff(q.ids) > 0)
    full = S.filtered(logits[None], s)[0]
    assert set(q.ids) == set(full.ids[np.argsort(-full.probs)[: S.Q_MAX_SUPPORT]])
    t = S.draft_token(logits, s, 7)
    assert t.q is not None and t.token == q.race(2, 7)
    # a round trip through float32 (the wire) leaves q as it was
    assert np.array_equal(dist_of(q.ids.tolist(), q.probs.tolist()).probs, q.probs)
    assert S.draft_token(logits, None, 7).q is None


def test_invalid_draft_q_is_refused():
    ok = dist_of([1, 4], [0.5, 0.5])
    S.check_draft_q([ok], [4], 10)
    S.check_draft_q([], [4], 10)
    for q, drafts in [([ok], [4, 1]), ([dist_of([1, 4], [0.5, 0.5])], [2]), ([dist_of([4, 1], [0.5, 0.5])], [4]),
                      ([dist_of([1, 12], [0.5, 0.5])], [1]), ([TokenDist(np.array([1]), np.array([np.nan]))], [1]),
                      ([dist_of([1, 4], [1.0, 0.0])], [4])]:
        with pytest.raises(InvalidArgument):
            S.check_draft_q(q, drafts, 10)


def reference_probabilities(logits, s: Sampling):
    """The straightforward filters (float64, full sorts) the fast ones replace."""
    x = logits.astype(np.float64) / s.temperature
    n = x.shape[0]
    ids = np.argpartition(-x, s.top_k - 1)[: s.top_k] if 0 < s.top_k < n else np.arange(n)
    p = np.exp(x[ids] - x[ids].max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), s.top_p, side="left")) + 1]
        ids, p = ids[keep], p[keep]
    if s.min_p > 0.0:
        keep = p >= s.min_p * p.max()
        ids, p = ids[keep], p[keep]
    order = np.argsort(ids)
    return ids[order], p[order] / p[order].sum()


@pytest.mark.parametrize("s", [Sampling(temperature=0.7), Sampling(temperature=1.0, top_k=40),
                               Sampling(temperature=1.0, top_p=0.9), Sampling(temperature=0.5, min_p=0.05),
                               Sampling(temperature=1.3, top_k=200, top_p=0.95, min_p=0.01),
                               Sampling(temperature=2.0, top_p=0.99)])
def test_fast_filters_match_the_reference(s):
    rng = np.random.default_rng(0)
    logits = (rng.standard_t(3, size=(4, 20000)) * 3).astype(np.float32)
    for row, d in zip(logits, S.filtered(logits, s)):
        ids, p = reference_probabilities(row, s)
        assert np.array_equal(d.ids, ids)
        assert np.allclose(d.probs, p, rtol=1e-4, atol=1e-7)


# ------------------------------------------------------------ real logits
def _logits(engine, text: str, n_last: int) -> np.ndarray:
    """The model's logits at the last n_last positions of `text`."""
    toks = np.array(engine.tokenize(text, True, True), dtype=np.int32)

    def steps():
        return (yield from engine._decode_g(0, 0, toks, len(toks)))
    engine.clear(0)
    return np.array(engine.run_one(steps())[-n_last:], dtype=np.float32)


@pytest.fixture(scope="module")
def real_logits(models):
    """Target (F32) and Q2_K draft logits at a few contexts: a draft unlike
    its target (sum min(p, q) about 0.75 at T = 1)."""
    from specd.llama import LlamaConfig
    from specd.models import derived_model
    from specd.target_worker.engine import TargetEngine
    from tests.conftest import PROMPTS

    out = []
    for path in (models["target"], derived_model("Q2_K", quiet=True)):
        e = TargetEngine(LlamaConfig(path, n_ctx_seq=256, n_seq=1, n_threads=1))
        out.append(np.concatenate([_logits(e, p, 4) for p in PROMPTS]))
        e.model.close()
    return out


SETTINGS = [Sampling(temperature=0.5, top_k=50, top_p=0.95, min_p=0.02, seed=21),
            Sampling(temperature=1.0, top_k=50, top_p=0.95, min_p=0.02, seed=22)]


def _pvalues(real_logits, s: Sampling, n: int) -> list[float]:
    target, draft = real_logits
    out = []
    for row_p, row_q in zip(target, draft):
        p = S.filtered(row_p[None], s)[0]
        q = S.draft_distribution(row_q, s)
        if float(np.minimum(p.probs, q.at(p.ids)).sum()) > 0.995 or len(p.ids) < 2:
            continue  # p and q alike here: nothing a bias could show
        counts, _ = draws(p, q, s, n)
        out.append(chi2_pvalue(counts, p))
    return out


@pytest.mark.parametrize("s", SETTINGS, ids=["T0.5", "T1.0"])
def test_lossless_on_real_logits_and_a_biased_acceptor_fails(real_logits, s, monkeypatch):
    """Per context, the first output token's counts against the target's own
    filtered distribution (what target-only sampling draws from), with a
    Bonferroni-corrected ALPHA over the contexts. Resampling from p instead
    of max(0, p - q) skews the output towards q, and must fail."""
    n = 6000
    fair = _pvalues(real_logits, s, n)
    assert len(fair) >= 3
    assert min(fair) > ALPHA / len(fair), fair
    monkeypatch.setattr(S, "residual", lambda p, q: p)
    biased = _pvalues(real_logits, s, n)
    assert min(biased) < ALPHA / len(biased), biased


# ------------------------------------------------------------ end to end
def test_router_rejection_sampling_end_to_end(models):
    """Through the router's loop (overlap on, alignment checked): the first
    token over many seeds follows the target's distribution at the prompt,
    both acceptances take most drafts (the draft samples with the target's
    noise), exact acceptance gives target-only's text for the same seed, and
    overlapped drafts carry their q."""
    from specd.draft_worker.engine import DraftModelEngine
    from specd.router.clients import LocalWorker
    from specd.router.engine import Router
    from specd.router.params import GenParams, Result, RouterSettings
    from specd.llama import LlamaConfig
    from specd.target_worker.engine import TargetEngine

    t = TargetEngine(LlamaConfig(models["target"], n_ctx_seq=256, n_seq=1, n_threads=1))
    d = DraftModelEngine(LlamaConfig(models["draft"], n_ctx_seq=256, n_seq=1, n_threads=1))
    prompt = t.tokenize("My favourite colour is", True, True)
    s = Sampling(temperature=1.0, top_k=20)
    p0 = S.filtered(_logits(t, "My favourite colour is", 1), s)[0]

    async def main():
        r = Router(LocalWorker(t, "target"), LocalWorker(d, "draft"), RouterSettings(check_alignment=True))
        await r.start()
        firsts: dict[int, int] = {}
        tot = {"exact": Result(), "rejection": Result(), "alone": Result()}
        texts: dict[str, list] = {"exact": [], "alone": []}
        for i in range(120):
            for acc in ("rejection", "exact", "alone") if i < 12 else ("rejection",):
                res, toks = Result(), []
                params = GenParams(prompt=prompt, max_tokens=2 if i >= 12 else 24, n_max=4, acceptance=acc,
                                   sampling=Sampling(temperature=1.0, top_k=20, seed=1000 + i))
                if acc == "alone":
                    params = replace(params, acceptance=None, speculative=False)
                async for step in r.generate(params, res):
                    toks += step.tokens
                if acc == "rejection":
                    firsts[toks[0]] = firsts.get(toks[0], 0) + 1
                else:
                    texts[acc].append(toks)
                for f in ("n_drafted", "n_accepted", "n_ahead_used"):
                    setattr(tot[acc], f, getattr(tot[acc], f) + getattr(res, f))
        return firsts, tot, texts

    try:
        firsts, tot, texts = asyncio.run(main())
    finally:
        t.model.close()
        d.model.close()
    assert chi2_pvalue(firsts, p0) > ALPHA
    rej, ex = (tot[a].n_accepted / tot[a].n_drafted for a in ("rejection", "exact"))
    assert rej > 0.75 and ex > 0.75, (rej, ex)
    assert texts["exact"] == texts["alone"]
    assert tot["rejection"].n_ahead_used > 0
