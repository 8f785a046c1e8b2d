"""The OpenAI-compatible HTTP front end of a `goose.Engine` (FastAPI).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus), and the playground at ``/``. Requests become engine requests (`Engine.submit`);
their token blocks come back on the engine's thread through ``on_tokens`` and are handed to the event loop,
which turns them into text (stop strings cut, partial characters held back) and into one JSON response or
server-sent events in OpenAI's chunk format. Every error is OpenAI's error JSON, never a traceback. A client
that goes away cancels its request (its slot is freed at the next step boundary).

`Serving` holds one server's state (engine, settings, metrics) and handles requests; `create_app` is the thin
FastAPI router over it. The engine's thread never waits for the event loop (blocks are handed over with
``call_soon_threadsafe``) and prompts are tokenized on worker threads. When the engine fails, ``/health``
answers 503 with the reason and the server builds a new engine (``restart``) once; when that one fails too,
the server stops with exit status 1, for a supervisor to act on (docs/reliability.md). ``/health`` also answers
503 while the step loop is stuck (requests wait or run and no step finished for ``stall_s`` seconds) and once
the watcher that restarts engines has itself failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import os
import secrets
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from ..config import DEFAULT_SNAPSHOT_S, EngineConfig, GooseConfig
from ..config import DEFAULT_STALL_S as STALL_S
from ..decoding import encode_chat
from ..engine.methods import METHODS
from ..engine.output import MAX_STOP_BYTES, Detokenizer, text_decoder
from ..errors import EngineClosed, GooseError, MethodNotAllowed, QueueFull
from ..machine import glibc
from .connections import ServeLimits, server_config
from .keys import ApiKeys, Key
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .schema import ChatCompletionRequest, CompletionRequest
from .snapshots import MemorySnapshots, snapshot_identity

log = logging.getLogger("goose.server")

STATIC = Path(__file__).parent / "static"
POLL_S = 0.05  # how often a waiting handler checks for a finished request or a gone client
WATCH_S = 0.1  # how often the server checks whether its engine failed or is idle
SERVE_ENGINE = EngineConfig(max_queue=64)  # goose serve's engine settings unless told otherwise
# what each arithmetic guarantees (shown by /v1/models; docs/usage.md "Two arithmetics")
ARITH_GUARANTEES = {
    "exact": "every method's tokens equal plain greedy decoding in float32, and Hugging Face's float32 generate",
    "int8": "every method's tokens equal plain greedy decoding by goose in int8 (not float32's tokens)",
}
MAX_STOPS = 4  # stop sequences per request (as OpenAI; each of at most MAX_STOP_BYTES bytes of UTF-8)
MAX_JSON_DEPTH = 32  # nesting levels of a request body
FAILED_STEPS = 3  # steps in a row whose shared work failed after which /health answers 503
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")  # Host names a loopback server answers by default


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


class HostCheck:
    """ASGI middleware: requests whose Host header names no allowed host get 400 (against DNS rebinding: a web
    page of another site whose name resolves to 127.0.0.1 must not reach a loopback server)."""

    def __init__(self, app, allowed: frozenset[str]) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
        if host_name(host) not in self.allowed:
            allowed = ", ".join(sorted(self.allowed))
            body = error_body(f"the host {host[:100]!r} is not served here (allowed: {allowed}; see --allowed-hosts)",
                              code="invalid_host")
            return await JSONResponse(body, 400)(scope, receive, send)
        await self.app(scope, receive, send)


def host_name(host: str) -> str:
    """The name of a Host header value, without its port, lowercase: ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def check_stops(stops: list[str]) -> None:
    """400 unless there are at most MAX_STOPS stop strings of at most MAX_STOP_BYTES bytes of UTF-8 each."""
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"at most {MAX_STOPS} stop sequences are allowed", param="stop")
    for s in stops:
        size = len(s.encode("utf-8"))
        if size > MAX_STOP_BYTES:
            raise ApiError(400, f"a stop sequence may have at most {MAX_STOP_BYTES} bytes of UTF-8 "
                                f"(MAX_STOP_BYTES), got {size}", param="stop")


