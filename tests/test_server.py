"""`goose serve`: the OpenAI-compatible API through the official `openai` client against a live server on a
random loopback port (a tiny random Llama with SmolLM2's real tokenizer), raw SSE, errors, cancellation."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest import TINY_EOS, hf_greedy  # noqa: E402
from goose import Engine  # noqa: E402
from goose.decoding import encode_chat  # noqa: E402
from serving import TIMEOUT, live_server, raw  # noqa: E402


@pytest.fixture(scope="module")
def engine(worded):
    model, tok = worded
    eng = Engine(model, tok, "goose", max_batch=4, max_queue=8)
    yield eng
    eng.close(timeout=10, cancel=True)


@pytest.fixture(scope="module")
def url(engine):
    with live_server(engine) as base:
        yield base


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def chat_ids(tok, text: str) -> list[int]:
    return encode_chat(tok, [{"role": "user", "content": text}])


def greedy_text(worded, ids: list[int], n: int) -> tuple[list[int], str]:
    model, tok = worded
    out = hf_greedy(model, ids, n, eos=TINY_EOS)
    return out, tok.decode(out, skip_special_tokens=True)


def wait_idle(engine, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while engine.load() != (0, 0):
        assert time.monotonic() < deadline, f"requests still held: {engine.load()}"
        time.sleep(0.02)


PROMPTS = ["Write a haiku about geese.", "List three prime numbers and say why.", "Hello!", "a b c a b c a b"]


# ---- the API through the openai client ----------------------------------------------------------------

def test_models_and_health(client, url):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    status, _, body = raw(url, "GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_a_repeated_system_prompt_is_prefilled_once(client, worded):
    """The second request of a tenant with the same long system prompt takes its keys and values from the
    engine's prefix cache (usage.prompt_tokens_details.cached_tokens) and still answers exactly the greedy
    tokens."""
    _, tok = worded
    system = "You are a careful assistant. Answer in one short sentence, and never use lists. " * 3
    answers = []
    for question in ("What is a goose?", "What is a duck?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                           user="prefix-test")
        ids = encode_chat(tok, messages)
        assert r.model_extra["goose"]["completion_token_ids"] == greedy_text(worded, ids, 12)[0]
        answers.append((len(ids), r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
    (n1, p1, c1), (n2, p2, c2) = answers
    assert (p1, p2) == (n1, n2) and c2 >= len(encode_chat(tok, [{"role": "system", "content": system}])) - 16
    assert c2 % 8 == 0 and c2 < p2


@pytest.mark.parametrize("speculative", [None, "off", "pld"])
def test_chat_completion_equals_greedy_decoding(client, worded, speculative):
    _, tok = worded
    for prompt in PROMPTS[:3]:
        extra = {} if speculative is None else {"speculative": speculative}
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=24, temperature=0, extra_body=extra)
        ids, text = greedy_text(worded, chat_ids(tok, prompt), 24)
        g = r.model_extra["goose"]
        assert g["completion_token_ids"] == ids
        assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == ("stop" if ids[-1] == TINY_EOS else "length")
        assert r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(chat_ids(tok, prompt))
        assert g["method"] == {None: "goose", "off": "ar", "pld": "pld"}[speculative]
        assert g["forward_calls"] >= 1 and g["tau"] > 0 and set(g["accepted"]) == {"spine", "branch", "memory", "head"}


def test_stream_matches_non_stream_and_ends_with_usage(client, worded):
    for prompt in PROMPTS:
        kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=30, temperature=0)
        full = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == [full.choices[0].finish_reason]
        last = chunks[-1]
        assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
        assert last.model_extra["goose"]["completion_token_ids"] == full.model_extra["goose"]["completion_token_ids"]


def test_completions_text_and_token_prompts(client, worded):
    model, tok = worded
    prompt = "Once upon a time"
    ids = tok(prompt)["input_ids"]
    ref_ids, ref_text = greedy_text(worded, ids, 20)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == ref_text and r.object == "text_completion"
    r2 = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0)
    assert r2.choices[0].text == ref_text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True))
    assert streamed == ref_text
    assert len(client.completions.create(model="tiny", prompt=prompt, temperature=0).model_extra["goose"]
               ["completion_token_ids"]) <= 16  # OpenAI's default max_tokens for completions


def test_concurrent_requests_are_token_identical_to_solo_decoding(client, worded, engine):
    _, tok = worded
    jobs = [(p, spec) for p in PROMPTS for spec in (None, "off")]
    results: dict = {}

    def one(i, prompt, spec):
        extra = {} if spec is None else {"speculative": spec}
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=40, temperature=0, stream=True, extra_body=extra,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        results[i] = ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                      chunks[-1].model_extra["goose"]["completion_token_ids"])

    threads = [threading.Thread(target=one, args=(i, p, s)) for i, (p, s) in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert len(results) == len(jobs)
    for i, (prompt, _) in enumerate(jobs):
        ids, text = greedy_text(worded, chat_ids(tok, prompt), 40)
        assert results[i] == (text, ids)
    assert max(engine.batch_sizes) > 1  # they really ran together
    wait_idle(engine)


def test_stop_strings_cut_the_text(client, worded):
    _, tok = worded
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}],
                                          max_tokens=30, temperature=0).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    want = full[: full.find(stop)]
    for stream in (False, True):
        kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=30, temperature=0,
                  stop=[stop, "\x00never"])
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][0]
        else:
            r = client.chat.completions.create(**kw)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == want and reason == "stop"


def test_seeded_sampling_is_reproducible_and_lossless(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=24, temperature=0.8,
              top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kw).model_extra["goose"]["completion_token_ids"]
    b = client.chat.completions.create(**kw).model_extra["goose"]["completion_token_ids"]
    off = client.chat.completions.create(**kw, extra_body={"speculative": "off"})
    assert a == b == off.model_extra["goose"]["completion_token_ids"]


def test_token_sources_in_the_stream(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[3]}], max_tokens=40, temperature=0, stream=True,
        extra_body={"sources": True}))
    text, pieces, calls = "", [], []
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            g = c.model_extra["goose"]
            text += c.choices[0].delta.content
            assert "".join(p for p, _ in g["pieces"]) == c.choices[0].delta.content
            pieces += g["pieces"]
            calls.append(g["forward_calls"])
    assert "".join(p for p, _ in pieces) == text and text
    assert {s for _, s in pieces} <= {"spine", "branch", "bonus"}
    assert calls == sorted(calls)
    final = chunks[-1].model_extra["goose"]
    assert final["forward_calls"] >= 1 and "pieces" not in final


# ---- raw HTTP: SSE framing, errors ---------------------------------------------------------------------

def test_sse_is_openai_chunk_format_ending_with_done(url):
    status, headers, body = raw(url, "POST", "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0,
        "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for ev in events[:-2]:
        assert ev.startswith("data: ")
        obj = json.loads(ev[6:])
        assert obj["object"] == "chat.completion.chunk" and obj["id"].startswith("chatcmpl-")
        assert obj["model"] == "tiny" and len(obj["choices"]) == 1


@pytest.mark.parametrize("body, status, needle", [
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n > 1"),
    ({"messages": [{"role": "user", "content": "x"}], "frobnicate": 1}, 400, "frobnicate"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, 400, "context length"),
    ({"messages": [{"role": "user", "content": "x"}], "speculative": "warp"}, 400, "warp"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, 400, "logprobs"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}, 404, "gpt-9"),
])
def test_bad_requests_get_openai_error_json(url, body, status, needle):
    got, _, raw_body = raw(url, "POST", "/v1/chat/completions", {"model": "tiny", **body})
    err = json.loads(raw_body)["error"]
    assert got == status and needle in err["message"] and err["type"]
    assert "Traceback" not in raw_body.decode()


def test_malformed_json_and_huge_bodies(url, client):
    status, _, body = raw(url, "POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "error" in json.loads(body)
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    status, _, body = raw(url, "POST", "/v1/chat/completions", big)
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=["a", "b"], max_tokens=4)
    status, _, body = raw(url, "GET", "/v1/nothing")
    assert status == 404 and "error" in json.loads(body)


def test_context_overflow_is_400_with_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=list(range(5, 1005)), max_tokens=100)
    assert info.value.body["code"] == "context_length_exceeded"


def test_api_key(engine):
    with live_server(engine, api_key="s3cret") as base:
        bad = openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert raw(base, "POST", "/v1/completions", {"prompt": "x"})[0] == 401
        good = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0, timeout=TIMEOUT)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason
        assert raw(base, "GET", "/health")[0] == 200  # health, metrics and the playground stay open


# ---- load: 429, disconnects free slots, metrics ---------------------------------------------------------

def _open_stream(url: str, max_tokens: int):
    """A streaming request left open after its first event (its connection, to be closed by the caller)."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": "tiny", "prompt": "a b c d e f g", "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "speculative": "off"}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn


