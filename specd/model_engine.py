"""`ModelEngine`: a WorkerEngine whose sequences live in a llama.cpp context."""
from __future__ import annotations

import logging
import time
from typing import NoReturn

import numpy as np

from specd.router.costs import COST_CHECK
from specd.engine import Capabilities, ModelInfo, Steps, WorkerEngine
from specd.errors import FailedPrecondition, Internal, InvalidArgument, ResourceExhausted, SpecdError
from specd.llama import DecodeError, LlamaConfig, LlamaModel
from specd.ubatch import DEFAULT_PASS_TOKENS, NO_FILL, Fill, Part, pass_tokens, plan_fill, shared_tokens


log = logging.getLogger("specd.engine")

# A calibration that fails COST_CHECK is timed again: one more sweep after
# each pause, so that what disturbed it can pass (mostly the other worker
# timing its own decodes on the same cores, for a few seconds). A machine
# busy for longer would make every start wait: the retries of all of a
# worker's curves share CALIBRATION_RETRY_SECONDS, and then the curve is
# repaired (the router learns the rest from the batches it sees).
CALIBRATION_PAUSES = (0.5, 1.0, 2.0)  # then the last again
CALIBRATION_RETRY_SECONDS = 6.0


class ModelEngine(WorkerEngine):
    kind = "model"
    capabilities = Capabilities(vocabulary=True, chat_template=True)
    # time prompts too (`prompt_costs`): the router prices a draft's catch-up
    # on them; a target's prompts it never prices, and every start pays it
    time_prompts = False

    def __init__(self, config: LlamaConfig, max_checkpoint_bytes: int = 1 << 30):
        self.model = LlamaModel(config)
        self.config = config
        super().__init__(config.n_seq, self.model.n_ctx_seq, self.model.n_vocab, max_checkpoint_bytes)
        self.can_rm_partial = not self.model.is_recurrent
        self.can_shift = self.model.can_shift
        self._fingerprint = self.model.vocab_fingerprint()
        self.decode_costs: tuple[tuple[int, float], ...] = ()
        self.decode_costs_shared: tuple[tuple[int, float], ...] = ()
        self.prompt_costs: tuple[tuple[int, float], ...] = ()
        self.pass_tokens = DEFAULT_PASS_TOKENS  # a model pass's fixed cost in tokens (specd.ubatch)
        self._retry_left = CALIBRATION_RETRY_SECONDS  # seconds left to time implausible curves again
        self._shared_until = 0.0  # time.monotonic() until which the other worker computes (share_cores)

    def info(self) -> ModelInfo:
        m = self.model
        return ModelInfo(
            kind=self.kind,
            description=m.description(),
            architecture=m.meta("general.architecture"),
            n_vocab=m.n_vocab,
            vocab_fingerprint=self._fingerprint,
            n_ctx_seq=m.n_ctx_seq,
            n_seq=m.n_seq,
            can_rm_partial=self.can_rm_partial,
            can_shift=self.can_shift,
            n_swa=m.n_swa,
            eog_tokens=m.eog_tokens,
            add_bos=m.add_bos,
            n_threads=m.threads[0],
            n_threads_batch=m.threads[1],
            model_path=self.config.model_path,
            decode_costs=self.decode_costs,
            decode_costs_shared=self.decode_costs_shared,
            prompt_costs=self.prompt_costs,
        )

    def share_cores(self, busy_seconds: float) -> None:
        self._shared_until = time.monotonic() + busy_seconds if busy_seconds > 0 else 0.0

    def _lend_cores(self, n_tokens: int) -> int:
        """Set the threads for the next llama_decode of a round with
        `n_tokens` left, and return at most how many tokens it may take: on
        the base threads only while the other worker is expected to compute
        (specd.ubatch.shared_tokens), so a short draft operation does not
        keep a long prompt batch off half the cores."""
        left = self._shared_until - time.monotonic()
        per_token = self.decode_costs_shared[-1][1] / self.decode_costs_shared[-1][0] if self.decode_costs_shared else 0.0
        k = shared_tokens(n_tokens, left, per_token, self.pass_tokens)
        self.model.share_cores(k > 0)
        return k if 0 < k < n_tokens else self.model.n_batch

    def calibrate(self, max_tokens: int = 64, repeats: int = 3) -> None:
        """Time llama_decode for batches of 1, 2, 4 .. max_tokens tokens, each
        token with its logits (the router's prior for adaptive speculation:
        the shape of its steps, where every drafted and verified token needs
        its logits), on the batch threads and,
        when those are more, on the base threads alone (`decode_costs_shared`);
        and, for a draft (`time_prompts`), with the last token's logits only
        (`prompt_costs`: what catching up on missed tokens pays). Each curve
        must pass COST_CHECK (`_time_decodes`). Leaves the sequences empty."""
        self._retry_left = CALIBRATION_RETRY_SECONDS
        self.decode_costs = self._time_decodes(max_tokens, repeats)
        log.info("decode cost (tokens: ms): %s", ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.decode_costs))
        self.pass_tokens = pass_tokens(self.decode_costs)
        if self.time_prompts:
            self.prompt_costs = self._time_decodes(max_tokens, repeats, all_logits=False)
            log.info("prompt cost, last token's logits (tokens: ms): %s",
                     ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.prompt_costs))
        if self.model.threads[1] != self.model.threads[0]:
            self.model.share_cores(True)
            try:
                self.decode_costs_shared = self._time_decodes(max_tokens, repeats)
            finally:
                self.model.share_cores(False)
            log.info("decode cost on %d threads (tokens: ms): %s", self.model.threads[0],
                     ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.decode_costs_shared))

    def _time_decodes(self, max_tokens: int, repeats: int, all_logits: bool = True) -> tuple[tuple[int, float], ...]:
        """Each size's fastest of `repeats` runs, taken in interleaved sweeps
        so that a passing disturbance cannot spoil every run of one size. A
        longer one (the other worker timing its decodes on the same cores)
        can: a curve that fails COST_CHECK is discarded and timed again, a
        sweep at a time after a pause (CALIBRATION_PAUSES), each size keeping
        its fastest run of all, while the worker's retry time lasts; if it
        still fails, it is repaired (lowered until it passes) and said so.

        The two shapes differ: a small quantised draft pays a clear price
        for each row of logits (docs/adaptive.md). Priced with the last
        token's logits only, drafting under load would look cheaper than it
        is; with a row per token, a catch-up on a 32-token prompt would be
        priced with 31 rows of logits it does not compute. An F32 target's
        rows cost little."""
        limit = min(max_tokens, self.model.n_batch, self.n_ctx_seq)
        sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
        best = dict.fromkeys(sizes, float("inf"))
        what = "decode cost" if all_logits else "prompt cost"
        self._sweeps(best, repeats, all_logits)
        retries = 0
        while problems := COST_CHECK.problems(best.items()):
            if self._retry_left <= 0:
                log.warning("%s still implausible after %d more sweeps (%s): lowered until plausible", what,
                            retries, "; ".join(problems[:2]))
                break
            pause = CALIBRATION_PAUSES[min(retries, len(CALIBRATION_PAUSES) - 1)]
            log.warning("%s discarded as implausible (%s); timing again in %.1f s", what, "; ".join(problems[:2]),
                        pause)
            t0 = time.perf_counter()
            time.sleep(pause)
            self._sweeps(best, 1, all_logits)
            self._retry_left -= time.perf_counter() - t0
            retries += 1
        return COST_CHECK.repair(best.items())

    def _sweeps(self, best: dict[int, float], repeats: int, all_logits: bool) -> None:
        """Time a decode of each size in `best` `repeats` times, in turn,
        keeping each size's fastest."""
        toks = np.full(max(best), self.model.eog_tokens[0] if self.model.eog_tokens else 0, dtype=np.int32)
        for _ in range(repeats):
            for n in best:
                t0 = time.perf_counter()
                self.model.decode(0, 0, toks[:n], n if all_logits else 1)
                best[n] = min(best[n], time.perf_counter() - t0)
                self.model.seq_rm(0, -1, -1)

    # ------------------------------------------------------------- storage
    def _decode_g(self, seq_id: int, pos: int, toks: np.ndarray, n_logits: int) -> Steps:
        """Decode n_batch tokens a round, as llama.cpp splits a batch into
        ubatches: a catch-up longer than n_batch (a draft far behind) takes
        several rounds, and other sequences' decodes go on in between. The
        logits are the last chunk's, so `n_logits` must fit in it. If a chunk
        fails, what the earlier ones added is removed (all or nothing)."""
        n_batch = self.model.n_batch
        last = (len(toks) - 1) // n_batch * n_batch  # where the last chunk starts
        if n_logits > len(toks) - last:
            raise Internal(f"{n_logits} rows of logits asked of a decode whose last chunk has {len(toks) - last}")
        logits = None
        for start in range(0, len(toks), n_batch):
            chunk = toks[start : start + n_batch]
            try:
                logits = yield (seq_id, pos + start, chunk, n_logits if start == last else 0)
            except SpecdError as exc:
                if start:
                    self._fail_from(seq_id, pos, exc)
                raise
            self.seqs[seq_id].append(pos + start, chunk)
        return logits

    def _fail_from(self, seq_id: int, pos: int, exc: SpecdError) -> NoReturn:
        """Remove what a failed operation decoded from `pos` on, then raise
        `exc`. Memory that cannot drop part of a sequence (recurrent) loses
        all of it, and the error says so: the bookkeeping must match what
        llama.cpp holds. (`exc` may be shared by other sequences' operations
        of the same batch: it is not changed.)"""
        seq = self.seqs[seq_id]
        if self.model.seq_rm(seq_id, pos, -1):
            seq.rm(pos, -1)
            raise exc
        self.model.seq_rm(seq_id, -1, -1)
        seq.clear()
        note = f"seq {seq_id} could not be cut back to position {pos} and is now empty"
        raise type(exc)(f"{exc.message}; {note}") from exc

    def _decode_parts(self, parts: list[tuple]) -> list:
        """Decode the parts in as few llama_decode calls as n_batch allows
        (and _lend_cores: a call on the base threads takes only what fits
        while the other worker computes). Logits of all but the last call
        are copied (the next call reuses the buffer). A failed call leaves
        none of its parts behind."""
        out: list = [None] * len(parts)
        start = 0
        while start < len(parts):
            cap = self._lend_cores(sum(len(p[2]) for p in parts[start:]))
            end, size = start + 1, len(parts[start][2])
            while end < len(parts) and size + len(parts[end][2]) <= cap:
                size += len(parts[end][2])
                end += 1
            idx, start = list(range(start, end)), end
            t0 = time.perf_counter()
            fill = NO_FILL
            try:
                if len(idx) == 1:  # may exceed n_batch: model.decode splits it
                    seq_id, pos, toks, n_logits = parts[idx[0]]
                    logits = [self.model.decode(seq_id, pos, toks, n_logits)]
                else:
                    fill = self._fill([parts[i] for i in idx])
                    logits = self.model.decode_multi([parts[i] for i in idx], fill)
            except DecodeError as exc:
                for i in range(len(parts)):  # a partially applied batch must not stay behind
                    seq_id, pos = parts[i][0], parts[i][1]
                    self.model.seq_rm(seq_id, pos, -1)
                raise ResourceExhausted(f"decode failed: {exc}") from exc
            seconds = time.perf_counter() - t0
            n_tokens = sum(len(parts[i][2]) for i in idx) + fill.n_tokens
            for i in idx:
                self.round_cost[parts[i][0]] = (n_tokens, seconds)
            if self.on_decode is not None:
                self.on_decode(n_tokens, seconds, len(idx), self.model.threads_now)
            last = start == len(parts)
            for i, lg in zip(idx, logits):
                out[i] = lg if last or lg is None else lg.copy()
        return out

    def _fill(self, parts: list[tuple]) -> Fill:
        """The throwaway tokens that make a batch of several sequences fewer
        model passes (specd.ubatch); none with one KV buffer for all. No
        padding where the memory cannot drop the tail again (recurrent), nor
        with a sliding window, whose cache may drop cells the sequence still
        needs to make room for tokens beyond its own."""
        if self.model.kv_unified:
            return NO_FILL
        room = self.n_ctx_seq if self.can_rm_partial and not self.model.n_swa else 0
        plan = [Part(seq_id, len(toks), max(min(room - pos - len(toks), self.model.n_batch), 0))
                for seq_id, pos, toks, _ in parts]
        ids = {p.seq_id for p in plan}
        gaps = {s for s in range(min(ids) + 1, max(ids)) if s not in ids and self.model.seq_pos_max(s) < 0}
        return plan_fill(plan, gaps, self.pass_tokens, self.model.n_batch)

    def _kv_rm(self, seq_id: int, p0: int, p1: int) -> None:
        if not self.model.seq_rm(seq_id, p0, p1):
            raise Internal(f"llama_memory_seq_rm({seq_id}, {p0}, {p1}) failed")

    def _kv_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.model.seq_add(seq_id, p0, p1, delta)

    def _kv_cp(self, src: int, dst: int) -> None:
        self.model.seq_rm(dst, -1, -1)
        self.model.seq_cp(src, dst, -1, -1)

    def _kv_save(self, seq_id: int) -> bytes:
        # The whole sequence: restoring it is then correct for every kind of
        # memory (KV cache, recurrent, hybrid, SWA).
        return self.model.state_save(seq_id, partial_only=False)

    def _kv_restore(self, seq_id: int, data: bytes) -> None:
        self.model.state_restore(seq_id, data, partial_only=False)

    def _kv_range(self, seq_id: int) -> tuple[int, int]:
        return self.model.seq_pos_min(seq_id), self.model.seq_pos_max(seq_id)

    # ----------------------------------------------------------- vocabulary
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        return self.model.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens) -> str:
        return self.model.detokenize(self._check_tokens(tokens, allow_empty=True))

    def apply_chat_template(self, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
        """The conversation rendered with the model's own chat template."""
        try:
            return self.model.apply_chat_template(messages, add_generation_prompt)
        except ValueError as exc:
            raise FailedPrecondition(str(exc)) from None

    def pieces(self, tokens) -> list[bytes]:
        return [self.model.piece(int(t)) for t in tokens]

    def check_batch(self, n: int, name: str = "tokens") -> None:
        if n > self.model.n_batch:
            raise InvalidArgument(f"{name} has {n} tokens; at most n_batch = {self.model.n_batch}", field=name)
