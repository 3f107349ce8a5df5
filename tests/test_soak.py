"""Soak: 32 concurrent streams for SPECD_SOAK_SECONDS (default 30; longer runs: set it) against a
real cluster (target, draft and router as subprocesses, alignment check on,
more streams than sequences so that sessions queue), with random
cancellations and client deadlines.

At the end: no unexpected error (every stream that was left to finish
finished, and greedy ones gave exactly the target-only output), nothing
leaked (no session running or queued; the target's KV cells are exactly the
tokens the router's prompt cache accounts for, the draft's at most those),
and the workers' resident memory grew by less than RSS_LIMIT between the end
of the warm-up and the end of the soak."""
from __future__ import annotations

import asyncio
import os
import random
import time

import grpc

from specd.client import RouterClient, make_request
from specd.v1 import router_pb2_grpc as rpb_grpc
from tests.conftest import PROMPTS
from tests.leaks import rss, wait_no_leaks

SOAK_SECONDS = float(os.environ.get("SPECD_SOAK_SECONDS", "30"))
STREAMS = 32
N_SEQ = 8
MAX_TOKENS = 48
RSS_LIMIT = 64 << 20


def test_soak_32_streams_with_cancellations(cluster_factory):
    c = cluster_factory(n_ctx=1024, n_seq=N_SEQ, metrics=True, router_args=["--max-queue", "64"])
    with RouterClient(c.router_address, timeout=120) as client:
        reference = [client.generate(p, max_tokens=MAX_TOKENS, speculative=False).tokens for p in PROMPTS]
    rss_start = rss(c)
    warmup = min(15.0, SOAK_SECONDS / 4)
    stats = {"completed": 0, "cancelled": 0, "deadline": 0, "finished_before_cancel": 0, "tokens": 0}
    errors: list[str] = []
    marks: dict[str, dict] = {}

    async def main() -> None:
        rng = random.Random(2024)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        end = t0 + SOAK_SECONDS
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = rpb_grpc.RouterStub(ch)

            async def one() -> None:
                i = rng.randrange(len(PROMPTS))
                max_tokens = rng.randrange(1, MAX_TOKENS + 1)
                greedy = rng.random() < 0.7
                kw = dict(max_tokens=max_tokens, speculative=rng.random() < 0.8,
                          n_draft=rng.choice([None, 2, 4, 8]), adaptive=rng.choice([None, True, False]))
                if not greedy:
                    kw.update(temperature=rng.choice([0.5, 1.0]), seed=rng.randrange(1 << 32))
                action = rng.choices(["finish", "cancel_after", "cancel_soon", "deadline"], [60, 25, 10, 5])[0]
                timeout = 0.05 + rng.random() * 0.5 if action == "deadline" else 120
                call = stub.Generate(make_request(PROMPTS[i], **kw), timeout=timeout)
                tokens: list[int] = []
                try:
                    if action == "cancel_soon":
                        await asyncio.sleep(rng.random() * 0.1)
                        call.cancel()
                        stats["cancelled"] += 1
                        return
                    reads = rng.randrange(1, 5) if action == "cancel_after" else None
                    n = 0
                    async for msg in call:
                        tokens += msg.token_ids
                        n += 1
                        if msg.HasField("finish"):
                            if reads is not None:
                                stats["finished_before_cancel"] += 1
                            stats["completed"] += 1
                            stats["tokens"] += msg.finish.usage.generated_tokens
                            if greedy and tokens != reference[i][:max_tokens]:
                                errors.append(f"greedy output differs from target-only: prompt {i}, {kw}")
                            if msg.finish.usage.generated_tokens > max_tokens:
                                errors.append(f"generated {msg.finish.usage.generated_tokens} > {max_tokens}")
                        if reads is not None and n >= reads:
                            call.cancel()
                            stats["cancelled"] += 1
                            return
                    if action == "deadline":
                        stats["deadline_missed"] = stats.get("deadline_missed", 0) + 1
                except grpc.aio.AioRpcError as exc:
                    if action == "deadline" and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        stats["deadline"] += 1
                    else:
                        errors.append(f"{action} {kw}: {exc.code().name}: {exc.details()}")
                except asyncio.CancelledError:
                    if action not in ("cancel_after", "cancel_soon"):
                        raise

            async def stream_loop() -> None:
                while loop.time() < end:
                    await one()

            async def mark_warm() -> None:
                await asyncio.sleep(warmup)
                marks["warm"] = await asyncio.to_thread(rss, c)

            await asyncio.gather(mark_warm(), *[stream_loop() for _ in range(STREAMS)])

    t0 = time.monotonic()
    asyncio.run(main())
    elapsed = time.monotonic() - t0
    snap = wait_no_leaks(c)
    rss_end = rss(c)
    mib = 1 << 20
    print(f"\nsoak {elapsed:.0f}s, {STREAMS} streams: {stats}, unexpected errors {len(errors)}")
    print(f"prompt cache holds {snap['router'].get('specd_prompt_cache_tokens', 0):g} tokens; "
          f"target {snap['target']['held']}, draft {snap['draft']['held']}")
    for role in rss_end:
        print(f"RSS {role}: start {rss_start[role] / mib:.1f} MiB, after warm-up {marks['warm'][role] / mib:.1f} MiB, "
              f"end {rss_end[role] / mib:.1f} MiB (growth {(rss_end[role] - marks['warm'][role]) / mib:+.1f} MiB)")
    assert not errors, errors[:10]
    # enough of each to have exercised it (about 2.4 and 1.2 a second here)
    assert stats["completed"] >= SOAK_SECONDS and stats["cancelled"] >= SOAK_SECONDS / 3, stats
    for role in ("target", "draft", "router"):
        assert rss_end[role] - marks["warm"][role] < RSS_LIMIT, (role, marks["warm"][role], rss_end[role])
    # every sequence serves again, with the reference output
    with RouterClient(c.router_address, timeout=120) as client:
        assert client.generate(PROMPTS[0], max_tokens=MAX_TOKENS).tokens == reference[0]