def test_full_queue_gets_429_and_disconnects_free_their_slots(worded):
    model, tok = worded
    eng = Engine(model, tok, "goose", max_batch=1, max_queue=1)
    try:
        with live_server(eng) as base:
            running = _open_stream(base, 1000)
            # the second request waits in the queue (no token yet: send it without reading)
            u = urlparse(base)
            waiting = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
            waiting.request("POST", "/v1/completions", body=json.dumps({
                "model": "tiny", "prompt": "x", "max_tokens": 1000, "stream": True, "temperature": 0}),
                headers={"Content-Type": "application/json"})
            deadline = time.monotonic() + 20
            while eng.load() != (1, 1):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            status, headers, body = raw(base, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"})
            assert status == 429 and headers["retry-after"] == "1"
            assert json.loads(body)["error"]["type"] == "rate_limit_error"
            with pytest.raises(openai.RateLimitError):
                openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(
                    model="tiny", prompt="x", max_tokens=2)
            running.close()
            waiting.close()
            wait_idle(eng)  # both cancelled: the running one mid-stream, the waiting one in the queue
            assert eng.steps < 1000
            metrics = raw(base, "GET", "/metrics")[2].decode()
            assert 'goose_requests_total{endpoint="completions",outcome="http_429"} 2.0' in metrics
            assert 'outcome="cancelled"' in metrics
            assert "goose_requests_running 0.0" in metrics and "goose_requests_waiting 0.0" in metrics
    finally:
        eng.close(timeout=10, cancel=True)


def test_non_streaming_disconnect_cancels(worded):
    model, tok = worded
    eng = Engine(model, tok, "ar", max_batch=2)
    try:
        with live_server(eng) as base:
            u = urlparse(base)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=TIMEOUT)
            conn.request("POST", "/v1/completions", body=json.dumps({
                "model": "tiny", "prompt": "x y", "max_tokens": 1000, "temperature": 0}),
                headers={"Content-Type": "application/json"})
            deadline = time.monotonic() + 20
            while eng.load()[0] != 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            conn.close()
            wait_idle(eng)
            assert eng.steps < 1000
    finally:
        eng.close(timeout=10, cancel=True)


