"""gRPC server lifecycle shared by the router and both workers (grpc.aio).

Listen first and say NOT_SERVING on the standard health service while the
model loads; SERVING once ready; on SIGTERM say NOT_SERVING again, give
in-flight calls `grace_seconds`, then stop. Server reflection is on.

The health service name LIVENESS says SERVING from the start to the end,
through loading and draining: it answers "is the process alive", for liveness
probes, which must not kill a pod that is only loading or draining.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger("specd.server")

MAX_MESSAGE = 64 << 20

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LIVENESS = "liveness"
# Ping idle connections so that a peer that vanished without closing them (a
# node lost, a partition) ends its streams within about half a minute: a
# worker's lease to its router (specd.ownership) then runs out.
KEEPALIVE = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
             ("grpc.http2.max_pings_without_data", 0), ("grpc.keepalive_permit_without_calls", 1)]


class Lifecycle:
    """A started server: its port, health and stop signal."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer, services: list[str]):
        self.server = server
        self.port = port
        self.health = health_servicer
        self.services = services
        self.stopping = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.services]:
            await self.health.set(name, status)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stopping.set)
            except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread
                pass

    async def stop(self, grace: float, drain: float = 0.0) -> None:
        """NOT_SERVING first; after `drain` seconds (for load balancers and
        readiness probes to notice) refuse new calls and give in-flight ones
        `grace` seconds."""
        await self.set_serving(False)
        if drain > 0:
            await asyncio.sleep(drain)
        await self.server.stop(grace)


async def start_server(host: str, port: int, register: Callable[[grpc.aio.Server], list[str]],
                       port_file: str = "", interceptors=None, credentials: grpc.ServerCredentials | None = None,
                       max_receive_bytes: int = MAX_MESSAGE) -> Lifecycle:
    """Create, register, listen, start; health NOT_SERVING until set_serving(True).

    `credentials` (specd.security.server_credentials): TLS, or mTLS when they
    require client certificates; None listens in plaintext. A request larger
    than `max_receive_bytes` is refused by gRPC with RESOURCE_EXHAUSTED."""
    server = grpc.aio.server(
        interceptors=interceptors,
        options=[("grpc.max_receive_message_length", max_receive_bytes),
                 ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.so_reuseport", 0), *KEEPALIVE],
    )
    services = register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*services, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}")
    await server.start()
    life = Lifecycle(server, bound, health_servicer, services)
    await life.set_serving(False)
    await health_servicer.set(LIVENESS, SERVING)
    if port_file:
        tmp = f"{port_file}.tmp"
        with open(tmp, "w") as f:
            f.write(str(bound))
        os.replace(tmp, port_file)
    log.info("listening on %s:%d%s", host, bound, "" if credentials is None else " (TLS)")
    return life


def start_metrics(port: int, registry, host: str = "0.0.0.0") -> None:
    """Serve /metrics over HTTP on `port` (0: off), on the gRPC host's address."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, addr=host, registry=registry)
        log.info("metrics on %s:%d/metrics", host, port)


async def run_until_stopped(life: Lifecycle, grace: float, on_stop: Callable[[], Awaitable[None]] | None = None,
                            drain: float = 0.0) -> None:
    life.install_signal_handlers()
    await life.stopping.wait()
    log.info("shutting down (drain %.1fs, grace %.1fs)", drain, grace)
    await life.stop(grace, drain)
    if on_stop is not None:
        await on_stop()
    log.info("stopped")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