def tenant_of(key: Key | None, user: str | None, cache_salt: str | None) -> str | None:
    """The tenant (prefix-cache and suffix-memory scope) of a request: a digest of its key's scope (when the
    server checks keys), its `user` and its `cache_salt`; None when it names no tenant (its key names none in
    the key file, and it sends no `user` nor `cache_salt`): such a request is private, it reuses nothing
    stored by another and leaves nothing for another. A key alone names a tenant only through the key file;
    `user` and `cache_salt` scope further inside the key's scope (they are not authentication)."""
    if (key is None or key.tenant is None) and not user and not cache_salt:
        return None
    parts = [key.scope if key else "", user or "", cache_salt or ""]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def parse_json(raw: bytes):
    """The JSON value of a request body; 400 (naming the field where there is one) for bad UTF-8, bad JSON,
    numbers too long to convert, nesting deeper than MAX_JSON_DEPTH, and lone surrogates (``\\ud800``) in
    any string."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (at byte {exc.start})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise ApiError(400, f"the request body's JSON is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # JSONDecodeError, and integers past Python's digit limit
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    todo = [(obj, (), 0)]
    while todo:  # iterative: a deep body must not exhaust the stack here
        value, path, depth = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body's JSON is nested more than {MAX_JSON_DEPTH} levels deep",
                           param=".".join(path) or None)
        if isinstance(value, str):
            _utf8(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                _utf8(k, path)
                todo.append((v, (*path, k), depth + 1))
        elif isinstance(value, list):
            todo.extend((v, (*path, str(i)), depth + 1) for i, v in enumerate(value))
    return obj


def _utf8(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        field = ".".join(path) or "body"
        raise ApiError(400, f"{field}: the string holds a lone surrogate (not valid Unicode text)",
                       param=field) from None


def validation_error(errors: list[dict]) -> ApiError:
    """A pydantic validation failure as one 400 naming the fields."""
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (".".join(loc) or None)
        msg = "unknown field (not supported)" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        parts.append(f"{'.'.join(loc) or 'body'}: {msg}")
    return ApiError(400, "invalid request: " + "; ".join(parts[:5]), param=param)


class _EngineView:
    """The serving engine as the metrics see it: always the current one (across restarts), with step counts
    summed over every engine this server ran."""

    def __init__(self, serving: "Serving") -> None:
        self._serving = serving
        self._steps = 0
        self._counts: list[int] = []

    def retire(self, engine) -> None:
        """Add a replaced engine's counts to the totals."""
        self._steps += engine.steps
        self._counts = [a + b for a, b in itertools.zip_longest(self._counts, engine.batch_counts, fillvalue=0)]

    @property
    def steps(self) -> int:
        return self._steps + self._serving.engine.steps

    @property
    def batch_counts(self) -> list[int]:
        counts = self._serving.engine.batch_counts
        return [a + b for a, b in itertools.zip_longest(self._counts, counts, fillvalue=0)]

    def __getattr__(self, name):
        return getattr(self._serving.engine, name)


