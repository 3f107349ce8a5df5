"""The router's OpenAI-compatible HTTP API against real processes and real
clients: the official `openai` package and plain httpx reading raw SSE.

Two clusters, one per module fixture:
- `api`: target + draft, 4 sequences, an API key, metrics: answers, streams,
  stop, seeds, greedy identity with gRPC and target-only, 16 concurrent
  streams, disconnects, bad requests, keys, metrics, the gRPC chat path;
- `edge`: target only on a model whose chat template was removed, one
  sequence, no queue, a 2 s request timeout: 400 (no template), 429, 504,
  then 503 once its target is killed.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specd.client import RouterClient, make_request
from specd.v1 import router_pb2_grpc as rpb_grpc
from tests.conftest import PROMPTS
from tests.leaks import wait_no_leaks

KEY = "sk-test-0123456789"
CHAT = [{"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def api(cluster_factory, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api-keys"
    keys.write_text(f"# test keys\n{KEY}\n")
    return cluster_factory(n_ctx=512, n_seq=4, http=True, metrics=True, router_args=["--api-key-file", str(keys)])


def oa(cluster, **kw) -> openai.OpenAI:
    # no retries: a 429 or 503 must reach the test, not be retried away
    return openai.OpenAI(base_url=cluster.http_url + "/v1", api_key=kw.pop("api_key", KEY), max_retries=0,
                         timeout=120, **kw)


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def router_counts(cluster) -> dict[tuple, float]:
    """specd_requests_total by (outcome, protocol)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.metrics_ports['router']}/metrics").read().decode()
    return {(s.labels["outcome"], s.labels["protocol"]): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "specd_requests_total"}


