"""A live goose server for tests: `create_app` under uvicorn on a random free loopback port, in a thread."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

TIMEOUT = 60  # seconds any one test request may take


@contextlib.contextmanager
def live_server(engine, model_name: str = "tiny", **app_kw):
    """Yields the server's base URL (``http://127.0.0.1:PORT``); stops the server (not the engine) on exit. It
    runs with goose serve's own uvicorn configuration (`server_config`: connection limit, header deadline)."""
    import uvicorn

    from goose.server.app import create_app
    from goose.server.connections import ServeLimits, server_config

    limits = app_kw.setdefault("limits", ServeLimits())
    app = create_app(engine, model_name, close_engine=False, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, limits, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def raw(url: str, method: str, path: str, body=None, headers=None):
    """(status, headers, body bytes) of one plain HTTP request."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out
