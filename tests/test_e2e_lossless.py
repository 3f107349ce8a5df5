"""Greedy speculative output is token-for-token the target's own output.

Real processes: target worker, draft worker and router over gRPC on loopback,
with the router's alignment check on (a divergence fails the request)."""
from __future__ import annotations

import pytest

from specd.client import RouterClient
from tests.conftest import PROMPTS

MAX_TOKENS = 24
DRAFT_LENGTHS = (1, 2, 4, 8)


def run_matrix(address: str, max_tokens: int = MAX_TOKENS, prompts=PROMPTS, **kw) -> dict:
    out = {}
    with RouterClient(address) as client:
        assert client.info().check_alignment
        for i, prompt in enumerate(prompts):
            base = client.generate(prompt, max_tokens=max_tokens, speculative=False, **kw)
            assert base.n_drafted == 0 and not base.speculative
            assert base.n_generated == len(base.tokens) + (base.finish_reason == "eog")
            for n in DRAFT_LENGTHS:
                spec = client.generate(prompt, max_tokens=max_tokens, n_draft=n, **kw)
                assert spec.speculative
                assert spec.tokens == base.tokens, f"prompt {i}, n_draft {n}: speculative output differs"
                assert spec.text == base.text
                assert spec.finish_reason == base.finish_reason
                assert spec.n_accepted <= spec.n_drafted
                out[(i, n)] = spec
    return out


def test_greedy_identical_to_target_only(cluster):
    out = run_matrix(cluster.router_address)
    drafted = sum(c.n_drafted for c in out.values())
    accepted = sum(c.n_accepted for c in out.values())
    # the default pair shares its weights: the draft must actually be used and mostly right
    assert drafted > 0 and accepted / drafted > 0.5


def test_greedy_identical_in_checkpoint_mode(cluster_factory):
    c = cluster_factory(router_args=["--checkpoint-mode"], n_ctx=512, n_seq=1)
    with RouterClient(c.router_address) as client:
        assert client.info().checkpoint_mode
    out = run_matrix(c.router_address, max_tokens=16, prompts=PROMPTS[:10])
    assert sum(s.n_drafted for s in out.values()) > 0


COUNTING = ", ".join(str(i) for i in range(1, 31)) + ","  # the model keeps counting, no early EOG


@pytest.fixture(scope="module")
def small_cluster(cluster_factory):
    return cluster_factory(n_ctx=256, n_seq=1)


def test_greedy_identical_across_context_shift(small_cluster):
    prompt = COUNTING
    with RouterClient(small_cluster.router_address) as client:
        base = client.generate(prompt, max_tokens=400, speculative=False, context_shift=True, n_keep=4)
        assert base.n_generated == 400 and base.finish_reason == "length"
        assert base.n_shifts >= 2  # 400 tokens after a ~90-token prompt in a 256-token context
        for n in (2, 4):
            spec = client.generate(prompt, max_tokens=400, n_draft=n, context_shift=True, n_keep=4)
            assert spec.tokens == base.tokens
            assert spec.n_drafted > 0 and spec.n_shifts >= 2


def test_context_full_without_shift_finishes_with_length(small_cluster):
    with RouterClient(small_cluster.router_address) as client:
        prompt = client.tokenize(COUNTING)
        r = client.generate(prompt, n_draft=4)  # no max_tokens: until the context is full
        assert r.finish_reason == "length"
        assert r.n_prompt + r.n_generated == 256 and r.n_shifts == 0
