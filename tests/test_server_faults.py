"""`goose serve` under faults and hostile input: a failed engine makes /health answer 503 with the reason, is
rebuilt once (requests in flight fail, the next ones succeed) and stops the server with exit status 1 when it
fails again; the engine's thread never waits for the event loop and a 1 MiB prompt being tokenized does not
stall other streams; every malformed body gets OpenAI's error JSON (never a 500); Host check, metrics key,
API key from a file or the environment; stop strings capped and checked incrementally."""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import socket
import threading
import time
from urllib.parse import urlparse

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from conftest import TINY_EOS, hf_greedy, make_tiny_llama  # noqa: E402
from goose import Engine, GooseError  # noqa: E402
from goose.engine import scheduler  # noqa: E402
from goose.engine.output import (  # noqa: E402
    MAX_STOP_BYTES,  # noqa: E402
    Detokenizer,
    TokenBlock,
)
from goose.server.app import ApiError, Serving  # noqa: E402
from goose.server.schema import CompletionRequest  # noqa: E402
from serving import TIMEOUT, live_server, raw  # noqa: E402


@pytest.fixture(scope="module")
def worded():
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    return make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=2), tok


def sse_events(url: str, body: dict, on_event=None) -> list[dict]:
    """The JSON events of one streaming request; `on_event(i)` after each."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    events = []
    for line in resp:
        if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
            events.append(json.loads(line[6:]))
            if on_event is not None:
                on_event(len(events))
    conn.close()
    return events


def wait_for(check, seconds: float = TIMEOUT, what: str = "condition"):
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Fault:
    def __init__(self) -> None:
        self.fired = 0


def fail_next_step(engine, fault: Fault, when=lambda eng: True) -> None:
    """Make the engine's step loop itself raise (once `when(engine)` holds): an engine-level failure."""
    real = engine._next_step

    def next_step():
        if when(engine):
            fault.fired += 1
            raise MemoryError("injected engine fault")
        return real()

    engine._next_step = next_step


def greedy_completion(worded, prompt: str, n: int) -> list[int]:
    model, tok = worded
    return hf_greedy(model, tok(prompt)["input_ids"], n, eos=TINY_EOS)


# ---- engine failure: /health, restart once, then stop ----------------------------------------------------

def test_a_failed_engine_is_reported_restarted_once_then_fatal(worded):
    model, tok = worded
    gate = threading.Event()  # holds the restart until the test has seen the server without an engine
    built: list = []
    fatal: list = []

    def restart():
        assert gate.wait(TIMEOUT)
        built.append(Engine(model, tok, "ar", max_batch=2))
        return built[-1]

    eng = Engine(model, tok, "ar", max_batch=2)
    fault = Fault()
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 400, "temperature": 0}
    try:
        with live_server(eng, restart=restart, on_fatal=fatal.append) as base:
            assert raw(base, "GET", "/health")[0] == 200

            def on_event(i):  # the stream is running: the engine's loop fails at its next step
                if i == 2:
                    fail_next_step(eng, fault)

            events = sse_events(base, body, on_event)
            assert fault.fired == 1
            assert "the engine stopped: MemoryError: injected engine fault" in events[-1]["error"]["message"]
            status, _, health = raw(base, "GET", "/health")
            assert status == 503 and "injected engine fault" in json.loads(health)["reason"]
            status, headers, err = raw(base, "POST", "/v1/completions", {**body, "max_tokens": 4})
            assert status == 503 and json.loads(err)["error"]["code"] == "engine_unavailable"
            gate.set()
            wait_for(lambda: raw(base, "GET", "/health")[0] == 200, what="the restarted engine")
            assert json.loads(raw(base, "GET", "/health")[2])["restarts"] == 1
            status, _, ok = raw(base, "POST", "/v1/completions", {**body, "max_tokens": 12})
            assert status == 200
            assert json.loads(ok)["goose"]["completion_token_ids"] == greedy_completion(worded, "a b c", 12)
            # the second failure is fatal: /health stays 503 and the server is asked to stop
            fail_next_step(built[0], fault)
            status, _, err = raw(base, "POST", "/v1/completions", {**body, "max_tokens": 4})
            assert status == 500 and "the engine stopped" in json.loads(err)["error"]["message"]
            assert fault.fired == 2
            wait_for(lambda: fatal, what="on_fatal")
            status, _, health = raw(base, "GET", "/health")
            assert status == 503 and "after 1 restart" in json.loads(health)["reason"] and len(built) == 1
    finally:
        eng.close(timeout=10, cancel=True)