# ------------------------------------------------------------------ answers
def test_chat_and_completion_answer_as_openai_does(api):
    client = oa(api)
    r = client.chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == client.models.list().data[0].id
    choice = r.choices[0]
    assert choice.message.role == "assistant" and "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert 0 < u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    spec = u.model_extra["speculative"]
    assert spec["enabled"] and spec["drafted_tokens"] >= spec["accepted_tokens"] > 0

    kw = dict(model="any", prompt=PROMPTS[3], max_tokens=6, temperature=0)
    c = client.completions.create(**kw)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage.completion_tokens == 6 and c.choices[0].text
    # the same prompt again: the prompt cache kept it
    again = client.completions.create(**kw)
    assert again.choices[0].text == c.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streams_match_the_whole_answer_and_end_with_usage(api):
    client = oa(api)
    whole = client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    text = client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=10, temperature=0).choices[0].text
    parts = list(client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == text
    assert parts[-1].choices[0].finish_reason == "length" and all(p.usage is None for p in parts)


def test_stop_strings_end_the_text_before_them(api):
    client = oa(api)
    base = client.completions.create(model="any", prompt=PROMPTS[8], max_tokens=24, temperature=0).choices[0].text
    words = base.split()
    stop = next(w for w in words[2:] if len(w) >= 3)
    cut = base[:base.index(stop)]
    r = client.completions.create(model="any", prompt=PROMPTS[8], max_tokens=24, temperature=0, stop=[stop, "\x01"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (cut, "stop")
    streamed = client.completions.create(model="any", prompt=PROMPTS[8], max_tokens=24, temperature=0, stop=stop,
                                         stream=True)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == cut and parts[-1].choices[0].finish_reason == "stop"


def test_a_seed_reproduces_sampled_output(api):
    client = oa(api)
    kw = dict(model="any", prompt="Once upon a time", max_tokens=16, temperature=0.9, top_p=0.95)
    first = client.completions.create(seed=1234, **kw).choices[0].text
    assert client.completions.create(seed=1234, **kw).choices[0].text == first
    streamed = "".join(p.choices[0].text for p in client.completions.create(seed=1234, stream=True, **kw))
    assert streamed == first
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others - {first}, "three other seeds all gave the same text"


def test_greedy_output_is_the_same_over_http_grpc_and_target_only(api):
    client = oa(api)
    with RouterClient(api.router_address, api_key=KEY) as grpc_client:
        for prompt in PROMPTS[:3]:
            target_only = grpc_client.generate(prompt, max_tokens=24, speculative=False).tokens
            over_grpc = grpc_client.generate(prompt, max_tokens=24).tokens
            r = client.completions.create(model="any", prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"return_token_ids": True})
            off = client.completions.create(model="any", prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"return_token_ids": True, "speculative": {"enabled": False}})
            assert token_ids(r.choices[0]) == over_grpc == target_only == token_ids(off.choices[0])
            assert r.usage.model_extra["speculative"]["drafted_tokens"] > 0
            assert not off.usage.model_extra["speculative"]["enabled"]
        # chat: both APIs render the messages with the one template path
        chat_grpc = grpc_client.generate(CHAT, max_tokens=16)
        chat_grpc_off = grpc_client.generate(CHAT, max_tokens=16, speculative=False)
    r = client.chat.completions.create(model="any", messages=CHAT, max_tokens=16, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert token_ids(r.choices[0]) == chat_grpc.tokens == chat_grpc_off.tokens
    assert r.choices[0].message.content == chat_grpc.text and r.usage.prompt_tokens == chat_grpc.n_prompt


def test_specd_generate_chat_renders_like_the_http_api(api):
    out = subprocess.run([sys.executable, "-m", "specd", "generate", "--router", api.router_address, "--api-key", KEY,
                          "--system", CHAT[0]["content"], CHAT[1]["content"], "--json", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    r = oa(api).chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0,
                                        extra_body={"return_token_ids": True})
    assert got["tokens"] == token_ids(r.choices[0]) and got["n_prompt"] == r.usage.prompt_tokens


def test_16_concurrent_streams_equal_each_alone(api):
    prompts = [f"{i + 1}. {PROMPTS[i % len(PROMPTS)]}" for i in range(16)]
    client = oa(api)
    alone = [token_ids(client.completions.create(model="any", prompt=p, max_tokens=12, temperature=0,
                                                 extra_body={"return_token_ids": True}).choices[0])
             for p in prompts]

    async def stream(aclient: openai.AsyncOpenAI, prompt: str) -> list[int]:
        ids = []
        async for chunk in await aclient.completions.create(model="any", prompt=prompt, max_tokens=12, temperature=0,
                                                            stream=True, extra_body={"return_token_ids": True}):
            ids += chunk.choices[0].model_extra.get("token_ids", [])
        return ids

    async def main() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=api.http_url + "/v1", api_key=KEY, max_retries=0, timeout=120) as ac:
            return await asyncio.gather(*(stream(ac, p) for p in prompts))

    together = asyncio.run(main())
    assert together == alone
    wait_no_leaks(api)


# ------------------------------------------------------ raw HTTP, disconnects
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_raw_sse_lines_from_a_plain_http_client(api):
    body = {"model": "any", "messages": CHAT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", api.http_url + "/v1/chat/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    # events are `data: ...` lines, each followed by a blank line; the last is [DONE]
    assert lines[1::2] == [""] * (len(lines) // 2)
    events = lines[0::2]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 4


def test_clients_that_go_away_free_their_sequences(api):
    """Streams closed mid-way, and a request whose client gives up while it
    waits in the queue: all are cancelled at once, and nothing stays held on
    either worker, as for cancelled gRPC streams."""
    before = router_counts(api).get(("cancelled", "http"), 0)
    url = api.http_url + "/v1/completions"
    long = {"model": "any", "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60, headers=auth()) as h:
        # prompts whose greedy answers run past 300 tokens: one that ends early
        # (PROMPTS[0] and [2] end near 30) would free a sequence for the fifth
        streams = [h.stream("POST", url, json={**long, "prompt": PROMPTS[i]}) for i in (3, 6, 7, 8)]
        responses = [s.__enter__() for s in streams]  # the 4 sequences are busy now
        # keep every line iterator alive: one dropped is closed, and with it
        # its connection, which cancels that stream and frees its sequence
        readers = [r.iter_lines() for r in responses]
        for r, lines in zip(responses, readers):
            assert r.status_code == 200
            assert next(lines).startswith("data: ")
        # a fifth waits for a sequence; its client gives up after 0.5 s
        with pytest.raises(httpx.ReadTimeout):
            h.post(url, json={"model": "any", "prompt": PROMPTS[5], "max_tokens": 4}, timeout=0.5)
        for s in streams:
            s.__exit__(None, None, None)  # closes the connection mid-stream
    wait_no_leaks(api)
    deadline = time.monotonic() + 10
    while router_counts(api).get(("cancelled", "http"), 0) < before + 5:
        assert time.monotonic() < deadline, router_counts(api)
        time.sleep(0.1)


# ---------------------------------------------------------------- refusals
GOOD = {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
BAD_REQUESTS = [
    # (path, body, status, what the message or param must name)
    ("chat/completions", b"{not json", 400, "JSON"),
    ("chat/completions", b"[1, 2]", 400, "body"),
    ("chat/completions", {"model": "any"}, 400, "messages"),
    ("chat/completions", {**GOOD, "messages": "hi"}, 400, "messages"),
    ("chat/completions", {**GOOD, "messages": []}, 400, "messages"),
    ("chat/completions", {**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    ("chat/completions", {**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]"),
    ("chat/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens"),
    ("chat/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("chat/completions", {**GOOD, "max_tokens": 100000}, 400, "max_tokens"),
    ("chat/completions", {**GOOD, "max_completion_tokens": 1.5}, 400, "max_completion_tokens"),
    ("chat/completions", {**GOOD, "temperature": True}, 400, "temperature"),
    ("chat/completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("chat/completions", {**GOOD, "seed": "x"}, 400, "seed"),
    ("chat/completions", {**GOOD, "stop": 5}, 400, "stop"),
    ("chat/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("chat/completions", {**GOOD, "n": 2}, 400, "n"),
    ("chat/completions", {**GOOD, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("chat/completions", {**GOOD, "logprobs": True}, 400, "logprobs"),
    ("chat/completions", {**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("chat/completions", {**GOOD, "speculative": {"n_max": "4"}}, 400, "speculative.n_max"),
    ("chat/completions", {**GOOD, "speculative": {"n_max": 1000}}, 400, "speculative.n_max"),
    ("chat/completions", {**GOOD, "speculative": {"turbo": True}}, 400, "speculative.turbo"),
    ("completions", {"model": "any", "prompt": ["one", "two"]}, 400, "prompt"),
    ("completions", {"model": "any", "prompt": {"text": "x"}}, 400, "prompt"),
    ("completions", {"model": "any", "prompt": [1, -5]}, 400, "prompt_tokens[1]"),
    ("completions", {"model": "any", "prompt": ""}, 400, "prompt"),
]


def test_bad_requests_get_400_naming_the_field_and_the_router_keeps_serving(api):
    with httpx.Client(base_url=api.http_url, headers=auth(), timeout=60) as h:
        for path, body, status, names in BAD_REQUESTS:
            kw = {"content": body} if isinstance(body, bytes) else {"json": body}
            r = h.post(f"/v1/{path}", **kw)
            err = r.json()["error"]
            assert r.status_code == status, (body, r.text)
            assert names in f"{err['param']} {err['message']}", (body, err)
            assert err["type"] == "invalid_request_error"
        # a body over --max-message-bytes (4 MiB): 413, read to the end so the client sees it
        r = h.post("/v1/chat/completions", content=b"{" + b" " * (5 << 20) + b"}")
        assert r.status_code == 413 and "max-message-bytes" in r.json()["error"]["message"]
        r = h.get("/v1/nothing")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert h.get("/health").status_code == 200
        ok = h.post("/v1/chat/completions", json=GOOD)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(openai.BadRequestError) as exc:  # the official client sees the same
        oa(api).chat.completions.create(model="any", messages=GOOD["messages"], n=3)
    assert exc.value.status_code == 400 and exc.value.body["param"] == "n"


def test_api_keys_are_required_except_for_health(api):
    with pytest.raises(openai.AuthenticationError) as exc:
        oa(api, api_key="wrong").chat.completions.create(model="any", messages=CHAT, max_tokens=2)
    assert exc.value.status_code == 401 and "not valid" in exc.value.message
    with httpx.Client(base_url=api.http_url, timeout=30) as h:
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
        assert h.get("/v1/models").status_code == 401
        assert h.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert h.get("/health").json() == {"status": "ok"}


def test_kept_alive_connections_answer_without_delay(api):
    """Without TCP_NODELAY on the server every request of a kept-alive
    connection waits ~40 ms for the client's delayed ACK (Linux's minimum):
    a response's headers and body leave as two segments."""
    with httpx.Client(base_url=api.http_url, headers=auth(), timeout=30) as h:
        h.get("/v1/models").raise_for_status()
        times = []
        for _ in range(15):
            t0 = time.perf_counter()
            h.get("/v1/models").raise_for_status()
            times.append(time.perf_counter() - t0)
    assert sorted(times)[len(times) // 2] < 0.030, times


def test_metrics_count_http_requests_beside_grpc(api):
    before = router_counts(api)
    oa(api).completions.create(model="any", prompt=PROMPTS[0], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oa(api).completions.create(model="any", prompt=PROMPTS[0], max_tokens=2, logprobs=2)
    with RouterClient(api.router_address, api_key=KEY) as grpc_client:
        grpc_client.generate(PROMPTS[0], max_tokens=2)
    after = router_counts(api)
    moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    assert moved == {("ok", "http"): 1, ("invalid_argument", "http"): 1, ("ok", "grpc"): 1}


def test_a_busy_http_port_stops_the_router_saying_so():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "specd", "router", "--port", "0", "--target", "127.0.0.1:1",
                              "--http-port", str(port)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and f"cannot listen on 127.0.0.1:{port} (--http-port" in out.stderr, out.stderr


def test_the_tls_flags_serve_https_with_client_certificates(tmp_path):
    """--tls-cert/--tls-key/--tls-ca cover the HTTP port as the gRPC one: a
    router without a target yet answers /health 503 over HTTPS to a client
    holding a certificate of its CA, and refuses one without."""
    import ssl

    from specd.launcher import Proc, free_port
    from tests.test_security import make_pki

    pki = make_pki(tmp_path)
    port = free_port()
    router = Proc("router", ["router", "--port", "0", "--target", "127.0.0.1:1", "--http-port", str(port),
                             "--tls-cert", pki.path("server.pem"), "--tls-key", pki.path("server.key"),
                             "--tls-ca", pki.path("ca.pem")], tmp_path)
    try:
        router.wait_port(time.monotonic() + 30)
        trusted = ssl.create_default_context(cafile=pki.path("ca.pem"))
        holder = ssl.create_default_context(cafile=pki.path("ca.pem"))
        holder.load_cert_chain(pki.path("router.pem"), pki.path("router.key"))
        deadline = time.monotonic() + 10
        while True:  # the HTTP port listens just after the gRPC port file is written
            try:
                r = httpx.get(f"https://127.0.0.1:{port}/health", verify=holder, timeout=10)
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, router.log_tail()
                time.sleep(0.1)
        assert r.status_code == 503 and r.json() == {"status": "unavailable"}
        for refused in (lambda: httpx.get(f"https://127.0.0.1:{port}/health", verify=trusted, timeout=10),
                        lambda: httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)):
            with pytest.raises(httpx.HTTPError):
                refused().raise_for_status()
    finally:
        router.stop()


# ------------------------------------------------------ 400 / 429 / 504 / 503
def without_chat_template(src: str, dst) -> str:
    """A copy of a GGUF whose tokenizer.chat_template key is renamed (same
    length, so every offset holds): llama.cpp then finds no template."""
    key = b"tokenizer.chat_template"
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(16 << 20)
        at = head.index(struct.pack("<Q", len(key)) + key) + 8
        f.seek(at)
        f.write(b"tokenizer.chat_templatX")
    return str(dst)


@pytest.fixture(scope="module")
def edge(cluster_factory, models, tmp_path_factory):
    model = without_chat_template(models["draft"], tmp_path_factory.mktemp("model") / "no-template.gguf")
    return cluster_factory(target_model=model, draft_model="", n_ctx=1024, n_seq=1, http=True, metrics=True,
                           worker_args=["--no-calibrate"],
                           router_args=["--max-queue", "0", "--request-timeout", "2"])


def test_a_model_without_chat_template_refuses_chat_clearly(edge):
    client = oa(edge)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="any", messages=CHAT, max_tokens=4)
    assert "no chat template" in exc.value.message and exc.value.body["code"] == "failed_precondition"
    with grpc.insecure_channel(edge.router_address) as ch:
        with pytest.raises(grpc.RpcError) as rpc:
            list(rpb_grpc.RouterStub(ch).Generate(make_request(CHAT, max_tokens=4), timeout=30))
    assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "no chat template" in rpc.value.details()
    assert client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=4, temperature=0).usage.completion_tokens == 4


def test_a_full_queue_is_429_and_the_request_timeout_504(edge):
    client = oa(edge)
    outcome = {}

    def long_request():
        try:  # counting goes on for far longer than the 2 s request_timeout
            client.completions.create(model="any", prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=900, temperature=0)
        except openai.APIStatusError as exc:
            outcome["error"] = exc

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.5)  # it holds the only sequence now
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=2)
    assert exc.value.status_code == 429 and "max_queue" in exc.value.message
    t.join(30)
    err = outcome["error"]
    assert err.status_code == 504 and "request_timeout" in err.message, err
    wait_no_leaks(edge)
    assert client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=2,
                                    temperature=0).usage.completion_tokens == 2


def test_503_while_the_target_is_down(edge):
    edge.procs["target"].popen.kill()
    edge.procs["target"].popen.wait()
    client = oa(edge)
    with pytest.raises(openai.InternalServerError) as exc:
        client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.body["code"] == "unavailable"
    deadline = time.monotonic() + 10
    while httpx.get(edge.http_url + "/health", headers=auth()).status_code != 503:
        assert time.monotonic() < deadline, "/health still 200 with the target down"
        time.sleep(0.2)
    assert httpx.get(edge.http_url + "/health").json() == {"status": "unavailable"}
