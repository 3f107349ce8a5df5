"""The HTTP API's server: uvicorn on the router's event loop, beside its gRPC
server, with the router's TLS and its drain on SIGTERM (router/http.py is the
API it serves)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from dataclasses import dataclass

import uvicorn

from specd.router.http import HttpApi
from specd.security import ConfigError

log = logging.getLogger("specd.router.http")


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # the router owns SIGTERM and SIGINT (specd.server.Lifecycle) and
        # stops this server itself; uvicorn would take them over
        yield


@dataclass
class HttpServer:
    server: _Uvicorn
    task: asyncio.Task
    port: int

    async def stop(self) -> None:
        """Refuse new connections, give open ones the grace, then return."""
        self.server.should_exit = True
        await self.task


def _tls_options(cfg) -> dict:
    """The router's --tls-* flags serve HTTPS too (client certificates
    required with --tls-ca, as on gRPC)."""
    if not cfg.tls_cert:
        return {}
    options = {"ssl_certfile": cfg.tls_cert, "ssl_keyfile": cfg.tls_key}
    if cfg.tls_ca:
        options |= {"ssl_ca_certs": cfg.tls_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


async def start_http(cfg, servicer, api_keys: list[bytes] | None, stopping: asyncio.Event) -> HttpServer | None:
    """Listen on cfg.http_port (None when 0) and serve until stopped: on
    `stopping`, /health answers 503 at once and, after cfg.drain_seconds, new
    connections are refused and open ones get cfg.grace_seconds."""
    if not cfg.http_port:
        return None
    api = HttpApi(servicer, api_keys, cfg.max_message_bytes, stopping)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    try:  # bound here, so that a port in use stops the router saying which
        sock = socket.create_server((cfg.host, cfg.http_port), family=family, backlog=2048)
    except OSError as exc:
        raise ConfigError(f"specd router: cannot listen on {cfg.host}:{cfg.http_port} (--http-port; 0 turns the "
                          f"HTTP API off): {exc.strerror or exc}") from None
    # Accepted connections inherit it (Linux): without it, a response's
    # headers and body go out as two segments, the second held back until
    # the client's delayed ACK (40 ms) on every request of a kept-alive
    # connection
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    config = uvicorn.Config(api.app(), lifespan="off", log_config=None, access_log=False,
                            timeout_graceful_shutdown=cfg.grace_seconds, **_tls_options(cfg))
    config.load()  # a bad certificate fails here, not in the task
    server = _Uvicorn(config)
    loop = asyncio.get_running_loop()
    task = loop.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("the HTTP server stopped while starting")
        await asyncio.sleep(0.01)

    async def drain() -> None:
        await stopping.wait()
        await asyncio.sleep(cfg.drain_seconds)
        server.should_exit = True

    drainer = loop.create_task(drain())
    task.add_done_callback(lambda _: drainer.cancel())
    port = sock.getsockname()[1]
    log.info("OpenAI-compatible HTTP API on %s:%d%s", cfg.host, port, " (TLS)" if cfg.tls_cert else "")
    return HttpServer(server, task, port)
