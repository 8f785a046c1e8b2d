"""`goose replicas`: two `goose serve` processes of a tiny model behind vLLM's router (vllm-router), loopback only.

One replica set is started for the module; the tests run in order, the last kills a replica."""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm_router", reason="goose replicas needs the router extra (vllm-router)")

from goose.errors import GooseError  # noqa: E402
from goose.server.replicas import replica_commands, router_command  # noqa: E402
from serving import raw  # noqa: E402

STARTUP_S = 240
N = 2


def _free_block(n: int) -> int:
    """A port P with P .. P + n - 1 all free on 127.0.0.1."""
    rng = random.Random(os.getpid())
    for _ in range(200):
        base = rng.randrange(20000, 60000)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free block of ports")


def call(port: int, path: str, body: dict | None = None, headers: dict | None = None):
    """(status, body bytes) of one request to 127.0.0.1:`port` (`serving.raw`)."""
    status, _, data = raw(f"http://127.0.0.1:{port}", "POST" if body is not None else "GET", path, body, headers)
    return status, data


def complete(port: int, prompt: str, session: str | None = None, user: str | None = None, max_tokens: int = 12):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if user is not None:
        body["user"] = user
    status, data = call(port, "/v1/completions", body, {"X-Session-ID": session} if session else None)
    assert status == 200, data[:500]
    return json.loads(data)["choices"][0]["text"]


