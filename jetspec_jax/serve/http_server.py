"""The OpenAI-compatible HTTP layer: parses and validates requests, turns text into token ids, submits
them to the engine, streams the text back and maps errors to OpenAI error objects. Scheduling, slots
and the device live in engine.py; this file never touches them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import math
import signal
import threading
from typing import Any, AsyncIterator, NamedTuple

import h11
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from jetspec_jax.serve.detokenize import IncrementalText
from jetspec_jax.serve.engine import (EngineClosedError, EngineFailedError, EngineRequest, FinishEvent,
                                      QueueFullError, SamplingParams, TokenEvent)
from jetspec_jax.serve.limits import (DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_BODY_BYTES,
                                      DEFAULT_MAX_CONNECTIONS)
from jetspec_jax.serve.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                                        ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                        CompletionChoice, CompletionRequest, CompletionResponse, DeltaMessage,
                                        ErrorResponse, ModelCard, ModelList, SamplingFields, Usage,
                                        completion_id, invalid_request, now, validation_error)
from jetspec_jax.tokens import encode_prompts

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256  # when the client gives no limit (capped by the room left in the context)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default


def error_response(error: APIError) -> Response:
    # ASCII JSON: a message quoting a client's lone surrogate still encodes (JSONResponse's UTF-8 did not)
    return Response(json.dumps(ErrorResponse(error=error.info).model_dump()), status_code=error.status,
                    media_type="application/json", headers=error.headers)


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_none=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


class Piece(NamedTuple):
    text: str
    finish_reason: str | None = None  # set on the last piece: "stop" or "length"
    completion_tokens: int = 0


async def pieces(handle, text: IncrementalText) -> AsyncIterator[Piece]:
    """The engine's events as text pieces; a stop string ends the request early. Errors (a cancelled
    or failed request) raise APIError."""
    while True:
        event = await handle.next()
        if isinstance(event, TokenEvent):
            delta = text.add(event.token_ids)
            if text.stopped:
                handle.cancel()  # the slot is freed at the next chunk boundary
                yield Piece(delta, "stop", len(text.token_ids))
                return
            if delta:
                yield Piece(delta)
        elif isinstance(event, FinishEvent):
            if event.reason in ("stop", "length"):
                yield Piece(text.flush(), event.reason, event.completion_tokens)
                return
            if event.reason == "cancelled":
                raise APIError(503, f"the request was cancelled: {event.message or 'server shutting down'}",
                               type="server_error", code="cancelled")
            raise APIError(500, f"generation failed: {event.message or 'engine error'}", type="server_error",
                           code="engine_error")


async def until_disconnected(request: Request) -> None:
    # After the body is read, the server's receive() returns only when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EngineStreamingResponse(StreamingResponse):
    """A server-sent event stream that cancels its engine request however the stream ends, including
    a client that disconnects before or during it."""

    def __init__(self, content, handle):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.handle.cancel()
            await self.body_iterator.aclose()


def prometheus_text(metrics: dict[str, Any], prefix: str = "jetspec_") -> str:
    """engine.metrics() in Prometheus' text format: numbers become gauges (counters for *_total), a
    dict of numbers one labelled series; strings and missing values are left out."""
    def is_number(v) -> bool:
        return isinstance(v, (int, float))  # bools included, as 0/1

    def render(v) -> str:
        v = float(v)
        return "NaN" if math.isnan(v) else str(int(v)) if v.is_integer() else repr(v)

    lines = []
    for key, value in metrics.items():
        name = prefix + "".join(c if c.isalnum() or c == "_" else "_" for c in key)
        if isinstance(value, dict):
            series = [(f'{name}{{key="{k}"}}', v) for k, v in value.items() if is_number(v)]
        else:
            series = [(name, value)] if is_number(value) else []
        if series:
            lines.append(f"# TYPE {name} {'counter' if key.endswith('_total') else 'gauge'}")
            lines += [f"{label} {render(v)}" for label, v in series]
    return "\n".join(lines) + "\n"


class Server:
    """The handlers of one app; holds the engine, tokenizer and served model name."""

    def __init__(self, engine, tokenizer, model_name: str, default_max_tokens: int, shutdown_timeout: float,
                 api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer to turn text into tokens; this target has none")
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.default_max_tokens, self.shutdown_timeout = default_max_tokens, shutdown_timeout
        self.api_key, self.max_body_bytes = api_key, max_body_bytes
        self.closing = False  # /health and new requests answer 503
        self.stopper: threading.Thread | None = None

    def begin_shutdown(self) -> threading.Thread:
        """Refuses new work and lets the engine finish what it has for `shutdown_timeout` seconds, then
        cancel the rest, so every open request ends with an answer or an error event, not a cut
        connection. Runs in a thread; idempotent."""
        self.closing = True
        if self.stopper is None:
            self.stopper = threading.Thread(target=self.engine.shutdown, name="jetspec-engine-shutdown",
                                            kwargs=dict(drain=True, timeout=self.shutdown_timeout), daemon=True)
            self.stopper.start()
        return self.stopper

    # -- parsing -------------------------------------------------------------------------------

    async def authorize(self, request: Request) -> None:
        """With an API key set, the /v1 routes need `Authorization: Bearer <key>` (OpenAI clients send it)."""
        if self.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise APIError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        # headers arrive as latin-1; compare bytes in constant time, so timing tells nothing of the key
        if not hmac.compare_digest(key.strip().encode("latin-1"), self.api_key.encode()):
            raise APIError(401, "the API key is not valid", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    async def read_body(self, request: Request) -> bytes:
        """The body, if sent as JSON (415 otherwise: a web page can post text/plain or a form to any port
        without asking, but not JSON) and at most max_body_bytes long (413, without reading past it)."""
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, f"the request body must be JSON sent with 'Content-Type: application/json', "
                                f"got {media_type or 'no Content-Type'}", code="unsupported_media_type")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self.body_too_large(f"is {int(declared)} bytes")
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:  # a chunked body, which declares no length
                    raise self.body_too_large(f"is over {self.max_body_bytes} bytes")
        except ClientDisconnect:
            raise invalid_request("the connection closed before the request body was complete",
                                  code="incomplete_body") from None
        return bytes(body)

    def body_too_large(self, size: str) -> APIError:
        # closing the connection spares reading the rest of the body
        return APIError(413, f"the request body {size}; this server takes at most {self.max_body_bytes} "
                             "(--max-body-bytes)", code="request_too_large", headers={"Connection": "close"})

    async def parse(self, request: Request, schema: type[SamplingFields]) -> SamplingFields:
        raw = await self.read_body(request)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise invalid_request("the request body must be a JSON object", code="invalid_json")
        try:
            body = schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(schema, e) from None
        if body.model != self.model_name:
            raise invalid_request(f"model {body.model!r} is not served here; this server serves "
                                  f"{self.model_name!r} (see /v1/models)", param="model", code="model_not_found")
        return body

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     enable_thinking=False)
        except Exception as e:  # the template rejects these messages (e.g. roles out of order)
            raise invalid_request(f"the chat template rejects these messages: {e}", param="messages") from None
        if hasattr(ids, "input_ids") or isinstance(ids, dict):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def text_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt[0] if isinstance(body.prompt, list) and isinstance(body.prompt[0], str) else body.prompt
        if isinstance(prompt, list):
            bad = [t for t in prompt if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise invalid_request(f"token ids {bad[:4]} are outside the vocabulary of {len(self.tokenizer)}",
                                      param="prompt")
            return list(prompt)
        try:
            return encode_prompts(self.tokenizer, [prompt], chat=False)[0]
        except ValueError as e:
            raise invalid_request(str(e).replace("prompt 0", "the prompt"), param="prompt") from None

    def engine_request(self, body: SamplingFields, prompt_ids: list[int], prompt_field: str,
                       request_id: str) -> EngineRequest:
        requested, field = body.requested_max_tokens()
        room = self.engine.max_context - len(prompt_ids)
        if room < 1:
            raise invalid_request(f"the prompt is {len(prompt_ids)} tokens, which leaves no room for an answer "
                                  f"in the context of {self.engine.max_context} tokens", param=prompt_field,
                                  code="context_length_exceeded")
        if requested is not None and requested > room:
            raise invalid_request(f"{field}={requested} is too large: the prompt is {len(prompt_ids)} tokens and "
                                  f"the context {self.engine.max_context}, so at most {room} can be generated",
                                  param=field, code="context_length_exceeded")
        max_new = requested if requested is not None else min(self.default_max_tokens, room)
        try:
            self.engine.check_request(len(prompt_ids), max_new)
        except ValueError as e:
            raise invalid_request(str(e), param=field) from None
        try:
            self.engine.check_prompt(prompt_ids)  # ids past the model's vocabulary, from a larger tokenizer
        except ValueError as e:
            raise invalid_request(str(e), param=prompt_field) from None
        sampling = SamplingParams(temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=0 if body.top_k is None else body.top_k, seed=body.seed)
        try:
            self.engine.check_sampling(sampling)  # ranges only the engine knows: top_k up to the vocabulary
        except ValueError as e:
            raise invalid_request(str(e), param=next((f for f in ("temperature", "top_p", "top_k")
                                                      if str(e).startswith(f)), None)) from None
        return EngineRequest(prompt_ids=prompt_ids, max_new_tokens=max_new, sampling=sampling,
                             request_id=request_id)

    def submit(self, request: EngineRequest):
        if self.closing:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        try:
            return self.engine.submit(request, loop=asyncio.get_running_loop())
        except QueueFullError as e:
            raise APIError(429, str(e), type="rate_limit_error", code="queue_full") from None
        except EngineFailedError as e:
            raise APIError(503, str(e), type="server_error", code="engine_failed") from None
        except EngineClosedError as e:
            raise APIError(503, str(e), type="server_error", code="shutting_down") from None
        except ValueError as e:
            raise invalid_request(str(e)) from None

    # -- generation ----------------------------------------------------------------------------

    async def complete(self, request: Request, body: SamplingFields, prompt_ids: list[int], prompt_field: str,
                       chat: bool) -> Response:
        rid = completion_id("chatcmpl" if chat else "cmpl")
        handle = self.submit(self.engine_request(body, prompt_ids, prompt_field, rid))
        text = IncrementalText(self.tokenizer, body.stop_strings())
        if body.stream:
            return EngineStreamingResponse(self.stream(handle, text, body, rid, chat, len(prompt_ids)), handle)
        try:
            return await self.whole(request, handle, text, rid, chat, len(prompt_ids))
        finally:
            handle.cancel()  # frees the slot on every exit; a no-op once the request has finished

    async def whole(self, request: Request, handle, text: IncrementalText, rid: str, chat: bool,
                    prompt_tokens: int) -> Response:
        async def collect() -> Piece:
            return [piece async for piece in pieces(handle, text)][-1]  # the last one says how it ended

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or this handler was cancelled): stop generating
                work.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody is listening
        last = work.result()  # re-raises APIError
        usage = Usage.of(prompt_tokens, last.completion_tokens)
        if chat:
            return JSONResponse(ChatCompletionResponse(
                id=rid, created=now(), model=self.model_name, usage=usage,
                choices=[ChatChoice(message=AssistantMessage(content=text.text), finish_reason=last.finish_reason)],
            ).model_dump())
        return JSONResponse(CompletionResponse(
            id=rid, created=now(), model=self.model_name, usage=usage,
            choices=[CompletionChoice(text=text.text, finish_reason=last.finish_reason)]).model_dump())

    async def stream(self, handle, text: IncrementalText, body: SamplingFields, rid: str, chat: bool,
                     prompt_tokens: int) -> AsyncIterator[str]:
        created = now()
        usage_field = {"usage": None} if body.include_usage else {}

        def chunk(delta: str | None = None, finish: str | None = None, role: bool = False,
                  usage: Usage | None = None, empty: bool = False) -> str:
            if chat:
                choices = [] if empty else [ChatChunkChoice(
                    delta=DeltaMessage(role="assistant" if role else None, content=delta), finish_reason=finish)]
                obj = ChatCompletionChunk(id=rid, created=created, model=self.model_name, choices=choices)
            else:
                choices = [] if empty else [CompletionChoice(text=delta or "", finish_reason=finish)]
                obj = CompletionResponse(id=rid, created=created, model=self.model_name, choices=choices)
            data = obj.model_dump(exclude={"usage"})
            if chat:
                for c in data["choices"]:  # OpenAI's deltas carry only the fields they set
                    c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            if usage is not None:
                data["usage"] = usage.model_dump()
            elif usage_field:
                data.update(usage_field)
            return sse(data)

        try:
            if chat:
                yield chunk("", role=True)
            async for piece in pieces(handle, text):
                if piece.text:
                    yield chunk(piece.text)
                if piece.finish_reason is not None:
                    yield chunk(None if chat else "", finish=piece.finish_reason)
                    if body.include_usage:
                        yield chunk(usage=Usage.of(prompt_tokens, piece.completion_tokens), empty=True)
        except APIError as e:  # after the 200 went out, an error is an event in the stream
            yield sse(ErrorResponse(error=e.info))
        yield "data: [DONE]\n\n"


def create_app(engine, tokenizer, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               shutdown_timeout: float = 30.0, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The app around a started engine. On shutdown (or from `begin_shutdown(app)`, which
    GracefulServer calls on SIGINT/SIGTERM) it stops the engine, letting running requests finish for
    up to `shutdown_timeout` seconds. With `api_key` the /v1 routes need it as a bearer token; POST
    bodies must be JSON of at most `max_body_bytes`."""
    server = Server(engine, tokenizer, model_name, default_max_tokens, shutdown_timeout, api_key, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(server.begin_shutdown().join)

    app = FastAPI(title="jetspec-jax", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(server.authorize)])

    # Tokenising runs in a thread: a long prompt on the event loop stalled every other client.
    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await server.parse(request, ChatCompletionRequest)
        prompt_ids = await asyncio.to_thread(server.chat_prompt, body)
        return await server.complete(request, body, prompt_ids, "messages", chat=True)

    @v1.post("/completions")
    async def completions(request: Request):
        body = await server.parse(request, CompletionRequest)
        prompt_ids = await asyncio.to_thread(server.text_prompt, body)
        return await server.complete(request, body, prompt_ids, "prompt", chat=False)

    @v1.get("/models")
    async def models():
        return ModelList(data=[ModelCard(id=model_name, created=0)]).model_dump()

    @v1.get("/models/{name:path}")
    async def model(name: str):
        if name != model_name:
            raise APIError(404, f"model {name!r} is not served here", type="not_found_error", param="model",
                           code="model_not_found")
        return ModelCard(id=model_name, created=0).model_dump()

    app.include_router(v1)

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # the device thread died: nothing will be served until a restart
            return JSONResponse({"status": "engine_failed", "message": engine.failure}, status_code=503)
        if server.closing:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.metrics()), media_type="text/plain; version=0.0.4")

    return app