class Serving:
    """One server's state and request handling: the engine (replaced by `restart()` once it fails, up to
    `max_restarts` times), the settings and the metrics. `create_app` routes HTTP requests here."""

    def __init__(self, engine, model_name: str, *, api_key: str | None = None, api_keys: ApiKeys | None = None,
                 metrics_key: str | None = None, default_max_tokens: int = 512, restart=None,
                 max_restarts: int = 1, on_fatal=None, hide_sources: bool = False,
                 stall_s: float = STALL_S, limits: ServeLimits = ServeLimits()) -> None:
        if not stall_s > 0:
            raise GooseError(f"stall_s must be > 0 seconds, got {stall_s}")
        self.limits = limits
        self.max_pending = limits.max_pending or (engine.max_queue or 64) + engine.max_batch
        self.pending = 0  # requests being parsed and tokenized now (on the event loop's count)
        self.engine, self.model_name = engine, model_name
        self.keys = all_keys(api_key, api_keys)  # None: /v1 is open
        self.metrics_key = metrics_key
        self.default_max_tokens = default_max_tokens
        self.hide_sources, self.stall_s = hide_sources, stall_s
        self.restart, self.max_restarts, self.on_fatal = restart, max_restarts, on_fatal
        self.restarts = 0
        self.restarting = False
        self.fatal: str | None = None  # the engine failed and will not be restarted: the server must stop
        self.last_failure: str | None = None
        self.watch_failure: str | None = None  # why the watcher (`watch`) stopped: no restart will come
        self.idle_at = time.monotonic()  # when the watcher last saw the engine with no request
        self.started_engines: list = []  # engines this server built (it closes them)
        self.snapshots = None  # the suffix memories' snapshot file (`create_app`'s `snapshots`)
        self._background: set = set()  # tasks of `background` still running
        tok = engine.tokenizer
        self.tok = tok
        self.decode = text_decoder(tok)
        self._view = _EngineView(self)
        self.metrics = Metrics(self._view, model_name)
        self.created = int(time.time())

    # ---- engine failures -------------------------------------------------------------------------------
    def engine_failure(self) -> str | None:
        """Why the server cannot serve now (None: it can)."""
        if self.fatal is not None:
            return self.fatal
        if self.engine.failure is not None:
            return f"the engine failed ({self.engine.failure}); " + \
                ("restarting it" if self.can_restart() else "not restarting it")
        return None

    def can_restart(self) -> bool:
        return self.restart is not None and self.restarts < self.max_restarts

    def stall(self) -> str | None:
        """Why the step loop looks stuck (None: it does not): requests wait or run, and no step finished for
        `stall_s` seconds since the later of the last step and the moment the watcher last saw no request."""
        running, waiting = self.engine.load()
        if not running and not waiting:
            return None
        last_step = self.engine.last_step_at  # None before the first step
        quiet = time.monotonic() - (self.idle_at if last_step is None else max(self.idle_at, last_step))
        if quiet <= self.stall_s:
            return None
        return (f"the engine's step loop is stuck: no step finished for {quiet:.0f} s while {running} request(s) "
                f"run and {waiting} wait (stall timeout {self.stall_s:g} s)")

    async def watch(self) -> None:
        """Until cancelled, every WATCH_S seconds: note when the engine has no request (for `stall`), and
        rebuild a failed engine (`recover`). When the watcher itself fails, `watch_failure` says why (and
        /health answers 503 with it): no failed engine would be rebuilt any more."""
        try:
            while True:
                await asyncio.sleep(WATCH_S)
                if self.engine.load() == (0, 0):
                    self.idle_at = time.monotonic()
                await self.recover()
        except Exception as exc:
            self.watch_failure = f"{type(exc).__name__}: {exc}"
            log.critical("the engine watcher failed (%s): a failed engine will not be rebuilt", self.watch_failure,
                         exc_info=exc)

    async def recover(self) -> None:
        """When the engine has failed, build a new one (once per `max_restarts`); when it may not, record the
        failure as fatal and call `on_fatal` (the server stops, exit status 1)."""
        failure = self.engine.failure
        if failure is None or self.fatal is not None:
            return
        self.last_failure = failure
        if not self.can_restart():
            self.fatal = f"the engine failed ({failure}) after {self.restarts} restart(s)"
            log.critical("%s: stopping the server", self.fatal)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return
        log.error("the engine failed (%s): restarting it (%d of %d)", failure, self.restarts + 1, self.max_restarts)
        self.restarting = True
        try:
            new = await asyncio.to_thread(self.restart)
        except Exception as exc:
            self.restarting = False
            self.fatal = f"the engine failed ({failure}) and restarting it failed ({type(exc).__name__}: {exc})"
            log.critical("%s: stopping the server", self.fatal, exc_info=exc)
            if self.on_fatal is not None:
                self.on_fatal(self.fatal)
            return
        old = self.engine
        self._view.retire(old)
        self.started_engines.append(new)
        self.engine, self.restarts, self.restarting = new, self.restarts + 1, False
        self.idle_at = time.monotonic()
        await asyncio.to_thread(old.close, 0)
        if self.snapshots is not None and not self.snapshots.held_elsewhere:
            # the failed engine's memories to the file, then into the new engine (which serves meanwhile)
            self.background(asyncio.to_thread(self.snapshots.carry, old, new))

    def background(self, work) -> None:
        """Run the awaitable `work` as a task of the server's own (awaited by `settled`); its failure is logged."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background work of the server failed", exc_info=task.exception())

    async def settled(self) -> None:
        """Wait for the server's background work (`background`) to end."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # ---- access --------------------------------------------------------------------------------------
    def authorized(self, request: Request) -> None:
        if self.keys is not None and self.key_of(request) is None:
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    def key_of(self, request: Request | None) -> Key | None:
        """The accepted key a request sent (None: none, or the server checks no keys)."""
        if self.keys is None or request is None:
            return None
        return self.keys.lookup(_bearer(request))

    def metrics_allowed(self, request: Request) -> None:
        """/metrics: with a metrics key, only for that key; else, when an API key is set, only from loopback
        clients; else open."""
        if self.metrics_key is not None:
            if not _bearer_is(request, self.metrics_key):
                raise ApiError(401, "invalid or missing metrics key (send 'Authorization: Bearer <metrics key>')",
                               code="invalid_api_key")
        elif self.keys is not None:
            client = request.client.host if request.client else ""
            if client not in LOOPBACK_HOSTS and not client.startswith("127."):
                raise ApiError(403, "/metrics is served to loopback clients only (set --metrics-key to read it "
                                    "from elsewhere)", "permission_error", "forbidden")

    # ---- plain endpoints -------------------------------------------------------------------------------
    def health(self) -> JSONResponse:
        why = self.engine_failure()
        if why is None and self.watch_failure is not None:
            why = f"the engine watcher failed ({self.watch_failure}); a failed engine would not be rebuilt"
        if why is None:
            why = self.stall()
        if why is None and self.engine.failed_steps >= FAILED_STEPS:
            why = (f"the engine's last {self.engine.failed_steps} steps all failed in their shared work (last: "
                   f"{self.engine.step_failure}); every request in them failed")
        if why is not None:
            return JSONResponse({"status": "error", "reason": why, "model": self.model_name,
                                 "restarts": self.restarts}, 503)
        running, waiting = self.engine.load()
        body = {"status": "ok", "model": self.model_name, "running": running, "waiting": waiting}
        if self.snapshots is not None:
            body["memory_snapshot"] = self.snapshots.status
        if self.restarts:
            body.update(restarts=self.restarts, last_failure=self.last_failure)
        return JSONResponse(body)

    def models(self) -> dict:
        engine = self.engine
        info = {"default_method": engine.default_method, "methods": list(engine.offered_methods),
                "arith": engine.arith, "guarantee": ARITH_GUARANTEES.get(engine.arith, "")}
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "goose", "max_model_len": engine.limit, "goose": info}]}

    # ---- completions -----------------------------------------------------------------------------------
    async def parse(self, http: Request, cls):
        """The request body as `cls` (OpenAI's error JSON for anything malformed; 408 when the body takes longer
        than `limits.body_timeout_s` to arrive)."""
        try:
            raw = await asyncio.wait_for(http.body(), self.limits.body_timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                                "(--body-timeout)", code="request_timeout") from None
        except ClientDisconnect:  # (the client went away while sending: nobody reads the answer)
            raise ApiError(400, "the client disconnected before its request body arrived",
                           code="client_disconnected") from None
        obj = parse_json(raw)
        if not isinstance(obj, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:
            return cls.model_validate(obj)
        except ValidationError as exc:
            raise validation_error(exc.errors()) from None

    def prepare(self, body, chat: bool) -> tuple[list[int], int]:
        """Prompt ids and max_new_tokens of a request (400 on anything goose will not do). Runs on a worker
        thread: tokenizing a long prompt does not hold up the event loop."""
        why = body.unsupported()
        if why:
            raise ApiError(400, why)
        if body.model is not None and body.model != self.model_name:
            raise ApiError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                           "not_found_error", "model_not_found", "model")
        check_stops(body.stop)
        tok, engine = self.tok, self.engine
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
        except Exception as exc:  # the tokenizer or its chat template refused this input
            log.warning("tokenizing a request failed", exc_info=exc)
            raise ApiError(400, f"the {'messages' if chat else 'prompt'} could not be tokenized: "
                                f"{type(exc).__name__}: {str(exc)[:200]}", param="messages" if chat else "prompt") \
                from None
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        room = None if engine.limit is None else engine.limit - len(ids)
        max_new = body.max_new()
        if max_new is None:
            max_new = self.default_max_tokens if chat else 16
            if room is not None:
                max_new = min(max_new, room)
        if room is not None and (room < 1 or max_new > room):
            raise ApiError(400, f"this model's maximum context length is {engine.limit} tokens; the prompt has "
                                f"{len(ids)} tokens and max_tokens is {max_new}", code="context_length_exceeded",
                           param="max_tokens")
        return ids, max_new

    async def submit(self, http: Request, body, ids: list[int], max_new: int, sink: asyncio.Queue):
        """An engine request whose committed `TokenBlock`s arrive in the asyncio queue `sink`
        (handed over with `call_soon_threadsafe`: the engine's thread never waits for the event loop)."""
        loop = asyncio.get_running_loop()
        try:
            method = body.method(METHODS)
            options = body.engine_options()
        except GooseError as exc:
            raise ApiError(400, str(exc), param="speculative") from None
        def on_tokens(block):  # engine thread: a TokenBlock, handed over without waiting for the event loop
            loop.call_soon_threadsafe(sink.put_nowait, block)

        tenant = tenant_of(self.key_of(http), body.user, getattr(body, "cache_salt", None))
        engine = self.engine

        def queue_it():  # on a worker thread: submitting may prepare a method (seconds) off the event loop
            return engine.submit(ids, max_new, False, method=method, on_tokens=on_tokens, tenant=tenant or "",
                                 private=tenant is None, stop=body.stop or None, **options)

        try:
            return await asyncio.to_thread(queue_it)
        except MethodNotAllowed as exc:
            raise ApiError(400, str(exc), param="speculative") from None
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {exc}; retry later", "rate_limit_error",
                           "queue_full", headers={"Retry-After": "1"}) from None
        except GooseError as exc:
            msg = str(exc)
            if isinstance(exc, EngineClosed):
                why = self.engine_failure()
                if why is not None or engine is not self.engine:
                    raise ApiError(503, f"the server cannot serve now: {why or 'the engine was restarted'}; retry "
                                        "later", "server_error", "engine_unavailable",
                                   headers={"Retry-After": "1"}) from None
                raise ApiError(503, "the server is shutting down", "server_error", "shutting_down") from None
            raise ApiError(400, msg) from None
        except (ValueError, TypeError, OverflowError) as exc:  # options the engine cannot take
            raise ApiError(400, f"invalid request: {type(exc).__name__}: {exc}") from None

    async def blocks(self, req, sink: asyncio.Queue):
        """The request's `TokenBlock`s as they come, until it is over."""
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

    def goose_info(self, req) -> dict:
        """A response's `goose` object; without the draft sources' counts (`accepted`, `drafted`) when the
        server hides them."""
        st = req.stats
        info = {"method": req.method,
                "tau": round(st.tau, 4), "forward_calls": st.forward_calls,
                "accepted": dict(st.accepted), "drafted": dict(st.drafted),
                "ttft_s": req.ttft_s, "tpot_s": req.tpot_s, "tokens_per_s": round(st.tokens_per_s, 3),
                "completion_token_ids": req.token_ids}
        if self.hide_sources:
            del info["accepted"], info["drafted"]
        return info

    def admissible(self) -> None:
        """429 before the body is read or parsed when the engine's queue is full (the engine refuses such a
        request anyway: the work before it is not done for nothing)."""
        engine = self.engine
        if engine.max_queue is not None and engine.load()[1] >= engine.max_queue:
            raise ApiError(429, f"the server is busy: the queue is full ({engine.max_queue} waiting requests); "
                                "retry later", "rate_limit_error", "queue_full", headers={"Retry-After": "1"})

    @staticmethod
    def usage(req) -> dict:
        st = req.stats
        return {"prompt_tokens": st.prompt_tokens, "completion_tokens": st.new_tokens,
                "total_tokens": st.prompt_tokens + st.new_tokens,
                "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}

    @staticmethod
    def failure(req) -> ApiError:
        return ApiError(500, f"generation failed: {req.error}", "server_error")

    async def complete(self, http: Request, cls, chat: bool):
        endpoint = "chat" if chat else "completions"
        metrics = self.metrics
        try:
            self.admissible()
            body = await self.parse(http, cls)
            if self.pending >= self.max_pending:  # (parsing and tokenizing are bounded too, not only the queue)
                raise ApiError(429, f"the server is busy: {self.pending} requests are being prepared "
                                    f"(max_pending {self.max_pending}); retry later", "rate_limit_error",
                               "queue_full", headers={"Retry-After": "1"})
            self.pending += 1
            try:
                ids, max_new = await asyncio.to_thread(self.prepare, body, chat)
                sink: asyncio.Queue = asyncio.Queue()
                req = await self.submit(http, body, ids, max_new, sink)
            finally:
                self.pending -= 1
        except ApiError as exc:
            metrics.refused(endpoint, exc.status_code)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if body.stream:
            return StreamingResponse(self.stream(http, body, chat, req, sink, rid, now),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        emitter = Detokenizer(self.decode, body.stop)
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
            raise self.failure(req)
        emitter.feed(req.token_ids)
        emitter.finish()
        reason = "stop" if emitter.stopped else req.finish_reason
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": emitter.text}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": emitter.text, "logprobs": None, "finish_reason": reason}
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
                "model": self.model_name, "choices": [choice], "usage": self.usage(req),
                "goose": self.goose_info(req)}

    async def stream(self, http: Request, body, chat: bool, req, sink, rid: str, now: int):
        endpoint = "chat" if chat else "completions"
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        emitter = Detokenizer(self.decode, body.stop)
        want_sources = bool(body.sources) and not self.hide_sources
        model_name = self.model_name

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
            async for block in self.blocks(req, sink):
                if not role_sent:
                    role_sent = True
                    yield chunk(None, role=True)
                pieces = emitter.feed(block, per_token=want_sources)
                if not pieces:
                    continue
                extra = None
                if want_sources:
                    st = req.stats
                    extra = {"goose": {"pieces": [[t, s] for t, s in pieces], "tokens": len(emitter.ids),
                                       "forward_calls": st.forward_calls}}
                yield chunk("".join(t for t, _ in pieces), extra=extra)
            finished = True
            if not role_sent:
                yield chunk(None, role=True)
            self.metrics.observe(endpoint, req)
            if req.finish_reason not in ("stop", "length"):
                err = self.failure(req)
                yield sse(error_body(err.message, err.type))
                yield "data: [DONE]\n\n"
                return
            tail = emitter.finish()
            if tail:
                extra = None
                if want_sources:
                    st = req.stats
                    extra = {"goose": {"pieces": [[tail, "bonus"]], "tokens": len(emitter.ids),
                                       "forward_calls": st.forward_calls}}
                yield chunk(tail, extra=extra)
            reason = "stop" if emitter.stopped else req.finish_reason
            info = {"goose": self.goose_info(req)}
            yield chunk(None, reason, extra=None if include_usage else info)
            if include_usage:
                yield sse({"id": rid, "object": obj, "created": now, "model": model_name, "choices": [],
                           "usage": self.usage(req), **info})
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                req.cancel()  # the client went away (or the stream broke): free the slot
                self.metrics.requests.labels(endpoint, "cancelled").inc()


