"""LlamaModel.decode_multi against a real model: sequences in any order and
with any token counts share one llama_decode and each gets its own logits,
with one KV buffer for all sequences (the default) and with one per sequence."""
from __future__ import annotations

import numpy as np
import pytest

from specd.llama import LlamaConfig, LlamaModel
from specd.ubatch import NO_FILL, Fill

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 1707, 33217, 30], [1, 26227, 1542, 253, 655, 28], [1, 504, 1115, 30]]
# (seq_id, new tokens, logits wanted), deliberately not in seq_id order and of different lengths
PARTS = [(2, [2980, 314], 2), (0, [216], 1), (3, [9225, 46, 253], 1), (1, [2273], 1)]


@pytest.fixture(scope="module", params=[True, False], ids=["unified", "per-sequence"])
def model(models, request):
    m = LlamaModel(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=4, kv_unified=request.param))
    yield m
    m.close()


def prefill(m: LlamaModel) -> None:
    m.clear()
    for s, p in enumerate(PROMPTS):
        m.decode(s, 0, p, 0)


def test_each_part_gets_its_own_logits_whatever_the_order(model):
    prefill(model)
    alone = []
    for s, toks, n_logits in PARTS:
        alone.append(np.array(model.decode(s, len(PROMPTS[s]), toks, n_logits)))
        assert model.seq_rm(s, len(PROMPTS[s]), -1)
    batched = model.decode_multi([(s, len(PROMPTS[s]), toks, n) for s, toks, n in PARTS])
    for (s, toks, n), a, b in zip(PARTS, alone, batched):
        assert b.shape == (n, model.n_vocab)
        # the same numbers up to what batch composition changes in float sums;
        # another part's logits would differ everywhere
        assert np.abs(a - b).max() < 1e-2 * np.abs(a).max(), f"seq {s}"
        assert (a.argmax(-1) == b.argmax(-1)).all()
    for s, toks, _ in PARTS:
        assert model.seq_pos_max(s) == len(PROMPTS[s]) + len(toks) - 1


def test_a_sequence_gets_the_context_asked_for(model):
    # llama.cpp pads the context (to 256 per sequence here), and a unified
    # buffer reports all sequences' cells as one sequence's context
    assert model.n_ctx_seq == 64


def test_batch_threads_change_speed_not_numbers(models):
    """--threads-batch: batches run on more threads, single tokens stay on
    --threads, and the logits are bit for bit those of one thread (each
    output row is summed by one thread), so greedy output cannot change."""
    logits = []
    for n_batch_threads in (0, 2):
        m = LlamaModel(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=4, n_threads=1,
                                   n_threads_batch=n_batch_threads))
        try:
            assert m.threads == (1, n_batch_threads or 1)
            prefill(m)
            got = [np.array(x) for x in m.decode_multi([(s, len(PROMPTS[s]), toks, n) for s, toks, n in PARTS])]
            got.append(np.array(m.decode(0, len(PROMPTS[0]) + 1, [30], 1)))
            logits.append(got)
        finally:
            m.close()
    for one, two in zip(*logits):
        assert np.array_equal(one, two)


def test_a_free_id_between_sequences_is_filled_for_the_pass_and_left_empty(model):
    """Sequences 0, 1 and 3 decode one token each while 2 holds nothing:
    with a KV stream per sequence llama.cpp would run ids 0-1 and 3 as two
    passes, so sequence 2 decodes a throwaway token in the same batch and is
    emptied after. The others' logits are theirs."""
    prefill(model)
    assert model.seq_rm(2, -1, -1)
    step = [(0, [216]), (1, [2273]), (3, [9225])]
    alone = []
    for s, toks in step:
        alone.append(np.array(model.decode(s, len(PROMPTS[s]), toks, 1)))
        assert model.seq_rm(s, len(PROMPTS[s]), -1)
    fill = Fill(pad={}, gaps={2: 1})
    batched = model.decode_multi([(s, len(PROMPTS[s]), toks, 1) for s, toks in reversed(step)], fill)
    for (s, _), a, b in zip(step, alone, reversed(batched)):
        assert np.abs(a - b).max() < 1e-2 * np.abs(a).max(), f"seq {s}"
        assert a.argmax() == b.argmax()
    assert model._batch.n_tokens == 4
    assert model.seq_pos_max(2) == -1
    for s, _ in step:
        assert model.seq_pos_max(s) == len(PROMPTS[s])



def test_padded_parts_keep_their_logits_and_leave_no_padding_behind(model):
    """Parts of 2, 1, 3 and 1 tokens padded to 3 (one pass instead of
    several with a stream per sequence): each part's logits are its own, the
    padding is gone after, and the next token decodes as without it."""
    def run(fill):
        prefill(model)
        first = [np.array(x) for x in model.decode_multi([(s, len(PROMPTS[s]), t, n) for s, t, n in PARTS], fill)]
        heads = [model.seq_pos_max(s) for s in range(len(PROMPTS))]
        nxt = np.array(model.decode(1, len(PROMPTS[1]) + 1, [30], 1))
        return first, heads, nxt

    plain, heads, nxt = run(NO_FILL)
    padded, heads_p, nxt_p = run(Fill(pad={0: 2, 1: 2, 2: 1}, gaps={}))
    assert heads_p == heads == [len(PROMPTS[s]) + len(t) - 1 for s, t, _ in sorted(PARTS)]
    for a, b in zip(plain, padded):
        assert np.abs(a - b).max() < 1e-2 * np.abs(a).max()
        assert (a.argmax(-1) == b.argmax(-1)).all()
    assert np.abs(nxt - nxt_p).max() < 1e-2 * np.abs(nxt).max() and nxt.argmax() == nxt_p.argmax()


def test_the_engine_pads_a_batch_of_mixed_lengths_into_one_pass(models):
    """ModelEngine plans the padding (specd.ubatch): 1, 2, 1 and 2 tokens
    would be three passes with a stream per sequence, padded they are one
    of 8 tokens; each sequence then holds exactly its own tokens."""
    from specd.model_engine import ModelEngine

    eng = ModelEngine(LlamaConfig(models["target"], n_ctx_seq=64, n_seq=4))
    try:
        prefill(eng.model)
        step = [(0, [216]), (1, [2273, 30]), (2, [2980]), (3, [9225, 46])]
        out = eng._decode_parts([(s, len(PROMPTS[s]), toks, len(toks)) for s, toks in step])
        assert [o.shape[0] for o in out] == [1, 2, 1, 2]
        assert eng.round_cost[0][0] == 8 and eng.model._batch.n_tokens == 8
        assert [eng.model.seq_pos_max(s) for s, _ in step] == [len(PROMPTS[s]) + len(t) - 1 for s, t in step]
    finally:
        eng.model.close()
