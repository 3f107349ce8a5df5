"""The worker engine: sequences, KV operations, checkpoints, validation.

`WorkerEngine` keeps, per sequence, the (position, token) pairs the worker
holds (specd.tokens.SeqTokens) and validates every request before touching
anything, so a bad request changes nothing. Subclasses supply the storage:
`ModelEngine` a llama.cpp context, the n-gram draft engine only the history.

Engines are synchronous and not thread-safe; the gRPC layer runs them on one
thread.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

import numpy as np

from specd.errors import (FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange, ResourceExhausted,
                          SpecdError)
from specd.sampling import TokenDist
from specd.tokens import SeqTokens, range_mask


log = logging.getLogger("specd.worker")

# llama.cpp's C API takes positions, deltas and token ids as int32
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1

# An operation written as a generator: it yields the decodes it needs as
# (seq_id, pos, tokens, n_logits), receives their logits, returns its result.
Steps = Generator[tuple, Any, Any]

# The most drafts one Propose returns (ProposeRequest.n_max), and so the most
# one step of the router verifies.
MAX_DRAFT = 64


@dataclass(frozen=True)
class Capabilities:
    """What an engine serves beyond the KV operations every engine has. The
    gRPC layer reads it to answer UNIMPLEMENTED for the rest; each flag names
    methods the engine then has."""

    verifies: bool = False  # verify, verify_steps (TargetWorker.Verify)
    proposes: bool = False  # propose, propose_steps (DraftWorker.Propose)
    vocabulary: bool = False  # tokenize, detokenize (Worker.Tokenize, Detokenize)
    chat_template: bool = False  # apply_chat_template (Worker.ApplyChatTemplate)


@dataclass
class ModelInfo:
    kind: str
    description: str
    architecture: str
    n_vocab: int
    vocab_fingerprint: str
    n_ctx_seq: int
    n_seq: int
    can_rm_partial: bool
    can_shift: bool
    n_swa: int
    eog_tokens: tuple[int, ...]
    add_bos: bool
    n_threads: int
    model_path: str
    # (n_tokens, seconds) of one llama_decode, measured at load
    decode_costs: tuple[tuple[int, float], ...] = ()
    n_threads_batch: int = 0  # 0: n_threads
    # decode_costs on n_threads alone (the draft computing meanwhile); () when the same
    decode_costs_shared: tuple[tuple[int, float], ...] = ()
    # as decode_costs with the last token's logits only (a prompt, a catch-up)
    prompt_costs: tuple[tuple[int, float], ...] = ()
    # the worker process's random id (ModelInfo.instance_id); set by its server
    instance_id: str = ""
    # a model-free drafter's: drafts need a repeat of the history's last this many tokens (Proposer)
    match_needs_repeat: int = 0


@dataclass
class SeqState:
    seq_id: int
    pos_min: int
    pos_max: int
    n_tokens: int
    token_hash: str


@dataclass
class CheckpointInfo:
    handle: int
    seq_id: int
    pos_min: int
    pos_max: int
    n_tokens: int
    n_bytes: int


@dataclass
class VerifyResult:
    """What a verification returns (VerifyResponse)."""

    tokens: list[int]  # accepted drafts + the target's next token
    pieces: list[bytes]
    state: SeqState
    compute_seconds: float = 0.0
    batch_tokens: int = 0  # of the llama_decode shared with other sequences
    batch_seconds: float = 0.0
    n_more: int = 0  # of tokens, at their end, generated after the target's next token (VerifyRequest.n_more)


@dataclass
class VerifyPartial:
    """Tokens a verification going on alone generated so far: its final
    tokens[offset : offset + len(tokens)] (VerifyRequest.stream_every)."""

    offset: int
    tokens: list[int]
    pieces: list[bytes]


@dataclass
class ProposeResult:
    """What a proposal returns (ProposeResponse)."""

    tokens: list[int]
    state: SeqState
    compute_seconds: float = 0.0
    batch_tokens: int = 0  # of the last llama_decode, shared with other sequences
    batch_seconds: float = 0.0
    q: list[TokenDist] = field(default_factory=list)  # when sampled: the distribution of each token


@dataclass
class _Checkpoint:
    info: CheckpointInfo
    tokens: SeqTokens
    data: bytes = b""


@dataclass
class EngineStats:
    """Counters a metrics exporter reads."""

    checkpoint_bytes: int = 0


class WorkerEngine:
    """Bookkeeping and validation common to every worker."""

    kind = "base"
    capabilities = Capabilities()

    def __init__(self, n_seq: int, n_ctx_seq: int, n_vocab: int, max_checkpoint_bytes: int = 1 << 30):
        self.n_seq = n_seq
        self.n_ctx_seq = n_ctx_seq
        self.n_vocab = n_vocab
        self.max_checkpoint_bytes = max_checkpoint_bytes
        self.seqs = [SeqTokens() for _ in range(n_seq)]
        self.checkpoints: dict[int, _Checkpoint] = {}
        self._handles = itertools.count(1)
        self.stats = EngineStats()
        # called with (tokens, seconds, sequences, threads) after every llama_decode
        self.on_decode: Callable[[int, float, int, int], None] | None = None
        # per sequence: (tokens, seconds) of the last llama_decode it took part in
        self.round_cost: dict[int, tuple[int, float]] = {}

    # ------------------------------------------------------------ storage hooks
    can_rm_partial = True
    can_shift = True

    def _kv_decode(self, seq_id: int, pos: int, tokens: np.ndarray) -> None:
        pass

    def _kv_rm(self, seq_id: int, p0: int, p1: int) -> None:
        pass

    def _kv_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        pass

    def _kv_cp(self, src: int, dst: int) -> None:
        pass

    def _kv_save(self, seq_id: int) -> bytes:
        return b""

    def _kv_restore(self, seq_id: int, data: bytes) -> None:
        pass

    def _kv_range(self, seq_id: int) -> tuple[int, int]:
        s = self.seqs[seq_id]
        return s.pos_min, s.pos_max

    def info(self) -> ModelInfo:
        raise NotImplementedError

    def share_cores(self, busy_seconds: float) -> None:
        """For about how long the next batches run while the other worker
        computes on the same machine (0: not at all; math.inf: unknown, all
        of them; see LlamaModel.share_cores); nothing to do without a model."""

    # -------------------------------------------------------------- validation
    def _check_seq(self, seq_id: int, name: str = "seq_id") -> SeqTokens:
        if not 0 <= seq_id < self.n_seq:
            raise InvalidArgument(f"{name} must be in [0, {self.n_seq}), got {seq_id}", field=name)
        return self.seqs[seq_id]

    def _check_tokens(self, tokens, name: str = "tokens", allow_empty: bool = False) -> np.ndarray:
        toks = np.asarray(tokens, dtype=np.int64)
        if len(toks) == 0 and not allow_empty:
            raise InvalidArgument(f"{name} must not be empty", field=name)
        if len(toks):
            # no vocabulary (a model-free drafter without --n-vocab): token ids
            # are still never negative nor past what llama.cpp's int32 holds
            hi = self.n_vocab if self.n_vocab > 0 else INT32_MAX + 1
            bad = np.nonzero((toks < 0) | (toks >= hi))[0]
            if len(bad):
                i = int(bad[0])
                bound = f"n_vocab = {self.n_vocab}" if self.n_vocab > 0 else str(hi)
                raise InvalidArgument(f"{name}[{i}] = {int(toks[i])} is not in [0, {bound})", field=f"{name}[{i}]")
        return toks.astype(np.int32)

    def _check_append(self, seq: SeqTokens, pos: int, n: int, name: str = "pos") -> None:
        # An empty sequence takes position 0 only (llama.cpp accepts any): a
        # caller that believes the worker holds a prefix it lost in a restart
        # must be told, not have its tokens decoded without their context.
        expected = seq.pos_max + 1 if len(seq) else 0
        self._check_int32(**{name: pos})
        if pos < 0:
            raise InvalidArgument(f"{name} must be >= 0, got {pos}", field=name)
        if pos != expected:
            held = f"holds positions [{seq.pos_min}, {seq.pos_max}]" if len(seq) else "is empty"
            raise FailedPrecondition(f"{name} = {pos} but the sequence {held}; the next position is {expected}")
        if pos + n > self.n_ctx_seq:
            raise OutOfRange(
                f"positions [{pos}, {pos + n}) exceed the context of a sequence (n_ctx_seq = {self.n_ctx_seq})"
            )

    @staticmethod
    def _check_int32(**values: int) -> None:
        """Values llama.cpp's C API takes as int32: outside that range ctypes
        would wrap them silently (p0 = 2**31 becomes "from 0")."""
        for name, v in values.items():
            if not INT32_MIN <= v <= INT32_MAX:
                raise InvalidArgument(f"{name} = {v} is outside the int32 range [{INT32_MIN}, {INT32_MAX}]", field=name)

    @classmethod
    def _check_range(cls, p0: int, p1: int) -> None:
        cls._check_int32(p0=p0, p1=p1)
        if p0 >= 0 and p1 >= 0 and p1 < p0:
            raise InvalidArgument(f"p1 ({p1}) must be >= p0 ({p0}) or negative")

    # -------------------------------------------------------------- operations
    def state(self, seq_id: int) -> SeqState:
        seq = self._check_seq(seq_id)
        pos_min, pos_max = self._kv_range(seq_id)
        return SeqState(seq_id, pos_min, pos_max, len(seq), seq.hash())

    def decode(self, seq_id: int, pos: int, tokens) -> SeqState:
        return self.run_one(self.decode_steps(seq_id, pos, tokens))

    def decode_steps(self, seq_id: int, pos: int, tokens) -> Steps:
        seq = self._check_seq(seq_id)
        toks = self._check_tokens(tokens)
        self._check_append(seq, pos, len(toks))
        yield from self._decode_g(seq_id, pos, toks, 0)
        return self.state(seq_id)

    def _decode_g(self, seq_id: int, pos: int, toks: np.ndarray, n_logits: int) -> Steps:
        """Decode validated tokens and track them; a generator so that a
        model engine can merge it with other sequences' decodes (it yields
        (seq_id, pos, tokens, n_logits) and receives the logits)."""
        self._kv_decode(seq_id, pos, toks)
        self.seqs[seq_id].append(pos, toks)
        return None
        yield  # noqa: unreachable - makes this a generator

    # --------------------------------------------------------------- batching
    def run_one(self, steps: Steps):
        """Run one operation's steps; its errors propagate."""
        out = self.run_batch([steps])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def run_batch(self, ops: list[Steps]) -> list:
        """Run operations on distinct sequences together: every round, the
        decodes all of them ask for go to the model as one batch
        (continuous batching). Returns each operation's result, or the
        SpecdError it raised; one operation's error does not touch the others."""
        results: list = [None] * len(ops)
        waiting: dict[int, tuple] = {}

        def advance(i: int, value=None, exc: BaseException | None = None) -> None:
            try:
                req = ops[i].throw(exc) if exc is not None else ops[i].send(value)
            except StopIteration as stop:
                results[i] = stop.value
            except SpecdError as err:
                results[i] = err
            except Exception as err:  # a bug: this operation fails, the others and the worker go on
                log.exception("operation failed")
                results[i] = Internal(f"{type(err).__name__}: {err}")
            else:
                waiting[i] = req

        for i in range(len(ops)):
            advance(i)
        while waiting:
            idx = list(waiting)
            parts = [waiting.pop(i) for i in idx]
            try:
                logits = self._decode_parts(parts)
            except SpecdError as err:
                for i in idx:
                    advance(i, exc=err)
                continue
            for i, lg in zip(idx, logits):
                advance(i, lg)
        return results

    def _decode_parts(self, parts: list[tuple]) -> list:
        raise Internal("this engine has no model to decode with")

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> SeqState:
        seq = self._check_seq(seq_id)
        self._check_range(p0, p1)
        whole = (p0 <= 0 or p0 <= seq.pos_min) and (p1 < 0 or p1 > seq.pos_max)
        if not whole and not self.can_rm_partial and len(seq):
            raise FailedPrecondition("this model cannot remove part of a sequence; use checkpoints")
        self._kv_rm(seq_id, p0, p1)
        seq.rm(p0, p1)
        return self.state(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> SeqState:
        seq = self._check_seq(seq_id)
        self._check_range(p0, p1)
        self._check_int32(delta=delta)
        if not self.can_shift:
            raise FailedPrecondition("this model cannot shift positions (llama_memory_can_shift is false)")
        moved = seq.shifted_positions(p0, p1, delta)  # int64: an int32 delta cannot wrap
        if len(moved):
            if moved.min() < 0:
                raise InvalidArgument(f"delta = {delta} would move position {int(moved.min()) - delta} below 0")
            if moved.max() >= self.n_ctx_seq:
                raise InvalidArgument(f"delta = {delta} would move position {int(moved.max()) - delta} past "
                                      f"n_ctx_seq = {self.n_ctx_seq}")
            staying = seq.pos[~range_mask(seq.pos, p0, p1)]
            clash = np.intersect1d(staying, moved)
            if len(clash):
                raise FailedPrecondition(f"seq_add would put two tokens at position {int(clash[0])}")
        self._kv_add(seq_id, p0, p1, delta)
        seq.add(p0, p1, delta)
        return self.state(seq_id)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> SeqState:
        self._check_seq(src, "seq_id_src")
        self._check_seq(dst, "seq_id_dst")
        if src == dst:
            raise InvalidArgument("seq_id_src and seq_id_dst must differ")
        self._check_int32(p0=p0, p1=p1)
        # Sequences live in separate KV streams; llama.cpp copies across
        # streams only whole sequences (and aborts the process otherwise).
        if p0 > 0 or p1 >= 0:
            raise InvalidArgument("seq_cp copies whole sequences only: p0 and p1 must be negative")
        self._kv_cp(src, dst)
        self.seqs[dst] = self.seqs[src].copy()
        return self.state(dst)

    def clear(self, seq_id: int) -> None:
        ids = range(self.n_seq) if seq_id == -1 else [seq_id]
        if seq_id != -1:
            self._check_seq(seq_id)
        for s in ids:
            self._kv_rm(s, -1, -1)
            self.seqs[s].clear()
        for h in [h for h, c in self.checkpoints.items() if c.info.seq_id in ids]:
            self.checkpoint_drop(h)

    # ------------------------------------------------------------- checkpoints
    def checkpoint_save(self, seq_id: int) -> CheckpointInfo:
        seq = self._check_seq(seq_id)
        data = self._kv_save(seq_id)
        if self.stats.checkpoint_bytes + len(data) > self.max_checkpoint_bytes:
            raise ResourceExhausted(
                f"checkpoint of {len(data)} bytes exceeds the worker's checkpoint budget "
                f"({self.max_checkpoint_bytes} bytes, {self.stats.checkpoint_bytes} held)"
            )
        info = CheckpointInfo(next(self._handles), seq_id, seq.pos_min, seq.pos_max, len(seq), len(data))
        self.checkpoints[info.handle] = _Checkpoint(info, seq.copy(), data)
        self.stats.checkpoint_bytes += len(data)
        return info

    def _get_checkpoint(self, handle: int) -> _Checkpoint:
        ck = self.checkpoints.get(handle)
        if ck is None:
            raise NotFound(f"no checkpoint with handle {handle}")
        return ck

    def checkpoint_restore(self, handle: int, drop: bool = False) -> SeqState:
        ck = self._get_checkpoint(handle)
        seq_id = ck.info.seq_id
        self._kv_rm(seq_id, -1, -1)
        self.seqs[seq_id].clear()  # the bookkeeping follows the KV at every point, a failed restore included
        if len(ck.tokens):
            try:
                self._kv_restore(seq_id, ck.data)
            except Exception as exc:
                # llama.cpp empties a sequence it failed to restore; make sure, and say so
                self._kv_rm(seq_id, -1, -1)
                raise Internal(f"restoring checkpoint {handle} failed ({type(exc).__name__}: {exc}); "
                               f"seq {seq_id} is now empty and the checkpoint is kept") from exc
        self.seqs[seq_id] = ck.tokens.copy()
        if drop:
            self.checkpoint_drop(handle)
        return self.state(seq_id)

    def checkpoint_drop(self, handle: int) -> None:
        ck = self.checkpoints.pop(handle, None)
        if ck is None:
            raise NotFound(f"no checkpoint with handle {handle}")
        self.stats.checkpoint_bytes -= ck.info.n_bytes

    def sequences_in_use(self) -> int:
        return sum(1 for s in self.seqs if len(s))

    def cells_used(self) -> int:
        return sum(len(s) for s in self.seqs)
