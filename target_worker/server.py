"""The target worker process: a TargetEngine behind gRPC."""
from __future__ import annotations

from specd.config import WorkerConfig
from specd.worker_service import serve_worker


def make_engine(cfg: WorkerConfig):
    from specd.llama import LlamaConfig
    from specd.target_worker.engine import TargetEngine

    engine = TargetEngine(LlamaConfig.of_worker(cfg), max_checkpoint_bytes=cfg.max_checkpoint_bytes)
    if cfg.calibrate:
        engine.calibrate()
    return engine


async def serve(cfg: WorkerConfig) -> None:
    await serve_worker(cfg, lambda: make_engine(cfg))
