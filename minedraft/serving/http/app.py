"""The Starlette app: OpenAI-compatible completions and chat completions, models, health, metrics, dashboard.

Built on an engine that is already started (Engine.start or `async with Engine(...)`). Streaming responses are
server-sent events written by sse-starlette, which also notices a client that goes away and cancels the
stream; cancelling the stream closes Engine.stream, which aborts the request and frees its KV cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import time
from pathlib import Path

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ...errors import EngineDeadError, InvalidRequestError, OverloadedError
from . import output_fields as ctl
from . import openai_api as oa
from .guard import DEFAULT_REFUSAL_RATE, RefusalPacer
from .metrics import CONTENT_TYPE, Metrics

log = logging.getLogger("minedraft.http")
STATIC = Path(__file__).resolve().parent / "static"
MIN_BODY_LIMIT = 1 << 20
TIMELINE_WINDOW_S = 1.0


def body_limit_for(max_prompt_tokens: int) -> int:
    """The default body limit: room for the longest prompt the engine accepts as JSON (16 characters per token,
    each up to 6 bytes as a \\u escape) plus 64 KiB, and never below 1 MiB (pretty-printed bodies, many
    messages)."""
    from ...config import PROMPT_CHARS_PER_TOKEN
    return max(MIN_BODY_LIMIT, 6 * PROMPT_CHARS_PER_TOKEN * max_prompt_tokens + (64 << 10))


def _engine_error(e: Exception, req: oa.ParsedRequest, chat: bool) -> oa.APIError:
    if isinstance(e, InvalidRequestError):
        return oa.engine_refusal(e, req, chat)
    if isinstance(e, OverloadedError):
        return oa.APIError(429, str(e), "rate_limit_error", "overloaded")
    if isinstance(e, EngineDeadError):
        return oa.APIError(503, str(e), "server_error", "engine_dead")
    raise e


async def _until_disconnect(request: Request, aw):
    """Await `aw`, but cancel it (aborting its request) if the client disconnects first."""
    task = asyncio.ensure_future(aw)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watch
    await asyncio.wait({task})  # a cancelled task ends once it has run its cancellation (the abort)
    if task.cancelled():
        raise oa.APIError(499, "client disconnected")  # nobody reads it; ends the handler
    try:
        return task.result()
    finally:
        # a failed task holds its exception, whose traceback holds this frame, which holds the task: a cycle
        # only a full gc frees, which kept every refused request's body (MBs of messages) alive (issue 35)
        del task


def _internal_error(exc: BaseException) -> JSONResponse:
    return JSONResponse(oa.APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").body(),
                        status_code=500)


def _guarded(handler):
    """A route handler whose unexpected errors become a 500 reply here. Left to Starlette's catch-all, the
    error is re-raised after the reply and the server drops the keep-alive connection without saying so, so a
    client's next request on it fails."""
    @functools.wraps(handler)
    async def run(request: Request):
        try:
            return await handler(request)
        except (oa.APIError, HTTPException):
            raise
        except ClientDisconnect:  # hung up while sending the body: not a server error
            raise oa.APIError(499, "client disconnected") from None
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.url.path)
            return _internal_error(exc)
    return run


