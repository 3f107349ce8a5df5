"""OpenAI's request and response shapes, converted to and from the router's
own messages. A request body becomes the GenerateRequest a gRPC client would
send; the GenerateResponse stream becomes OpenAI's JSON. Everything between
(tokenizing, chat rendering, limits, stop strings, the engine, metrics) is
the gRPC servicer's one path (RouterServicer.generate). No HTTP here: that is
router/http.py.

Supported: /v1/chat/completions and /v1/completions with max_tokens /
max_completion_tokens, temperature, top_p, top_k, min_p, seed, stop, n = 1,
stream and stream_options.include_usage. Extensions: `speculative`
({enabled, n_max, n_min, p_min, adaptive}, as SpeculativeParams) and
`return_token_ids` (vLLM's: the generated token ids beside the text).
Features that would change the output and are not implemented (logit_bias,
logprobs, tools, penalties, ...) are refused with a 400 naming the field, so
that nobody gets an answer that silently ignored them. Unknown fields are
ignored, as OpenAI's own clients send some (user, store, metadata, ...).
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specd.router.chat import ChatMessage, FieldError, check_messages
from specd.v1 import router_pb2 as rpb

# OpenAI's default temperature: a client written against OpenAI that sends
# none expects sampling (send 0 for greedy decoding)
DEFAULT_TEMPERATURE = 1.0
CHAT, COMPLETION = "chat", "completion"
SPECULATIVE_FIELDS = {"enabled": bool, "n_max": int, "n_min": int, "p_min": float, "adaptive": bool}
FINISH_REASONS = {rpb.FINISH_REASON_EOG: "stop", rpb.FINISH_REASON_STOP: "stop", rpb.FINISH_REASON_LENGTH: "length"}
# fields that would change the answer and are not implemented: refused unless
# absent or set to their "off" value (null, false, 0, empty; "none" for a tool choice)
UNSUPPORTED = ("logit_bias", "logprobs", "top_logprobs", "tools", "tool_choice", "functions", "function_call",
               "presence_penalty", "frequency_penalty", "echo", "suffix", "prediction", "audio")
OFF = (None, False, 0, {}, [], "")


@dataclass
class ApiRequest:
    """One OpenAI request, converted."""

    kind: str  # CHAT | COMPLETION
    request: rpb.GenerateRequest
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == CHAT else "cmpl-") + self.id


# ------------------------------------------------------------------ fields
def _typed(body: dict, name: str, kind: type, default: Any = None, prefix: str = "") -> Any:
    """body[name] checked against a JSON type (bool is not a number); None
    when absent or null. `prefix`: where `body` sits in the request."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        expected = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object",
                    list: "an array"}[kind]
        raise FieldError(prefix + name, f"must be {expected}, got {type(value).__name__} {value!r}"[:200])
    return value


def _refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in OFF and not (name in ("tool_choice", "function_call") and value == "none"):
            raise FieldError(name, "is not supported by this server; remove it")
    if body.get("n") not in (None, 1):
        raise FieldError("n", f"only n = 1 is supported, got {body.get('n')!r}")
    if body.get("best_of") not in (None, 1):
        raise FieldError("best_of", f"only best_of = 1 is supported, got {body.get('best_of')!r}")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise FieldError("response_format", "only {\"type\": \"text\"} is supported")


def _text_content(content: Any, name: str) -> str:
    """A message's content: a string or an array of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FieldError(name, "must be a string or an array of text parts")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise FieldError(f"{name}[{j}]", "only parts {\"type\": \"text\", \"text\": STRING} are supported")
        parts.append(part["text"])
    return "".join(parts)


def parse_messages(value: Any) -> list[ChatMessage]:
    if not isinstance(value, list):
        raise FieldError("messages", "must be an array of messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise FieldError(f"messages[{i}]", "must be an object with `role` and `content`")
        if m.get("tool_calls") or m.get("function_call"):
            raise FieldError(f"messages[{i}].tool_calls", "tools are not supported by this server")
        role = m.get("role")
        # OpenAI's newer name for the system role
        role = "system" if role == "developer" else role
        if not isinstance(role, str):
            raise FieldError(f"messages[{i}].role", "must be a string")
        out.append(ChatMessage(role, _text_content(m.get("content"), f"messages[{i}].content")))
    check_messages(out)
    return out


def _set_prompt(req: rpb.GenerateRequest, value: Any) -> None:
    """/v1/completions `prompt`: a string or token ids, or an array of one of them."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        req.prompt = value
    elif isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        if any(not -(1 << 31) <= t < (1 << 31) for t in value):
            raise FieldError("prompt", "token ids must be 32-bit integers")
        req.prompt_tokens.ids.extend(value)
    elif isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise FieldError("prompt", f"one prompt per request is supported, got {len(value)}")
    else:
        raise FieldError("prompt", "must be a string, an array of token ids, or an array of one of them")


