"""One config object per process, built from flags with env-var fallback.

Every flag `--some-flag` falls back to `SPECD_SOME_FLAG`, then to its default.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

from specd.router.params import RouterSettings

# The router's defaults are RouterSettings' (router/params.py); the config
# fields and the flags below read them from there.
_ROUTER = RouterSettings()

# Limits against unbounded work from one request or caller, each defined here
# once (the config fields, the flags and the objects enforcing them read these).
# Stop strings: OpenAI's API takes 4; a few more leave room for chat templates'
# end markers, and each step scans every one of them.
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256  # characters
# Prompt text is tokenized before its tokens can be counted, under the target's
# engine lock: text longer than this many bytes per token of the prompt limit
# is refused first. Text averages a few bytes per token; this leaves room for
# runs of whitespace and other long tokens.
PROMPT_BYTES_PER_TOKEN = 32
# Worker: operations waiting for a round, all Execute streams together, and
# operations of one stream not answered yet. The router sends every session's
# operations on one stream, a few per session at most, and llama.cpp hosts at
# most 256 sequences.
MAX_QUEUED_OPS = 8192
# The smallest context per sequence a worker takes: a chat template and a
# few tokens of answer need more than this; smaller values are typos.
MIN_N_CTX = 16
MAX_STREAM_OPS = 2048
# Tokens a target generates alone in one verification after its own
# (VerifyRequest.n_more): each is a round of its own, so one call cannot hold
# a sequence's stream for long; the router asks for --solo-tokens - 1.
MAX_N_MORE = 64
# The longest run VerifyRequest.stop_on_repeat looks for: the n-gram
# drafters' key lengths go up to 1024 (llama.cpp's --spec-ngram-*-size-n).
MAX_STOP_ON_REPEAT = 1024


def env_name(flag: str) -> str:
    return "SPECD_" + flag.lstrip("-").replace("-", "_").upper()


def _bool(v: str | bool) -> bool:
    if isinstance(v, bool):
        return v
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {v!r}")


def at_least(minimum: int, maximum: int | None = None):
    """An int flag type refusing values below `minimum` (or above `maximum`)."""
    def parse(v: str) -> int:
        n = int(v)
        if n < minimum or (maximum is not None and n > maximum):
            raise argparse.ArgumentTypeError(f"must be in [{minimum}, {maximum}], got {n}" if maximum is not None
                                             else f"must be >= {minimum}, got {n}")
        return n
    parse.__name__ = f"int >= {minimum}" if maximum is None else f"int in [{minimum}, {maximum}]"
    return parse


def from_env(env: str, raw: str, parse, choices=None):
    """`raw` (the value of `env`) parsed as its flag parses it; a bad value
    ends the process with one line naming the variable, as a bad flag does."""
    try:
        value = parse(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
        raise SystemExit(f"specd: error: environment variable {env}={raw!r}: {exc}") from None
    if choices is not None and value not in choices:
        raise SystemExit(f"specd: error: environment variable {env}={raw!r}: choose from "
                         f"{', '.join(map(str, choices))}")
    return value


def add(parser: argparse.ArgumentParser, flag: str, type=str, default=None, help: str = "", **kw) -> None:
    """Add `flag` whose default comes from its environment variable."""
    env = env_name(flag)
    raw = os.environ.get(env)
    if type is bool:
        value = from_env(env, raw, _bool) if raw is not None else bool(default)
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [env {env}]", **kw)
        return
    value = from_env(env, raw, type, kw.get("choices")) if raw not in (None, "") else default
    parser.add_argument(flag, type=type, default=value, help=f"{help} [env {env}] (default: {default})", **kw)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    port_file: str = ""
    grace_seconds: float = 30.0
    drain_seconds: float = 0.0
    log_level: str = "INFO"
    # TLS of this server (paths); with tls_ca, client certificates are required
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # API keys every call must carry (a file, one key a line; empty: none)
    api_key_file: str = ""


@dataclass
class WorkerConfig(ServerConfig):
    role: str = "target"  # "target" | "draft"
    model: str = ""
    ngram: str = ""
    ngram_cache: str = ""
    n_vocab: int = 0  # n-gram drafter: token ids must be below it (0: any non-negative id)
    threads: int = 1
    threads_batch: int = 0
    kv_unified: bool = False
    n_ctx: int = 2048
    n_seq: int = 4
    n_batch: int = 512
    n_gpu_layers: int = 0
    max_checkpoint_bytes: int = 1 << 30
    calibrate: bool = True
    batch_wait_ms: float = 10.0
    max_queued_ops: int = MAX_QUEUED_OPS
    max_stream_ops: int = MAX_STREAM_OPS


@dataclass
class RouterConfig(ServerConfig):
    target: str = ""
    draft: str = ""
    ngram: str = ""  # a model-free drafter in the router process instead of a draft worker
    ngram_cache: str = ""
    n_max: int = _ROUTER.n_max
    n_min: int = _ROUTER.n_min
    p_min: float = _ROUTER.p_min
    checkpoint_mode: bool = _ROUTER.checkpoint_mode
    check_alignment: bool = _ROUTER.check_alignment
    overlap: bool = _ROUTER.overlap
    adaptive: bool = _ROUTER.adaptive
    prompt_cache: bool = _ROUTER.prompt_cache
    max_queue: int = _ROUTER.max_queue
    worker_timeout: float = 60.0
    draft_wait: float = _ROUTER.draft_wait
    target_wait: float = _ROUTER.target_wait
    solo_tokens: int = _ROUTER.solo_tokens
    stream_tokens: int = _ROUTER.stream_tokens
    # mTLS towards the workers (paths)
    worker_tls_cert: str = ""
    worker_tls_key: str = ""
    worker_tls_ca: str = ""
    worker_tls_server_name: str = ""
    # file whose first key the router presents to its workers (empty: the first of api_key_file)
    worker_api_key_file: str = ""
    # public API: limits
    max_prompt_tokens: int = 0
    max_tokens_limit: int = 0
    max_message_bytes: int = 4 << 20
    request_timeout: float = 0.0
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_length: int = MAX_STOP_LENGTH
    max_prompt_bytes: int = 0  # 0: PROMPT_BYTES_PER_TOKEN per token of the prompt limit
    # the OpenAI-compatible HTTP API (router/http.py); 0: off
    http_port: int = 8080


def add_server_flags(p: argparse.ArgumentParser, port: int) -> None:
    add(p, "--host", str, "127.0.0.1", "address to listen on")
    add(p, "--port", int, port, "gRPC port (0 picks a free one)")
    add(p, "--metrics-port", int, 0, "Prometheus /metrics HTTP port (0: off)")
    add(p, "--port-file", str, "", "write the bound gRPC port to this file once listening")
    add(p, "--grace-seconds", float, 30.0, "on SIGTERM, time given to in-flight calls")
    add(p, "--drain-seconds", float, 0.0, "on SIGTERM, time health says NOT_SERVING before new calls are refused")
    add(p, "--log-level", str, "INFO", "logging level")
    add(p, "--tls-cert", str, "", "serve TLS with this PEM certificate (chain) file")
    add(p, "--tls-key", str, "", "PEM private key of --tls-cert")
    add(p, "--tls-ca", str, "", "PEM CA file: require client certificates signed by it (mTLS); "
        "gRPC health probes then need a client certificate too")
    add(p, "--api-key-file", str, "", "file of API keys, one a line; every call must then carry "
        "`authorization: Bearer KEY` or `x-api-key: KEY` (health checks excepted; on the router, reflection too)")


def add_worker_flags(p: argparse.ArgumentParser, role: str) -> None:
    add_server_flags(p, 50061 if role == "target" else 50062)
    add(p, "--model", str, "", "GGUF model path (default: the default model of this role)")
    if role == "draft":
        add(p, "--ngram", str, "", "model-free drafter(s): simple|map-k|map-k4v|mod|cache, comma-separated chain; "
            "llama.cpp parameters after a name, e.g. map-k:size-n=3:size-m=16")
        add(p, "--ngram-cache", str, "", "file the `cache` drafter loads its static n-gram cache from")
        add(p, "--n-vocab", int, 0, "n-gram drafter: vocabulary size of the target; token ids at or above it "
            "are refused (0: any non-negative id)")
    add(p, "--threads", at_least(1), 1, "threads for decoding while the router says the draft computes "
        "on the cores --threads-batch borrows; set it explicitly when processes share cores")
    add(p, "--threads-batch", at_least(0), 0, "threads for every decode (single tokens too) while the draft "
        "does not compute: prompts, verifications, batched sessions, a target alone (0: --threads)")
    add(p, "--n-ctx", at_least(MIN_N_CTX), 2048, "context of ONE sequence, in positions (llama.cpp's -c is the "
        "total split over its slots: this worker allocates --n-ctx × --n-seq)")
    add(p, "--n-seq", int, 4, "sequences hosted at once")
    add(p, "--n-batch", int, 512, "largest batch decoded at once")
    add(p, "--kv-unified", bool, False, "one KV buffer for all sequences, as llama.cpp's --kv-unified: any mix of "
        "sequences and lengths decodes in one pass, but greedy output under concurrency may then differ from "
        "the request alone (logits depend on where cells sit) and attention reads every sequence's cells")
    add(p, "--n-gpu-layers", int, 0, "layers offloaded to the GPU (CUDA builds)")
    add(p, "--calibrate", bool, True, "time decode batches at load (the router's prior for adaptive speculation)")
    add(p, "--batch-wait-ms", float, 10.0, "longest wait (and at most a fifth of the last batch's time) for the "
        "last batch's sequences to send their next operation, so they batch together (0: never wait)")
    add(p, "--max-queued-ops", at_least(1), MAX_QUEUED_OPS, "operations waiting for a round, all streams "
        "together; past it an operation is answered RESOURCE_EXHAUSTED")
    add(p, "--max-stream-ops", at_least(1), MAX_STREAM_OPS, "operations of one Execute stream not answered yet; "
        "past it the stream ends with RESOURCE_EXHAUSTED (its caller is not reading its results)")


def add_router_flags(p: argparse.ArgumentParser) -> None:
    add_server_flags(p, 50051)
    add(p, "--target", str, "", "target worker HOST:PORT; a comma list of several spreads sessions over them "
                                "and moves a session whose target dies to another")
    add(p, "--draft", str, "", "draft worker HOST:PORT (none: target-only)")
    add(p, "--ngram", str, "", "instead of --draft: a model-free drafter in the router process, as `specd draft "
        "--ngram` takes it (no round trip to a worker per step; it holds no KV)")
    add(p, "--ngram-cache", str, "", "with --ngram: file the `cache` drafter loads its static n-gram cache from")
    r = _ROUTER
    add(p, "--n-max", int, r.n_max, "default draft tokens per step")
    add(p, "--n-min", int, r.n_min, "default minimum draft tokens worth verifying")
    add(p, "--p-min", float, r.p_min, "default draft probability below which drafting stops")
    add(p, "--checkpoint-mode", bool, r.checkpoint_mode, "use checkpoints instead of partial KV removal (forced)")
    add(p, "--check-alignment", bool, r.check_alignment, "compare both workers' sequences with the history after every step")
    add(p, "--overlap", bool, r.overlap, "draft the next step while the target verifies this one")
    add(p, "--prompt-cache", bool, r.prompt_cache, "keep finished sessions' KV for prompts that share their prefix")
    add(p, "--adaptive", bool, r.adaptive, "choose each step's draft length (up to n_max, down to 0) from acceptance and load")
    add(p, "--solo-tokens", at_least(1, MAX_N_MORE + 1), r.solo_tokens, "tokens the target generates per call when a step "
        "asks for no drafts (drafting off, or adaptive under load), fewer when other sessions' work waits for it")
    add(p, "--stream-tokens", at_least(1, MAX_N_MORE + 1), r.stream_tokens, "meanwhile the stream gets them in groups "
        "this large; a request with stop strings asks for no more per call")
    add(p, "--max-queue", int, r.max_queue, "sessions waiting for a sequence before RESOURCE_EXHAUSTED")
    add(p, "--worker-timeout", float, RouterConfig.worker_timeout, "deadline of one worker call in seconds")
    add(p, "--draft-wait", float, r.draft_wait, "at start, seconds to wait for a loading draft before serving target-only")
    add(p, "--target-wait", float, r.target_wait, "seconds a new request waits for a target that is draining, "
        "restarting or reconnecting before UNAVAILABLE")
    add(p, "--worker-tls-cert", str, "", "PEM client certificate presented to the workers (mTLS)")
    add(p, "--worker-tls-key", str, "", "PEM private key of --worker-tls-cert")
    add(p, "--worker-tls-ca", str, "", "PEM CA file the workers' certificates are verified against "
        "(any --worker-tls-* flag turns TLS on; no CA: the system roots)")
    add(p, "--worker-tls-server-name", str, "", "name expected in the workers' certificates when it is not their host")
    add(p, "--worker-api-key-file", str, "", "file whose first key is presented to workers started with "
        "--api-key-file; unset: the first key of --api-key-file")
    add(p, "--max-prompt-tokens", int, 0, "largest prompt in tokens (0: the context size)")
    add(p, "--max-tokens-limit", int, 0, "largest max_tokens of a request; also caps requests that leave it unset (0: none)")
    add(p, "--max-message-bytes", int, 4 << 20, "largest request message in bytes (gRPC answers RESOURCE_EXHAUSTED)")
    add(p, "--request-timeout", float, 0.0, "longest a Generate may run in seconds (0: no limit; "
        "the client's own gRPC deadline always applies)")
    add(p, "--max-stop-strings", at_least(0), MAX_STOP_STRINGS, "most stop strings in one request")
    add(p, "--max-stop-length", at_least(1), MAX_STOP_LENGTH, "longest stop string in characters")
    add(p, "--max-prompt-bytes", at_least(0), 0, "largest prompt text in UTF-8 bytes, refused before it is "
        f"tokenized (0: {PROMPT_BYTES_PER_TOKEN} per token of --max-prompt-tokens, or of the context)")
    add(p, "--http-port", int, 8080, "port of the OpenAI-compatible HTTP API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health) on --host; same keys, limits and TLS as gRPC (0: off)")


def build(cls, args: argparse.Namespace, **extra):
    names = {f.name for f in fields(cls)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(extra)
    return cls(**values)
