"""specd's map-k / map-k4v draft what llama.cpp's common_ngram_map drafts.

tests/data/ngram_map_llama.json holds copy-heavy generations played through
llama.cpp's own ngram-map.cpp (scripts/ngram_parity/ngram_parity.py records
them from the llama.cpp that llama-cpp-python 0.3.36 vendors): each step
drafts after the tokens so far, keeps the draft's tokens that match the true
continuation, tells the drafter how many, and adds the next true token.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specd.draft_worker.ngram import NgramMapProposer
from specd.draft_worker.ngram.map_k import NgramMap
from specd.router.pool import common_prefix

TRACES = json.loads((Path(__file__).parent / "data" / "ngram_map_llama.json").read_text())["traces"]


def play(tokens: list[int], begin: int, draft_after, accept) -> list[list[int]]:
    """The same steps as the recording: draft after tokens[:pos], accept the
    leading matches, then the target's own token."""
    drafts = []
    pos = begin + 1
    while pos <= len(tokens):
        draft = draft_after(pos)
        drafts.append(draft)
        k = common_prefix(draft, tokens[pos:])  # the draft's tokens the target keeps
        accept(k)
        pos += k + 1
    return drafts


@pytest.mark.parametrize("trace", TRACES, ids=[t["name"] for t in TRACES])
def test_the_map_drafts_what_llama_cpp_drafts(trace):
    ngram_map = NgramMap(trace["size_n"], trace["size_m"], trace["key_only"], trace["min_hits"])
    drafts = []
    for turn in trace["turns"]:
        tokens = np.asarray(turn["tokens"], dtype=np.int64)
        ngram_map.begin(turn["begin"])
        drafts += play(turn["tokens"], turn["begin"],
                       lambda pos: ngram_map.draft(tokens[: pos - 1], int(tokens[pos - 1])), ngram_map.accept)
    assert len(drafts) == len(trace["drafts"])
    for i, (ours, theirs) in enumerate(zip(drafts, trace["drafts"])):
        assert ours == theirs, f"step {i}"
    assert sum(map(len, drafts)) > 300   # the traces do draft


@pytest.mark.parametrize("trace", TRACES, ids=[t["name"] for t in TRACES])
def test_the_proposer_drafts_what_llama_cpp_drafts_in_a_request(trace):
    """Through specd's proposer interface, which learns the accepted counts
    from the verified history instead of being told: the first turn (one
    request; specd starts each request's sequence afresh)."""
    p = NgramMapProposer(trace["key_only"], trace["size_n"], trace["size_m"], trace["min_hits"])
    turn = trace["turns"][0]
    tokens = turn["tokens"]
    drafts = play(tokens, turn["begin"], lambda pos: p.propose(tokens[:pos], trace["size_m"], pos), lambda k: None)
    assert drafts == trace["drafts"][: len(drafts)]
    assert sum(map(len, drafts)) > 100
