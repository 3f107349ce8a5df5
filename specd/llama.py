"""A thin wrapper over llama-cpp-python's low-level (ctypes) API.

One `LlamaModel` owns a llama.cpp model and context. It decodes token batches
for any sequence, exposes the logits as numpy views (no copy), and performs the
memory operations llama.cpp offers (seq_rm, seq_add, seq_cp, sequence state
save/restore). It knows nothing about gRPC or speculative decoding.

Not thread-safe: one caller at a time (the worker engine serialises calls).
"""
from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass

import llama_cpp as L
import numpy as np

from specd.ubatch import NO_FILL, Fill

_backend_lock = threading.Lock()
_backend_ready = False
_log_callback = None  # keep the ctypes callback alive


def _init_backend(verbose: bool) -> None:
    global _backend_ready, _log_callback
    with _backend_lock:
        if _backend_ready:
            return
        if not verbose:
            @L.llama_log_callback
            def _quiet(level, text, user_data):  # noqa: ARG001 - ctypes signature
                return None

            _log_callback = _quiet
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
        L.llama_backend_init()
        _backend_ready = True


class DecodeError(RuntimeError):
    """llama_decode failed (e.g. no KV slot for the batch)."""


@dataclass(frozen=True)
class LlamaConfig:
    model_path: str
    n_ctx_seq: int = 2048
    n_seq: int = 1
    n_threads: int = 1
    # threads for batches of more than one token (prompts, verifications,
    # batched sessions), llama.cpp's n_threads_batch; 0: n_threads
    n_threads_batch: int = 0
    n_batch: int = 512
    n_gpu_layers: int = 0
    # one KV buffer shared by all sequences (llama.cpp's --kv-unified): a
    # batch of any sequences and lengths is one model pass, but a sequence's
    # logits then depend on where its cells sit (greedy output under
    # concurrency is no longer that of the request alone); per-sequence
    # streams keep it, and split batches whose sequences differ in token count
    kv_unified: bool = False
    verbose: bool = False

    @classmethod
    def of_worker(cls, cfg) -> "LlamaConfig":
        """From a specd.config.WorkerConfig."""
        return cls(cfg.model, n_ctx_seq=cfg.n_ctx, n_seq=cfg.n_seq, n_threads=cfg.threads,
                   n_threads_batch=cfg.threads_batch, n_batch=cfg.n_batch, n_gpu_layers=cfg.n_gpu_layers, kv_unified=cfg.kv_unified)


