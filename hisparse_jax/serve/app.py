"""The HTTP routes (a Starlette app) over one `EngineLoop`.

  POST /v1/completions, POST /v1/chat/completions (when the tokenizer has a chat template):
    the body is checked (`schema`) before anything reaches the engine: 400 with OpenAI's
    error object naming the field (`param`); 404 for another `model`; 503 with Retry-After
    when the server already holds `capacity` requests, 503 while it shuts down. Then the
    request runs on the engine thread and the response is one JSON body, or (stream: true)
    server-sent events in OpenAI's chunk format ending with `data: [DONE]`. A client that
    disconnects cancels its request (its seat is freed at the loop's next turn). An engine
    failure of the request: 500 with the error object, or, streaming, an error event then
    [DONE].
  GET /v1/models, GET /health (503 while draining), GET /metrics (Prometheus text).

`ServerState` holds what the routes share; `JobResponse` is the ASGI response of one
generation request (both the streamed and the whole form), which also watches for the
client's disconnect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hisparse_jax.models.tokenizer import Tokenizer
from hisparse_jax.serve import schema
from hisparse_jax.serve.engine_loop import Draining, EngineLoop, Job, QueueFull, Update
from hisparse_jax.serve.metrics import ServerMetrics
from hisparse_jax.serve.responses import Output
from hisparse_jax.serve.schema import GenerationRequest, Limits, RequestError
from hisparse_jax.serve.text import ChatTemplate, TextStream

RETRY_AFTER_S = 1  # what a 503 for a full server asks the client to wait


@dataclasses.dataclass
class ServerState:
    """What the routes share: the engine loop, the metrics, the model's limits, its
    tokenizer and chat template (None: none), and the responses open now."""

    loop: EngineLoop
    metrics: ServerMetrics
    limits: Limits
    tokenizer: Tokenizer | None = None
    chat_template: ChatTemplate | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    open_responses: int = 0

    @property
    def model_name(self) -> str:
        return self.limits.model_name

    def encode(self, special: bool) -> Callable[[str], list[int]] | None:
        if self.tokenizer is None:
            return None
        return lambda text: self.tokenizer.encode(text, add_special_tokens=special)

    def stop_token_ids(self, gen: GenerationRequest) -> tuple[int, ...]:
        """The engine's stop tokens: the request's, and the tokenizer's end of sequence
        unless it asked to ignore it."""
        eos = () if gen.ignore_eos or self.tokenizer is None else self.tokenizer.eos_token_ids
        return tuple(dict.fromkeys((*gen.stop_token_ids, *eos)))


def error_response(error: RequestError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class JobResponse:
    """The ASGI response of one submitted request: waits for its updates (an asyncio queue the
    engine thread posts into), sends the whole body or the event stream, and cancels the
    request when the client disconnects or the response ends early."""

    def __init__(self, state: ServerState, job: Job, events: asyncio.Queue,
                 output: Output) -> None:
        self.state, self.job, self.events, self.output = state, job, events, output
        self.engine_done = False

    async def _next(self) -> Update:
        update = await self.events.get()
        if update.finish_reason is not None or update.rejected is not None:
            self.engine_done = True
        return update

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        self.state.open_responses += 1
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, tasks.cancel_scope)
                first = await self._next()
                if first.rejected is not None:
                    self.state.metrics.rejected("invalid")
                    await error_response(RequestError(first.rejected, "prompt"))(
                        scope, receive, send)
                elif self.output.gen.stream:
                    await self._stream(send)
                else:
                    await self._whole(scope, receive, send)
                tasks.cancel_scope.cancel()
        finally:
            self.state.open_responses -= 1
            if not self.engine_done:  # a disconnect, or a stop string: free its seat
                self.state.loop.cancel(self.job.request_id)

    async def _watch(self, receive: Callable, scope: anyio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                scope.cancel()
                return

    async def _finished(self) -> None:
        """Applies updates until the output is done (the engine finished it, or a stop
        string did)."""
        while not self.output.done:
            self.output.apply(await self._next())

    async def _whole(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self._finished()
        out = self.output
        if out.finish_reason == "error":
            error = RequestError(f"the engine failed this request: {out.error}", None,
                                 status=500, kind="engine_error")
            await error_response(error)(scope, receive, send)
        else:
            await JSONResponse(out.body())(scope, receive, send)

    async def _stream(self, send: Callable) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})

        async def event(data: Any) -> None:
            text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {text}\n\n".encode(),
                        "more_body": True})

        out = self.output
        if out.kind == "chat":
            await event(out.chunk([], ""))  # the assistant's turn opens at once
        while not out.done:
            ids, text = out.apply(await self._next())
            if out.finish_reason == "error":
                await event(RequestError(f"the engine failed this request: {out.error}", None,
                                         status=500, kind="engine_error").body())
                break
            chunk = out.chunk(ids, text)
            if chunk is not None:
                await event(chunk)
        if out.gen.include_usage:
            await event(out.usage_chunk())
        await event("[DONE]")
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON ({e})") from None


def _submit(state: ServerState, kind: str, gen: GenerationRequest) -> JobResponse:
    """Hands a checked request to the engine loop (QueueFull / Draining propagate)."""
    events: asyncio.Queue = asyncio.Queue()
    aloop = asyncio.get_running_loop()

    def sink(update: Update) -> None:  # on the engine thread
        try:
            aloop.call_soon_threadsafe(events.put_nowait, update)
        except RuntimeError:  # the event loop closed: nobody is listening
            pass

    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    job = Job(request_id, gen.prompt, gen.max_tokens, gen.temperature, gen.seed,
              state.stop_token_ids(gen), sink)
    text = None
    if state.tokenizer is not None:
        tok = state.tokenizer
        text = TextStream(lambda ids: tok.decode(ids, skip_special_tokens=True), gen.stop)
    output = Output(kind, request_id, state.model_name, gen, text)
    state.loop.submit(job)
    return JobResponse(state, job, events, output)


def _unavailable(state: ServerState, error: Exception) -> JSONResponse:
    full = isinstance(error, QueueFull)
    state.metrics.rejected("queue_full" if full else "draining")
    message = f"{error}; retry later" if full else str(error)
    return error_response(RequestError(message, None, status=503, kind="service_unavailable"),
                          headers={"Retry-After": str(RETRY_AFTER_S)} if full else None)


def build_app(state: ServerState, lifespan: Callable | None = None) -> Starlette:
    """The Starlette app of `state`; `lifespan`: the caller's (`server.py` stops the engine
    loop at its end)."""

    async def generate(request: Request, kind: str) -> Any:
        try:
            body = await _body(request)
            if kind == "chat":
                gen = _chat(state, body)
            else:
                gen = schema.completion_request(body, state.limits, state.encode(True))
        except RequestError as e:
            state.metrics.rejected("invalid")
            return error_response(e)
        try:
            return _submit(state, kind, gen)
        except (QueueFull, Draining) as e:
            return _unavailable(state, e)

    async def completions(request: Request) -> Any:
        return await generate(request, "completion")

    async def chat(request: Request) -> Any:
        return await generate(request, "chat")

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": state.model_name, "object": "model", "created": state.created,
            "owned_by": "hisparse-jax", "max_model_len": state.limits.max_model_len}]})

    async def health(request: Request) -> JSONResponse:
        if state.loop.draining or not state.loop.alive:
            return JSONResponse({"status": "draining" if state.loop.alive else "stopped"},
                                status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        body, content_type = state.metrics.exposition()
        return Response(body, media_type=content_type)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)


def _chat(state: ServerState, body: Any) -> GenerationRequest:
    template = state.chat_template
    if template is None or state.tokenizer is None:
        raise RequestError("this model has no chat template (tokenizer_config.json "
                           "'chat_template'); use /v1/completions", "messages")

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return template.render(messages)
        except Exception as e:  # noqa: BLE001 - the template's own refusal, or a bad one
            raise RequestError(f"the chat template refused 'messages': {e}",
                               "messages") from None

    return schema.chat_request(body, state.limits, render, state.encode(False))