def test_goose_serve_exits_nonzero_when_its_engine_fails_twice(worded, tmp_path, monkeypatch):
    from goose.cli import main

    model, tok = worded
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    fault = Fault()
    real = scheduler.Engine._next_step

    def next_step(self):  # every engine fails while its first request runs
        if self._running:
            fault.fired += 1
            raise MemoryError("injected engine fault")
        return real(self)

    monkeypatch.setattr(scheduler.Engine, "_next_step", next_step)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc: list = []
    argv = ["serve", "--model", str(tmp_path / "tiny"), "--port", str(port), "--method", "ar", "--drain-timeout", "2"]
    server = threading.Thread(target=lambda: rc.append(main(argv)), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{port}"

    def up():
        try:
            return raw(base, "GET", "/health")[0] == 200
        except OSError:
            return False

    wait_for(up, 120, "goose serve")
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 4}
    assert raw(base, "POST", "/v1/completions", body)[0] == 500
    wait_for(lambda: up() and json.loads(raw(base, "GET", "/health")[2]).get("restarts") == 1, what="restart")
    assert raw(base, "POST", "/v1/completions", body)[0] == 500
    server.join(TIMEOUT)
    assert not server.is_alive() and rc == [1] and fault.fired == 2


class BlockingForward:
    """A forward whose `run` waits while `gate` is closed (a step loop stuck inside its forward)."""

    def __init__(self, forward) -> None:
        self._forward = forward
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self._forward, name)

    def run(self, segments):
        self.entered.set()
        assert self.gate.wait(2 * TIMEOUT)
        return self._forward.run(segments)


def health(base: str) -> tuple[int, dict]:
    status, _, body = raw(base, "GET", "/health")
    return status, json.loads(body)


def test_health_reports_a_step_loop_stuck_in_its_forward(worded):
    """/health answers 503 once requests run and no step finished for stall_s seconds, and 200 again when
    steps go on; an idle engine is never stuck, however long ago its last step was."""
    from goose.decoding import default_forward

    model, tok = worded
    forward = BlockingForward(default_forward(model))
    eng = Engine(model, tok, "ar", max_batch=1, forward=forward)
    body = {"model": "tiny", "prompt": "a b c", "max_tokens": 6, "temperature": 0}
    try:
        with live_server(eng, stall_s=2.0) as base:
            assert raw(base, "POST", "/v1/completions", body)[0] == 200 and eng.last_step_at is not None
            time.sleep(2.5)  # idle for longer than stall_s
            assert health(base)[0] == 200
            forward.gate.clear()
            forward.entered.clear()
            answer: dict = {}
            sender = threading.Thread(target=lambda: answer.update(r=raw(base, "POST", "/v1/completions", body)))
            sender.start()
            assert forward.entered.wait(TIMEOUT)
            assert health(base)[0] == 200  # stuck for less than stall_s so far
            status, why = wait_for(lambda: (lambda h: h if h[0] == 503 else None)(health(base)), what="503")
            assert "stuck" in why["reason"] and "1 request(s) run" in why["reason"]
            forward.gate.set()
            sender.join(TIMEOUT)
            assert answer["r"][0] == 200 and health(base)[0] == 200
    finally:
        forward.gate.set()
        eng.close(timeout=10, cancel=True)


@pytest.mark.parametrize("value", ["0", "-5", "inf", "soon"])
def test_the_stall_timeout_is_a_positive_number_of_seconds(value, capsys):
    from goose.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--stall-timeout", value])
    assert info.value.code == 2 and "--stall-timeout" in capsys.readouterr().err
    with pytest.raises(GooseError, match="stall_s"):
        Serving(None, "tiny", stall_s=0)


