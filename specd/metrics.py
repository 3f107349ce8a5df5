"""Metrics: a stats dataclass, a logger and Prometheus classes.

Names follow vLLM / llama.cpp (`specd_spec_decode_num_drafts_total`,
`specd_spec_decode_num_accepted_tokens_per_pos_total{position}`, ...). Each
process owns its CollectorRegistry; nothing is registered at import time.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("specd.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# whole requests: a long generation runs for minutes (the deployment admits up to 120 s)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SEQ_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


@dataclass
class SpecDecodingStats:
    """Drafting counters since the start: the one place a speculative step
    is counted. The router's Prometheus export reads them as they stand, the
    acceptance log what they gained since its last line (`minus`)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_drafts_per_pos: list[int] = field(default_factory=list)  # drafts long enough to reach each position

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if num_draft_tokens <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        while len(self.num_drafts_per_pos) < num_draft_tokens:
            self.num_drafts_per_pos.append(0)
            self.num_accepted_tokens_per_pos.append(0)
        for i in range(num_draft_tokens):
            self.num_drafts_per_pos[i] += 1
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def copy(self) -> SpecDecodingStats:
        return dataclasses.replace(self, num_accepted_tokens_per_pos=list(self.num_accepted_tokens_per_pos),
                                   num_drafts_per_pos=list(self.num_drafts_per_pos))

    def minus(self, earlier: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted since `earlier`, a copy of these stats taken
        before; positions no draft reached since are left out."""
        def since(now: list[int], then: list[int]) -> list[int]:
            return [n - (then[i] if i < len(then) else 0) for i, n in enumerate(now)]

        drafts = since(self.num_drafts_per_pos, earlier.num_drafts_per_pos)
        reached = sum(1 for n in drafts if n > 0)  # a draft reaching a position reached every one before it
        return SpecDecodingStats(self.num_drafts - earlier.num_drafts,
                                 self.num_draft_tokens - earlier.num_draft_tokens,
                                 self.num_accepted_tokens - earlier.num_accepted_tokens,
                                 since(self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos)[:reached],
                                 drafts[:reached])


class SpecDecodingLogging:
    """Logs acceptance every `interval` seconds (vLLM's SpecDecodingLogging):
    what `stats` counted since the previous line."""

    def __init__(self, stats: SpecDecodingStats, interval: float = 10.0):
        self.stats = stats
        self.interval = interval
        self.mark = stats.copy()
        self.last = time.monotonic()

    def tick(self) -> None:
        """Log if `interval` seconds have passed since the last line."""
        if time.monotonic() - self.last >= self.interval:
            self.log()

    def log(self) -> None:
        s = self.stats.minus(self.mark)
        if s.num_drafts:
            rate = s.num_accepted_tokens / s.num_draft_tokens
            mean_len = 1 + s.num_accepted_tokens / s.num_drafts
            per_pos = ", ".join(f"{a / s.num_drafts:.2f}" for a in s.num_accepted_tokens_per_pos)
            log.info("spec decoding: drafts %d, draft tokens %d, accepted %d, acceptance %.3f, mean acceptance "
                     "length %.2f, per-position acceptance [%s]", s.num_drafts, s.num_draft_tokens,
                     s.num_accepted_tokens, rate, mean_len, per_pos)
        self.mark = self.stats.copy()
        self.last = time.monotonic()


class SpecDecodingPrometheus:
    """The spec-decode counters (`specd_spec_decode_num_drafts_total`, ...,
    `..._num_accepted_tokens_per_pos_total{position}`), read at scrape time
    from the SpecDecodingStats that `observe` counts into."""

    def __init__(self, stats: SpecDecodingStats, registry: CollectorRegistry):
        self.stats = stats
        self.lock = threading.Lock()  # scrapes run on the metrics server's thread
        self.created = time.time()
        self.pos_created: list[float] = []  # when each position's series appeared
        registry.register(self)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        with self.lock:
            self.stats.observe_draft(num_draft_tokens, num_accepted_tokens)
            new = len(self.stats.num_accepted_tokens_per_pos) - len(self.pos_created)
            if new > 0:  # the series of every drafted position exists from its first draft, at 0 if none accepted
                self.pos_created += [time.time()] * new

    def collect(self):
        with self.lock:
            s, pos_created = self.stats.copy(), list(self.pos_created)
        yield CounterMetricFamily("specd_spec_decode_num_drafts", "Speculative steps with at least one draft token",
                                  value=float(s.num_drafts), created=self.created)
        yield CounterMetricFamily("specd_spec_decode_num_draft_tokens", "Draft tokens verified",
                                  value=float(s.num_draft_tokens), created=self.created)
        yield CounterMetricFamily("specd_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                  value=float(s.num_accepted_tokens), created=self.created)
        per_pos = CounterMetricFamily("specd_spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens by position in the draft", labels=["position"])
        # the denominator of acceptance by position: draft lengths vary
        # (adaptive drafting), so not every draft reaches every position
        drafted = CounterMetricFamily("specd_spec_decode_num_draft_tokens_per_pos",
                                      "Draft tokens verified by position in the draft", labels=["position"])
        for i, created in enumerate(pos_created):
            per_pos.add_metric([str(i)], float(s.num_accepted_tokens_per_pos[i]), created=created)
            drafted.add_metric([str(i)], float(s.num_drafts_per_pos[i]), created=created)
        yield per_pos
        yield drafted

    def describe(self):
        return self.collect()  # the names, for the registry to refuse a duplicate


class RouterPrometheus:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        # protocol: "grpc" (specd.v1.Router) or "http" (the OpenAI-compatible API, router/http.py)
        self.requests = Counter("specd_requests", "Generate requests by outcome and protocol", ["outcome", "protocol"],
                                registry=r)
        self.ttft = Histogram("specd_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specd_inter_token_latency_seconds", "Time between streamed tokens (per token)", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specd_e2e_request_latency_seconds", "End-to-end request latency", buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specd_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("specd_generation_tokens", "Tokens generated", registry=r)
        # every target step, with or without drafts: tokens per step is
        # generation_tokens / steps (num_drafts counts only steps with drafts)
        self.steps = Counter("specd_decode_steps", "Target steps (a verify or a plain decode), with or without "
                             "draft tokens", registry=r)
        self.spec = SpecDecodingStats()  # counted once, in self.spec_decode; exported and logged from there
        self.spec_decode = SpecDecodingPrometheus(self.spec, r)
        self.rpc_latency = Histogram("specd_worker_rpc_latency_seconds", "Worker call latency seen by the router", ["worker", "method"], buckets=LATENCY_BUCKETS, registry=r)
        self.sessions_running = Gauge("specd_sessions_running", "Sessions holding a sequence", registry=r)
        self.sessions_queued = Gauge("specd_sessions_queued", "Sessions waiting for a sequence", registry=r)
        self.prompt_cache_tokens = Gauge("specd_prompt_cache_tokens",
                                         "Tokens free sequences keep on their target for the prompt cache", registry=r)
        self.targets_up = Gauge("specd_target_workers_up", "Target workers taking new sessions (attached, not draining)", registry=r)
        self.draft_up = Gauge("specd_draft_worker_up", "1 when the draft worker is in use", registry=r)
        self.divergences = Counter("specd_router_divergences", "Divergences the alignment check found, by worker "
                                   "(target: the request fails; draft: re-synced from the history)", ["worker"],
                                   registry=r)
        for worker in ("target", "draft"):
            self.divergences.labels(worker=worker)  # both series exist from the start, at 0
        self.logging = SpecDecodingLogging(self.spec)

    def observe_step(self, stats) -> None:
        self.steps.inc()
        if stats.n_drafted:
            self.spec_decode.observe(stats.n_drafted, stats.n_accepted)
            self.rpc_latency.labels(worker="draft", method="propose").observe(stats.draft_seconds)
            self.logging.tick()
        self.rpc_latency.labels(worker="target", method="verify").observe(stats.verify_seconds)

    def observe_divergence(self, worker: str) -> None:
        self.divergences.labels(worker=worker).inc()


class WorkerPrometheus:
    """Decode histograms fed by the engine; KV gauges read at scrape time."""

    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.batch = Histogram("specd_worker_decode_batch_size", "Tokens per llama_decode", buckets=BATCH_BUCKETS, registry=r)
        self.latency = Histogram("specd_worker_decode_latency_seconds", "llama_decode latency", buckets=LATENCY_BUCKETS, registry=r)
        self.sequences = Histogram("specd_worker_decode_batch_sequences", "Sequences sharing one llama_decode (continuous batching)",
                                   buckets=SEQ_BUCKETS, registry=r)
        self.threads = Counter("specd_worker_decode_multi_token_batches", "llama_decode calls of more than one "
                               "token by the threads they ran on (--threads-batch, or --threads while the draft "
                               "computes on the same machine)", ["threads"], registry=r)
        self.engine = None
        r.register(self)

    def attach(self, engine) -> None:
        self.engine = engine
        engine.on_decode = self.on_decode

    def on_decode(self, n_tokens: int, seconds: float, n_sequences: int = 1, threads: int = 1) -> None:
        if n_tokens > 1:
            self.threads.labels(threads=str(threads)).inc()
        self.batch.observe(n_tokens)
        self.latency.observe(seconds)
        self.sequences.observe(n_sequences)

    def collect(self):
        e = self.engine
        if e is None:
            return
        yield GaugeMetricFamily("specd_worker_sequences_in_use", "Sequences holding tokens", value=e.sequences_in_use())
        yield GaugeMetricFamily("specd_worker_kv_cells_used", "KV cells (tokens) held", value=e.cells_used())
        yield GaugeMetricFamily("specd_worker_kv_cells_total", "KV cells available", value=e.n_ctx_seq * e.n_seq)
        yield GaugeMetricFamily("specd_worker_checkpoint_bytes", "Bytes held in checkpoints", value=e.stats.checkpoint_bytes)

    def describe(self):
        return []
