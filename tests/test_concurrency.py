"""Concurrent sessions against real processes: batched output equals each
request run alone, cancellations free both workers, the prompt cache."""
from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specd.client import RouterClient, make_request
from specd.v1 import router_pb2_grpc as rpb_grpc
from specd.worker.v1 import worker_pb2 as wpb
from specd.worker.v1 import worker_pb2_grpc as wpb_grpc
from tests.conftest import PROMPTS

N_SEQ = 8


@pytest.fixture(scope="module")
def busy(cluster_factory):
    # batches on both cores while the draft idles, as `specd up` runs them
    return cluster_factory(n_ctx=1536, n_seq=N_SEQ, metrics=True, target_threads=1, target_threads_batch=2)


def mixed_requests() -> list[tuple[str, dict]]:
    """16 requests: mixed prompts, lengths and draft settings."""
    variants = [
        {"speculative": False},
        {"n_draft": 2, "adaptive": False},
        {"n_draft": 6, "adaptive": False},
        {"n_draft": 8, "adaptive": True},
    ]
    return [(PROMPTS[i % len(PROMPTS)], {"max_tokens": (12, 24, 40, 64)[(i // 4) % 4], **variants[i % 4]})
            for i in range(16)]


def metric(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def seq_states(cluster, n_seq: int) -> dict[str, list[wpb.SeqState]]:
    out = {}
    for role in ("target", "draft"):
        port = int(cluster.procs[role].port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = wpb_grpc.WorkerStub(ch)
            out[role] = [stub.GetSeqState(wpb.GetSeqStateRequest(seq_id=i), timeout=10) for i in range(n_seq)]
    return out


def test_16_concurrent_streams_match_each_run_alone(busy):
    reqs = mixed_requests()
    with RouterClient(busy.router_address, timeout=600) as client:
        alone = [client.generate(p, **kw) for p, kw in reqs]
        before = metric(busy.metrics_ports["target"], "specd_worker_decode_batch_sequences_bucket")
        with ThreadPoolExecutor(16) as pool:
            together = list(pool.map(lambda r: client.generate(r[0], **r[1]), reqs))
        after = metric(busy.metrics_ports["target"], "specd_worker_decode_batch_sequences_bucket")
    for (p, kw), a, b in zip(reqs, alone, together):
        assert b.tokens == a.tokens, (p, kw)
        assert b.finish_reason == a.finish_reason
    assert sum(c.n_drafted for c in together) > 0
    # the target decoded several sessions' tokens in one llama_decode
    one = after['{le="1.0"}'] - before['{le="1.0"}']
    total = after['{le="+Inf"}'] - before['{le="+Inf"}']
    assert total > one, (one, total)


def test_target_batches_borrow_the_draft_core_only_while_the_draft_idles(busy):
    """--threads-batch 2 next to a one-thread draft: a target-only request's
    prompt decodes on 2 threads; while a speculative request drafts (its
    prompt goes to both workers, its verifications run beside the draft's
    look-ahead) the target's batches run on its one thread."""
    name = "specd_worker_decode_multi_token_batches_total"
    port = busy.metrics_ports["target"]
    with RouterClient(busy.router_address, timeout=600) as client:
        m0 = metric(port, name)
        client.generate(PROMPTS[0] + " (alone)", max_tokens=8, speculative=False)
        m1 = metric(port, name)
        r = client.generate(PROMPTS[1] + " (drafted)", max_tokens=32, n_draft=4, adaptive=False)
        m2 = metric(port, name)
    solo, shared = '{threads="2"}', '{threads="1"}'
    assert m1.get(solo, 0) - m0.get(solo, 0) >= 1 and m1.get(shared, 0) == m0.get(shared, 0), (m0, m1)
    assert r.n_drafted > 0
    assert m2.get(shared, 0) - m1.get(shared, 0) >= r.n_drafted // 4, (m1, m2)


def test_prompt_cache_reuses_a_long_prefix(busy):
    rows = "\n".join(f"| {i:03d} | item-{i * 7919 % 1000:03d} | {i * 37 % 101:3d} units |" for i in range(58))
    prompt = f"Inventory ({time.time_ns()}):\n{rows}\nThe item with the most units is"
    with RouterClient(busy.router_address, timeout=600) as client:
        assert len(client.tokenize(prompt)) >= 1000

        def first_token_seconds():
            t0 = time.perf_counter()
            stream = client.stub.Generate(make_request(prompt, max_tokens=8), timeout=600)
            first = None
            finish = None
            for msg in stream:
                if first is None and msg.token_ids:
                    first = time.perf_counter() - t0
                if msg.HasField("finish"):
                    finish = msg.finish
            return first, finish

        cold, f_cold = first_token_seconds()
        hit, f_hit = first_token_seconds()
    assert f_cold.usage.cached_tokens == 0
    assert f_hit.usage.cached_tokens >= 1000
    assert f_hit.usage.prompt_tokens == f_cold.usage.prompt_tokens
    print(f"\nfirst token: {cold * 1000:.0f} ms cold, {hit * 1000:.0f} ms on a prompt-cache hit ({cold / hit:.1f}x)")
    assert cold >= 5 * hit, (cold, hit)


def test_100_cancelled_streams_leave_nothing_behind(cluster_factory):
    c = cluster_factory(n_ctx=512, n_seq=4, router_args=["--max-queue", "64"])

    async def main() -> int:
        rng = random.Random(7)
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = rpb_grpc.RouterStub(ch)

            async def one(i: int) -> bool:
                call = stub.Generate(make_request(PROMPTS[i % len(PROMPTS)], max_tokens=200,
                                                  speculative=i % 3 != 0), timeout=120)
                reads = rng.randrange(0, 4)
                try:
                    for _ in range(reads):
                        msg = await call.read()
                        if msg is grpc.aio.EOF or msg.HasField("finish"):
                            return False
                    if reads == 0:
                        await asyncio.sleep(rng.random() * 0.05)
                finally:
                    call.cancel()
                return True

            cancelled = 0
            for wave in range(5):  # of 20 streams for 4 sequences: most wait in the queue when cancelled
                done = await asyncio.gather(*[one(wave * 20 + i) for i in range(20)])
                cancelled += sum(done)
            return cancelled

    cancelled = asyncio.run(main())
    assert cancelled == 100
    deadline = time.monotonic() + 15
    while True:
        states = seq_states(c, 4)
        held = {role: [(s.seq_id, s.n_tokens, s.pos_max) for s in ss if s.n_tokens or s.pos_max != -1]
                for role, ss in states.items()}
        if not held["target"] and not held["draft"]:
            break
        assert time.monotonic() < deadline, f"sequences still hold KV after 100 cancellations: {held}"
        time.sleep(0.2)
    with RouterClient(c.router_address, timeout=120) as client:  # and the router serves all its sequences
        with ThreadPoolExecutor(4) as pool:
            assert [r.n_generated for r in pool.map(lambda p: client.generate(p, max_tokens=5), PROMPTS[:4])] == [5] * 4