class LlamaModel:
    """A llama.cpp model and context hosting `n_seq` sequences."""

    def __init__(self, config: LlamaConfig):
        _init_backend(config.verbose)
        self.config = config
        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = config.n_gpu_layers
        self._model = L.llama_model_load_from_file(config.model_path.encode(), mparams)
        if not self._model:
            raise ValueError(f"cannot load model {config.model_path!r}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self._vocab))

        cparams = L.llama_context_default_params()
        cparams.n_ctx = config.n_ctx_seq * config.n_seq
        cparams.n_batch = config.n_batch
        cparams.n_ubatch = config.n_batch
        cparams.n_seq_max = config.n_seq
        cparams.n_threads = config.n_threads
        cparams.n_threads_batch = config.n_threads_batch or config.n_threads
        cparams.no_perf = True
        cparams.kv_unified = config.kv_unified
        self._ctx = L.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            L.llama_model_free(self._model)
            raise ValueError(f"cannot create a context for {config.model_path!r}")
        self._mem = L.llama_get_memory(self._ctx)
        # exactly the positions asked for: llama.cpp pads the context, and a
        # unified cache reports all sequences' cells as one sequence's
        self.n_ctx_seq = min(config.n_ctx_seq, int(L.llama_n_ctx_seq(self._ctx)))
        self.n_seq = config.n_seq
        self.n_batch = config.n_batch
        self.kv_unified = config.kv_unified
        # as configured: single tokens, batches of more than one
        self.threads = (int(L.llama_n_threads(self._ctx)), int(L.llama_n_threads_batch(self._ctx)))
        self._threads_now = self.threads[0]
        self.share_cores(False)
        self.is_recurrent = bool(L.llama_model_is_recurrent(self._model)) or bool(
            L.llama_model_is_hybrid(self._model)
        )
        self.can_shift = bool(L.llama_memory_can_shift(self._mem))
        self.n_swa = int(L.llama_model_n_swa(self._model))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self._vocab))
        self.eog_tokens = tuple(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self._vocab, t))
        self._setup_batch(config.n_batch)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}

    @property
    def threads_now(self) -> int:
        """Threads llama.cpp decodes on now, for a batch of any size (share_cores)."""
        return self._threads_now

    def share_cores(self, shared: bool) -> None:
        """Decode on the batch threads, single tokens included, or, while
        another process computes on the cores those borrow (`shared`), on the
        base threads: more threads than cores make llama.cpp's threads spin
        at every barrier waiting for a descheduled one. A single token is
        memory-bound, so an idle core read more weights for it (docs/perf)."""
        n = self.threads[0] if shared else self.threads[1]
        if n != self._threads_now:
            L.llama_set_n_threads(self._ctx, n, n)
            self._threads_now = n

    # ----------------------------------------------------------------- batch
    def _setup_batch(self, n: int) -> None:
        """A llama_batch whose arrays are numpy-owned, so filling is vectorised."""
        self._b_token = np.zeros(n, dtype=np.int32)
        self._b_pos = np.zeros(n, dtype=np.int32)
        self._b_nseq = np.ones(n, dtype=np.int32)
        self._b_seq = np.zeros(n, dtype=np.int32)
        self._b_logits = np.zeros(n, dtype=np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        base = self._b_seq.ctypes.data
        self._b_seq_ptrs = (int32_p * n)(*[ctypes.cast(base + 4 * i, int32_p) for i in range(n)])
        batch = L.llama_batch()
        batch.token = self._b_token.ctypes.data_as(int32_p)
        batch.embd = None
        batch.pos = self._b_pos.ctypes.data_as(int32_p)
        batch.n_seq_id = self._b_nseq.ctypes.data_as(int32_p)
        batch.seq_id = ctypes.cast(self._b_seq_ptrs, ctypes.POINTER(int32_p))
        batch.logits = self._b_logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = batch

    def decode(self, seq_id: int, pos: int, tokens, n_logits: int = 1) -> np.ndarray | None:
        """Decode `tokens` for `seq_id` at positions pos, pos+1, ...

        Returns a read-only numpy view (n_logits, n_vocab) of the logits of the
        last `n_logits` tokens, valid until the next decode, or None when
        n_logits == 0. Batches longer than n_batch are split.
        """
        toks = np.asarray(tokens, dtype=np.int32)
        n = len(toks)
        if n == 0:
            raise ValueError("decode of an empty batch")
        start = 0
        while start < n:
            m = min(self.n_batch, n - start)
            self._b_token[:m] = toks[start : start + m]
            self._b_pos[:m] = np.arange(pos + start, pos + start + m, dtype=np.int32)
            self._b_seq[:m] = seq_id
            self._b_logits[:m] = 0
            # logits for the tokens among the last n_logits of the whole call
            first_out = max(0, n - n_logits - start)
            if first_out < m:
                self._b_logits[first_out:m] = 1
            self._batch.n_tokens = m
            rc = L.llama_decode(self._ctx, self._batch)
            if rc != 0:
                raise DecodeError(f"llama_decode returned {rc} (seq {seq_id}, pos {pos + start}, {m} tokens)")
            start += m
        if n_logits <= 0:
            return None
        n_out = min(n_logits, n - max(0, ((n - 1) // self.n_batch) * self.n_batch))
        ptr = L.llama_get_logits(self._ctx)
        arr = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab))
        arr.flags.writeable = False
        return arr

    def decode_multi(self, parts, fill: Fill = NO_FILL) -> list[np.ndarray | None]:
        """Decode several sequences' tokens in one llama_decode, as llama.cpp's
        server batches its slots. `parts` is a list of (seq_id, pos, tokens,
        n_logits) with distinct seq_ids; with `fill`'s throwaway tokens (no
        logits, removed right after: see specd.ubatch) at most n_batch
        tokens in all.

        Returns, per part, a read-only view (n_logits, n_vocab) of the logits
        of its last n_logits tokens (None when n_logits == 0), valid until
        the next decode.
        """
        # In increasing seq_id order: with a KV stream per sequence, llama.cpp
        # puts into one ubatch only sequences whose ids follow each other in
        # the batch (split_equal), so arrival order would cost one model pass
        # per out-of-order sequence (docs/batching.md).
        order = sorted(range(len(parts)), key=lambda i: parts[i][0])
        filler = next((int(p[2][0]) for p in parts if len(p[2])), 0)  # any token: no logits are read
        rows = sorted([(parts[i][0], i) for i in order] + [(s, -1) for s in fill.gaps])
        n = 0
        for seq_id, i in rows:
            if i >= 0:
                pos, tokens, n_logits = parts[i][1:]
                extra = fill.pad.get(seq_id, 0)
            else:  # an empty id between the parts
                pos, tokens, n_logits, extra = 0, (), 0, fill.gaps[seq_id]
            m = len(tokens) + extra
            if n + m > self.n_batch:
                raise ValueError(f"decode_multi of more than n_batch ({self.n_batch}) tokens")
            self._b_token[n : n + len(tokens)] = tokens
            self._b_token[n + len(tokens) : n + m] = filler
            self._b_pos[n : n + m] = np.arange(pos, pos + m, dtype=np.int32)
            self._b_seq[n : n + m] = seq_id
            self._b_logits[n : n + m] = 0
            if n_logits > 0:
                self._b_logits[n + len(tokens) - n_logits : n + len(tokens)] = 1
            n += m
        if n == 0:
            raise ValueError("decode_multi of an empty batch")
        self._batch.n_tokens = n
        try:
            rc = L.llama_decode(self._ctx, self._batch)
        finally:
            for i in order:
                if fill.pad.get(parts[i][0]):
                    self.seq_rm(parts[i][0], parts[i][1] + len(parts[i][2]), -1)
            for s in fill.gaps:
                self.seq_rm(s, -1, -1)
        if rc != 0:
            raise DecodeError(f"llama_decode returned {rc} ({len(parts)} sequences, {n} tokens)")
        n_out = sum(p[3] for p in parts)
        out: list[np.ndarray | None] = [None] * len(parts)
        if n_out:
            arr = np.ctypeslib.as_array(L.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
            arr.flags.writeable = False
        row = 0
        for i in order:
            n_logits = parts[i][3]
            if n_logits:
                out[i] = arr[row : row + n_logits]
            row += n_logits
        return out

    # ---------------------------------------------------------------- memory
    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(L.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        L.llama_memory_seq_add(self._mem, seq_id, p0, p1, delta)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        L.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_pos_min(self, seq_id: int) -> int:
        return int(L.llama_memory_seq_pos_min(self._mem, seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return int(L.llama_memory_seq_pos_max(self._mem, seq_id))

    def clear(self) -> None:
        L.llama_memory_clear(self._mem, True)

    def state_save(self, seq_id: int, partial_only: bool) -> bytes:
        """llama_state_seq_get_data_ext; PARTIAL_ONLY keeps only the recurrent /
        SWA part (what llama.cpp's server checkpoints)."""
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial_only else 0
        size = L.llama_state_seq_get_size_ext(self._ctx, seq_id, flags)
        buf = (ctypes.c_uint8 * size)()
        written = L.llama_state_seq_get_data_ext(self._ctx, buf, size, seq_id, flags)
        if written == 0 and size != 0:
            raise RuntimeError(f"saving the state of sequence {seq_id} failed")
        return bytes(memoryview(buf)[:written])

    def state_restore(self, seq_id: int, data: bytes, partial_only: bool) -> None:
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial_only else 0
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        read = L.llama_state_seq_set_data_ext(self._ctx, buf, len(data), seq_id, flags)
        if read == 0 and len(data) != 0:
            raise RuntimeError(f"restoring the state of sequence {seq_id} failed")

    # ------------------------------------------------------------ vocabulary
    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, raw, len(raw), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token's text (special tokens rendered), cached."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        n = L.llama_token_to_piece(self._vocab, token, self._piece_buf, len(self._piece_buf), 0, True)
        if n < 0:
            big = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, big, len(big), 0, True)
            out = big.raw[:n]
        else:
            out = self._piece_buf.raw[:n]
        self._pieces[token] = out
        return out

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self._vocab, token))

    def vocab_fingerprint(self) -> str:
        """SHA-256 over each token's text, score and attributes."""
        h = hashlib.sha256()
        for t in range(self.n_vocab):
            h.update(L.llama_vocab_get_text(self._vocab, t) or b"")
            h.update(np.float32(L.llama_vocab_get_score(self._vocab, t)).tobytes())
            h.update(int(L.llama_vocab_get_attr(self._vocab, t)).to_bytes(4, "little", signed=True))
        return h.hexdigest()

    def meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = L.llama_model_meta_val_str(self._model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self._model, buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[tuple[str, str]], add_assistant: bool = True) -> str:
        """Render messages with the model's own chat template."""
        tmpl = L.llama_model_chat_template(self._model, None)
        if not tmpl:
            # llama_chat_apply_template falls back to ChatML without one: a
            # model must not be prompted in a format it may never have seen
            raise ValueError("the model has no chat template (tokenizer.chat_template in its GGUF)")
        arr = (L.llama_chat_message * len(messages))()
        keep = []
        for i, (role, content) in enumerate(messages):
            r, c = role.encode(), content.encode()
            keep += [r, c]
            arr[i].role, arr[i].content = r, c
        cap = sum(len(c) for c in keep) * 2 + 512
        buf = ctypes.create_string_buffer(cap)
        n = L.llama_chat_apply_template(tmpl, arr, len(messages), add_assistant, buf, cap)
        if n > cap:
            buf = ctypes.create_string_buffer(n)
            n = L.llama_chat_apply_template(tmpl, arr, len(messages), add_assistant, buf, n)
        if n < 0:
            raise ValueError("the model's chat template is not one llama.cpp's llama_chat_apply_template knows")
        return buf.raw[:n].decode("utf-8", errors="replace")

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            L.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass
