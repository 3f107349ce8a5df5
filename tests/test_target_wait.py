"""How long a new request waits for a target that takes no new sessions
(router.targets.TargetSet.wait_open): an attached target draining,
restarting or reconnecting gets settings.target_wait; a target the router
knows is down, and a request beyond max_queue waiting, fail at once. The
end-to-end case (a request held while the target restarts) is in
test_faults.py."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from specd.errors import Unavailable
from specd.router.params import RouterSettings
from specd.router.targets import TargetSet


def targets(up: bool, serving: bool, target_wait: float = 0.3, max_queue: int = 4) -> TargetSet:
    ts = TargetSet([object()], SimpleNamespace(settings=RouterSettings(target_wait=target_wait, max_queue=max_queue)))
    ts.slots[0].up, ts.slots[0].serving = up, serving
    return ts


def test_a_target_taking_sessions_is_not_waited_for():
    asyncio.run(targets(up=True, serving=True).wait_open())


def test_an_attached_target_not_serving_is_waited_for_until_target_wait():
    async def run():
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="draining or restarting"):
            await targets(up=True, serving=False, target_wait=0.3).wait_open()
        return time.monotonic() - t0
    assert 0.3 <= asyncio.run(run()) < 2.0


def test_a_waiting_request_goes_on_once_the_target_serves_again():
    async def run():
        ts = targets(up=True, serving=False, target_wait=30)
        waiting = asyncio.ensure_future(ts.wait_open())
        await asyncio.sleep(0.1)
        assert not waiting.done()
        ts.set_serving(ts.slots[0], True)
        await asyncio.wait_for(waiting, 1.0)
    asyncio.run(run())


def test_a_target_known_down_fails_at_once():
    async def run():
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="no target worker is available"):
            await targets(up=False, serving=True, target_wait=30).wait_open()
        return time.monotonic() - t0
    assert asyncio.run(run()) < 1.0


def test_requests_beyond_max_queue_fail_at_once():
    async def run():
        ts = targets(up=True, serving=False, target_wait=30, max_queue=2)
        waiting = [asyncio.ensure_future(ts.wait_open()) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(Unavailable):
            await asyncio.wait_for(ts.wait_open(), 1.0)
        ts.set_serving(ts.slots[0], True)
        await asyncio.wait_for(asyncio.gather(*waiting), 1.0)
    asyncio.run(run())