def metric(port: int, name: str) -> float:
    status, data = call(port, "/metrics")
    assert status == 200
    total = 0.0
    for line in data.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def replicas(worded, tmp_path_factory):
    model, tok = worded
    folder = tmp_path_factory.mktemp("replicas")
    model.save_pretrained(folder / "tiny")
    tok.save_pretrained(folder / "tiny")
    port = _free_block(N + 2)
    env = dict(os.environ, XDG_CACHE_HOME=str(folder / "cache"))
    cmd = [sys.executable, "-m", "goose", "replicas", "--replicas", str(N), "--port", str(port), "--threads", "1",
           "--max-restarts", "1", "--drain-timeout", "5", "--", "--model", str(folder / "tiny"), "--method", "goose",
           "--max-batch", "4"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + STARTUP_S
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                if call(port, "/health")[0] == 200 and call(port, "/v1/models")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "goose replicas did not come up"
            time.sleep(0.3)
        yield port, [port + 1 + i for i in range(N)], proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        proc.stdout.close()


PROMPTS = [f"Tell me about item {i}: the cat sat on the mat and" for i in range(8)]


def test_same_tokens_as_one_replica(replicas):
    router, reps, _ = replicas
    alone = [complete(reps[0], p) for p in PROMPTS]  # one replica, asked directly
    before = [metric(r, "goose_requests_total") for r in reps]
    routed = [complete(router, p, session=f"s{i}", user=f"u{i}") for i, p in enumerate(PROMPTS)]
    after = [metric(r, "goose_requests_total") for r in reps]
    assert routed == alone
    assert all(a > b for a, b in zip(after, before)), (before, after)  # the router used both


def test_a_session_stays_on_one_replica_with_a_warm_prefix_cache(replicas):
    router, reps, _ = replicas
    history = "The quick brown fox jumps over the lazy dog. " * 12
    homes = {}
    for s in range(24):  # 6 sessions, more until both replicas hold one (the ring hashes this run's ports too)
        if s >= 6 and len({h for h, _ in homes.values()}) == N:
            break
        session = f"tenant-{s}"
        before = [metric(r, "goose_requests_total") for r in reps]
        first = complete(router, f"Session {s}. {history}", session=session, user=session)
        after = [metric(r, "goose_requests_total") for r in reps]
        home = [i for i in range(N) if after[i] > before[i]]
        assert len(home) == 1, (before, after)
        homes[session] = (home[0], f"Session {s}. {history}{first}")
    assert len({h for h, _ in homes.values()}) == N  # sessions spread over both replicas
    prompt0 = [metric(r, "goose_prompt_tokens_total") for r in reps]
    cached0 = [metric(r, "goose_prompt_tokens_cached_total") for r in reps]
    for turn in range(2):
        for session, (home, text) in homes.items():
            before = [metric(r, "goose_requests_total") for r in reps]
            answer = complete(router, text + f" Next {turn}.", session=session, user=session)
            after = [metric(r, "goose_requests_total") for r in reps]
            assert [i for i in range(N) if after[i] > before[i]] == [home]  # the same replica every turn
            homes[session] = (home, text + f" Next {turn}." + answer)
    prompt = sum(metric(r, "goose_prompt_tokens_total") for r in reps) - sum(prompt0)
    cached = sum(metric(r, "goose_prompt_tokens_cached_total") for r in reps) - sum(cached0)
    assert cached / prompt >= 0.9, (cached, prompt)


def test_a_killed_replica_fails_or_retries_its_requests_cleanly(replicas):
    router, reps, proc = replicas
    expected = {i: complete(reps[1], p) for i, p in enumerate(PROMPTS)}
    # a stream from replica 0, cut when replica 0 is killed: it ends (an error or a short stream), never hangs
    import psutil

    victim = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)
              if "serve" in c.cmdline() and str(reps[0]) in c.cmdline()]
    assert len(victim) == 1, "replica 0's process not found"
    c = http.client.HTTPConnection("127.0.0.1", reps[0], timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": "a b c", "max_tokens": 400,
                                                     "temperature": 0, "stream": True, "ignore_eos": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    r.readline()
    for p in victim:
        os.kill(int(p), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises((http.client.IncompleteRead, ConnectionError, http.client.HTTPException)):
        while r.read(1024):
            pass
        raise ConnectionError("the stream ended early")
    assert time.monotonic() - t0 < 30
    c.close()
    # every session keeps being served through the router, with the same tokens: the dead replica's sessions
    # are retried on the live one
    got = {i: complete(router, p, session=f"k{i}", user=f"k{i}") for i, p in enumerate(PROMPTS)}
    assert got == expected
    # goose replicas starts the killed replica again, and the router sends it requests once it is healthy
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            if call(reps[0], "/health")[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None
        assert time.monotonic() < deadline, "the killed replica was not started again"
        time.sleep(0.5)
    assert complete(reps[0], PROMPTS[0]) == expected[0]


def test_replica_commands_and_router_command():
    reps = replica_commands(3, "127.0.0.1", 9000, ["--arith", "int8"], "/snap", 2)
    assert [r.url for r in reps] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002", "http://127.0.0.1:9003"]
    assert reps[2].cmd[-2:] == ["--memory-snapshot", "/snap/replica-2.snapshot"]
    assert all(r.env["OMP_NUM_THREADS"] == "2" and "--arith" in r.cmd for r in reps)
    for bad in (["--port", "1"], ["--host=0.0.0.0"], ["--memory-snapshot", "x"], ["--drain-timeout", "3"]):
        with pytest.raises(GooseError, match="sets --"):
            replica_commands(2, "127.0.0.1", 9000, bad, None, None)
    cmd = router_command("127.0.0.1", 9000, [r.url for r in reps], "consistent_hash", 9004, 1)
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 4] == [r.url for r in reps]
    assert cmd[cmd.index("--prometheus-host") + 1] == "127.0.0.1"  # the router's metrics stay on loopback


def test_a_replica_unhealthy_for_long_is_stopped_and_started_again(tmp_path):
    """`goose replicas` used to restart only replicas that exit: one whose /health stayed 503 (a stuck engine)
    was left up for good. Now one unhealthy for `unhealthy_s` is stopped, then started again."""
    import sys
    import time

    from goose.server.replicas import Replica, Replicas

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    rep = Replica(0, "http://127.0.0.1:1", sleeper, {})
    answers = iter([True, False, False, False, False])
    sup = Replicas([rep], [], startup_timeout=30, max_restarts=1, drain_timeout=0.1, unhealthy_s=0.3,
                   is_healthy=lambda url: next(answers, False))
    rep.start()
    first = rep.proc
    try:
        sup.supervise_once()  # healthy
        sup.supervise_once()  # unhealthy from now on
        assert rep.alive() and rep.proc is first
        time.sleep(0.4)
        sup.supervise_once()  # unhealthy for longer than unhealthy_s: stopped, and started again
        assert first.poll() is not None and rep.restarts == 1 and rep.alive() and rep.proc is not first
    finally:
        for p in (first, rep.proc):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