def all_keys(api_key: str | None, api_keys: ApiKeys | None) -> ApiKeys | None:
    """The keys a server accepts: a key file's (`api_keys`) or the single `api_key`, which names no tenant
    (None: neither, /v1 is open)."""
    if api_key is not None and api_keys is not None:
        raise GooseError("give one API key or a key file's keys, not both")
    return ApiKeys({api_key: None}) if api_key is not None else api_keys


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _bearer_is(request: Request, key: str) -> bool:
    return secrets.compare_digest(_bearer(request).encode("utf-8", "surrogatepass"), key.encode())


def create_app(engine, model_name: str, *, api_key: str | None = None, api_keys: ApiKeys | None = None,
               metrics_key: str | None = None, allowed_hosts=LOOPBACK_HOSTS, max_body_bytes: int = 1 << 20,
               default_max_tokens: int = 512, drain_timeout: float = 30.0, close_engine: bool = True,
               restart=None, max_restarts: int = 1, on_fatal=None, hide_sources: bool = False,
               stall_s: float = STALL_S, snapshots=None, limits: ServeLimits = ServeLimits()) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name` (the state and handlers are a `Serving`, at
    ``app.state.serving``). `api_key`: bearer token /v1 requires (None: none), or `api_keys`: the tokens of a
    key file (`goose.server.keys`); `metrics_key`: bearer token /metrics requires (None: /metrics is open, or
    loopback-only when keys are set); `allowed_hosts`: Host header names served (None: any);
    `default_max_tokens`: a chat request's limit when it gives none (completions: 16, as OpenAI); `restart()`:
    builds a new engine when the engine fails, at most `max_restarts` times (None: no restart); after that
    `on_fatal(reason)` is called; `close_engine`: on shutdown, close the engine, letting running requests
    finish for `drain_timeout` s (engines built by `restart` are always closed); `hide_sources`: responses
    and streams carry no draft sources (`sources` pieces, `accepted` / `drafted` counts); `stall_s`: /health
    answers 503 when requests wait or run and no step finished for this many seconds; `snapshots`: a
    `goose.server.snapshots.MemorySnapshots` (the suffix memories loaded at start-up, saved at its interval
    and after shutdown) or None; `limits`: the body deadline and the requests prepared at once
    (`goose.server.connections.ServeLimits`; its connection limit and header deadline are the uvicorn
    configuration's: `server_config`)."""
    srv = Serving(engine, model_name, api_key=api_key, api_keys=api_keys, metrics_key=metrics_key,
                  default_max_tokens=default_max_tokens, restart=restart, max_restarts=max_restarts,
                  on_fatal=on_fatal, hide_sources=hide_sources, stall_s=stall_s, limits=limits)

    srv.snapshots = snapshots

    @asynccontextmanager
    async def lifespan(app):
        tasks = [asyncio.create_task(srv.watch())]
        if snapshots is not None and await asyncio.to_thread(snapshots.acquire):
            # loaded while the server already serves: the memories learned meanwhile are kept, as the newest
            srv.background(asyncio.to_thread(snapshots.load, srv.engine))
            tasks.append(asyncio.create_task(snapshots.run(lambda: srv.engine)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if snapshots is not None:
                await snapshots.finished()  # a periodic save still running lands before the final one
            if close_engine or srv.engine is not engine:
                await asyncio.to_thread(srv.engine.close, drain_timeout)
            if snapshots is not None:  # (after the drain: the finished requests' text is in it)
                await srv.settled()
                await asyncio.to_thread(snapshots.save, srv.engine, True)
                snapshots.release()

    app = FastAPI(title="goose", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # (served below, behind the API key)
    app.state.serving, app.state.metrics = srv, srv.metrics
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=frozenset(host_name(h) for h in allowed_hosts))

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
        err = validation_error(exc.errors())
        return JSONResponse(error_body(err.message, param=err.param), 400)

    @app.exception_handler(Exception)
    async def _crash(request, exc: Exception):
        log.exception("internal error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", "server_error"), 500)

    # ---- routes --------------------------------------------------------------------------------------
    def authorized(request: Request) -> None:
        srv.authorized(request)

    @app.get("/health")
    async def health():
        return srv.health()

    @app.get("/metrics")
    async def prometheus(request: Request):
        srv.metrics_allowed(request)
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json", dependencies=[Depends(authorized)], include_in_schema=False)
    async def openapi():
        return app.openapi()

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models():
        return srv.models()

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(http: Request):
        return await srv.complete(http, ChatCompletionRequest, chat=True)

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(http: Request):
        return await srv.complete(http, CompletionRequest, chat=False)

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
    libc = glibc()
    if libc is None:
        return False
    # -8: M_ARENA_MAX, -3: M_MMAP_THRESHOLD
    return bool(libc.mallopt(-8, int(arenas))) and bool(libc.mallopt(-3, int(mmap_threshold)))


def _quiet_health(record: logging.LogRecord) -> bool:
    """uvicorn's access log without the successful health checks (a router's every second or so)."""
    args = record.args
    return not (isinstance(args, tuple) and len(args) >= 5 and args[2] == "/health" and args[4] == 200)


def serve(model: str, method: str = "goose", host: str = "127.0.0.1", port: int = 8000,
          engine_config: EngineConfig = SERVE_ENGINE, api_key: str | None = None, dtype: str = "float32",
          device: str = "cpu", served_name: str | None = None, drain_timeout: float = 30.0,
          max_body_bytes: int = 1 << 20, default_max_tokens: int = 512, log_level: str = "info",
          weights: str | None = None, metrics_key: str | None = None, allowed_hosts=None, max_restarts: int = 1,
          arith: str = "exact", api_keys: ApiKeys | None = None, hide_sources: bool = False,
          stall_s: float = STALL_S, config=None, memory_snapshot: str | None = None,
          snapshot_interval_s: float = DEFAULT_SNAPSHOT_S, limits: ServeLimits = ServeLimits()) -> int:
    """Load `model`, start an Engine with `engine_config` (`SERVE_ENGINE`: the engine's defaults with a queue
    of 64) and the methods' `config` (a GooseConfig; None: the defaults) and serve it until SIGINT / SIGTERM
    (running requests get `drain_timeout` seconds to finish). A failed engine is rebuilt up to `max_restarts`
    times; after that the server stops.
    `allowed_hosts` None: the loopback names when `host` is a loopback address, else any host; `api_keys`,
    `hide_sources`, `stall_s`: as `create_app`'s. `memory_snapshot`: a file the suffix memories are loaded from
    at start-up and written to every `snapshot_interval_s` seconds (when they changed) and on shutdown
    (`goose.server.snapshots`; None: none). `limits`: connections, header and body deadlines, requests
    prepared at once (`goose.server.connections.ServeLimits`). Returns the exit status: 0, or 1 when the server stopped
    because its engine failed (uvicorn itself exits with status 1 or 3 when it cannot start, e.g. on a taken
    port)."""
    import uvicorn

    from ..engine.scheduler import Engine
    from ..loading.model import load_model

    tune_malloc()
    net, tok = load_model(model, dtype, device, weights=weights, arith=arith)  # (the Engine takes its arith)

    def build():
        return Engine(net, tok, method, config=config, engine_config=engine_config)

    snapshots = None
    if memory_snapshot is not None:
        min_match = (config or GooseConfig()).memory.min_match
        snapshots = MemorySnapshots(memory_snapshot, snapshot_identity(net, tok, min_match),
                                    net.get_output_embeddings().weight.shape[0], snapshot_interval_s)

    if allowed_hosts is None:
        allowed_hosts = LOOPBACK_HOSTS if host_name(host) in LOOPBACK_HOSTS or host.startswith("127.") else None
    elif "*" in allowed_hosts:
        allowed_hosts = None
    server_box: list = []

    def fatal(reason: str) -> None:
        server_box[0].should_exit = True

    app = create_app(build(), served_name or Path(model).name, api_key=api_key, api_keys=api_keys,
                     metrics_key=metrics_key, allowed_hosts=allowed_hosts, max_body_bytes=max_body_bytes,
                     default_max_tokens=default_max_tokens, drain_timeout=drain_timeout, restart=build,
                     max_restarts=max_restarts, on_fatal=fatal, hide_sources=hide_sources, stall_s=stall_s,
                     snapshots=snapshots, limits=limits)
    server = uvicorn.Server(server_config(app, limits, host=host, port=port, log_level=log_level,
                                          timeout_graceful_shutdown=drain_timeout))
    server_box.append(server)
    logging.getLogger("uvicorn.access").addFilter(_quiet_health)  # routers ask every second or so
    server.run()
    if not server.started:  # uvicorn logged why
        raise GooseError(f"the server could not start on {host}:{port}")
    return 1 if app.state.serving.fatal is not None else 0
