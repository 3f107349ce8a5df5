"""The router process: connects to its workers, then serves specd.v1.Router."""
from __future__ import annotations

import asyncio
import logging
import uuid

from specd.router.clients import GrpcWorker, LocalWorker
from specd.router.engine import Router
from specd.router.params import RouterSettings
from specd.router.http_server import start_http
from specd.router.limits import Limits
from specd.router.service import RouterServicer
from specd.config import RouterConfig
from specd.errors import FailedPrecondition, SpecdError
from specd.metrics import RouterPrometheus
from specd.security import (ApiKeyInterceptor, ConfigError, channel_credentials, load_api_keys,
                             server_credentials_of, worker_api_key)
from specd.server import run_until_stopped, start_metrics, start_server
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc

log = logging.getLogger("specd.router")


def settings_of(cfg: RouterConfig) -> RouterSettings:
    return RouterSettings(n_max=cfg.n_max, n_min=cfg.n_min, p_min=cfg.p_min, checkpoint_mode=cfg.checkpoint_mode,
                          check_alignment=cfg.check_alignment, max_queue=cfg.max_queue, overlap=cfg.overlap,
                          adaptive=cfg.adaptive, prompt_cache=cfg.prompt_cache,
                          draft_wait=cfg.draft_wait, target_wait=cfg.target_wait, solo_tokens=cfg.solo_tokens,
                          stream_tokens=cfg.stream_tokens)


# An n-gram drafter in the router offers as many sequences and as long a
# context as llama.cpp could hold: the router fits both to its targets'.
IN_PROCESS_SEQS = 256
IN_PROCESS_CTX = 1 << 24


def in_process_ngram(cfg: RouterConfig) -> LocalWorker:
    """The model-free drafter of --ngram, called in this process: an n-gram
    proposal takes microseconds, a round trip to a draft worker about a
    millisecond, and a step without a match pays it with nothing to show."""
    from specd.draft_worker.engine import NgramEngine  # numpy-heavy: only when asked for

    try:
        engine = NgramEngine(cfg.ngram, IN_PROCESS_SEQS, IN_PROCESS_CTX, cfg.ngram_cache or None)
    except (ValueError, OSError) as exc:
        raise ConfigError(f"specd router: --ngram {cfg.ngram}: {exc}") from None
    return LocalWorker(engine, "draft")


async def connect(router: Router, stopping: asyncio.Event) -> None:
    """Retry until the target (and the draft, when configured) answer."""
    delay = 0.2
    while not stopping.is_set():
        try:
            await router.start()
            return
        except FailedPrecondition:
            raise
        except SpecdError as exc:
            log.warning("waiting for workers: %s", exc)
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 5.0)


async def follow_readiness(router: Router, life, interval: float = 0.5) -> None:
    """The router's health (readiness) says SERVING while a target takes new
    sessions (router.health follows the workers' own), until it stops."""
    serving = None
    while not life.stopping.is_set():
        now = router.can_serve
        if now != serving:
            if serving is not None:
                log.warning("router %s: %s", "serving again" if now else "NOT_SERVING",
                            "a target takes sessions" if now else "no target takes new sessions")
            serving = now
            await life.set_serving(now)
        await asyncio.sleep(interval)
    await life.set_serving(False)  # Lifecycle.stop said it first; a change read before must not undo it


async def serve(cfg: RouterConfig) -> None:
    if not cfg.target:
        raise SystemExit("specd router: --target HOST:PORT is required")
    # every file (certificates, keys, API keys) is read here, before anything starts
    worker_creds = channel_credentials(cfg.worker_tls_cert, cfg.worker_tls_key, cfg.worker_tls_ca)
    if cfg.worker_tls_server_name and worker_creds is None:
        raise ConfigError("specd router: --worker-tls-server-name needs --worker-tls-ca (or a client certificate)")
    worker_key = worker_api_key(cfg)
    server_creds = server_credentials_of(cfg)
    api_keys = load_api_keys(cfg.api_key_file) if cfg.api_key_file else None
    interceptors = [ApiKeyInterceptor(api_keys)] if api_keys else None
    if cfg.max_message_bytes <= 0:
        raise ConfigError(f"specd router: --max-message-bytes must be > 0, got {cfg.max_message_bytes}")
    try:
        limits = Limits.of(cfg)
    except ValueError as exc:
        raise ConfigError(f"specd router: {exc}") from None

    router_id = uuid.uuid4().hex  # leases the workers to this router (specd.ownership)

    def worker(address: str, name: str) -> GrpcWorker:
        return GrpcWorker(address, name, timeout=cfg.worker_timeout, credentials=worker_creds,
                          server_name=cfg.worker_tls_server_name, api_key=worker_key, owner=router_id)

    addresses = [a.strip() for a in cfg.target.split(",") if a.strip()]
    targets = [worker(a, "target" if len(addresses) == 1 else f"target {i}") for i, a in enumerate(addresses)]
    if cfg.draft and cfg.ngram:
        raise ConfigError("specd router: --draft and --ngram exclude each other (one drafter)")
    draft = worker(cfg.draft, "draft") if cfg.draft else (in_process_ngram(cfg) if cfg.ngram else None)
    router = Router(targets, draft, settings_of(cfg))
    metrics = RouterPrometheus()
    router.step_observers.append(metrics.observe_step)
    router.divergence_observers.append(metrics.observe_divergence)
    servicer = RouterServicer(router, metrics, limits)

    def register(server):
        rpb_grpc.add_RouterServicer_to_server(servicer, server)
        return [rpb.DESCRIPTOR.services_by_name["Router"].full_name]

    life = await start_server(cfg.host, cfg.port, register, cfg.port_file, interceptors=interceptors,
                              credentials=server_creds, max_receive_bytes=cfg.max_message_bytes)
    start_metrics(cfg.metrics_port, metrics.registry, cfg.host)
    # the OpenAI-compatible API over the same servicer; its /health says 503 until ready
    http = await start_http(cfg, servicer, api_keys, life.stopping)
    life.install_signal_handlers()
    readiness: asyncio.Future | None = None  # follow_readiness, once connected
    try:
        await connect(router, life.stopping)
    except FailedPrecondition as exc:
        log.error("refusing to start: %s", exc)
        await life.stop(0)
        raise SystemExit(f"specd router: {exc}") from None
    if not life.stopping.is_set():
        metrics.draft_up.set_function(lambda: 1 if router.draft_up else 0)
        metrics.sessions_running.set_function(lambda: router.pool.n_running)
        metrics.sessions_queued.set_function(lambda: len(router.pool.waiters))
        metrics.prompt_cache_tokens.set_function(lambda: sum(len(t) for t in router.pool.cached.values()))
        metrics.targets_up.set_function(lambda: sum(t.takes_sessions for t in router.targets))
        servicer.ready = True
        readiness = asyncio.ensure_future(follow_readiness(router, life))
        log.info("router %s ready: target %s%s%s%s", router_id, cfg.target,
                 f", draft {cfg.draft}" if cfg.draft else (f", n-gram drafter {cfg.ngram} in process" if cfg.ngram
                                                           else " (no draft)"),
                 ", workers over TLS" if worker_creds is not None else "",
                 ", API keys required" if interceptors else "")

    async def close():
        if readiness is not None:
            readiness.cancel()
        await router.close()
        if http is not None:
            await http.stop()  # before the workers: in-flight HTTP streams still use them
        for target in targets:
            await target.close()
        if draft is not None:
            await draft.close()

    await run_until_stopped(life, cfg.grace_seconds, close, cfg.drain_seconds)