def test_a_failed_watcher_shows_in_health_and_the_log(worded, caplog):
    """The watcher fails while replacing a failed engine (closing the old one raises): /health answers 503
    naming it from then on, and the failure is logged."""
    model, tok = worded
    built: list = []
    eng = Engine(model, tok, "ar", max_batch=1)
    real_close = eng.close

    def broken_close(timeout=None, cancel=False):
        raise RuntimeError("closing broke")

    def restart():
        built.append(Engine(model, tok, "ar", max_batch=1))
        return built[-1]

    eng.close = broken_close
    fail_next_step(eng, Fault())
    try:
        with live_server(eng, restart=restart) as base:
            assert raw(base, "POST", "/v1/completions", {"model": "tiny", "prompt": "a b c", "max_tokens": 8})[0] == 500
            status, why = wait_for(lambda: (lambda h: h if "watcher" in h[1].get("reason", "") else None)(
                health(base)), what="the watcher's failure")
            assert status == 503 and "RuntimeError: closing broke" in why["reason"] and built
            assert any("watcher failed" in r.getMessage() for r in caplog.records)
    finally:
        real_close(timeout=10, cancel=True)


# ---- the event loop and the engine's thread --------------------------------------------------------------

def test_the_engine_thread_never_waits_for_the_event_loop(worded):
    """The event loop is blocked right after a request is queued: the engine still decodes it to the end
    (its blocks are handed over without waiting for the loop), and they all arrive once the loop runs."""
    model, tok = worded
    eng = Engine(model, tok, "ar", max_batch=1)
    try:
        srv = Serving(eng, "tiny")
        body = CompletionRequest(prompt="a b c", max_tokens=40, temperature=0)
        ids, max_new = srv.prepare(body, False)

        async def main():
            sink: asyncio.Queue = asyncio.Queue()
            task = asyncio.ensure_future(srv.submit(None, body, ids, max_new, sink))
            await asyncio.sleep(0)  # the request is being queued on a worker thread
            deadline = time.monotonic() + 20
            while not (eng.steps and eng.load() == (0, 0)):  # the loop is blocked meanwhile
                assert time.monotonic() < deadline, "the engine waited for the event loop"
                time.sleep(0.01)
            req = await task
            got = []
            async for block in srv.blocks(req, sink):
                got += block
            return req, got

        req, got = asyncio.run(main())
        assert req.finish_reason in ("stop", "length") and got == req.token_ids
        assert got == greedy_completion(worded, "a b c", 40)
    finally:
        eng.close(timeout=10, cancel=True)


class GatedTokenizer:
    """The real tokenizer, but tokenizing a text of over 100,000 characters waits for `gate` (so the test
    knows the tokenization is in progress while it watches the other streams)."""

    def __init__(self, tok) -> None:
        self._tok = tok
        self.entered, self.gate, self.left = threading.Event(), threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, text, *args, **kwargs):
        if isinstance(text, str) and len(text) > 100_000:
            self.entered.set()
            self.gate.wait(2 * TIMEOUT)
            self.left.set()
        return self._tok(text, *args, **kwargs)


