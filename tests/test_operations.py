"""Operations against real processes: Prometheus metrics move as they must
during a real generation; health goes NOT_SERVING -> SERVING -> stopped; a
SIGTERM lets an in-flight stream finish."""
from __future__ import annotations

import signal
import time
import urllib.request

import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from specd.client import RouterClient, collect, make_request
from specd.launcher import Proc, free_port
from tests.conftest import health


def scrape(port: int) -> dict[tuple, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def metered(cluster_factory):
    return cluster_factory(n_ctx=1024, n_seq=2, metrics=True)


def test_metrics_move_with_a_generation(metered):
    ports = metered.metrics_ports
    before = scrape(ports["router"])
    with RouterClient(metered.router_address) as client:
        c = client.generate("The capital of France is Paris. The capital of Germany is", max_tokens=40, n_draft=4)
    r = scrape(ports["router"])
    d = lambda name, **lb: value(r, name, **lb) - value(before, name, **lb)  # noqa: E731
    assert d("specd_requests_total", outcome="ok", protocol="grpc") == 1
    assert d("specd_generation_tokens_total") == c.n_generated
    assert d("specd_prompt_tokens_total") == c.n_prompt
    assert d("specd_spec_decode_num_draft_tokens_total") == c.n_drafted > 0
    assert d("specd_spec_decode_num_accepted_tokens_total") == c.n_accepted
    assert c.n_drafted >= c.n_accepted
    assert 1 <= d("specd_spec_decode_num_drafts_total") <= c.n_steps
    per_pos = [value(r, "specd_spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert sum(per_pos) == value(r, "specd_spec_decode_num_accepted_tokens_total")
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])), per_pos
    # acceptance by position divides by the drafts that reached the position
    drafted = [value(r, "specd_spec_decode_num_draft_tokens_per_pos_total", position=str(i)) for i in range(4)]
    assert sum(drafted) == value(r, "specd_spec_decode_num_draft_tokens_total")
    assert all(d >= a for d, a in zip(drafted, per_pos)), (drafted, per_pos)
    # every target step counts, with or without drafts (tokens per step)
    assert d("specd_decode_steps_total") == c.n_steps
    assert value(r, "specd_time_to_first_token_seconds_count") >= 1
    assert value(r, "specd_worker_rpc_latency_seconds_count", worker="target", method="verify") >= c.n_steps
    assert value(r, "specd_draft_worker_up") == 1
    assert value(r, "specd_sessions_running") == 0
    assert value(r, "specd_target_workers_up") == 1
    # the finished session's sequence is free and keeps its KV for the prompt cache:
    # the target holds the history (but its last token), the draft a prefix of it
    cached = value(r, "specd_prompt_cache_tokens")
    assert cached >= c.n_prompt + c.n_generated - 1  # a last step may accept past the end
    for role in ("target", "draft"):
        w = scrape(ports[role])
        assert value(w, "specd_worker_decode_batch_size_count") > 0
        assert value(w, "specd_worker_decode_latency_seconds_count") > 0
        assert value(w, "specd_worker_decode_batch_sequences_count") > 0
        assert value(w, "specd_worker_kv_cells_total") == 2 * 1024
        assert value(w, "specd_worker_sequences_in_use") == 1
        used = value(w, "specd_worker_kv_cells_used")
        assert used == cached if role == "target" else 0 < used <= cached


def test_router_health_follows_its_target_and_sigterm_drains(models, tmp_path):
    target_port = free_port()
    router = Proc("router", ["router", "--port", "0", "--target", f"127.0.0.1:{target_port}", "--grace-seconds", "30",
                            "--drain-seconds", "3", "--http-port", "0"], tmp_path)
    target = None
    try:
        address = f"127.0.0.1:{router.wait_port(time.monotonic() + 30)}"
        time.sleep(1.0)
        assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING  # no target yet
        # ... but alive: a liveness probe must not restart it (specd/server.py LIVENESS)
        assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING
        target = Proc("target", ["target", "--model", models["target"], "--port", str(target_port), "--threads", "1",
                                 "--n-ctx", "1024", "--n-seq", "1"], tmp_path)
        deadline = time.monotonic() + 60
        while health(address) != health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline, router.log_tail()
            time.sleep(0.1)
        with RouterClient(address) as client:
            stream = client.stub.Generate(make_request("1, 2, 3, 4,", max_tokens=120), timeout=120)
            first = next(stream)
            router.popen.send_signal(signal.SIGTERM)  # in-flight stream gets the grace period
            deadline = time.monotonic() + 2
            while health(address) != health_pb2.HealthCheckResponse.NOT_SERVING:  # draining
                assert time.monotonic() < deadline, "health did not say NOT_SERVING on SIGTERM"
                time.sleep(0.05)
            assert health(address, "liveness") == health_pb2.HealthCheckResponse.SERVING  # draining, alive
            rest = collect(stream)
        assert len(first.token_ids) + len(rest.tokens) == 120 and rest.finish_reason == "length"
        assert router.popen.wait(30) == 0
    finally:
        router.stop()
        if target is not None:
            assert target.stop() == 0