def test_metrics_after_requests(client, url, engine):
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "metrics"}], max_tokens=6,
                                   temperature=0)
    status, headers, body = raw(url, "GET", "/metrics")
    text = body.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for name in ("goose_requests_total", "goose_generation_tokens_total", "goose_prompt_tokens_total",
                 'goose_accepted_tokens_total{source="spine"}', 'goose_drafted_tokens_total{source="branch"}',
                 "goose_request_tau_bucket", "goose_time_to_first_token_seconds_bucket",
                 "goose_time_per_output_token_seconds_bucket", "goose_batch_size_bucket", "goose_requests_running",
                 "goose_requests_waiting", "goose_forward_calls_total", "goose_prompt_tokens_cached_total",
                 'goose_accepted_tokens_total{source="memory"}', 'goose_accepted_tokens_total{source="head"}'):
        assert name in text, name
    assert f"\ngoose_step_threads {float(engine.step_threads)}\n" in text and engine.step_threads >= 1


def test_memory_bytes_per_tenant_under_hashed_labels(client, url, engine):
    """Each tenant's suffix memory bytes are on /metrics under a hashed label (names never shown), with the
    totals; the label set is bounded (the largest MEMORY_REPORT_TENANTS tenants)."""
    from goose.engine.scheduler import MEMORY_REPORT_TENANTS

    for user in ("alice-metrics", "bob-metrics"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "remember this text"}],
                                       max_tokens=12, temperature=0, user=user)
    deadline = time.monotonic() + 10
    while True:  # the engine publishes the sizes once it goes idle
        text = raw(url, "GET", "/metrics")[2].decode()
        series = [line for line in text.splitlines() if line.startswith("goose_memory_tenant_bytes{")]
        if len(series) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert 2 <= len(series) <= MEMORY_REPORT_TENANTS and "alice" not in text and "bob" not in text
    assert all(line.split('tenant="')[1].startswith("t-") and float(line.split()[-1]) > 0 for line in series)
    total = next(line for line in text.splitlines() if line.startswith("goose_memory_bytes "))
    assert float(total.split()[-1]) >= sum(float(line.split()[-1]) for line in series)
    assert engine.memory_report.tenants >= 2


