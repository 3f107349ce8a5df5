"""The public gRPC API (specd.v1.Router): protobuf in, Router call, protobuf out."""
from __future__ import annotations

import contextlib
import logging
import time

import grpc

from specd import codec
from specd.router.chat import chat_prompt
from specd.router.engine import Router
from specd.router.params import GenParams, Result
from specd.router.limits import Limits
from specd.router.text import TextAssembler
from specd.errors import InvalidArgument, SpecdError, Unavailable
from specd.v1 import router_pb2 as rpb
from specd.v1 import router_pb2_grpc as rpb_grpc

log = logging.getLogger("specd.router")


async def abort(context: grpc.aio.ServicerContext, exc: SpecdError) -> None:
    """End the call with the error's rich status (codec.rich_status)."""
    status = codec.rich_status(exc)
    await context.abort(status.code, status.details, status.trailing_metadata)


class RouterServicer(rpb_grpc.RouterServicer):
    def __init__(self, router: Router, metrics=None, limits: Limits | None = None):
        self.router = router
        self.metrics = metrics
        self.limits = limits or Limits()
        self.ready = False

    def _check_ready(self) -> None:
        if not self.ready:
            raise Unavailable("the router is waiting for its target worker")

    async def _params(self, r: rpb.GenerateRequest) -> GenParams:
        which = r.WhichOneof("input")
        if which is None:
            raise InvalidArgument("prompt: set `prompt` (text), `prompt_tokens` or `messages`", field="prompt")
        self.limits.check_stops(r.stop)
        if which == "prompt":
            if not r.prompt:
                raise InvalidArgument("prompt must not be empty", field="prompt")
            self.limits.check_prompt_text("prompt", [r.prompt], self.router.n_ctx)
            add_special = r.add_special if r.HasField("add_special") else True
            tokens = await (await self.router.live_target()).tokenize(r.prompt, add_special, True)
        elif which == "messages":
            self.limits.check_prompt_text("messages", (m.content for m in r.messages.messages), self.router.n_ctx)
            tokens = await chat_prompt(self.router, codec.messages_from_pb(r.messages))
        else:
            tokens = list(r.prompt_tokens.ids)
            if not tokens:
                raise InvalidArgument("prompt_tokens must not be empty", field="prompt_tokens")
        spec = r.speculative
        return GenParams(
            prompt=tokens,
            max_tokens=r.max_tokens if r.HasField("max_tokens") else None,
            sampling=codec.sampling_from_pb(r.sampling, random_seed=True),
            speculative=spec.enabled if spec.HasField("enabled") else None,
            n_max=spec.n_max if spec.HasField("n_max") else None,
            n_min=spec.n_min if spec.HasField("n_min") else None,
            p_min=spec.p_min if spec.HasField("p_min") else None,
            adaptive=spec.adaptive if spec.HasField("adaptive") else None,
            acceptance=codec.acceptance_from_pb(spec.acceptance),
            context_shift=r.context_shift,
            n_keep=r.n_keep,
            stop_strings=any(r.stop),
        )

    async def Generate(self, request, context):
        try:
            async with contextlib.aclosing(self.generate(request, "grpc")) as stream:
                async for msg in stream:
                    yield msg
        except Exception as exc:  # a SpecdError with its code, anything else INTERNAL
            await abort(context, codec.as_error(exc))

    async def generate(self, request: rpb.GenerateRequest, protocol: str):
        """Generate without its transport: GenerateResponse messages, failures
        raised as SpecdError. The gRPC and HTTP APIs are thin layers over it;
        `protocol` labels the request in the metrics."""
        t0 = time.perf_counter()
        outcome = "ok"
        res = Result()
        limits = self.limits
        deadline = limits.deadline()
        try:
            self._check_ready()
            params = await limits.within(self._params(request), deadline)
            limits.apply(params, self.router)
            text = TextAssembler(list(request.stop))
            last, n_streamed = None, 0
            async with contextlib.aclosing(self.router.generate(params, res)) as steps:
                while True:
                    # request_timeout bounds each step; the time spent writing to
                    # the client counts too, as the deadline is fixed
                    try:
                        step = await (anext(steps) if deadline is None else limits.within(anext(steps), deadline))
                    except StopAsyncIteration:
                        break
                    now = time.perf_counter()
                    if self.metrics is not None:
                        if last is None:
                            self.metrics.ttft.observe(now - t0)
                        else:
                            for _ in step.tokens:
                                self.metrics.itl.observe((now - last) / len(step.tokens))
                    last = now
                    # a step may run past the token completing a stop string;
                    # target-only decoding stops at it, so the tokens end there
                    fed = text.feed_pieces(step.pieces)
                    n_streamed += fed.n_tokens
                    yield rpb.GenerateResponse(text=fed.text, token_ids=step.tokens[:fed.n_tokens])
                    if text.stopped:
                        res.reason, res.n_generated = "stop", n_streamed
                        break
            yield rpb.GenerateResponse(text=text.flush(), finish=codec.finish_pb(res))
        except SpecdError as exc:
            outcome = exc.code.lower()
            raise
        except BaseException as exc:
            outcome = "cancelled" if isinstance(exc, GeneratorExit) or "Cancel" in type(exc).__name__ else "error"
            if outcome == "error":
                log.exception("Generate failed")
            raise
        finally:
            if self.metrics is not None:
                self.metrics.requests.labels(outcome=outcome, protocol=protocol).inc()
                self.metrics.e2e.observe(time.perf_counter() - t0)
                self.metrics.prompt_tokens.inc(res.n_prompt)
                self.metrics.generation_tokens.inc(res.n_generated)

    async def Tokenize(self, request, context):
        try:
            self._check_ready()
            self.limits.check_prompt_text("text", [request.text], self.router.n_ctx)
            target = await self.router.live_target()
            tokens = await target.tokenize(request.text, request.add_special, request.parse_special)
        except SpecdError as exc:
            await abort(context, exc)
        return rpb.TokenizeResponse(tokens=tokens)

    async def GetInfo(self, request, context):
        try:
            self._check_ready()
        except SpecdError as exc:
            await abort(context, exc)
        r, s = self.router, self.router.settings
        info = rpb.GetInfoResponse(target=codec.public_model_info_pb(r.target_info), default_n_max=s.n_max, default_p_min=s.p_min,
                              checkpoint_mode=r.checkpoint_mode, check_alignment=s.check_alignment,
                              draft_up=r.draft_up)
        if r.draft_info is not None:
            info.draft.CopyFrom(codec.public_model_info_pb(r.draft_info))
        return info
