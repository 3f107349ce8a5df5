"""A small synchronous client of the router, used by `specd generate`, `specd
demo`, the benchmark and the tests."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from specd.security import api_key_metadata
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc

REASON_NAMES = {rpb.FINISH_REASON_EOG: "eog", rpb.FINISH_REASON_LENGTH: "length", rpb.FINISH_REASON_STOP: "stop"}


@dataclass
class Completion:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    n_prompt: int = 0
    n_generated: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    n_steps: int = 0
    n_shifts: int = 0
    n_cached: int = 0
    finish_reason: str = ""
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    draft_compute_seconds: float = 0.0
    verify_compute_seconds: float = 0.0
    steps_seconds: float = 0.0
    critical_compute_seconds: float = 0.0
    wall_seconds: float = 0.0
    speculative: bool = False

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens / seconds of the generation phase (after the prompt)."""
        return self.n_generated / self.generation_seconds if self.generation_seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    def as_json(self) -> dict:
        return {
            "text": self.text, "tokens": self.tokens, "n_prompt": self.n_prompt, "n_generated": self.n_generated,
            "n_drafted": self.n_drafted, "n_accepted": self.n_accepted, "finish_reason": self.finish_reason,
            "tokens_per_second": round(self.tokens_per_second, 3), "steps": self.n_steps,
            "speculative": self.speculative,
        }


def make_request(prompt: str | list[int] | list[dict], max_tokens: int | None = None, temperature: float | None = None,
                 seed: int | None = None, speculative: bool | None = None, n_draft: int | None = None,
                 stop: list[str] | None = None, adaptive: bool | None = None, acceptance: str | None = None,
                 **extra) -> rpb.GenerateRequest:
    """`prompt`: text, token ids, or chat messages as OpenAI's
    [{"role": ..., "content": ...}] (rendered with the target's chat template).
    `acceptance`: "exact" or "rejection" (speculative.acceptance); None: the router's default.
    `temperature`, `seed`: set on top of a `sampling=` message when given (None
    leaves it as passed; without one, greedy)."""
    req = rpb.GenerateRequest(stop=stop or [], **extra)
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt and isinstance(prompt[0], dict):
        req.messages.messages.extend(rpb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.prompt_tokens.ids.extend(prompt)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if temperature is not None:
        req.sampling.temperature = temperature
    if seed is not None:
        req.sampling.seed = seed
    if speculative is not None:
        req.speculative.enabled = speculative
    if n_draft is not None:
        req.speculative.n_max = n_draft
    if adaptive is not None:
        req.speculative.adaptive = adaptive
    if acceptance is not None:
        req.speculative.acceptance = rpb.Acceptance.Value(f"ACCEPTANCE_{acceptance.upper()}")
    return req


def collect(stream, on_text: Callable[[str], None] | None = None) -> Completion:
    """Drain a Generate stream into a Completion."""
    out = Completion()
    t0 = time.perf_counter()
    parts = []
    for msg in stream:
        if msg.text:
            parts.append(msg.text)
            if on_text is not None:
                on_text(msg.text)
        out.tokens.extend(msg.token_ids)
        if msg.HasField("finish"):
            f = msg.finish
            out.finish_reason = REASON_NAMES.get(f.reason, "unspecified")
            out.n_prompt, out.n_generated = f.usage.prompt_tokens, f.usage.generated_tokens
            out.n_drafted, out.n_accepted, out.n_steps = f.usage.drafted_tokens, f.usage.accepted_tokens, f.usage.steps
            out.n_shifts = f.usage.context_shifts
            out.n_cached = f.usage.cached_tokens
            out.prompt_seconds, out.generation_seconds = f.timing.prompt_seconds, f.timing.generation_seconds
            out.draft_compute_seconds = f.timing.draft_compute_seconds
            out.verify_compute_seconds = f.timing.verify_compute_seconds
            out.steps_seconds = f.timing.steps_seconds
            out.critical_compute_seconds = f.timing.critical_compute_seconds
            out.speculative = f.speculative
    out.text = "".join(parts)
    out.wall_seconds = time.perf_counter() - t0
    return out


class RouterClient:
    """`api_key`: sent as `authorization: Bearer <key>` on every call (routers
    started with --api-key-file). `credentials`: TLS channel credentials
    (grpc.ssl_channel_credentials) for a router serving TLS; None: plaintext."""

    def __init__(self, address: str, timeout: float = 600.0, api_key: str | None = None,
                 credentials: grpc.ChannelCredentials | None = None):
        self.channel = (grpc.insecure_channel(address) if credentials is None
                        else grpc.secure_channel(address, credentials))
        self.stub = rpb_grpc.RouterStub(self.channel)
        self.timeout = timeout
        self.metadata = api_key_metadata(api_key)

    def generate(self, prompt: str | list[int] | list[dict], on_text: Callable[[str], None] | None = None,
                 **kw) -> Completion:
        stream = self.stub.Generate(make_request(prompt, **kw), timeout=self.timeout, metadata=self.metadata)
        return collect(stream, on_text)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        r = self.stub.Tokenize(rpb.TokenizeRequest(text=text, add_special=add_special, parse_special=parse_special),
                               timeout=self.timeout, metadata=self.metadata)
        return list(r.tokens)

    def info(self) -> rpb.GetInfoResponse:
        return self.stub.GetInfo(rpb.GetInfoRequest(), timeout=self.timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