# ---- the command line: goose serve in a subprocess, SIGTERM drains --------------------------------------

def test_goose_serve_cli_and_sigterm_drain(worded, tmp_path):
    model, tok = worded
    model.save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "goose", "serve", "--model", str(tmp_path / "tiny"), "--port",
                             str(port), "--method", "ar", "--drain-timeout", "20"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                if raw(base, "GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "goose serve did not come up"
            time.sleep(0.2)
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        assert c.models.list().data[0].id == "tiny"
        stream = c.completions.create(model="tiny", prompt="a b", max_tokens=300, temperature=0, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = list(stream)  # the running request is finished, not cut
        assert first.choices[0].text is not None and rest[-1].choices[0].finish_reason in ("stop", "length")
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn ends by re-raising the signal it drained on
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- goose bench-serve ----------------------------------------------------------------------------------

def test_bench_serve_levels_and_soak(url, engine, tmp_path, capsys):
    from goose.cli import main

    out = tmp_path / "bench.json"
    rc = main(["bench-serve", "--url", url + "/v1", "--concurrency", "1,2", "--max-tokens", "8", "--soak", "8",
               "--json", str(out), "--timeout", "120"])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 2]
    assert all(lv["errors"] == 0 and lv["tok_s"] > 0 for lv in result["levels"])
    assert result["levels"][1]["identical"] == "7/7"  # greedy texts equal at both concurrencies
    assert result["soak"]["requests"] == 8 and result["soak"]["running_after"] == 0
    assert "| concurrency |" in capsys.readouterr().out
    wait_idle(engine)


def test_bench_serve_talks_to_loopback_only(capsys):
    from goose.cli import main

    assert main(["bench-serve", "--url", "http://example.com/v1"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_malloc_is_tuned_unless_the_environment_says(monkeypatch):
    """`goose serve` sets glibc's arenas and mmap threshold before its threads start; explicit MALLOC_*
    settings in the environment win."""
    import platform

    from goose.server.app import tune_malloc

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert tune_malloc() is False
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert tune_malloc() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert tune_malloc() is True


def test_speculation_switch_per_request_among_the_offered_methods(worded):
    """``speculative``: false / "off" decode plainly, true the server's method, a method the server offers
    itself; any other method is a 400 naming it. /v1/models lists what is offered and the arithmetic's
    guarantee. Every answer is the same greedy text."""
    from goose.config import EngineConfig

    _, tok = worded
    eng = Engine(*worded, "goose", engine_config=EngineConfig(max_batch=2, methods=("pld",)))
    try:
        with live_server(eng) as base:
            status, _, body = raw(base, "GET", "/v1/models")
            info = json.loads(body)["data"][0]["goose"]
            assert status == 200 and info["methods"] == ["goose", "ar", "pld"] and info["default_method"] == "goose"
            assert info["arith"] == "exact" and "Hugging Face" in info["guarantee"]
            want = greedy_text(worded, chat_ids(tok, PROMPTS[0]), 16)[0]
            for spec, method in ((False, "ar"), ("off", "ar"), (True, "goose"), ("pld", "pld")):
                status, _, body = raw(base, "POST", "/v1/chat/completions", {
                    "model": "tiny", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 16,
                    "temperature": 0, "speculative": spec})
                g = json.loads(body)["goose"]
                assert status == 200 and g["method"] == method and g["completion_token_ids"] == want
            status, _, body = raw(base, "POST", "/v1/chat/completions", {
                "model": "tiny", "messages": [{"role": "user", "content": "x"}], "speculative": "tr"})
            err = json.loads(body)["error"]
            assert status == 400 and "'tr' is not offered" in err["message"] and err["param"] == "speculative"
    finally:
        eng.close(timeout=10, cancel=True)
