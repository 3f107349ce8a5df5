"""The router's OpenAI-compatible HTTP API: Starlette on uvicorn, on the
router's own event loop beside its gRPC server (`--http-port`, 0: off;
router/http_server.py).

- POST /v1/chat/completions, POST /v1/completions: one JSON answer, or with
  `stream` Server-Sent Events ending with `data: [DONE]`;
- GET /v1/models: the target model;
- GET /health: 200 while the router can serve (ready, a target taking
  sessions, not shutting down), 503 otherwise; open without an API key, for probes.

A request body becomes the GenerateRequest a gRPC client would send
(router/openai_api.py) and runs through RouterServicer.generate: the same
sessions, queue, limits, stop strings and metrics as gRPC. API keys
(--api-key-file): `Authorization: Bearer KEY` or `x-api-key: KEY`. Errors
are OpenAI's JSON error object: 400 naming the field, 401, 404, 413 (body
over --max-message-bytes), 429 (queue full), 503 (no target), 504
(request_timeout). A client that closes its connection cancels its request
wherever it is (queued, prompt, mid-stream): its sequence is freed on both
workers, as for a cancelled gRPC stream.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import pathlib
import time
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specd.router.openai_api import CHAT, COMPLETION, ApiRequest, chunk_json, parse_request, response_json, usage_chunk_json
from specd.errors import Internal, SpecdError
from specd.security import INVALID, authorized

log = logging.getLogger("specd.router.http")

STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
          "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "ABORTED": 503,
          "DEADLINE_EXCEEDED": 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}
MISSING_KEY = ("this router requires an API key: send the header `Authorization: Bearer <key>` "
               "or `x-api-key: <key>`")
# A body over the limit is still read (and dropped) up to this many bytes, so
# that the client, still sending, reads the 413 rather than a reset connection
DRAIN_BYTES = 64 << 20
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]  # proxies such as nginx must not buffer the stream


class HttpError(Exception):
    """An answer other than 200, as OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def of(cls, exc: SpecdError) -> "HttpError":
        return cls(STATUS.get(exc.code, 500), exc.message, getattr(exc, "field", "") or None, exc.code.lower())

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class HttpApi:
    """The endpoints, over one RouterServicer (router/service.py)."""

    def __init__(self, servicer, api_keys: list[bytes] | None = None, max_body: int = 4 << 20,
                 stopping: asyncio.Event | None = None):
        self.servicer = servicer
        self.api_keys = api_keys
        self.max_body = max_body
        self.stopping = stopping
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})

    def serving(self) -> bool:
        """Ready, not shutting down, and a target taking sessions (whose
        health the router watches: router.health)."""
        if not self.servicer.ready or (self.stopping is not None and self.stopping.is_set()):
            return False
        return self.servicer.router.can_serve

    def model_id(self) -> str:
        info = self.servicer.router.target_info
        return pathlib.Path(info.model_path).stem if info is not None and info.model_path else "specd"

    async def health(self, request: Request) -> Response:
        ok = self.serving()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._authorize(request)
            if not self.servicer.ready:
                raise HttpError(503, "the router is waiting for its target worker", code="unavailable")
        except HttpError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id(), "object": "model", "created": self.created, "owned_by": "specd"}]})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETION)

    async def _generate(self, request: Request, kind: str) -> Response:
        try:
            self._authorize(request)
            body = await read_json(request, self.max_body)
            try:
                a = parse_request(body, kind)
            except SpecdError as exc:
                self._count(exc)  # as the gRPC servicer counts the requests it refuses
                raise HttpError.of(exc) from None
        except HttpError as exc:
            return exc.response()
        except ClientDisconnect:  # gone while sending its body: nobody to answer
            return Response(status_code=400)
        return Generation(self, a)

    def _authorize(self, request: Request) -> None:
        if self.api_keys is None:
            return
        ok = authorized(request.headers.items(), self.api_keys)
        if not ok:
            raise HttpError(401, MISSING_KEY if ok is None else INVALID, code="invalid_api_key")

    def _count(self, exc: SpecdError) -> None:
        if self.servicer.metrics is not None:
            self.servicer.metrics.requests.labels(outcome=exc.code.lower(), protocol="http").inc()


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """Starlette's own 404 / 405 as OpenAI's error object."""
    return HttpError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").response()


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past `limit` bytes, 400 when it is not JSON."""
    size, chunks = 0, []
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > DRAIN_BYTES:
            break
    if size > limit:
        raise HttpError(413, f"the request body is larger than {limit} bytes (--max-message-bytes)",
                        code="request_too_large")
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:
        raise HttpError(400, f"the request body is not valid JSON: {exc}"[:300], param="body",
                        code="invalid_json") from None


class Generation(Response):
    """One request run as its response. The status is sent once the first
    tokens are out, so that a failure before them (a full queue, a timeout, no
    target) gets its own status; a failure after them ends the stream with an
    error event. A disconnect cancels the work wherever it is."""

    def __init__(self, api: HttpApi, a: ApiRequest):
        super().__init__(status_code=200)
        self.api, self.a = api, a

    async def __call__(self, scope, receive, send) -> None:
        work = asyncio.ensure_future(self._run(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            work.cancel()  # the client is gone (or this task was cancelled): the generation ends, its sequence frees
            await asyncio.wait({work})
        if not work.cancelled():
            work.result()

    async def _run(self, send) -> None:
        model = self.api.model_id()
        async with contextlib.aclosing(self.api.servicer.generate(self.a.request, "http")) as stream:
            try:
                first = await _next(stream)
            except SpecdError as exc:
                err = HttpError.of(exc)
                await send_json(send, err.status, err.body())
                return
            if self.a.stream:
                await self._stream(send, stream, first, model)
            else:
                await self._collect(send, stream, first, model)

    async def _collect(self, send, stream, msg, model: str) -> None:
        text, ids = [], []
        try:
            while True:
                text.append(msg.text)
                ids.extend(msg.token_ids)
                if msg.HasField("finish"):
                    await _finish(stream)
                    break
                msg = await _next(stream)
        except SpecdError as exc:
            err = HttpError.of(exc)
            await send_json(send, err.status, err.body())
            return
        await send_json(send, 200, response_json(self.a, model, "".join(text), ids, msg.finish))

    async def _stream(self, send, stream, msg, model: str) -> None:
        a = self.a
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        if a.kind == CHAT:
            await send_event(send, chunk_json(a, model, role=True))
        try:
            while True:
                if msg.text or (a.return_token_ids and msg.token_ids):
                    await send_event(send, chunk_json(a, model, msg.text, msg.token_ids))
                if msg.HasField("finish"):
                    await _finish(stream)
                    break
                msg = await _next(stream)
        except SpecdError as exc:
            await send_event(send, HttpError.of(exc).body())  # the openai client raises it as an APIError
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send_event(send, chunk_json(a, model, finish=msg.finish))
        if a.include_usage:
            await send_event(send, usage_chunk_json(a, model, msg.finish))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def _next(stream):
    """The next message; a bug surfaces as INTERNAL, answered as a 500 in
    OpenAI's shape rather than a bare one (the servicer logged it)."""
    try:
        return await anext(stream)
    except SpecdError:
        raise
    except Exception as exc:
        raise Internal(f"{type(exc).__name__}: {exc}") from exc


async def _finish(stream) -> None:
    """Run the generation past its last message, so that it ends as served
    (closing it there would count it as cancelled)."""
    await anext(stream, None)


async def _disconnected(receive) -> None:
    """Return once the client has gone (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def send_event(send, body: dict) -> None:
    data = b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": True})