def begin_shutdown(app: FastAPI) -> threading.Thread:
    return app.state.server.begin_shutdown()


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, which uvicorn lacks (it times out only idle keep-alive
    connections): a request's head must be whole `header_timeout` seconds after the connection opened or
    the head's first byte came, its body `body_timeout` seconds after the head; a client that stalls is
    disconnected, so stalled connections cannot pile up. Once a request is read, the app has no deadline
    (a stream may run for minutes). Follows h11's view of the client's side of the connection."""

    def __init__(self, *args, header_timeout: float, body_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeouts = {"head": header_timeout, "body": body_timeout}
        self.awaiting: str | None = None  # the part of a request being read: "head", "body" or None
        self.read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.await_part("head")  # a connection that sends nothing is held no longer than a slow head

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.follow_client()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.follow_client()

    def connection_lost(self, exc) -> None:
        self.await_part(None)
        super().connection_lost(exc)

    def follow_client(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:  # also after an early answer (401, 415): the rest is read and dropped
            self.await_part("body")
        elif state is h11.IDLE and self.conn.trailing_data[0]:  # part of a head came
            self.await_part("head")
        elif state is not h11.IDLE:  # the app's turn, or closing
            self.await_part(None)
        # IDLE with nothing received: a new connection keeps its deadline, a kept-alive one has uvicorn's

    def await_part(self, part: str | None) -> None:
        """Starts the deadline of `part` (None: none); the same part keeps its running deadline."""
        if part == self.awaiting:
            return
        if self.read_deadline is not None:
            self.read_deadline.cancel()
        self.awaiting, self.read_deadline = part, None
        if part is not None:
            self.read_deadline = self.loop.call_later(self.read_timeouts[part], self.read_timed_out)

    def read_timed_out(self) -> None:
        self.logger.info("%s: closing the connection: the request's %s did not arrive within %.0f s",
                         "%s:%d" % self.client if self.client else "a client", self.awaiting,
                         self.read_timeouts[self.awaiting])
        self.read_deadline = None
        self.transport.close()


def uvicorn_config(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                   header_timeout: float = DEFAULT_HEADER_TIMEOUT, body_timeout: float = DEFAULT_BODY_TIMEOUT,
                   max_connections: int = DEFAULT_MAX_CONNECTIONS) -> uvicorn.Config:
    """uvicorn's settings for an app of create_app: h11 with read deadlines (DeadlineH11Protocol); a request
    that comes while `max_connections` connections are open is answered 503 (uvicorn's limit_concurrency);
    request heads over 16 KiB get 400 (h11's bound); uvicorn's graceful-shutdown deadline is a backstop 10 s
    behind the engine's, which answers what it cancels."""
    shutdown_timeout = app.state.server.shutdown_timeout
    return uvicorn.Config(app, host=host, port=port, log_level=log_level,
                          http=functools.partial(DeadlineH11Protocol, header_timeout=header_timeout,
                                                 body_timeout=body_timeout),
                          limit_concurrency=max_connections, timeout_graceful_shutdown=shutdown_timeout + 10)


class GracefulServer(uvicorn.Server):
    """uvicorn whose first SIGINT/SIGTERM starts the app's engine shutdown at once: uvicorn stops
    listening (new connections are refused) and closes idle connections, a request that still arrives on
    an open one gets 503, running requests finish or are cancelled by the engine's deadline and answered,
    then uvicorn closes the connections. Set `timeout_graceful_shutdown` above the app's
    `shutdown_timeout` (uvicorn_config does): it is uvicorn's backstop, which cuts connections.
    `config.app` must come from create_app.
    `stop_requested()`, checked every tick, stops it the same way: for a signal that reached the
    caller's handlers just before uvicorn installed its own."""

    def __init__(self, config: uvicorn.Config, stop_requested=None):
        super().__init__(config)
        self.stop_requested = stop_requested

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            begin_shutdown(self.config.app)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has stopped (SIGTERM then kills the process, SIGINT
        # raises KeyboardInterrupt); a graceful stop is a normal exit here.
        self._captured_signals.clear()

    async def on_tick(self, counter: int) -> bool:
        if not self.should_exit and self.stop_requested is not None and self.stop_requested():
            self.handle_exit(signal.SIGTERM, None)
        return await super().on_tick(counter)
