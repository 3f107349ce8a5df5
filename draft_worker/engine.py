"""Draft engines: propose tokens after id_last.

Both keep the same contract, so the router cannot tell them apart: Propose
appends the tail it is given and then d0 .. dk-2 to the sequence (the drafts
it evaluated to find the next one), and returns d0 .. dk-1.
"""
from __future__ import annotations

import time

import numpy as np

from specd.draft_worker.verified import VerifiedPrefix
from specd.engine import MAX_DRAFT, Capabilities, ModelInfo, ProposeResult, Steps, WorkerEngine
from specd.errors import InvalidArgument, SpecdError
from specd.model_engine import ModelEngine
from specd.sampling import Sampling, TokenDist, draft_token


def check_propose_params(n_max: int, n_min: int, p_min: float) -> None:
    if not 1 <= n_max <= MAX_DRAFT:
        raise InvalidArgument(f"n_max must be in [1, {MAX_DRAFT}], got {n_max}")
    if not 0 <= n_min <= n_max:
        raise InvalidArgument(f"n_min must be in [0, n_max = {n_max}], got {n_min}")
    if not 0.0 <= p_min <= 1.0:
        raise InvalidArgument(f"p_min must be in [0, 1], got {p_min}")


class _ProposeMixin:
    """Validation and the n_min cut shared by both draft engines."""

    def propose(self, seq_id: int, pos: int, tokens, n_max: int, n_min: int, p_min: float,
                sampling: Sampling | None = None, sample_index: int = 0) -> ProposeResult:
        return self.run_one(self.propose_steps(seq_id, pos, tokens, n_max, n_min, p_min, sampling, sample_index))

    def _begin(self, seq_id: int, pos: int, tokens, n_max: int, n_min: int, p_min: float):
        seq = self._check_seq(seq_id)
        toks = self._check_tokens(tokens)
        check_propose_params(n_max, n_min, p_min)
        self._check_append(seq, pos, len(toks))
        # the drafts d0..dk-2 are decoded too: never past the context
        room = self.n_ctx_seq - (pos + len(toks))
        return toks, max(0, min(n_max, room + 1))

    def _finish(self, seq_id: int, end: int, drafts: list[int], n_min: int, t0: float) -> ProposeResult:
        if len(drafts) < n_min:
            drafts = []
        keep = end + max(len(drafts) - 1, 0)
        if self.seqs[seq_id].pos_max + 1 > keep and self.can_rm_partial:
            self.seq_rm(seq_id, keep, -1)
        n_batch, s_batch = self.round_cost.get(seq_id, (0, 0.0))
        return ProposeResult(drafts, self.state(seq_id), time.perf_counter() - t0, n_batch, s_batch)


class DraftModelEngine(_ProposeMixin, ModelEngine):
    """Greedy drafting with a small llama.cpp model (common_speculative_draft)."""

    capabilities = Capabilities(proposes=True, vocabulary=True, chat_template=True)
    time_prompts = True

    def propose_steps(self, seq_id: int, pos: int, tokens, n_max: int, n_min: int, p_min: float,
                      sampling: Sampling | None = None, sample_index: int = 0) -> Steps:
        """Propose as steps: each draft token is one decode, shared with the
        other sequences drafting at the same time. With `sampling` (not
        greedy) each draft is sampled from the draft's own distribution, for
        speculative sampling, and the result carries those distributions."""
        t0 = time.perf_counter()
        toks, n_max = self._begin(seq_id, pos, tokens, n_max, n_min, p_min)
        end = pos + len(toks)
        # a tail longer than n_batch (a draft far behind) is decoded in chunks
        logits = yield from self._decode_g(seq_id, pos, toks, 1)
        drafts: list[int] = []
        q: list[TokenDist] = []
        try:
            while len(drafts) < n_max:
                nxt = draft_token(logits[0], sampling, sample_index + len(drafts))
                if nxt.confidence < p_min:
                    break
                drafts.append(nxt.token)
                if nxt.q is not None:
                    q.append(nxt.q)
                if len(drafts) == n_max:
                    break
                logits = yield from self._decode_g(seq_id, end + len(drafts) - 1,
                                                   np.array([nxt.token], dtype=np.int32), 1)
        except SpecdError as exc:  # all or nothing: the tail goes too
            self._fail_from(seq_id, pos, exc)
        res = self._finish(seq_id, end, drafts, n_min, t0)
        res.q = q[: len(res.tokens)]
        return res


