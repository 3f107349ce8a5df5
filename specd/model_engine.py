"""`ModelEngine`: a WorkerEngine whose sequences live in a llama.cpp context."""
from __future__ import annotations

import logging
import time

import numpy as np

from specd.engine import ModelInfo, Steps, WorkerEngine
from specd.errors import Internal, InvalidArgument, ResourceExhausted
from specd.llama import DecodeError, LlamaConfig, LlamaModel


log = logging.getLogger("specd.engine")


class ModelEngine(WorkerEngine):
    kind = "model"
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

    def share_cores(self, shared: bool) -> None:
        self.model.share_cores(shared)

    def calibrate(self, max_tokens: int = 64, repeats: int = 5) -> None:
        """Time llama_decode for batches of 1, 2, 4 .. max_tokens tokens, each
        token with its logits (the router's prior for adaptive speculation:
        the shape of its steps, where every drafted and verified token needs
        its logits), on the batch threads and,
        when those are more, on the base threads alone (`decode_costs_shared`);
        and, for a draft (`time_prompts`), with the last token's logits only
        (`prompt_costs`: what catching up on missed tokens pays). Leaves the
        sequences empty."""
        self.decode_costs = self._time_decodes(max_tokens, repeats)
        log.info("decode cost (tokens: ms): %s", ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.decode_costs))
        if self.time_prompts:
            self.prompt_costs = self._time_decodes(max_tokens, repeats, all_logits=False)
            log.info("prompt cost, last token's logits (tokens: ms): %s",
                     ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.prompt_costs))
        if self.model.threads[1] != self.model.threads[0]:
            self.share_cores(True)
            try:
                self.decode_costs_shared = self._time_decodes(max_tokens, repeats)
            finally:
                self.share_cores(False)
            log.info("decode cost on %d threads (tokens: ms): %s", self.model.threads[0],
                     ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in self.decode_costs_shared))

    def _time_decodes(self, max_tokens: int, repeats: int, all_logits: bool = True) -> tuple[tuple[int, float], ...]:
        """Each size keeps its fastest of `repeats` runs, taken in interleaved
        sweeps so that a passing disturbance (the other worker starting on
        the same cores) cannot spoil every run of one size, and a bigger
        batch is never reported cheaper than a smaller one.

        The two shapes differ: with the last token's logits only the Q4_1
        draft takes 14.1 ms for 2 tokens where a drafting round of 2 sessions
        (2 logits) takes 19.8 (4: 26.2 vs 31.6 ms; an output row costs it
        2.5-5 ms). Priced with the first, drafting under load looked cheaper
        than it is; with the second, a catch-up on a 32-token prompt would
        be priced with 31 rows of logits it does not compute. The F32
        target's rows cost little (8 tokens: 46.8 vs 49.1 ms)."""
        limit = min(max_tokens, self.model.n_batch, self.n_ctx_seq)
        sizes = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
        toks = np.full(limit, self.model.eog_tokens[0] if self.model.eog_tokens else 0, dtype=np.int32)
        best = dict.fromkeys(sizes, float("inf"))
        for _ in range(repeats):
            for n in sizes:
                t0 = time.perf_counter()
                self.model.decode(0, 0, toks[:n], n if all_logits else 1)
                best[n] = min(best[n], time.perf_counter() - t0)
                self.model.seq_rm(0, -1, -1)
        costs = []
        for n in sizes:
            costs.append((n, max(best[n], costs[-1][1] if costs else 0.0)))
        return tuple(costs)

    # ------------------------------------------------------------- storage
    def _decode_g(self, seq_id: int, pos: int, toks: np.ndarray, n_logits: int) -> Steps:
        logits = yield (seq_id, pos, toks, n_logits)
        self.seqs[seq_id].append(pos, toks)
        return logits

    def _decode_parts(self, parts: list[tuple]) -> list:
        """Decode the parts in as few llama_decode calls as n_batch allows.
        Logits of all but the last call are copied (the next call reuses the
        buffer). A failed call leaves none of its parts behind."""
        groups: list[list[int]] = []
        size = 0
        for i, p in enumerate(parts):
            n = len(p[2])
            if groups and size + n <= self.model.n_batch:
                groups[-1].append(i)
                size += n
            else:
                groups.append([i])
                size = n
        out: list = [None] * len(parts)
        for g, idx in enumerate(groups):
            t0 = time.perf_counter()
            try:
                if len(idx) == 1:  # may exceed n_batch: model.decode splits it
                    seq_id, pos, toks, n_logits = parts[idx[0]]
                    logits = [self.model.decode(seq_id, pos, toks, n_logits)]
                else:
                    logits = self.model.decode_multi([parts[i] for i in idx])
            except DecodeError as exc:
                for i in range(len(parts)):  # a partially applied batch must not stay behind
                    seq_id, pos = parts[i][0], parts[i][1]
                    self.model.seq_rm(seq_id, pos, -1)
                raise ResourceExhausted(f"decode failed: {exc}") from exc
            n_tokens, seconds = sum(len(parts[i][2]) for i in idx), time.perf_counter() - t0
            for i in idx:
                self.round_cost[parts[i][0]] = (n_tokens, seconds)
            if self.on_decode is not None:
                self.on_decode(n_tokens, seconds, len(idx), self.model.threads_for(n_tokens))
            last = g == len(groups) - 1
            for i, lg in zip(idx, logits):
                out[i] = lg if last or lg is None else lg.copy()
        return out

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

    def pieces(self, tokens) -> list[bytes]:
        return [self.model.piece(int(t)) for t in tokens]

    def check_batch(self, n: int, name: str = "tokens") -> None:
        if n > self.model.n_batch:
            raise InvalidArgument(f"{name} has {n} tokens; at most n_batch = {self.model.n_batch}")