def _sampling(body: dict) -> rpb.SamplingParams:
    s = rpb.SamplingParams(temperature=_typed(body, "temperature", float, DEFAULT_TEMPERATURE))
    top_p = _typed(body, "top_p", float)
    if top_p is not None:
        if not 0.0 < top_p <= 1.0:  # proto3 reads 0 as unset
            raise FieldError("top_p", f"must be in (0, 1], got {top_p}")
        s.top_p = top_p
    s.top_k = _int32(body, "top_k", 0)
    s.min_p = _typed(body, "min_p", float, 0.0)
    seed = _typed(body, "seed", int)
    if seed is not None:
        if not -(1 << 63) <= seed < (1 << 64):
            raise FieldError("seed", "must fit 64 bits")
        s.seed = seed % (1 << 64)  # OpenAI's seeds are signed
    return s


def _int32(body: dict, name: str, default: int | None = None) -> int | None:
    value = _typed(body, name, int, default)
    if value is not None and not -(1 << 31) <= value < (1 << 31):
        raise FieldError(name, f"must fit 32 bits, got {value}")
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise FieldError("stop", "must be a string or an array of strings")
    return stops


def _speculative(body: dict, req: rpb.GenerateRequest) -> None:
    spec = _typed(body, "speculative", dict)
    for key, value in (spec or {}).items():
        if key not in SPECULATIVE_FIELDS:
            raise FieldError(f"speculative.{key}", f"unknown; the fields are {', '.join(SPECULATIVE_FIELDS)}")
        value = _typed(spec, key, SPECULATIVE_FIELDS[key], prefix="speculative.")
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value < (1 << 31):
            raise FieldError(f"speculative.{key}", f"must be in [0, 2^31), got {value}")
        if value is not None:
            setattr(req.speculative, key, value)


def parse_request(body: Any, kind: str) -> ApiRequest:
    """An OpenAI request body as the GenerateRequest both APIs run. Raises
    FieldError naming the first field that cannot be used."""
    if not isinstance(body, dict):
        raise FieldError("body", "must be a JSON object")
    _refuse_unsupported(body)
    req = rpb.GenerateRequest(sampling=_sampling(body), stop=_stops(body))
    if kind == CHAT:
        if "messages" not in body:
            raise FieldError("messages", "is required")
        req.messages.messages.extend(rpb.ChatMessage(role=m.role, content=m.content)
                                     for m in parse_messages(body["messages"]))
    else:
        if "prompt" not in body:
            raise FieldError("prompt", "is required")
        _set_prompt(req, body["prompt"])
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int32(body, name)
    if max_tokens is not None:
        if max_tokens < 1:
            raise FieldError(name, f"must be >= 1, got {max_tokens}")
        req.max_tokens = max_tokens
    _speculative(body, req)
    options = _typed(body, "stream_options", dict) or {}
    return ApiRequest(kind, req, stream=_typed(body, "stream", bool, False),
                      include_usage=_typed(options, "include_usage", bool, False, prefix="stream_options."),
                      return_token_ids=_typed(body, "return_token_ids", bool, False))


# ---------------------------------------------------------------- answers
def usage_json(finish: rpb.Finish) -> dict:
    u = finish.usage
    return {
        "prompt_tokens": u.prompt_tokens, "completion_tokens": u.generated_tokens,
        "total_tokens": u.prompt_tokens + u.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        # extension: what speculative decoding did for this request
        "speculative": {"enabled": finish.speculative, "drafted_tokens": u.drafted_tokens,
                        "accepted_tokens": u.accepted_tokens, "steps": u.steps},
    }


def _choice(a: ApiRequest, text: str | None, token_ids, finish_reason: str | None, delta: bool) -> dict:
    choice: dict = {"index": 0}
    if a.kind == COMPLETION:
        choice["text"] = text or ""
    elif delta:
        choice["delta"] = {} if text is None else {"content": text}
    else:
        choice["message"] = {"role": "assistant", "content": text}
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if a.return_token_ids:
        choice["token_ids"] = list(token_ids)
    return choice


def response_json(a: ApiRequest, model: str, text: str, token_ids: list[int], finish: rpb.Finish) -> dict:
    """The whole answer of a request without `stream`."""
    return {
        "id": a.response_id, "object": "chat.completion" if a.kind == CHAT else "text_completion",
        "created": a.created, "model": model,
        "choices": [_choice(a, text, token_ids, FINISH_REASONS.get(finish.reason, "stop"), delta=False)],
        "usage": usage_json(finish),
    }


def chunk_json(a: ApiRequest, model: str, text: str | None = None, token_ids=(), finish: rpb.Finish | None = None,
               role: bool = False) -> dict:
    """One streamed chunk: text (and its token ids), or the finish reason."""
    reason = FINISH_REASONS.get(finish.reason, "stop") if finish is not None else None
    choice = _choice(a, text, token_ids, reason, delta=True)
    if role:
        choice["delta"] = {"role": "assistant", "content": ""}
    out = {"id": a.response_id, "object": "chat.completion.chunk" if a.kind == CHAT else "text_completion",
           "created": a.created, "model": model, "choices": [choice]}
    if a.include_usage:
        out["usage"] = None  # as OpenAI: null on every chunk but the last
    return out


def usage_chunk_json(a: ApiRequest, model: str, finish: rpb.Finish) -> dict:
    """stream_options.include_usage: the last chunk, no choices, the usage."""
    return {"id": a.response_id, "object": "chat.completion.chunk" if a.kind == CHAT else "text_completion",
            "created": a.created, "model": model, "choices": [], "usage": usage_json(finish)}
