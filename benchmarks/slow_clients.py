"""Normal clients beside slowloris connections and slow bodies: p95 latency quiet and under attack, one run.

A `goose serve` app on the packaged model (in this process, loopback, goose serve's own uvicorn configuration)
answers 8 normal clients (completions, `--max-tokens` each, `--rounds` requests per client), first on a quiet
server, then while a separate process holds `--slowloris` connections that send a header byte every second and
`--slow-bodies` requests whose bodies arrive at 1 byte a second. Prints each phase's p50 / p95 latency, their
ratio (the target: p95 within 1.25x), how the attackers' connections ended (408, 503, closed), and the most
connections the server held (`--limit` at most). Bounded: every socket is loopback, the attack stops with the
normal clients, each phase has a deadline.

    python benchmarks/slow_clients.py [--arith int8] [--slowloris 200] [--slow-bodies 100] [--limit 512]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import statistics
import threading
import time

PHASE_S = 300  # the most one phase may take


def attacker(port: int, slowloris: int, slow_bodies: int, stop, report) -> None:
    """In its own process: hold slow connections until `stop` is set; report how each ended."""

    async def slow(opening: bytes, drip: bytes, kind: str, ends: dict) -> None:
        """Open a connection, send `opening`, then `drip` every second until the server answers or closes."""
        while not stop.is_set():
            try:
                r, w = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                ends["refused"] = ends.get("refused", 0) + 1
                await asyncio.sleep(1)
                continue
            w.write(opening)
            how = "open at the end"
            try:
                while not stop.is_set():
                    w.write(drip)
                    await w.drain()
                    try:
                        data = await asyncio.wait_for(r.read(100), 1.0)
                    except asyncio.TimeoutError:
                        continue
                    how = data.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] or "closed"
                    break
            except OSError:
                how = "closed"
            ends[kind + how] = ends.get(kind + how, 0) + 1
            w.close()

    loris = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-a: b\r\n", "")
    body = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000\r\n\r\n{", b" ", "body ")

    async def main() -> None:
        ends: dict = {}
        tasks = [asyncio.create_task(slow(*loris, ends)) for _ in range(slowloris)]
        tasks += [asyncio.create_task(slow(*body, ends)) for _ in range(slow_bodies)]
        while not stop.is_set():
            await asyncio.sleep(0.2)
        await asyncio.wait(tasks, timeout=5)
        report.put(ends)

    asyncio.run(main())


def normal_clients(port: int, clients: int, rounds: int, max_tokens: int) -> list[float]:
    import http.client

    lat: list[float] = []
    lock = threading.Lock()
    deadline = time.monotonic() + PHASE_S

    def one(c: int) -> None:
        for k in range(rounds):
            if time.monotonic() > deadline:
                return
            body = json.dumps({"prompt": f"Count from {c} to {c + k + 5}:", "max_tokens": max_tokens,
                               "temperature": 0})
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            if resp.status != 200:
                raise SystemExit(f"a normal client got {resp.status}")
            with lock:
                lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=one, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return lat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arith", default="int8")
    ap.add_argument("--method", default="goose")
    ap.add_argument("--slowloris", type=int, default=200)
    ap.add_argument("--slow-bodies", type=int, default=100)
    ap.add_argument("--limit", type=int, default=512)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import uvicorn

    from goose import Engine, load_model
    from goose.config import EngineConfig
    from goose.server.app import create_app
    from goose.server.connections import ServeLimits, server_config

    model, tok = load_model("smollm2-135m", arith=args.arith)
    engine = Engine(model, tok, args.method, engine_config=EngineConfig(max_batch=8, max_queue=64))
    limits = ServeLimits(connections=args.limit)
    app = create_app(engine, "smollm2-135m", close_engine=False, limits=limits)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = server_config(app, limits, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    most = [0]

    def count() -> None:  # the connections the server holds (its protocol's own set)
        while not server.should_exit:
            most[0] = max(most[0], len(server.server_state.connections))
            time.sleep(0.05)

    threading.Thread(target=count, daemon=True).start()
    normal_clients(port, args.clients, 1, args.max_tokens)  # warm-up (first-use costs)
    quiet = normal_clients(port, args.clients, args.rounds, args.max_tokens)
    quiet_most = most[0]
    ctx = multiprocessing.get_context("spawn")
    stop, report = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=attacker, args=(port, args.slowloris, args.slow_bodies, stop, report))
    proc.start()
    time.sleep(12)  # the attack is in place (slowloris past one header deadline)
    attacked = normal_clients(port, args.clients, args.rounds, args.max_tokens)
    stop.set()
    ends = report.get(timeout=60)
    proc.join(30)
    server.should_exit = True
    engine.close(timeout=10, cancel=True)

    def p95(xs):
        return statistics.quantiles(xs, n=20)[-1]

    print(f"normal clients: {args.clients} x {args.rounds} requests of {args.max_tokens} tokens, {args.method}, "
          f"{args.arith}; attack: {args.slowloris} slowloris + {args.slow_bodies} slow bodies; limit {args.limit}")
    print(f"quiet:    p50 {statistics.median(quiet) * 1000:.0f} ms, p95 {p95(quiet) * 1000:.0f} ms "
          f"(most connections {quiet_most})")
    print(f"attacked: p50 {statistics.median(attacked) * 1000:.0f} ms, p95 {p95(attacked) * 1000:.0f} ms "
          f"(most connections {most[0]})")
    print(f"p95 ratio attacked / quiet: {p95(attacked) / p95(quiet):.2f}x; attackers' connections ended: {ends}")


if __name__ == "__main__":
    main()