def test_a_1mib_prompt_does_not_stall_other_streams(worded):
    model, tok = worded
    gated = GatedTokenizer(tok)
    eng = Engine(model, gated, "ar", max_batch=2)
    try:
        with live_server(eng, max_body_bytes=4 << 20) as base:
            progress: list[int] = []
            done: dict = {}
            stream_body = {"model": "tiny", "prompt": "a b c", "max_tokens": 300, "temperature": 0}
            streamer = threading.Thread(target=lambda: done.update(events=sse_events(base, stream_body,
                                                                                     progress.append)))
            streamer.start()
            wait_for(lambda: len(progress) >= 2, what="the first stream")
            big = {"model": "tiny", "prompt": "goose " * ((1 << 20) // 6), "max_tokens": 4}  # 1 MiB of text
            answer: dict = {}
            sender = threading.Thread(target=lambda: answer.update(r=raw(base, "POST", "/v1/completions", big)))
            sender.start()
            assert gated.entered.wait(TIMEOUT)  # the big prompt is being tokenized now (held there) ...
            seen = len(progress)
            assert streamer.is_alive(), "the stream ended before the big prompt arrived: make it longer"
            wait_for(lambda: len(progress) >= seen + 5 or not streamer.is_alive(), TIMEOUT // 2, "the stream")
            assert len(progress) >= seen + 5 and not gated.left.is_set()  # ... and the other stream went on
            gated.gate.set()
            sender.join(TIMEOUT)
            streamer.join(TIMEOUT)
            status, _, body = answer["r"]
            assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
            text = "".join(e["choices"][0]["text"] for e in done["events"])
            ids = greedy_completion(worded, "a b c", 300)
            assert text == tok.decode(ids, skip_special_tokens=True)
    finally:
        eng.close(timeout=10, cancel=True)


# ---- hostile input: always OpenAI's error JSON -----------------------------------------------------------

MSG = b'"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("body, needle, param", [
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "surrogate",
     "messages.0.content"),
    (b'{"model": "tiny", ' + MSG + b', "stop": ["ok", "\\udfff"]}', "surrogate", "stop.1"),
    (b'{"model": "tiny", ' + MSG + b', "\\ud800": 1}', "surrogate", None),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "UTF-8", None),
    (b'{"model": "tiny", ' + MSG + b', "max_tokens": ' + b"9" * 5000 + b"}", "not valid JSON", None),
    (b'{"model": "tiny", ' + MSG + b', "temperature": 1e999}', "temperature", "temperature"),
    (b'{"model": "tiny", ' + MSG + b', "seed": 18446744073709551616}', "seed", "seed"),
    (b'{"model": "tiny", ' + MSG + b', "max_tokens": 100000000000000000000}', "context length", "max_tokens"),
    (b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested", None),
    (b'{"model": "tiny", ' + MSG + b', "x": ' + b'{"a": ' * 40 + b"1" + b"}" * 40 + b"}", "nested", None),
    (b"null", "JSON object", None),
    (b"", "not valid JSON", None),
    (b'{"model": "tiny", ' + MSG + b', "stop": ["' + b"s" * (MAX_STOP_BYTES + 1) + b'"]}', "at most", "stop"),
    (b'{"model": "tiny", ' + MSG + b', "stop": ["a", "b", "c", "d", "e"]}', "at most 4", "stop"),
])
def test_hostile_bodies_get_a_400_with_openai_error_json(worded, body, needle, param):
    model, tok = worded
    eng = Engine(model, tok, "ar", max_batch=1)
    try:
        with live_server(eng, max_body_bytes=2 << 20) as base:
            status, _, out = raw(base, "POST", "/v1/chat/completions", body)
    finally:
        eng.close(timeout=10, cancel=True)
    err = json.loads(out)["error"]
    assert status == 400, (status, err)
    assert needle in err["message"] and err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err


# ---- Host header, keys -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def idle_engine(worded):
    model, tok = worded
    eng = Engine(model, tok, "ar", max_batch=1)
    yield eng
    eng.close(timeout=10, cancel=True)


def test_the_host_header_is_checked(idle_engine):
    with live_server(idle_engine) as base:  # the loopback default
        port = urlparse(base).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST"):
            assert raw(base, "GET", "/health", headers={"Host": host})[0] == 200, host
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "attacker"):
            status, _, body = raw(base, "GET", "/v1/models", headers={"Host": host})
            assert status == 400 and json.loads(body)["error"]["code"] == "invalid_host", host
    with live_server(idle_engine, allowed_hosts=["goose.internal"]) as base:
        assert raw(base, "GET", "/health", headers={"Host": "goose.internal:80"})[0] == 200
        assert raw(base, "GET", "/health", headers={"Host": "127.0.0.1"})[0] == 400
    with live_server(idle_engine, allowed_hosts=None) as base:
        assert raw(base, "GET", "/health", headers={"Host": "evil.example"})[0] == 200


def test_metrics_need_their_key_or_a_loopback_client(idle_engine):
    from starlette.requests import Request

    with live_server(idle_engine, api_key="k", metrics_key="m") as base:
        assert raw(base, "GET", "/metrics")[0] == 401
        assert raw(base, "GET", "/metrics", headers={"Authorization": "Bearer k"})[0] == 401
        status, _, body = raw(base, "GET", "/metrics", headers={"Authorization": "Bearer m"})
        assert status == 200 and b"goose_requests_running" in body
    with live_server(idle_engine, api_key="k") as base:
        assert raw(base, "GET", "/metrics")[0] == 200  # this test's client is on loopback
    srv = Serving(idle_engine, "tiny", api_key="k")
    remote = Request({"type": "http", "headers": [], "client": ("10.1.2.3", 5555)})
    with pytest.raises(ApiError) as info:
        srv.metrics_allowed(remote)
    assert info.value.status_code == 403
    Serving(idle_engine, "tiny").metrics_allowed(remote)  # no key at all: open


