"""The draft worker process: a draft model or an n-gram drafter behind gRPC."""
from __future__ import annotations

from specd.config import WorkerConfig
from specd.worker_service import serve_worker


def make_engine(cfg: WorkerConfig):
    if cfg.ngram:
        from specd.draft_worker.engine import NgramEngine

        return NgramEngine(cfg.ngram, cfg.n_seq, cfg.n_ctx, cfg.ngram_cache or None, n_vocab=cfg.n_vocab)
    from specd.draft_worker.engine import DraftModelEngine
    from specd.llama import LlamaConfig

    engine = DraftModelEngine(LlamaConfig.of_worker(cfg), max_checkpoint_bytes=cfg.max_checkpoint_bytes)
    if cfg.calibrate:
        engine.calibrate()
    return engine


async def serve(cfg: WorkerConfig) -> None:
    await serve_worker(cfg, lambda: make_engine(cfg))
