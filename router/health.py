"""Follow a worker's gRPC health with `Watch`.

A worker says NOT_SERVING while it loads and while it drains before it
stops (specd/server.py). A draining worker finishes the sessions it has;
the router must give it no new ones, and must stop saying it can serve
when none of its targets can. The worker's server answers health from its
event loop, so a busy worker still reports promptly, and a Watch stream
costs nothing while nothing changes.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("specd.router")

SERVING = health_pb2.HealthCheckResponse.SERVING
# how soon a lost Watch is opened again (doubling up to the last)
RETRY_SECONDS = (0.2, 0.5, 1.0, 2.0)


async def follow(channel: grpc.aio.Channel, name: str, on_change: Callable[[bool], None]) -> None:
    """Call `on_change(serving)` with the worker's health as it changes: a
    lost connection counts as not serving until the Watch answers again.
    Runs until cancelled or the channel is closed."""
    failures = 0
    serving = None
    while True:
        try:
            # wait_for_ready: a Watch opened while the worker is down answers
            # as soon as the channel connects to it again
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""),
                                                              wait_for_ready=True)
            async for r in watch:
                failures = 0
                now = r.status == SERVING
                if now != serving:
                    log.info("%s worker health: %s", name, "SERVING" if now else "NOT_SERVING")
                    serving = now
                    on_change(now)
        except grpc.aio.UsageError:  # the channel was closed: the router is stopping
            return
        except grpc.aio.AioRpcError:
            pass
        if serving is not False:
            serving = False
            on_change(False)
        await asyncio.sleep(RETRY_SECONDS[min(failures, len(RETRY_SECONDS) - 1)])
        failures += 1
