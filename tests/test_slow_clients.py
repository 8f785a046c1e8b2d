"""Slow and hostile clients of `goose serve` (`goose.server.connections`, `Serving.parse` / `admissible`): a
connection that never finishes its headers is answered 408 and closed, connections past the limit are answered
503 and closed without being read (the count stays at the limit), a body that trickles in gets 408, and a full
queue answers 429 before the body is parsed. Loopback only, a bounded number of sockets, each test bounded in
time."""

from __future__ import annotations

import json
import socket
import time

import pytest

pytest.importorskip("fastapi")

from goose import Engine  # noqa: E402
from goose.config import EngineConfig  # noqa: E402
from goose.server.connections import ServeLimits  # noqa: E402
from serving import live_server, raw  # noqa: E402

BODY = {"model": "tiny", "prompt": "a b c", "max_tokens": 4, "temperature": 0}


def _connect(base: str) -> socket.socket:
    host, port = base.rsplit("/", 1)[-1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _read_all(sock: socket.socket, seconds: float = 10) -> bytes:
    """What the server sends until it closes the connection (or `seconds` pass)."""
    sock.settimeout(seconds)
    out = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            break
        if not chunk:
            break
        out += chunk
    return out


@pytest.fixture(scope="module")
def engine(worded):
    model, tok = worded
    eng = Engine(model, tok, "ar", engine_config=EngineConfig(max_batch=2, max_queue=8))
    yield eng
    eng.close(timeout=10, cancel=True)


def test_half_sent_headers_are_answered_408_and_closed(engine):
    limits = ServeLimits(header_timeout_s=0.5)
    with live_server(engine, limits=limits) as base:
        sock = _connect(base)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # and nothing more
        t0 = time.monotonic()
        got = _read_all(sock)
        waited = time.monotonic() - t0
        sock.close()
        assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got and 0.3 < waited < 8
        # a keep-alive connection that starts a second request and never finishes its headers: the same
        sock = _connect(base)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        time.sleep(0.2)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 1")
        got = _read_all(sock)
        sock.close()
        assert got.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408" in got
        assert raw(base, "POST", "/v1/completions", BODY)[0] == 200  # well-behaved clients see no change


def test_connections_past_the_limit_are_answered_503_and_the_count_stays_at_it(engine):
    limits = ServeLimits(connections=6, header_timeout_s=1.0)
    with live_server(engine, limits=limits) as base:
        idle = [_connect(base) for _ in range(5)]
        time.sleep(0.2)
        extra = [_connect(base) for _ in range(4)]  # the 6th is served; the rest refused at once
        answers = [_read_all(s, 3) for s in extra]
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        assert len(refused) >= 3 and all(b"too_many_connections" in a for a in refused)
        for s in idle + extra:
            s.close()
        time.sleep(1.5)  # the idle ones' header deadline passed: a new client is served
        assert raw(base, "POST", "/v1/completions", BODY)[0] == 200


def test_a_body_that_trickles_in_is_answered_408(engine):
    limits = ServeLimits(body_timeout_s=0.5)
    with live_server(engine, limits=limits) as base:
        sock = _connect(base)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n{")
        got = b""
        for _ in range(4):  # a byte every 0.3 s
            time.sleep(0.3)
            try:
                sock.sendall(b" ")
            except OSError:
                break
        got = _read_all(sock, 5)
        sock.close()
        assert b" 408 " in got.split(b"\r\n", 1)[0] and b"did not arrive within 0.5 s" in got


def test_a_full_queue_answers_429_before_the_body_is_parsed(worded):
    """With the queue full, a request is refused with 429 before its body is read or tokenized: a body that
    is not even JSON gets 429, not 400."""
    model, tok = worded
    with Engine(model, tok, "ar", engine_config=EngineConfig(max_batch=1, max_queue=1), thread=False) as eng:
        eng.submit([1, 2, 3], 4)  # (no loop runs: it waits in the queue, which is full)
        with live_server(eng) as base:
            status, headers, body = raw(base, "POST", "/v1/completions", b"this is not JSON")
    assert status == 429 and json.loads(body)["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