def create_app(engine, *, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int | None = None, refusal_rate: float = DEFAULT_REFUSAL_RATE) -> Starlette:
    served = model_name or os.path.basename(os.path.normpath(engine.config.target))
    if max_body_bytes is None:
        max_body_bytes = body_limit_for(engine.config.max_prompt_tokens)
    metrics = Metrics(engine)
    pacer = RefusalPacer(refusal_rate)
    created = int(time.time())
    token_text = None  # logprobs' token strings, once a request asks for them (the engine has its tokenizer then)

    def logprobs_of(ids: list[int], lps: list | None, chat: bool, offset0: int = 0, params=None,
                    reason: str | None = None) -> dict | None:
        nonlocal token_text
        if lps is None:
            return None
        if reason == "stop" and ids and ids[-1] in stop_ids(params):
            # the stop token is in token_ids but not in the text: OpenAI's logprobs follow the text
            ids, lps = ids[:-1], lps[:len(ids) - 1]
        if token_text is None:
            token_text = ctl.TokenText(engine.tokenizer)
        if chat:
            return ctl.chat_logprobs(token_text, ids, lps)
        return ctl.completion_logprobs(token_text, ids, lps, offset0)

    def stop_ids(params) -> set:
        return set(params.stop_token_ids or ()) | (set() if params.ignore_eos else set(engine.eos_token_ids))

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise oa.APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                              "invalid_request_error", "invalid_api_key")

    async def read_json(request: Request, max_messages: int | None = None):
        n = request.headers.get("content-length")
        if n is not None and n.isdigit() and int(n) > max_body_bytes:
            raise oa.APIError(413, f"request body is {n} bytes; the limit is {max_body_bytes} "
                                   "(`serve --max-message-bytes`)",
                              code="request_too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_body_bytes:
                raise oa.APIError(413, f"request body exceeds the limit of {max_body_bytes} bytes "
                                       "(`serve --max-message-bytes`)",
                                  code="request_too_large")
        if max_messages is not None and (n := oa.too_many_messages(body, max_messages)) is not None:
            # the engine's own limit (engine/chat.py), checked before the messages are built
            raise oa.invalid(f"{n} messages; the limit is {max_messages} (max_prompt_tokens: each message takes "
                             "at least one token)", "messages")
        try:
            obj = oa.decode_json(body)
        except (ValueError, UnicodeDecodeError) as e:
            raise oa.invalid(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise oa.invalid("the request body is nested too deeply") from None
        oa.check_body_text(bytes(body), obj)
        return obj

    async def completions(request: Request):
        check_key(request)
        req = oa.parse_completion(await read_json(request), served)
        return await _answer(request, req, oa.new_id("cmpl"), chat=False)

    async def chat(request: Request):
        check_key(request)
        body = await read_json(request, max_messages=engine.config.max_prompt_tokens)
        req = oa.parse_chat(body, served, engine.config.max_tokens_limit)
        return await _answer(request, req, oa.new_id("chatcmpl"), chat=True)

    async def _answer(request: Request, req: oa.ParsedRequest, rid: str, chat: bool):
        if req.stream:
            run = engine.stream_chat if chat else engine.stream
            return await _stream(request, run(req.prompt, req.params, request_id=rid), rid, req, chat)
        run = engine.chat if chat else engine.generate
        if req.params.n > 1:  # a list of results, one per choice
            run = engine.chat_choices if chat else engine.generate_choices
        try:
            res = await _until_disconnect(request, run(req.prompt, req.params, request_id=rid))
        except (InvalidRequestError, OverloadedError, EngineDeadError) as e:
            raise _engine_error(e, req, chat) from None
        rs = res if isinstance(res, list) else [res]
        return JSONResponse((oa.chat_completion if chat else oa.completion)(
            rid, req.model, res,
            [logprobs_of(r.token_ids, r.logprobs, chat, 0, req.params, r.finish_reason) for r in rs]))

    async def _stream(request: Request, deltas, rid: str, req: oa.ParsedRequest, chat: bool):
        # Wait for the first delta before answering, so a refused request (400/429/503) gets its status code
        # instead of a 200 stream carrying an error.
        try:
            first = await _until_disconnect(request, deltas.__anext__())
        except (InvalidRequestError, OverloadedError, EngineDeadError) as e:
            await deltas.aclose()
            raise _engine_error(e, req, chat) from None
        except BaseException:
            await deltas.aclose()
            raise
        t = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        pending: list = [[], []]  # token ids and logprobs not yet in a chunk (a delta without text has no chunk)
        offset = [0]

        def chunk(d) -> dict:
            reason = d.finish_reason if d.finished else None
            lp = (logprobs_of(pending[0], pending[1], chat, offset[0], req.params, reason)
                  if req.params.logprobs is not None else None)
            if lp is not None and not chat:
                offset[0] += sum(map(len, lp["tokens"]))
            pending[0], pending[1] = [], []
            if chat:
                return oa.chat_chunk(rid, req.model, t, {"content": d.text} if d.text else {}, reason, lp)
            return oa.completion_chunk(rid, req.model, t, d.text, reason, lp)

        async def events():
            def ev(obj_: dict) -> ServerSentEvent:
                return ServerSentEvent(json.dumps(obj_, separators=(",", ":")), sep="\n")
            final = None
            try:
                if chat:
                    yield ev(oa.chat_chunk(rid, req.model, t, {"role": "assistant", "content": ""}, None))
                d = first
                while True:
                    pending[0] += d.token_ids
                    pending[1] += d.logprobs or []
                    if d.text or d.finished:
                        yield ev(chunk(d))
                    if d.finished:
                        final = d
                        break
                    d = await deltas.__anext__()
                if req.include_usage:
                    yield ev(oa.usage_chunk(rid, req.model, t, obj, final.stats))
            except (InvalidRequestError, OverloadedError, EngineDeadError) as e:
                yield ev(_engine_error(e, req, chat).body())  # headers are gone: report in-band, as OpenAI does
            finally:
                await deltas.aclose()  # aborts the request if we leave early (client gone)
            yield ServerSentEvent("[DONE]", sep="\n")

        return EventSourceResponse(events(), sep="\n", ping=15)

    model_card = {"id": served, "object": "model", "created": created, "owned_by": "minedraft",
                  "root": engine.config.target}

    async def models(request: Request):
        check_key(request)
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: Request):
        check_key(request)
        if request.path_params["model"] != served:
            raise oa.APIError(404, f"The model '{request.path_params['model']}' does not exist; this server serves "
                                   f"'{served}'", code="model_not_found", param="model")
        return JSONResponse(model_card)

    async def health(request: Request):
        h = engine.health()
        return JSONResponse({"status": "ok" if h["ok"] else "dead", **h}, status_code=200 if h["ok"] else 503)

    async def metrics_endpoint(request: Request):
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    def chat_model() -> bool:
        if not hasattr(chat_model, "known"):  # read from the tokenizer once, on the dashboard's first refresh
            from ...engine.chat import is_chat_model
            chat_model.known = engine.tokenizer is not None and is_chat_model(engine.tokenizer, engine.eos_token_ids)
        return chat_model.known

    async def timeline(request: Request):
        """The draft/verify intervals of the last second, relative to now (s), for the dashboard."""
        now = time.monotonic()
        st = engine.step_stats
        ivs = st.recent(TIMELINE_WINDOW_S, now) if st else []
        return JSONResponse({"window_s": TIMELINE_WINDOW_S, "mode": engine.config.mode, "model": served,
                             "chat": chat_model(),  # the dashboard's prompt box then defaults to a chat turn
                             "k": engine.config.draft_k,
                             "intervals": [[lane, b, t0 - now, t1 - now] for lane, b, t0, t1 in ivs]})

    async def index(request: Request):
        return FileResponse(STATIC / "index.html")

    async def paced(status: int, body: dict) -> JSONResponse:
        if 400 <= status < 500 and status != 499:  # 499: nobody is waiting for it
            wait = pacer.delay(time.monotonic())
            if wait:
                await asyncio.sleep(wait)
        return JSONResponse(body, status_code=status)

    async def api_error(request: Request, exc: oa.APIError):
        body, status = exc.body(), exc.status
        exc.__traceback__ = None  # its frames hold the refused body: let it go while the reply waits its turn
        return await paced(status, body)

    async def http_error(request: Request, exc: HTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return await paced(exc.status_code, oa.APIError(exc.status_code, f"{exc.detail}: {request.method} "
                                                        f"{request.url.path}", type_).body())

    async def server_error(request: Request, exc: Exception):
        return _internal_error(exc)

    routes = [
        Route("/v1/completions", _guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(chat), methods=["POST"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/models/{model:path}", _guarded(model), methods=["GET"]),
        Route("/health", _guarded(health), methods=["GET"]),
        Route("/metrics", _guarded(metrics_endpoint), methods=["GET"]),
        Route("/dashboard/timeline", _guarded(timeline), methods=["GET"]),
        Route("/", index, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]
    app = Starlette(routes=routes, exception_handlers={oa.APIError: api_error, HTTPException: http_error,
                                                       Exception: server_error})
    app.state.metrics = metrics
    app.state.served = served
    return _CountStatus(app, metrics)


class _CountStatus:
    """ASGI wrapper counting responses by route and status for minedraft_http_requests_total; it also refuses
    a request framed two ways before any route sees it."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics
        self.state = app.state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = path if path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                 "/", "/dashboard/timeline") else (
            "/static" if path.startswith("/static/") else "/v1/models/{model}" if path.startswith("/v1/models/")
            else "other")

        async def counting_send(msg):
            if msg["type"] == "http.response.start":
                self.metrics.http.labels(route, str(msg["status"])).inc()
            await send(msg)
        names = {k for k, _ in scope["headers"]}
        if b"transfer-encoding" in names and b"content-length" in names:
            # RFC 9112 6.3: ambiguous framing (a request-smuggling vector); refuse it and close the connection
            err = oa.invalid("the request has both Transfer-Encoding and Content-Length; send one")
            return await JSONResponse(err.body(), status_code=400, headers={"connection": "close"})(
                scope, receive, counting_send)
        await self.app(scope, receive, counting_send)