class NgramEngine(_ProposeMixin, WorkerEngine):
    """Model-free drafting from the sequence's own token history."""

    kind = "ngram"
    capabilities = Capabilities(proposes=True)

    def __init__(self, spec: str, n_seq: int, n_ctx_seq: int, cache_path: str | None = None, n_vocab: int = 0):
        """`n_vocab`: token ids must be below it (the target's vocabulary
        size); 0: any id llama.cpp could hold. Negative ids are always refused."""
        from specd.draft_worker.ngram import make_proposer

        if n_vocab < 0:
            raise ValueError(f"n_vocab must be >= 0 (0: unknown), got {n_vocab}")
        super().__init__(n_seq, n_ctx_seq, n_vocab=n_vocab)
        self.spec = spec
        kwargs = {"cache_path": cache_path} if cache_path else {}
        self._make = lambda: make_proposer(spec, **kwargs)
        # one per sequence on its first proposal (a mod table is 16 MB): a
        # router drafting in process offers llama.cpp's most sequence ids
        self.proposers = {0: self._make()}  # a bad spec fails here, not at the first proposal
        self.verified = [VerifiedPrefix() for _ in range(n_seq)]
        # seq -> prompt length, told to its proposer at the next proposal:
        # what the router decodes outside a proposal is a prompt (its last
        # token comes with the first proposal)
        self.prompts: dict[int, int] = {}

    def info(self) -> ModelInfo:
        return ModelInfo(
            kind=self.kind, description=f"ngram:{self.spec}", architecture="", n_vocab=self.n_vocab,
            vocab_fingerprint="", n_ctx_seq=self.n_ctx_seq, n_seq=self.n_seq, can_rm_partial=True,
            can_shift=True, n_swa=0, eog_tokens=(), add_bos=False, n_threads=1, model_path="",
            match_needs_repeat=self.proposers[0].match_needs_repeat,
        )

    def propose_steps(self, seq_id: int, pos: int, tokens, n_max: int, n_min: int, p_min: float,
                      sampling: Sampling | None = None, sample_index: int = 0) -> Steps:
        """`sampling`, `sample_index`: unused; n-gram drafts have no distribution
        and are accepted by exact match."""
        t0 = time.perf_counter()
        toks, n_max = self._begin(seq_id, pos, tokens, n_max, n_min, p_min)
        yield from self._decode_g(seq_id, pos, toks, 0)
        end = pos + len(toks)
        history = self.seqs[seq_id].tokens()
        known = self.verified[seq_id]
        # learners learn and judge their drafts on verified tokens only
        n_verified = known.update(history, len(history) - len(toks))
        proposer = self.proposers.get(seq_id)
        if proposer is None:
            proposer = self.proposers[seq_id] = self._make()
        if seq_id in self.prompts:
            proposer.begin(self.prompts.pop(seq_id))
        proposer.observe(history[:n_verified])
        drafts = [int(t) for t in proposer.propose(history, n_max, n_verified)][:n_max]
        if len(drafts) > 1:
            yield from self._decode_g(seq_id, end, np.asarray(drafts[:-1], dtype=np.int32), 0)
        res = self._finish(seq_id, end, drafts, n_min, t0)
        if len(res.tokens) < len(drafts):  # cut by n_min: never sent, so never to be judged
            proposer.propose(history, 0, n_verified)
        known.proposed(len(history), res.tokens, n_verified)
        return res

    def decode_steps(self, seq_id: int, pos: int, tokens) -> Steps:
        state = yield from super().decode_steps(seq_id, pos, tokens)
        self.prompts[seq_id] = state.n_tokens + 1
        return state

    def clear(self, seq_id: int) -> None:
        super().clear(seq_id)
        for i in range(self.n_seq) if seq_id == -1 else [seq_id]:
            self.prompts.pop(i, None)
            if i in self.proposers:
                self.proposers[i].reset()
            self.verified[i].reset()