def test_keys_from_a_file_or_the_environment(tmp_path, monkeypatch, capsys):
    from goose.cli import main
    from goose.server.cli import secret

    key = tmp_path / "key"
    key.write_text("s3cret\nignored\n")
    monkeypatch.setenv("GOOSE_API_KEY", "from-env")
    assert secret("flag", None, "GOOSE_API_KEY", "API key") == "flag"
    assert secret(None, str(key), "GOOSE_API_KEY", "API key") == "s3cret"
    assert secret(None, None, "GOOSE_API_KEY", "API key") == "from-env"
    monkeypatch.delenv("GOOSE_API_KEY")
    assert secret(None, None, "GOOSE_API_KEY", "API key") is None
    with pytest.raises(GooseError, match="not both"):
        secret("flag", str(key), "GOOSE_API_KEY", "API key")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(GooseError, match="empty"):
        secret(None, str(tmp_path / "empty"), "GOOSE_API_KEY", "API key")
    assert main(["serve", "--model", "smollm2-135m", "--api-key-file", str(tmp_path / "missing")]) == 2
    assert "cannot read the API key file" in capsys.readouterr().err


def test_the_api_key_also_scopes_nothing_else_open(idle_engine):
    """With a key, /v1 needs it; /health stays open (for supervisors)."""
    with live_server(idle_engine, api_key="k") as base:
        assert raw(base, "GET", "/v1/models")[0] == 401
        assert raw(base, "GET", "/v1/models", headers={"Authorization": "Bearer k"})[0] == 200
        assert raw(base, "GET", "/health")[0] == 200


# ---- text and stop strings: incremental, exact -----------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(worded):
    return worded[1]


def _expected(text: str, stops: list[str]) -> str:
    cut = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cut)] if cut else text


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_emitted_text_is_the_decoding_cut_at_the_first_stop(tokenizer, data):
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    vocab = len(tokenizer)
    ids = [rng.randrange(vocab) for _ in range(data.draw(st.integers(1, 60)))]
    decode = lambda t: tokenizer.decode(t, skip_special_tokens=True)  # noqa: E731
    full = decode(ids)
    stops = []
    for _ in range(data.draw(st.integers(0, 3))):
        if full and data.draw(st.booleans()):
            i = rng.randrange(len(full))
            stops.append(full[i: i + rng.randint(1, 6)])
        else:
            stops.append(data.draw(st.text(min_size=1, max_size=4)))
    per_token = data.draw(st.booleans())
    em = Detokenizer(decode, stops)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        pieces += [p for p, _ in em.feed(TokenBlock(ids[i: i + n], [0] * len(ids[i: i + n])), per_token)]
        i += n
    pieces.append(em.finish())
    assert "".join(pieces) == em.text == _expected(full, stops)
    assert em.stopped == (em.text != full or any(s in full for s in stops))


def test_text_costs_the_same_per_token_however_long_the_output(tokenizer):
    """Every token is decoded a bounded number of times (the whole output only once, at the end), and stop
    strings are searched for in the new text only."""
    clean = [t for t in range(1000, 3000) if "\ufffd" not in tokenizer.decode([t]) and tokenizer.decode([t])]
    rng = random.Random(1)
    ids = [rng.choice(clean) for _ in range(600)]
    decoded = []

    def decode(t):
        decoded.append(len(t))
        return tokenizer.decode(t, skip_special_tokens=True)

    em = Detokenizer(decode, ["\x00never", "zzzz-not-there"])
    for t in ids:
        em.feed([t], per_token=True)
    streamed = sum(decoded)
    em.finish()
    assert em.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert streamed <= 6 * len(ids)  # the old whole-text decoding: ~n^2/2 = 180,000 tokens


