"""The OpenAI-compatible HTTP layer over a `Scheduler`: completions, chat, models, health, metrics.

Every response is JSON in OpenAI's shape, errors included ({"error": {...}} with a 4xx status for
any bad input). Streams are server-sent events ending in `data: [DONE]`. A request whose client
goes away is cancelled, so its batch slot is freed before the scheduler's next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.middleware.trustedhost import TrustedHostMiddleware

from verispec.grammar import SchemaError
from verispec.serving.guard import RequestFrame, ServerSettings, request_id_of
from verispec.serving.metrics import CONTENT_TYPE, ServerMetrics
from verispec.serving.tools import CALL_OPEN, parse_tool_calls, template_messages, tool_tokens
from verispec.serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    parse_json_object,
    resolve_max_tokens,
    validate,
    validation_error,
)
from verispec.sampling import TokenLogprob
from verispec.core.requests import QueueFullError, RequestHandle, SequenceEvent
from verispec.core.scheduler import Scheduler

LOWEST_LOGPROB = -9999.0  # what OpenAI reports for a token of probability 0 (JSON has no -Infinity)


def completion_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str], offset: int) -> dict:
    """/v1/completions' logprobs object for these tokens; offset: characters of completion text before them."""
    texts = [token_text(e.token_id) for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []
    tops = []
    for entry in entries:  # keyed by text: of tokens that read alike, the likeliest stays
        top: dict[str, float] = {}
        for token_id, logprob in entry.top:
            top.setdefault(token_text(token_id), max(logprob, LOWEST_LOGPROB))
        tops.append(top)
    return {
        "tokens": texts,
        "token_logprobs": [max(e.logprob, LOWEST_LOGPROB) for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenLogprob], token_text: Callable[[int], str], offset: int) -> dict:
    """/v1/chat/completions' logprobs object for these tokens."""

    def item(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": max(logprob, LOWEST_LOGPROB), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries]}


@dataclass(frozen=True)
class _Shape:
    """How one endpoint spells its responses."""

    id_prefix: str
    object: str
    chunk_object: str
    choice: Callable[[int, str, str | None, dict | None], dict]  # (index, text, finish_reason, logprobs) -> choice
    delta: Callable[[int, str | None, str | None, dict | None], dict]  # (index, text or None, finish, logprobs)
    opening_delta: Callable[[int], dict] | None  # index -> the first chunk's choice, if the endpoint has one
    logprobs: Callable[[list[TokenLogprob], Callable[[int], str], int], dict]  # (tokens, token text, offset) -> dict


COMPLETION = _Shape(
    "cmpl", "text_completion", "text_completion",
    choice=lambda index, text, finish, logprobs=None: {
        "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
    },
    delta=lambda index, text, finish, logprobs=None: {
        "index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish,
    },
    opening_delta=None,
    logprobs=completion_logprobs,
)
CHAT = _Shape(
    "chatcmpl", "chat.completion", "chat.completion.chunk",
    choice=lambda index, text, finish, logprobs=None: {
        "index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
        "finish_reason": finish,
    },
    delta=lambda index, text, finish, logprobs=None: {
        "index": index, "delta": {} if text is None else {"content": text}, "logprobs": logprobs,
        "finish_reason": finish,
    },
    opening_delta=lambda index: {
        "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
    },
    logprobs=chat_logprobs,
)


PREPARING_THREADS = 2  # tokenizing, chat templating and grammar compilation run here, off the event loop
PREPARING_NICENESS = 10  # below the model thread's priority: a 1 MB prompt's tokenizing must not slow the streams


def _lower_priority() -> None:
    """Lower this thread's scheduling priority (Linux: threads have their own niceness); elsewhere nothing."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREPARING_NICENESS)


def create_app(scheduler: Scheduler, metrics: ServerMetrics, settings: ServerSettings) -> FastAPI:
    """An app serving `scheduler` (started and stopped by the caller) as `settings.model_name`."""
    preparing = concurrent.futures.ThreadPoolExecutor(
        PREPARING_THREADS, thread_name_prefix="verispec-prepare", initializer=_lower_priority
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        preparing.shutdown(wait=False, cancel_futures=True)

    docs = settings.docs
    app = FastAPI(
        title="verispec", summary="OpenAI-compatible lossless speculative decoding", lifespan=lifespan,
        docs_url="/docs" if docs else None, redoc_url=None, openapi_url="/openapi.json" if docs else None,
    )
    model_name = settings.model_name
    created = int(time.time())
    target = scheduler.target
    call_tokens = tool_tokens(target.tokenizer)  # once: it reads the whole vocabulary

    def error_response(error: APIError, request: Request) -> JSONResponse:
        metrics.error(error.type, error.code)
        request_id = request_id_of(request.scope)
        if error.status >= 500 and request_id not in error.message:  # the id the server log files details under
            error.message = f"{error.message} (request id {request_id})"
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return error_response(error, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(error.errors())), request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message, code = f"no such endpoint: {request.method} {request.url.path}", "not_found"
        elif error.status_code == 405:
            message, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            message, code = str(error.detail), None
        return error_response(APIError(error.status_code, message, code=code, headers=error.headers), request)

    # The last added is the outermost: RequestFrame sees every request first (ids, keys, one error shape).
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type", "x-request-id"], expose_headers=["x-request-id"],
        )
    if settings.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts))
    app.add_middleware(RequestFrame, settings=settings, metrics=metrics)

    # -- endpoints ----------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"active": scheduler.num_active, "waiting": scheduler.num_waiting}
        if scheduler.healthy:
            return JSONResponse({"status": "ok", **body})
        return JSONResponse({"status": "unavailable", **body}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        metrics.set_queue(scheduler.num_active, scheduler.num_waiting)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def model_card() -> dict:
        return {
            "id": model_name, "object": "model", "created": created, "owned_by": "verispec",
            "max_model_len": scheduler.limits.max_context, "drafter": scheduler.drafter,
        }

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        check_model(model_id)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = validate(CompletionRequest, await read_json(request, settings))
        check_model(body.model)

        def prompt_ids() -> list[int]:  # off the event loop
            if isinstance(body.prompt, str):
                return target.encode(body.prompt)
            vocab = target.model.vocab_size
            if max(body.prompt) >= vocab:
                message = f"prompt: token id {max(body.prompt)} is outside the vocabulary (0..{vocab - 1})"
                raise APIError(400, message, "prompt")
            return body.prompt

        return await generate(request, body, prompt_ids, "prompt", COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = validate(ChatCompletionRequest, await read_json(request, settings))
        check_model(body.model)
        if not getattr(target.tokenizer, "chat_template", None):
            message = f"model {model_name!r} has no chat template; use /v1/completions with a raw prompt"
            raise APIError(400, message, "messages")
        tools = body.functions_for_template()
        if tools and call_tokens is None:
            message = f"model {model_name!r} has no tool calling in its chat template (no {CALL_OPEN} token)"
            raise APIError(400, message, "tools")

        def prompt_ids() -> list[int]:  # off the event loop
            messages = template_messages([message.to_template() for message in body.messages])
            try:
                text = target.tokenizer.apply_chat_template(
                    messages, tools=tools, tokenize=False, add_generation_prompt=True
                )
            except Exception as error:  # the template itself may refuse a conversation (e.g. roles out of order)
                raise APIError(400, f"messages: the chat template rejected them: {error}", "messages") from None
            return target.encode(text)

        return await generate(request, body, prompt_ids, "messages", CHAT)

    # -- shared machinery ---------------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            message = f"The model '{name}' does not exist; this server serves '{model_name}'."
            raise APIError(404, message, "model", "model_not_found")

    async def generate(
        request: Request, body: CompletionRequest | ChatCompletionRequest, make_prompt_ids: Callable[[], list[int]],
        prompt_param: str, shape: _Shape,
    ) -> Response:
        if not scheduler.healthy:
            message = "the decoding loop is not running; see /health"
            raise APIError(503, message, code="unavailable", type="server_error")
        loop = asyncio.get_running_loop()
        arrived = time.perf_counter()
        deadline = None if settings.request_timeout is None else arrived + settings.request_timeout
        request_id = request_id_of(request.scope)
        handles, max_tokens = await loop.run_in_executor(
            preparing, submit, body, make_prompt_ids, prompt_param, loop, request_id, deadline
        )
        request.state.generation = {"model": model_name, "drafter": scheduler.drafter}
        response_id = f"{shape.id_prefix}-{uuid.uuid4().hex}"
        header = {"id": response_id, "created": int(time.time()), "model": model_name}
        calls_tools = isinstance(body, ChatCompletionRequest) and body.calls_tools
        if body.stream:
            chunks = sse_chunks(request, handles, header, shape, body.include_usage, calls_tools)
            return StreamingResponse(
                chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            )
        logprobs = body.requested_logprobs() is not None
        return await whole_response(request, handles, header, shape, logprobs, calls_tools)

    def submit(
        body: CompletionRequest | ChatCompletionRequest, make_prompt_ids: Callable[[], list[int]], prompt_param: str,
        loop: asyncio.AbstractEventLoop, request_id: str, deadline: float | None,
    ) -> tuple[list[RequestHandle], int]:
        """Tokenize (and template), check and queue the request: in a worker thread, as grammars compile here."""
        prompt_ids = make_prompt_ids()
        if not prompt_ids:
            raise APIError(400, f"{prompt_param}: the prompt is empty after tokenization", prompt_param)
        context = scheduler.limits.max_context
        max_tokens = resolve_max_tokens(body.requested_max_tokens(), len(prompt_ids), context, prompt_param)
        batch = scheduler.limits.max_batch_size
        if body.choices > batch:
            message = f"n={body.choices} exceeds this server's batch of {batch} sequences (--max-batch-size)"
            raise APIError(400, message, "n")
        vocab = target.model.vocab_size
        too_large = [key for key in body.logit_bias or {} if int(key) >= vocab]
        if too_large:
            message = f"logit_bias: token id {too_large[0]} is outside the vocabulary (0..{vocab - 1})"
            raise APIError(400, message, "logit_bias")
        try:
            configs = body.generation_configs(max_tokens)
            handles = scheduler.submit_choices(prompt_ids, configs, request_id, loop, deadline)
        except QueueFullError as error:
            raise APIError(
                429, str(error), code="rate_limit_exceeded", type="rate_limit_error", headers={"Retry-After": "1"}
            ) from None
        except SchemaError as error:
            raise APIError(400, str(error), "response_format", "invalid_json_schema") from None
        except ValueError as error:  # a setting the request named, when the message starts with its name
            named = str(error).split(" ", 1)[0]
            raise APIError(400, str(error), named if named in type(body).model_fields else None) from None
        return handles, max_tokens

    def token_text(token_id: int) -> str:
        return target.decode([token_id])

    def note_generation(request: Request, finals: list[SequenceEvent | None]) -> None:
        """The access log's figures of this request's generation (its choices together)."""
        done = [event for event in finals if event is not None]
        if not done:
            return
        stats = [event.stats for event in done]
        completion = sum(s.completion_tokens for s in stats)
        drafted, accepted = sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)
        forwards = sum(s.target_forwards for s in stats)
        first = min((s.time_to_first_token for s in stats if s.time_to_first_token is not None), default=None)
        seconds = max(s.total_seconds for s in stats)
        request.state.generation.update(
            prompt_tokens=stats[0].prompt_tokens, completion_tokens=completion,
            ttft_s=None if first is None else round(first, 4),
            tokens_per_s=round(completion / seconds, 2) if seconds > 0 else None,
            acceptance=round(accepted / drafted, 3) if drafted else None,
            tokens_per_forward=round(completion / forwards, 2) if forwards else None,
            finish_reason=",".join(str(event.finish_reason) for event in done),
        )

    @contextlib.asynccontextmanager
    async def note_when_done(request: Request, finals: list[SequenceEvent | None]) -> AsyncIterator[None]:
        try:
            yield
        finally:
            note_generation(request, finals)

    async def whole_response(
        request: Request, handles: list[RequestHandle], header: dict, shape: _Shape, logprobs: bool,
        calls_tools: bool = False,
    ) -> JSONResponse:
        parts: list[list[str]] = [[] for _ in handles]
        token_ids: list[list[int]] = [[] for _ in handles]
        entries: list[list[TokenLogprob]] = [[] for _ in handles]
        finals: list[SequenceEvent | None] = [None] * len(handles)
        try:
            async with cancel_on_disconnect(request, handles):
                async for index, event in merged_events(handles):
                    parts[index].append(event.text)
                    token_ids[index].extend(event.token_ids)
                    entries[index].extend(event.logprobs or [])
                    finals[index] = event
                    if event.finish_reason not in (None, "stop", "length"):
                        if client_left(request, event):
                            raise ClientDisconnect()  # counted as 499, answered to no one
                        raise unfinished(event)  # leaving the block cancels the other choices
        finally:
            note_generation(request, finals)
        choices = [
            shape.choice(index, "".join(parts[index]), final.finish_reason,
                         shape.logprobs(entries[index], token_text, 0) if logprobs else None)
            for index, final in enumerate(finals)
        ]
        if calls_tools:  # chat: a completion that calls tools answers with tool_calls
            for choice, ids in zip(choices, token_ids):
                content, calls = parse_tool_calls(ids, call_tokens, target.decode)
                if calls:
                    choice["message"].update(content=content, tool_calls=calls)
                    if choice["finish_reason"] == "stop":
                        choice["finish_reason"] = "tool_calls"
        return JSONResponse({
            **header, "object": shape.object, "choices": choices, "usage": usage(finals),
            **speculative_stats(finals),
        })

    async def sse_chunks(
        request: Request, handles: list[RequestHandle], header: dict, shape: _Shape, include_usage: bool,
        calls_tools: bool = False,
    ) -> AsyncIterator[str]:
        def chunk(choices: list[dict], **extra) -> str:
            payload = {**header, "object": shape.chunk_object, "choices": choices}
            if include_usage:
                payload["usage"] = None
            payload.update(extra)
            return f"data: {json_dumps(payload)}\n\n"

        offsets = [0] * len(handles)  # per choice: characters of completion text its logprobs sent so far cover
        finals: list[SequenceEvent | None] = [None] * len(handles)
        # Per choice, with tools: None until its first token says; then whether it calls (its text is held back
        # and each call goes out whole once closed), the text so far and the calls sent.
        calling: list[bool | None] = [None if calls_tools else False] * len(handles)
        held: list[list[int]] = [[] for _ in handles]
        sent: list[list[dict]] = [[] for _ in handles]
        async with note_when_done(request, finals), cancel_on_disconnect(request, handles):
            if shape.opening_delta is not None:
                for index in range(len(handles)):
                    yield chunk([shape.opening_delta(index)])
            async for index, event in merged_events(handles):
                if event.finish_reason not in (None, "stop", "length"):
                    if client_left(request, event):
                        break  # no one to tell, and not an error
                    error = unfinished(event)
                    metrics.error(error.type, error.code)
                    yield f"data: {json_dumps(error.body())}\n\n"
                    break
                if calling[index] is None and event.token_ids:
                    calling[index] = event.token_ids[0] == call_tokens.open_id
                if calling[index]:
                    held[index] += event.token_ids
                    if call_tokens.close_id in event.token_ids:  # a call closed in this event: send it
                        _, calls = parse_tool_calls(held[index], call_tokens, target.decode)
                        for number, call in enumerate(calls[len(sent[index]):], start=len(sent[index])):
                            yield chunk([{"index": index, "delta": {"tool_calls": [{"index": number, **call}]},
                                          "logprobs": None, "finish_reason": None}])
                        sent[index] = calls
                elif event.text or event.logprobs:
                    step_logprobs = None
                    if event.logprobs:  # the step's tokens, whether or not their text is released yet
                        step_logprobs = shape.logprobs(event.logprobs, token_text, offsets[index])
                        offsets[index] += sum(len(token_text(e.token_id)) for e in event.logprobs)
                    yield chunk([shape.delta(index, event.text, None, step_logprobs)])
                if event.finish_reason is not None:
                    finals[index] = event
                    if calling[index] and not sent[index] and held[index]:  # cut before a call closed: as text
                        yield chunk([shape.delta(index, target.decode(held[index]), None)])
                    reason = "tool_calls" if sent[index] and event.finish_reason == "stop" else event.finish_reason
                    yield chunk([shape.delta(index, None, reason)])
                    if include_usage and all(final is not None for final in finals):
                        yield chunk([], usage=usage(finals), **speculative_stats(finals))
            yield "data: [DONE]\n\n"

    return app


async def read_json(request: Request, settings: ServerSettings) -> dict:
    """The body as a JSON object: application/json only (415: a browser's form post from another site is not),
    at most max_request_bytes (413, before reading them all), within body_timeout seconds (408)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        message = f"Content-Type must be application/json, got {content_type or 'none'!r}"
        raise APIError(415, message, code="unsupported_media_type")
    limit = settings.max_request_bytes
    close = {"Connection": "close"}  # the rest of the body is not read: the connection cannot carry another request
    too_large = APIError(
        413, f"the request body exceeds {limit} bytes (--max-request-bytes)", code="request_too_large", headers=close
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async with asyncio.timeout(settings.body_timeout):
            async for piece in request.stream():
                body += piece
                if len(body) > limit:
                    raise too_large
    except TimeoutError:
        message = f"the request body did not arrive within {settings.body_timeout:g} s (--body-timeout)"
        raise APIError(408, message, code="request_timeout", headers=close) from None
    return parse_json_object(bytes(body))


async def merged_events(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, SequenceEvent]]:
    """(choice index, event) from every handle as they arrive, until each has sent its last event."""
    if len(handles) == 1:
        async for event in handles[0].events():
            yield 0, event
        return
    arrivals: asyncio.Queue[tuple[int, SequenceEvent | None]] = asyncio.Queue()

    async def forward(index: int, handle: RequestHandle) -> None:
        async for event in handle.events():
            arrivals.put_nowait((index, event))
        arrivals.put_nowait((index, None))

    tasks = [asyncio.create_task(forward(index, handle)) for index, handle in enumerate(handles)]
    try:
        running = len(handles)
        while running:
            index, event = await arrivals.get()
            if event is None:
                running -= 1
            else:
                yield index, event
    finally:
        for task in tasks:
            task.cancel()


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: Request, handles: list[RequestHandle]) -> AsyncIterator[None]:
    """Within the block, a client disconnect cancels the request's choices; leaving the block cancels them too.

    Leaving covers a stream closed or cancelled by the server (the client went away while a chunk
    was being sent); the watcher covers a client that leaves while no chunk is due (queued, or a
    whole response still being generated). Cancelling a finished request does nothing.
    """

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        request.state.client_left = True
        for handle in handles:
            handle.cancel()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        for handle in handles:
            handle.cancel()


def client_left(request: Request, event: SequenceEvent) -> bool:
    """Whether the request was cancelled because its client went away (cancel_on_disconnect)."""
    return event.finish_reason == "cancelled" and getattr(request.state, "client_left", False)


def unfinished(event: SequenceEvent) -> APIError:
    if event.finish_reason == "cancelled":
        return APIError(503, "the request was cancelled before it finished", type="server_error", code="cancelled")
    return APIError(500, event.error or "generation failed", type="server_error", code="generation_failed")


def usage(finals: list[SequenceEvent]) -> dict:
    """OpenAI's usage of a request's choices: the prompt counted once, every choice's completion tokens."""
    first = finals[0].stats
    completion = sum(event.stats.completion_tokens for event in finals)
    return {
        "prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
        "total_tokens": first.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens},
    }


def speculative_stats(finals: list[SequenceEvent]) -> dict:
    """The response's "speculative" statistics (the first choice's), and each choice's when there are several."""
    stats = {"speculative": finals[0].stats.usage()}
    if len(finals) > 1:
        stats["speculative_choices"] = [event.stats.usage() for event in finals]
    return stats


def json_dumps(payload: dict) -> str:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
