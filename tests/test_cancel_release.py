"""Cancelled Generate streams free their sequence on both workers and in the
router's pool, whenever the cancel lands: while queued, during the prompt,
mid-stream, and while the router is already releasing the sequence after
the last token (the cleanup must not be cut short by the cancel)."""
from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specd.client import RouterClient, make_request
from specd.v1 import router_pb2_grpc as rpb_grpc
from tests.conftest import PROMPTS
from tests.leaks import wait_no_leaks

N_SEQ = 4


def test_cancels_at_awkward_moments_leave_no_sequence_or_kv(cluster_factory):
    c = cluster_factory(n_ctx=512, n_seq=N_SEQ, metrics=True, router_args=["--no-prompt-cache", "--max-queue", "64"])
    with RouterClient(c.router_address, timeout=30) as client:
        reference = client.generate(PROMPTS[0], max_tokens=8).tokens
    counts = {"after_last_token": 0, "mid_stream": 0, "early": 0, "deadline": 0, "finished": 0}

    async def main() -> None:
        rng = random.Random(11)
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = rpb_grpc.RouterStub(ch)

            async def after_last_token(i: int) -> None:
                """Cancel as soon as the last token arrives: the router is
                then releasing the sequence (its final message comes after)."""
                n = rng.randrange(1, 6)
                call = stub.Generate(make_request(PROMPTS[i % len(PROMPTS)], max_tokens=n,
                                                  speculative=i % 4 != 0), timeout=30)
                got = 0
                try:
                    while got < n:
                        msg = await call.read()
                        if msg is grpc.aio.EOF or msg.HasField("finish"):
                            counts["finished"] += 1
                            return
                        got += len(msg.token_ids)
                    counts["after_last_token"] += 1
                finally:
                    call.cancel()

            async def mid_stream(i: int) -> None:
                call = stub.Generate(make_request(PROMPTS[i % len(PROMPTS)], max_tokens=40), timeout=30)
                try:
                    for _ in range(rng.randrange(1, 4)):
                        msg = await call.read()
                        if msg is grpc.aio.EOF or msg.HasField("finish"):
                            counts["finished"] += 1
                            return
                    counts["mid_stream"] += 1
                finally:
                    call.cancel()

            async def early(i: int) -> None:
                """Cancel after a random few milliseconds: queued, taking a
                sequence, reusing or decoding the prompt."""
                call = stub.Generate(make_request(PROMPTS[i % len(PROMPTS)], max_tokens=40), timeout=30)
                await asyncio.sleep(rng.random() * 0.06)
                call.cancel()
                counts["early"] += 1

            async def deadline(i: int) -> None:
                """The client's deadline expires at a random moment."""
                call = stub.Generate(make_request(PROMPTS[i % len(PROMPTS)], max_tokens=rng.randrange(1, 12)),
                                     timeout=0.02 + rng.random() * 0.4)
                try:
                    async for _ in call:
                        pass
                    counts["finished"] += 1
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED, exc
                    counts["deadline"] += 1

            kinds = [after_last_token, after_last_token, mid_stream, early, deadline]
            for wave in range(12):
                # more streams than sequences: some wait in the queue, and the
                # workers are busy, so that releases take a while
                await asyncio.gather(*[rng.choice(kinds)(wave * 12 + i) for i in range(12)])
                # nothing running, nothing queued, no sequence and no KV cell on either worker
                await asyncio.to_thread(wait_no_leaks, c, 10.0)

    t0 = time.monotonic()
    asyncio.run(main())
    print(f"\ncancellations: {counts} in {time.monotonic() - t0:.1f}s")
    assert counts["after_last_token"] >= 30 and counts["early"] + counts["mid_stream"] >= 20
    # and every sequence is usable again: N_SEQ requests at once all run, with the reference output
    with RouterClient(c.router_address, timeout=60) as client:
        with ThreadPoolExecutor(N_SEQ) as pool:
            outs = list(pool.map(lambda _: client.generate(PROMPTS[0], max_tokens=8), range(N_SEQ)))
    assert [o.tokens for o in outs] == [reference] * N_SEQ
    wait_no_leaks(c)