def test_make_test_shows_skip_reasons():
    """Every pytest command of the Makefile (what `make test` and CI run) reports why tests were skipped."""
    from pathlib import Path

    makefile = (Path(__file__).parent.parent / "Makefile").read_text()
    commands = [line for line in makefile.splitlines() if "-m pytest" in line]
    assert commands and all(" -rs " in line for line in commands), commands


def test_a_prompt_the_tokenizer_refuses_is_a_400(idle_engine):
    from jinja2 import TemplateError

    from goose.server.schema import ChatCompletionRequest

    class Refusing:
        def __getattr__(self, name):
            return getattr(idle_engine.tokenizer, name)

        def apply_chat_template(self, *args, **kwargs):
            raise TemplateError("roles must alternate")

    srv = Serving(idle_engine, "tiny")
    srv.tok = Refusing()
    body = ChatCompletionRequest(messages=[{"role": "assistant", "content": "x"}])
    with pytest.raises(ApiError) as info:
        srv.prepare(body, True)
    assert info.value.status_code == 400 and "roles must alternate" in info.value.message
    assert info.value.param == "messages"


def test_goose_serve_on_a_taken_port_exits_nonzero(worded, tmp_path, capsys):
    from goose.cli import main

    model, tok = worded
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:  # uvicorn ends the process itself, after logging why
            main(["serve", "--model", str(tmp_path / "tiny"), "--port", str(port), "--method", "ar"])
    assert info.value.code not in (0, None)


def test_the_prefill_chunk_reaches_the_engine_and_must_be_positive(monkeypatch, capsys):
    """`goose serve --prefill-chunk N` sets the step's prompt-token budget (`EngineConfig.prefill_chunk`; without
    it each request's own chunk); 0 or a word is refused by the parser."""
    import goose.server.app as app
    from goose.cli import main

    seen = []
    monkeypatch.setattr(app, "serve", lambda model, method, host, port, engine, *a, **k: seen.append(engine) or 0)
    assert main(["serve", "--prefill-chunk", "96"]) == 0
    assert main(["serve"]) == 0
    assert [e.prefill_chunk for e in seen] == [96, None]
    for value in ("0", "many"):
        with pytest.raises(SystemExit) as info:
            main(["serve", "--prefill-chunk", value])
        assert info.value.code == 2 and "--prefill-chunk" in capsys.readouterr().err


# ---- a forward with a static cache of a few slots (the GPU forward, run on the CPU) ---------------------

def test_a_gpu_forward_server_queues_64_requests_past_its_slots_and_bounds_the_context(worded):
    """The GPU forward's 8 cache slots used to be taken at submit: the 8th concurrent request got 400 and
    max_batch / max_queue never acted; a request past the forward's entries got 500. Caches are now made at
    admission (a request waits for a slot), and the engine's context limit is the forward's."""
    from concurrent.futures import ThreadPoolExecutor

    from goose.backends.cuda import GPUForward
    from goose.config import EngineConfig

    model, tok = worded
    fwd = GPUForward(model, device="cpu", mode="fp32", max_len=256, slots=8)
    eng = Engine(model, tok, "pld", forward=fwd, engine_config=EngineConfig(max_batch=8, max_queue=64,
                                                                             tree_room=32))
    assert eng.limit == 256 - 32
    prompts = [" ".join(random.Random(i).choice(["a", "b", "c", "d"]) for _ in range(8)) for i in range(64)]
    try:
        with live_server(eng) as base:
            def one(p):
                body = {"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0}
                status, _, out = raw(base, "POST", "/v1/completions", body)
                return status, json.loads(out)

            with ThreadPoolExecutor(64) as pool:
                answers = list(pool.map(one, prompts))
            assert [s for s, _ in answers] == [200] * 64
            for p, (_, out) in zip(prompts[:4], answers[:4]):
                assert out["goose"]["completion_token_ids"] == greedy_completion(worded, p, 12)
            long = {"model": "tiny", "prompt": "a " * 200, "max_tokens": 100, "temperature": 0}
            status, _, err = raw(base, "POST", "/v1/completions", long)
            assert status == 400 and json.loads(err)["error"]["code"] == "context_length_exceeded"
        assert max(eng.batch_sizes) <= 7 and fwd.free_caches == 7  # (the forward's own cache holds one)
    finally:
        eng.close(timeout=10, cancel=True)
