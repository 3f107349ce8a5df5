"""Workers killed and restarted under the router (SIGKILL, same port, as a
process manager or Kubernetes restarts them): every request gets the answer
the target alone gives, or a clear gRPC status; never other text. A
restarted worker holds no sequence, so nothing the router cached for it may
be trusted (issue: a prompt-cache hit on a restarted target served text
decoded without its prefix)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2

from specd.client import RouterClient
from tests.conftest import PROMPTS, health

# clear statuses a request may end with while a worker is down or restarting
CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


def test_a_target_restarted_while_idle_gives_the_same_answer_from_the_prompt_cache(cluster_factory):
    # the workers skip timing their decodes, so a restarted one answers within
    # a second: before the router's channel to it has connected again
    c = cluster_factory(n_ctx=512, n_seq=2)
    prompt = PROMPTS[3]
    with RouterClient(c.router_address, timeout=120) as client:
        first = client.generate(prompt, max_tokens=24)
        c.restart("target")
        again = client.generate(prompt, max_tokens=24)
        assert again.tokens == first.tokens
        assert again.n_cached == 0  # the cache entry died with the process
        # said however the loss was found (a refused call or a broken channel)
        assert "restarted (instance" in c.procs["router"].log_path.read_text()
        # the draft restarted while idle: same answer, and drafting goes on
        c.restart("draft")
        after_draft = [client.generate(prompt, max_tokens=24) for _ in range(3)]
        assert all(a.tokens == first.tokens for a in after_draft)
        assert after_draft[-1].speculative and after_draft[-1].n_accepted > 0
        assert "draft worker restarted (instance" in c.procs["router"].log_path.read_text()


def test_a_request_sent_while_the_target_restarts_waits_for_it(cluster_factory):
    # the router holds a new request for an attached target that is down, up
    # to --target-wait, instead of refusing it while the target restarts
    c = cluster_factory(n_ctx=512, n_seq=2, router_args=["--target-wait", "300"])
    prompt = PROMPTS[2]
    with RouterClient(c.router_address, timeout=300) as client, ThreadPoolExecutor(1) as pool:
        first = client.generate(prompt, max_tokens=16)
        c.kill("target")
        deadline = time.monotonic() + 30
        while health(c.router_address) == health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, "the router did not notice its target go"
            time.sleep(0.05)
        held = pool.submit(client.generate, prompt, max_tokens=16)
        time.sleep(1.0)
        assert not held.done(), f"refused while the target was down: {held.exception()}"
        c.start_again("target")
        assert held.result().tokens == first.tokens


def test_sessions_survive_or_fail_cleanly_while_target_and_draft_restart(cluster_factory):
    c = cluster_factory(n_ctx=512, n_seq=4)
    prompts = [", ".join(str(i) for i in range(1, 16)) + ",", *PROMPTS[:5]]
    with RouterClient(c.router_address, timeout=120) as client:
        alone = {p: client.generate(p, max_tokens=40, speculative=False).tokens for p in prompts}

    stop = threading.Event()
    outcomes: list[tuple[str, object]] = []  # (prompt, tokens or status code)

    def session(i: int) -> None:
        with RouterClient(c.router_address, timeout=120) as cl:
            k = i
            while not stop.is_set():
                p = prompts[k % len(prompts)]
                k += 1
                try:
                    outcomes.append((p, cl.generate(p, max_tokens=40).tokens))
                except grpc.RpcError as err:
                    outcomes.append((p, err.code()))
                    time.sleep(0.2)

    def answered() -> int:
        return sum(isinstance(got, list) for _, got in list(outcomes))

    def after_two_more_answers() -> None:
        # restarts follow progress, not a clock: a slow machine gets as many
        # answers between restarts as a fast one
        want, deadline = answered() + 2, time.monotonic() + 120
        while answered() < want:
            assert time.monotonic() < deadline, f"no answers for 120 s: {outcomes[-4:]}"
            time.sleep(0.1)
        time.sleep(1)

    threads = [threading.Thread(target=session, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        for names in (["target"], ["draft"], ["target", "draft"]):
            after_two_more_answers()
            for name in names:
                c.restart(name)
        after_two_more_answers()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)

    wrong = [(p, got) for p, got in outcomes if isinstance(got, list) and got != alone[p]]
    assert not wrong, f"{len(wrong)} answers differ from the target alone: {wrong[:2]}"
    unclear = {got for _, got in outcomes if not isinstance(got, list)} - CLEAR
    assert not unclear, f"statuses other than UNAVAILABLE/DEADLINE_EXCEEDED: {unclear}"
    assert answered() >= 8
    # once both are back, sessions are served in full, with drafting
    with RouterClient(c.router_address, timeout=120) as client:
        for _ in range(60):
            try:
                done = [client.generate(p, max_tokens=40) for p in prompts[:3]]
                break
            except grpc.RpcError:
                time.sleep(1)
        assert [d.tokens for d in done] == [alone[p] for p in prompts[:3]]
        assert all(d.speculative for d in done) and sum(d.n_accepted for d in done) > 0


def test_one_slow_operation_fails_its_own_session_alone(cluster_factory):
    """A prompt whose prefill takes longer than --worker-timeout fails with
    DEADLINE_EXCEEDED; a short request sent beside it, whose operations wait
    behind that prefill on the same worker stream, gets its full answer."""
    c = cluster_factory(n_ctx=2048, n_seq=2, router_args=["--worker-timeout", "1"])
    short = PROMPTS[0]
    with RouterClient(c.router_address, timeout=120) as client:
        alone = client.generate(short, max_tokens=8).tokens
        text = " ".join(PROMPTS) * 40
        long_prompt = client.tokenize(text)[:1900]
        outcome: dict[str, object] = {}

        def long_request() -> None:
            try:
                outcome["long"] = client.generate(long_prompt, max_tokens=4)
            except grpc.RpcError as err:
                outcome["long"] = err.code()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.3)  # the long prefill is on the worker
        got = client.generate(short, max_tokens=8)
        t.join(timeout=120)
        assert got.tokens == alone
        assert outcome["long"] == grpc.StatusCode.DEADLINE_EXCEEDED
        # the stream and the worker serve on
        assert client.generate(short, max_tokens=8).tokens == alone


def test_short_lookaheads_with_n_min_keep_the_draft_on(cluster_factory):
    """With overlap the draft continues past the drafts while the target
    verifies; a continuation cut short by p_min leaves fewer drafts than
    n_min, and the next step must draft anew from what the draft holds (it
    once sent a Propose the draft refused, and the session lost its draft)."""
    from specd.client import collect, make_request

    c = cluster_factory(n_ctx=512, n_seq=2)
    with RouterClient(c.router_address, timeout=120) as client:
        for prompt in PROMPTS[:6]:
            alone = client.generate(prompt, max_tokens=48, speculative=False).tokens
            req = make_request(prompt, max_tokens=48)
            req.speculative.n_min, req.speculative.p_min = 2, 0.9
            got = collect(client.stub.Generate(req, timeout=120))
            assert got.tokens == alone
    assert "draft worker failed" not in c.procs["router"].log_path.read_text()
