"""The OpenAI-compatible HTTP front end of a `goose.Engine` (FastAPI).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), and the playground at ``/``. Requests become engine requests (`Engine.submit`);
their token blocks come back on the engine's thread through ``on_tokens`` and are handed to the event loop,
which turns them into text (stop strings cut, partial characters held back) and into one JSON response or
server-sent events in OpenAI's chunk format. Every error is OpenAI's error JSON, never a traceback. A client
that goes away cancels its request (its slot is freed at the next step boundary).
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..decoding import encode_chat
from ..drafting.tree import BRANCH, SPINE
from ..engine.methods import METHODS
from ..engine.prefix import DEFAULT_PREFIX_CACHE_MB
from ..errors import GooseError
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .schema import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("goose.server")

STATIC = Path(__file__).parent / "static"
SOURCE_NAMES = {SPINE: "spine", BRANCH: "branch"}  # anything else is the target's own token: "bonus"
POLL_S = 0.05  # how often a waiting handler checks for a finished request or a gone client


class ApiError(HTTPException):
    """An error answered as OpenAI's error JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(status, message, headers)
        self.message, self.type, self.code, self.param = message, type_, code, param


def error_body(message: str, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class BodyLimit:
    """ASGI middleware: request bodies over `limit` bytes are refused with 413 (by Content-Length at once, or
    while a chunked body is read)."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        too_large = ApiError(413, f"the request body exceeds {self.limit} bytes", code="request_too_large")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await JSONResponse(error_body(too_large.message, code=too_large.code), 413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise too_large
            return message

        await self.app(scope, limited, send)


class TextEmitter:
    """Token ids in, text pieces out: each piece is new text of the decoded whole; a piece is held back while
    the text ends inside a multi-byte character or with the start of a stop string; the text ends before the
    first stop string (OpenAI leaves the stop string out)."""

    def __init__(self, decode, stops: list[str]) -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.shown = ""
        self.stopped = False  # a stop string was seen: nothing more is shown

    def feed(self, tokens: list[int], sources: list[int], per_token: bool) -> list[tuple[str, str]]:
        """(text, source of its last token) pieces for the new tokens; with `per_token`, one try per token."""
        groups = [([t], [s]) for t, s in zip(tokens, sources)] if per_token else [(tokens, sources)]
        pieces = []
        for toks, srcs in groups:
            if self.stopped:
                break
            self.ids.extend(toks)
            piece = self._advance(final=False)
            if piece:
                pieces.append((piece, SOURCE_NAMES.get(srcs[-1], "bonus") if srcs else "bonus"))
        return pieces

    def finish(self) -> str:
        return "" if self.stopped else self._advance(final=True)

    @property
    def text(self) -> str:
        return self.shown

    def _advance(self, final: bool) -> str:
        text = self.decode(self.ids)
        if self.stops:
            hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
            if hits:
                text, final, self.stopped = text[: min(hits)], True, True
        if not final:
            if text.endswith("\ufffd"):
                return ""
            text = text[: len(text) - self._holdback(text)]
        if not text.startswith(self.shown) or len(text) <= len(self.shown):
            return ""
        piece, self.shown = text[len(self.shown):], text
        return piece

    def _holdback(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def stop_checker(decode, stops: list[str]):
    """The engine's `stop(tokens)`: True once the text of the last tokens holds a stop string."""
    if not stops:
        return None
    n = max(len(s) for s in stops) + 4  # every token decodes to at least one character (special ones aside)

    def stop(tokens: list[int]) -> bool:
        tail = decode(tokens[-n:])
        return any(s in tail for s in stops)

    return stop


def create_app(engine, model_name: str, *, api_key: str | None = None, max_body_bytes: int = 1 << 20,
               default_max_tokens: int = 512, drain_timeout: float = 30.0, close_engine: bool = True) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`. `api_key`: bearer token /v1 requires (None: none);
    `default_max_tokens`: a chat request's limit when it gives none (completions: 16, as OpenAI);
    `close_engine`: on shutdown, close the engine, letting running requests finish for `drain_timeout` s."""
    tok = engine.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    metrics = Metrics(engine, model_name)

    @asynccontextmanager
    async def lifespan(app):
        yield
        if close_engine:
            await asyncio.to_thread(engine.close, drain_timeout)

    app = FastAPI(title="goose", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)

    # ---- errors: always OpenAI's error JSON ------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_), exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        parts, param = [], None
        for e in exc.errors():
            loc = [str(x) for x in e.get("loc", ()) if x != "body"]
            param = param or (".".join(loc) or None)
            msg = "unknown field (not supported)" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
            parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
        return JSONResponse(error_body("invalid request: " + "; ".join(parts[:5]), param=param), 400)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)

    async def authorized(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    # ---- plain endpoints -------------------------------------------------------------------------------
    created = int(time.time())

    @app.get("/health")
    async def health():
        running, waiting = engine.load()
        return {"status": "ok", "model": model_name, "running": running, "waiting": waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "goose", "max_model_len": engine.limit}]}

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # ---- completions -----------------------------------------------------------------------------------
    def prepare(body, chat: bool) -> tuple[list[int], int]:
        """Prompt ids and max_new_tokens of a request (400 on anything goose will not do)."""
        why = body.unsupported()
        if why:
            raise ApiError(400, why)
        if body.model is not None and body.model != model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'",
                           "not_found_error", "model_not_found", "model")
        try:
            if chat:
                ids = encode_chat(tok, [{"role": m.role, "content": m.text()} for m in body.messages])
            else:
                prompt = body.prompt_input()
                if isinstance(prompt, str):
                    if not prompt:
                        raise GooseError("the prompt is empty")
                    ids = tok(prompt)["input_ids"]
                else:
                    ids = prompt
        except GooseError as exc:
            raise ApiError(400, str(exc), param="messages" if chat else "prompt") from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        room = None if engine.limit is None else engine.limit - len(ids)
        max_new = body.max_new()
        if max_new is None:
            max_new = default_max_tokens if chat else 16
            if room is not None:
                max_new = min(max_new, room)
        if room is not None and (room < 1 or max_new > room):
            raise ApiError(400, f"this model's maximum context length is {engine.limit} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {max_new}", code="context_length_exceeded",
                           param="max_tokens")
        return ids, max_new

    async def submit(body, ids: list[int], max_new: int, sink):
        """An engine request whose committed blocks (tokens, their sources) arrive in the asyncio queue `sink`."""
        loop = asyncio.get_running_loop()
        try:
            method = body.method(METHODS)
            options = body.engine_options()
        except GooseError as exc:
            raise ApiError(400, str(exc), param="speculative") from None
        box: list = []  # the request's slot (not the request: no reference cycle keeps its KV cache alive)
        ready = threading.Event()

        def on_tokens(block):  # engine thread: the slot's sources belong to this very block
            ready.wait(10)
            sources = list(box[0].new_sources) if box else []
            loop.call_soon_threadsafe(sink.put_nowait, (list(block), sources))

        try:
            req = await asyncio.to_thread(engine.submit, ids, max_new, False, method=method, on_tokens=on_tokens,
                                          stop=stop_checker(decode, body.stop), **options)
        except GooseError as exc:
            msg = str(exc)
            if "queue is full" in msg:
                raise ApiError(429, f"the server is busy: {msg}; retry later", "rate_limit_error",
                               "queue_full", headers={"Retry-After": "1"}) from None
            if "closed" in msg:
                raise ApiError(503, "the server is shutting down", "server_error", "shutting_down") from None
            raise ApiError(400, msg) from None
        box.append(req.slot)
        ready.set()
        return req

    async def blocks(req, sink: asyncio.Queue):
        """The request's (tokens, sources) blocks as they come, until it is over."""
        while True:
            try:
                yield await asyncio.wait_for(sink.get(), POLL_S)
                continue
            except (asyncio.TimeoutError, TimeoutError):
                pass
            if req.done:
                await asyncio.sleep(0)  # blocks handed over before it finished are queued by now
                while not sink.empty():
                    yield sink.get_nowait()
                return

    def goose_info(req) -> dict:
        st = req.slot.stats
        return {"method": req.method,
                "tau": round(st.tau, 4), "forward_calls": st.forward_calls,
                "accepted": dict(st.accepted), "drafted": dict(st.drafted),
                "ttft_s": req.ttft_s, "tpot_s": req.tpot_s, "tokens_per_s": round(st.tokens_per_s, 3),
                "completion_token_ids": list(req.slot.out)}

    def usage(req) -> dict:
        st = req.slot.stats
        return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
                "total_tokens": st.prompt_tokens + st.new_tokens,
                "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}

    def failure(req) -> ApiError:
        err = req.error
        return ApiError(500, f"generation failed: {err}", "server_error")

    async def complete(http: Request, body, chat: bool):
        endpoint = "chat" if chat else "completions"
        try:
            ids, max_new = prepare(body, chat)
            sink: asyncio.Queue = asyncio.Queue()
            req = await submit(body, ids, max_new, sink)
        except ApiError as exc:
            metrics.refused(endpoint, exc.status_code)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if body.stream:
            return StreamingResponse(stream(http, body, chat, req, sink, rid, now), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        emitter = TextEmitter(decode, body.stop)
        try:
            while not req.wait(0):
                if await http.is_disconnected():
                    req.cancel()
                    metrics.requests.labels(endpoint, "cancelled").inc()
                    return Response(status_code=499)
                try:
                    await asyncio.wait_for(sink.get(), POLL_S)
                except (asyncio.TimeoutError, TimeoutError):
                    pass
        finally:
            if not req.done:
                req.cancel()
        metrics.observe(endpoint, req)
        if req.finish_reason not in ("stop", "length"):
            raise failure(req)
        emitter.feed(list(req.slot.out), [], per_token=False)
        emitter.finish()
        reason = "stop" if emitter.stopped else req.finish_reason
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": emitter.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": emitter.text, "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                "model": model_name, "choices": [choice], "usage": usage(req), "goose": goose_info(req)}

    async def stream(http: Request, body, chat: bool, req, sink, rid: str, now: int):
        endpoint = "chat" if chat else "completions"
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        emitter = TextEmitter(decode, body.stop)
        want_sources = bool(body.sources)

        def chunk(content: str | None, reason: str | None = None, role: bool = False, extra: dict | None = None):
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if content is None else
                                                                            {"content": content})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": reason}
            out = {"id": rid, "object": obj, "created": now, "model": model_name, "choices": [choice]}
            if include_usage:
                out["usage"] = None
            if extra:
                out.update(extra)
            return sse(out)

        finished = False
        role_sent = not chat  # chat's role chunk goes with the first tokens, as vLLM's: clients time TTFT by it
        try:
            async for tokens, sources in blocks(req, sink):
                if not role_sent:
                    role_sent = True
                    yield chunk(None, role=True)
                pieces = emitter.feed(tokens, sources, per_token=want_sources)
                if not pieces:
                    continue
                extra = None
                if want_sources:
                    st = req.slot.stats
                    extra = {"goose": {"pieces": [[t, s] for t, s in pieces], "tokens": len(emitter.ids),
                                       "forward_calls": st.forward_calls}}
                yield chunk("".join(t for t, _ in pieces), extra=extra)
            finished = True
            if not role_sent:
                yield chunk(None, role=True)
            metrics.observe(endpoint, req)
            if req.finish_reason not in ("stop", "length"):
                err = failure(req)
                yield sse(error_body(err.message, err.type))
                yield "data: [DONE]\n\n"
                return
            tail = emitter.finish()
            if tail:
                extra = None
                if want_sources:
                    st = req.slot.stats
                    extra = {"goose": {"pieces": [[tail, "bonus"]], "tokens": len(emitter.ids),
                                       "forward_calls": st.forward_calls}}
                yield chunk(tail, extra=extra)
            reason = "stop" if emitter.stopped else req.finish_reason
            info = {"goose": goose_info(req)}
            yield chunk(None, reason, extra=None if include_usage else info)
            if include_usage:
                yield sse({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [],
                           "usage": usage(req), **info})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                req.cancel()  # the client went away (or the stream broke): free the slot
                metrics.requests.labels(endpoint, "cancelled").inc()

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(http: Request, body: ChatCompletionRequest):
        return await complete(http, body, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(http: Request, body: CompletionRequest):
        return await complete(http, body, chat=False)

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


MALLOC_ARENAS = 2  # glibc malloc arenas of the server process (see tune_malloc)
MMAP_THRESHOLD = 8 << 20  # allocations of this many bytes or more get pages of their own (see tune_malloc)


def tune_malloc(arenas: int = MALLOC_ARENAS, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set glibc's malloc for a long-running server, before its threads start: at most `arenas` arenas
    (``M_ARENA_MAX``; glibc gives each allocating thread an arena of its own, up to 8 per core, and keeps what
    they once held) and a fixed mmap threshold (``M_MMAP_THRESHOLD``: blocks of `mmap_threshold` bytes or more,
    such as every request's KV cache, are mapped on their own and go back to the system when freed; glibc's
    default threshold rises to the largest block freed so far, after which freed caches stay in the heap).
    A fresh server's resident memory otherwise grew by half over its first 500 requests (the caches of 8
    concurrent requests, kept) before levelling off. An explicit ``MALLOC_ARENA_MAX`` or
    ``MALLOC_MMAP_THRESHOLD_`` in the environment wins. Returns True when both were set."""
    if os.environ.get("MALLOC_ARENA_MAX") or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-8, int(arenas))) and bool(libc.mallopt(-3, int(mmap_threshold)))  # M_ARENA_MAX, M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False  # not glibc


def serve(model: str, method: str = "goose", host: str = "127.0.0.1", port: int = 8000, max_batch: int = 8,
          max_queue: int = 64, api_key: str | None = None, dtype: str = "float32", device: str = "cpu",
          served_name: str | None = None, drain_timeout: float = 30.0, max_body_bytes: int = 1 << 20,
          default_max_tokens: int = 512, log_level: str = "info", weights: str | None = None,
          prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> None:
    """Load `model`, start an Engine and serve it until SIGINT / SIGTERM (running requests get `drain_timeout`
    seconds to finish)."""
    import uvicorn

    from ..engine.scheduler import Engine
    from ..loading.model import load_model

    tune_malloc()
    net, tok = load_model(model, dtype, device, weights=weights)
    engine = Engine(net, tok, method, max_batch=max_batch, max_queue=max_queue, prefix_cache_mb=prefix_cache_mb)
    app = create_app(engine, served_name or Path(model).name, api_key=api_key, max_body_bytes=max_body_bytes,
                     default_max_tokens=default_max_tokens, drain_timeout=drain_timeout)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
