"""Model-free drafting end to end: a draft worker running each n-gram proposer
keeps its history in step through the mirrored calls, and greedy output stays
identical to target-only (alignment check on)."""
from __future__ import annotations

import json
import pathlib

import pytest

from specd.draft_worker.ngram import PROPOSER_NAMES
from specd.client import RouterClient
from tests.test_concurrency import metric

COPY_HEAVY = [json.loads(line)["prompt"] for line in
              (pathlib.Path(__file__).parent.parent / "bench" / "copy_heavy.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("spec,in_router", [*((name, True) for name in PROPOSER_NAMES), ("map-k,simple", True),
                                           ("simple", False)])
def test_ngram_greedy_identical(cluster_factory, spec, in_router):
    """In the router (router --ngram, as `specd up` runs it) or in a draft
    worker process of its own (specd draft --ngram), the drafter only ever
    changes speed. The target as `specd up` runs it: batches on both cores
    unless the draft computes."""
    c = cluster_factory(draft_model="", ngram=spec, ngram_in_router=in_router, n_ctx=1024, n_seq=1, metrics=True,
                        target_threads=1, target_threads_batch=2)
    batches = "specd_worker_decode_multi_token_batches_total"
    drafted = accepted = steps = generated = 0
    with RouterClient(c.router_address) as client:
        info = client.info()
        assert info.draft.kind == "ngram" and info.draft_up
        for prompt in (COPY_HEAVY[0], COPY_HEAVY[5]):
            base = client.generate(prompt, max_tokens=48, speculative=False)
            for n in (3, 8):
                r = client.generate(prompt, max_tokens=48, n_draft=n)
                assert r.tokens == base.tokens, f"{spec}, n_draft {n}"
                drafted += r.n_drafted
                accepted += r.n_accepted
                steps += r.n_steps
                generated += r.n_generated
    assert accepted <= drafted
    # an n-gram proposal costs microseconds: the target never left the draft a core for it
    by_threads = metric(c.metrics_ports["target"], batches)
    assert by_threads.get('{threads="2"}', 0) > 0 and by_threads.get('{threads="1"}', 0) == 0, by_threads
    if spec in ("simple", "map-k", "map-k,simple"):
        assert accepted > 0  # copying prompts: the history-scanning drafters must hit
        # without a match the target went on alone until one could come (stop_on_repeat)
        assert steps < generated - accepted
