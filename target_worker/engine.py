"""The target's verification step: decode [id_last, d0..dk-1] in one batch and
accept drafts while they match what the target samples."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from specd.config import MAX_N_MORE, MAX_STOP_ON_REPEAT
from specd.engine import Capabilities, Steps, VerifyPartial, VerifyResult
from specd.errors import FailedPrecondition, InvalidArgument, SpecdError
from specd.model_engine import ModelEngine
from specd.sampling import Sampling, accept, check_draft_q
from specd.tokens import ends_in_repeat


class TargetEngine(ModelEngine):
    capabilities = Capabilities(verifies=True, vocabulary=True, chat_template=True)

    def verify(self, seq_id: int, pos: int, tokens, sampling: Sampling, sample_index: int, trim: bool,
               draft_q=(), n_more: int = 0, stop_on_repeat: int = 0, stream_every: int = 0,
               on_partial: Callable[[VerifyPartial], None] | None = None,
               others_waiting: Callable[[], bool] | None = None) -> VerifyResult:
        return self.run_one(self.verify_steps(seq_id, pos, tokens, sampling, sample_index, trim, draft_q, n_more,
                                              stop_on_repeat, stream_every, on_partial, others_waiting))

    def verify_steps(self, seq_id: int, pos: int, tokens, sampling: Sampling, sample_index: int,
                     trim: bool, draft_q=(), n_more: int = 0, stop_on_repeat: int = 0, stream_every: int = 0,
                     on_partial: Callable[[VerifyPartial], None] | None = None,
                     others_waiting: Callable[[], bool] | None = None) -> Steps:
        """Verify as steps, so verifications of several sequences share one batch.
        `draft_q`: the drafts' distributions for speculative sampling; empty: exact match.
        `n_more`: then go on alone for up to that many tokens (_go_on), until
        a repeat of the last `stop_on_repeat` tokens when that is not 0, or
        until `others_waiting()` (operations queued for the next round: they
        batch sooner), handing `on_partial` the tokens after every
        `stream_every` of them (both called on the engine thread)."""
        seq = self._check_seq(seq_id)
        toks = self._check_tokens(tokens)
        sampling.validate()
        if sample_index < 0:
            raise InvalidArgument(f"sample_index must be >= 0, got {sample_index}", field="sample_index")
        if not 0 <= n_more <= MAX_N_MORE:
            raise InvalidArgument(f"n_more must be in [0, {MAX_N_MORE}], got {n_more}", field="n_more")
        if not 0 <= stop_on_repeat <= MAX_STOP_ON_REPEAT:
            raise InvalidArgument(f"stop_on_repeat must be in [0, {MAX_STOP_ON_REPEAT}], got {stop_on_repeat}",
                                  field="stop_on_repeat")
        if not 0 <= stream_every <= MAX_N_MORE + 1:
            raise InvalidArgument(f"stream_every must be in [0, {MAX_N_MORE + 1}], got {stream_every}",
                                  field="stream_every")
        self.check_batch(len(toks))
        self._check_append(seq, pos, len(toks))
        n_draft = len(toks) - 1
        check_draft_q(draft_q, toks[1:], self.n_vocab)
        if trim and n_draft > 0 and not self.can_rm_partial:
            raise FailedPrecondition("trim needs partial removal, which this model lacks; verify with checkpoints")
        t0 = time.perf_counter()
        logits = yield from self._decode_g(seq_id, pos, toks, len(toks))
        out = accept(logits, toks[1:].tolist(), sampling, sample_index, draft_q)
        n_accepted = len(out) - 1
        if trim and n_accepted < n_draft:
            self.seq_rm(seq_id, pos + 1 + n_accepted, -1)
        n_own = len(out)
        if n_more:
            stream = _Stream(self, stream_every, on_partial) if stream_every and on_partial else None
            yield from self._go_on(seq_id, out, sampling, sample_index, n_more, stop_on_repeat, stream,
                                   others_waiting)
        n_batch, s_batch = self.round_cost.get(seq_id, (0, 0.0))
        return VerifyResult(out, self.pieces(out), self.state(seq_id), time.perf_counter() - t0, n_batch, s_batch,
                            len(out) - n_own)

    def _go_on(self, seq_id: int, out: list[int], sampling: Sampling, sample_index: int, n_more: int,
               stop_on_repeat: int = 0, stream: _Stream | None = None,
               others_waiting: Callable[[], bool] | None = None) -> Steps:
        """Decode out's last token and sample the next, up to n_more times,
        appending to `out`; stop after an end-of-generation token, at the
        end of the context, or (stop_on_repeat > 0) at a token that ends a
        repeated run of that many, where an n-gram drafter has a match. Each
        decode is a round of its own, so other sequences' operations batch
        with it."""
        seq, eog = self.seqs[seq_id], self.model.eog_tokens
        for _ in range(n_more):
            pos = seq.pos_max + 1 if len(seq) else 0
            if out[-1] in eog or pos >= self.n_ctx_seq:
                return
            if stop_on_repeat and ends_in_repeat(np.append(seq.tokens(), out[-1]), stop_on_repeat):
                return
            if others_waiting is not None and others_waiting():
                return
            if stream is not None:
                stream.send(out)
            try:
                logits = yield from self._decode_g(seq_id, pos, np.asarray(out[-1:], dtype=np.int32), 1)
            except SpecdError:  # e.g. no KV slot: what is there stands, the decode left nothing behind
                return
            out.extend(accept(logits, [], sampling, sample_index + len(out)))


class _Stream:
    """Hands a verification's tokens on while it goes on alone, every
    `every` of them (VerifyRequest.stream_every)."""

    def __init__(self, engine: TargetEngine, every: int, on_partial: Callable[[VerifyPartial], None]):
        self.engine, self.every, self.on_partial = engine, every, on_partial
        self.sent = 0

    def send(self, out: list[int]) -> None:
        """Before the next decode: the tokens not sent yet, if `every` of them are there."""
        if len(out) - self.sent >= self.every:
            new = out[self.sent:]
            self.on_partial(VerifyPartial(self.sent, new, self.engine.pieces(new)))
            self.sent = len(out)
