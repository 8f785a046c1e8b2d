"""`goose serve`'s HTTP connections: how many are held at once, and how long a client may take to send a
request's headers (uvicorn bounds neither: its keep-alive timer starts only after a response, so half-sent
headers were held forever, before any authentication).

`server_config` is the uvicorn configuration every goose server runs with (the tests' too). Its protocol is
uvicorn's h11 one with two guards:
- a connection beyond `limit` (the ones open now, idle keep-alive ones included) is answered 503 at once and
  closed, never read, so the server's connection count stays at its limit;
- a connection that has not sent a whole request's headers `header_timeout_s` seconds after it opened, or after
  its last response, is answered 408 and closed.
The body's own deadline is the handlers' (`Serving.parse`: 408 too). For a server reachable from other machines,
put a reverse proxy in front (docs/serving.md "Exposed deployments").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, LIMIT_CONNECTIONS
from ..errors import GooseError


@dataclass(frozen=True)
class ServeLimits:
    """What a server lets clients hold: `connections` open at once (None: no limit), seconds to send a
    request's headers and its body, and `max_pending`: requests being parsed and tokenized at once, before the
    engine's queue (None: the engine's max_queue + max_batch); past it, 429."""

    connections: int | None = LIMIT_CONNECTIONS
    header_timeout_s: float = HEADER_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    max_pending: int | None = None

    def __post_init__(self) -> None:
        if self.connections is not None and self.connections < 1:
            raise GooseError(f"the connection limit must be >= 1, got {self.connections}")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise GooseError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_pending is not None and self.max_pending < 1:
            raise GooseError(f"max_pending must be >= 1, got {self.max_pending}")


def _answer(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response, OpenAI's error JSON, that closes the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500 else
                                 "server_error", "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n")
    return head.encode("latin-1") + body


def guarded_protocol(limit: int | None = LIMIT_CONNECTIONS, header_timeout_s: float = HEADER_TIMEOUT_S):
    """uvicorn's h11 protocol class with the connection limit and the header deadline (module docstring)."""
    over = _answer(503, "Service Unavailable", f"the server holds its limit of {limit} connections "
                   "(--limit-concurrency); retry later", "too_many_connections")
    late = _answer(408, "Request Timeout", f"the request's headers did not arrive within {header_timeout_s:g} s "
                   "(--header-timeout)", "request_timeout")

    class GuardedProtocol(H11Protocol):
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if limit is not None and len(self.connections) > limit:
                transport.write(over)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            """Start the header deadline for the next request (the one after the current cycle)."""
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self, cycle) -> None:
            self._header_timer = None
            if self.cycle is cycle and not self.transport.is_closing():  # no request began since
                self.transport.write(late)
                self.transport.close()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            if not self.transport.is_closing() and self.cycle is cycle:  # (a pipelined request began: none)
                self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedProtocol


def server_config(app, limits: ServeLimits = ServeLimits(), **uvicorn_kw):
    """The uvicorn.Config of a goose server (`uvicorn_kw`: host, port, log_level, timeout_graceful_shutdown,
    ...), on `guarded_protocol` with `limits`' connections and header deadline."""
    import uvicorn

    return uvicorn.Config(app, http=guarded_protocol(limits.connections, limits.header_timeout_s), **uvicorn_kw)
