"""A checkpoint restore that llama.cpp refuses leaves the worker's
bookkeeping matching its memory: the sequence is empty and the error says
so, so the next operation that counts on the old tokens is refused instead
of decoding without their context. Real models, in process (the bytes of a
checkpoint are truncated to make llama.cpp refuse them)."""
from __future__ import annotations

import pytest

from specd.draft_worker.engine import DraftModelEngine
from specd.errors import FailedPrecondition, Internal
from specd.llama import LlamaConfig
from specd.tokens import history_hash
from specd.target_worker.engine import TargetEngine

TEXT = "The history of the printing press begins in the fifteenth century"


@pytest.fixture(scope="module", params=["target", "draft"])
def engine(request, models):
    kind = TargetEngine if request.param == "target" else DraftModelEngine
    e = kind(LlamaConfig(models[request.param], n_ctx_seq=256, n_seq=2, n_threads=1))
    yield e
    e.model.close()


def test_failed_restore_leaves_an_empty_sequence_and_says_so(engine):
    engine.clear(-1)
    toks = engine.tokenize(TEXT, True, True)
    engine.decode(0, 0, toks[:8])
    ck = engine.checkpoint_save(0)
    engine.decode(0, 8, toks[8:])
    engine.decode(1, 0, toks[:3])
    other = engine.state(1)
    engine.checkpoints[ck.handle].data = engine.checkpoints[ck.handle].data[: ck.n_bytes // 2]
    with pytest.raises(Exception) as err:
        engine.checkpoint_restore(ck.handle, drop=True)
    s = engine.state(0)
    assert (s.pos_min, s.pos_max, s.n_tokens, s.token_hash) == (-1, -1, 0, history_hash([]))
    assert engine.model.seq_pos_max(0) == -1  # what llama.cpp holds: nothing
    assert isinstance(err.value, Internal) and "seq 0 is now empty" in err.value.message
    assert engine.state(1) == other
    with pytest.raises(FailedPrecondition):  # a caller counting on the old tokens is told
        engine.decode(0, len(toks), toks[:1])
    assert ck.handle in engine.checkpoints  # not restored, so not dropped
    engine.checkpoint_drop(ck.handle)
    assert engine.stats.checkpoint_bytes == 0
    assert engine.decode(0, 0, toks[:4]).token_hash == history_hash(toks[:4])


def test_restore_still_restores(engine):
    engine.clear(-1)
    toks = engine.tokenize(TEXT, True, True)
    engine.decode(0, 0, toks[:8])
    ck = engine.checkpoint_save(0)
    engine.decode(0, 8, toks[8:])
    assert engine.checkpoint_restore(ck.handle, drop=True).token_hash == history_hash(toks[:8])
    assert engine.model.seq_pos_max(0) == 7 and not engine.checkpoints
