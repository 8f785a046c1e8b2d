"""`goose replicas`: N `goose serve` processes behind vLLM's router, a tenant's requests kept on one replica.

The router is `vllm-router` (vllm-project/router, a Rust binary from PyPI, the `router` extra); goose starts
and supervises the processes, it does not route. Layout, all on `--host` (loopback by default):

    router              --port P                     the OpenAI-compatible endpoint clients use
    replica i (0..N-1)  P + 1 + i                    a whole `goose serve` each (its own engine, caches, memory)
    router metrics      P + N + 1 (`--metrics-port`) Prometheus text of the router (requests per worker, ...)

Routing (`--policy`, default `consistent_hash`): a request goes to the replica its key hashes to, the key being
the first of the headers X-Session-ID, X-User-ID, X-Tenant-ID, X-Request-ID, X-Correlation-ID, X-Trace-ID
(vllm-router 0.1.17 does not steer by the body's `user`); so a session or tenant that sends one always lands
on the same replica, where its prefix cache and suffix memory are warm (goose's tenant itself is still the API
key's scope, `user` and `cache_salt`). `cache_aware`
routes by the longest prompt prefix seen per replica instead (load-balanced), `round_robin` / `power_of_two` /
`random` spread requests with no affinity. Requests without any key are hashed by their whole body.

Failures: the router checks every replica's `/health` each `--health-interval` seconds (default 1) and routes
around one that fails it (`consistent_hash` then moves only that replica's keys); a request that cannot reach
its replica is retried by the router (up to 5 tries, 0.2 s backoff growing 1.5x), on another replica once the
dead one is marked unhealthy: greedy decoding gives the same tokens there. A request streaming from a replica
that dies ends with an error (nothing is resent mid-stream). goose restarts a replica that exits, at most
`--max-restarts` times each (default 3); when the router exits, everything is stopped. SIGINT / SIGTERM stop the
router, then drain the replicas (each finishes its running requests, `goose serve --drain-timeout`).

Threads: each replica gets OMP_NUM_THREADS = max(1, CPUs // N) unless the environment sets it. Memory
snapshots: `--memory-snapshot-dir D` gives replica i `D/replica-i.snapshot` (`goose serve --memory-snapshot`).
Across machines: run `goose serve --host <address> --api-key ...` on each machine and `vllm-router
--worker-urls http://host1:8000 http://host2:8000 --policy consistent_hash`
in front of them (docs/serving.md, "Replicas behind a router").
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .. import cachefs
from ..errors import GooseError

POLICIES = ("consistent_hash", "cache_aware", "round_robin", "power_of_two", "random")
MAX_REPLICAS = 64
UNHEALTHY_S = 120.0  # seconds a replica's /health may stay non-200 before it is restarted (--unhealthy-timeout)
# `goose serve` options `goose replicas` sets itself for each replica
OWN_FLAGS = ("--host", "--port", "--memory-snapshot", "--drain-timeout")


@dataclass
class Replica:
    index: int
    url: str
    cmd: list[str]
    env: dict
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    unhealthy_since: float | None = None  # when its /health last turned from 200 to anything else
    was_healthy: bool = False  # its /health answered 200 since it (re)started

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, env=self.env)
        self.started_at, self.unhealthy_since, self.was_healthy = time.monotonic(), None, False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def router_command(host: str, port: int, urls: list[str], policy: str, metrics_port: int,
                   health_interval: int) -> list[str]:
    """vllm-router's command line for `urls` (loopback metrics, quick health checks, retries with backoff)."""
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", host, "--port", str(port),
            "--worker-urls", *urls, "--policy", policy, "--prometheus-host", host, "--prometheus-port",
            str(metrics_port), "--health-check-interval-secs", str(health_interval), "--health-failure-threshold",
            "1", "--health-success-threshold", "1", "--retry-max-retries", "5", "--retry-initial-backoff-ms", "200",
            "--log-level", "warning"]


def replica_commands(n: int, host: str, port: int, serve_args: list[str], snapshot_dir: str | None,
                     threads: int | None, drain_timeout: float = 30.0) -> list[Replica]:
    """The `goose serve` command and environment of each replica."""
    for flag in OWN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in serve_args):
            hint = {"--memory-snapshot": " (use --memory-snapshot-dir)",
                    "--drain-timeout": " (give it to goose replicas)"}.get(flag, "")
            raise GooseError(f"goose replicas sets {flag} of each replica itself; leave it out of the serve "
                             f"arguments{hint}")
    default_threads = str(max(1, (os.cpu_count() or 1) // n))
    out = []
    for i in range(n):
        p = port + 1 + i
        cmd = [sys.executable, "-m", "goose", "serve", "--host", host, "--port", str(p), "--drain-timeout",
               str(drain_timeout), *serve_args]
        if snapshot_dir is not None:
            cmd += ["--memory-snapshot", str(Path(snapshot_dir) / f"replica-{i}.snapshot")]
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        else:
            env.setdefault("OMP_NUM_THREADS", default_threads)
        out.append(Replica(i, f"http://{'[' + host + ']' if ':' in host else host}:{p}", cmd, env))
    return out


class Replicas:
    """Starts the replicas, waits until each is healthy, starts the router, supervises them all (`run`)."""

    def __init__(self, replicas: list[Replica], router_cmd: list[str], startup_timeout: float,
                 max_restarts: int, drain_timeout: float, unhealthy_s: float = UNHEALTHY_S,
                 is_healthy=None) -> None:
        self.replicas, self.router_cmd = replicas, router_cmd
        self.startup_timeout, self.max_restarts, self.drain_timeout = startup_timeout, max_restarts, drain_timeout
        self.unhealthy_s = unhealthy_s
        self.is_healthy = healthy if is_healthy is None else is_healthy  # url -> bool (tests give their own)
        self.router: subprocess.Popen | None = None
        self._stop = False

    def _wait_healthy(self, reps: list[Replica]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        waiting = list(reps)
        while waiting:
            for r in list(waiting):
                if not r.alive():
                    raise GooseError(f"replica {r.index} ({r.url}) exited with status {r.proc.returncode} "
                                     "while starting; its messages are above")
                if healthy(r.url):
                    waiting.remove(r)
            if self._stop:
                raise KeyboardInterrupt
            if waiting and time.monotonic() > deadline:
                raise GooseError(f"replica(s) {', '.join(str(r.index) for r in waiting)} not healthy after "
                                 f"{self.startup_timeout:.0f} s")
            time.sleep(0.2)

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        self._wait_healthy(self.replicas)
        self.router = subprocess.Popen(self.router_cmd)

    def supervise_once(self) -> bool:
        """One look at every process: restarts a replica that exited (within its budget); False once the
        router has exited (everything is then to be stopped)."""
        if self.router is not None and self.router.poll() is not None:
            print(f"goose replicas: the router exited with status {self.router.returncode}", file=sys.stderr)
            return False
        for r in self.replicas:
            if r.alive():
                self._watch_health(r)
            if r.proc is None or r.alive():
                continue
            if r.restarts < self.max_restarts:
                print(f"goose replicas: replica {r.index} exited ({r.proc.returncode}); starting it again",
                      file=sys.stderr)
                r.restarts += 1
                r.start()
            else:
                print(f"goose replicas: replica {r.index} exited ({r.proc.returncode}) after {r.restarts} restarts; "
                      "left down (the router routes around it)", file=sys.stderr)
                r.proc = None
        return True

    def _watch_health(self, r: Replica) -> None:
        """Stop (SIGTERM, then SIGKILL after the drain) a running replica whose /health has not answered 200 for
        `unhealthy_s` seconds (or that never did within `startup_timeout` of its start): an engine stuck or failing
        every step stays up otherwise. Once it exits, `supervise_once` starts it again (within its budget)."""
        now = time.monotonic()
        if self.is_healthy(r.url):
            r.unhealthy_since, r.was_healthy = None, True
            return
        if r.unhealthy_since is None:
            r.unhealthy_since = now
        limit, since = (self.unhealthy_s, r.unhealthy_since) if r.was_healthy else (self.startup_timeout,
                                                                                     r.started_at)
        if now - since <= limit:
            return
        print(f"goose replicas: replica {r.index} has not been healthy for {now - since:.0f} s; stopping it",
              file=sys.stderr)
        r.proc.send_signal(signal.SIGTERM)
        try:
            r.proc.wait(self.drain_timeout + 10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        for r in self.replicas:
            if r.alive():
                r.proc.send_signal(signal.SIGTERM)  # goose serve drains: running requests finish
        deadline = time.monotonic() + self.drain_timeout + 10
        for r in self.replicas:
            if r.proc is None:
                continue
            try:
                r.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.proc.kill()
                r.proc.wait()

    def run(self, poll_s: float = 0.5) -> int:
        def on_signal(signum, frame):
            self._stop = True

        old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            self.start()
            while not self._stop:
                if not self.supervise_once():
                    return 1
                time.sleep(poll_s)
            return 0
        except KeyboardInterrupt:
            return 0
        finally:
            self.stop()
            for s, h in old.items():
                signal.signal(s, h)


def register(sub) -> None:
    from ..cliargs import int_in, positive_int

    r = sub.add_parser("replicas", help="N goose serve replicas behind vLLM's router (a tenant stays on one)",
                       description=__doc__.split("\n\n")[0] + " Arguments after -- go to every `goose serve`.")
    r.add_argument("--replicas", type=int_in(1, MAX_REPLICAS), default=2,
                   help=f"goose serve processes (default 2, at most {MAX_REPLICAS})")
    r.add_argument("--host", default="127.0.0.1", help="address of the router and the replicas (default 127.0.0.1)")
    r.add_argument("--port", type=int_in(1, 65535 - MAX_REPLICAS - 2), default=8000,
                   help="the router's port (default 8000); replica i listens on PORT + 1 + i")
    r.add_argument("--metrics-port", type=int_in(1, 65535), default=None,
                   help="the router's Prometheus port (default PORT + replicas + 1)")
    r.add_argument("--policy", choices=POLICIES, default="consistent_hash",
                   help="how the router picks a replica (default consistent_hash: by session / user / tenant)")
    r.add_argument("--threads", type=positive_int, default=None,
                   help="OMP_NUM_THREADS of each replica (default: the environment's OMP_NUM_THREADS, else CPUs // "
                        "replicas, at least 1)")
    r.add_argument("--memory-snapshot-dir", default=None, metavar="DIR",
                   help="replica i keeps its suffix memories in DIR/replica-i.snapshot (goose serve --memory-snapshot)")
    r.add_argument("--max-restarts", type=int_in(0), default=3,
                   help="times a replica that exits is started again (default 3)")
    r.add_argument("--health-interval", type=int_in(1, 3600), default=1,
                   help="seconds between the router's health checks of each replica (default 1)")
    r.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds the replicas may take to become healthy (default 600)")
    r.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds each replica may take to finish its requests on shutdown (default 30)")
    r.add_argument("--unhealthy-timeout", type=float, default=UNHEALTHY_S,
                   help="seconds a running replica's /health may answer anything but 200 (a stuck engine, steps "
                        f"failing in a row) before it is stopped and started again (default {UNHEALTHY_S:g})")
    r.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="-- then goose serve's arguments, given to every replica (e.g. -- --arith int8 --max-batch 4)")
    r.set_defaults(func=cmd_replicas)


def cmd_replicas(args) -> int:
    try:
        import vllm_router  # noqa: F401
    except ImportError:
        raise GooseError("goose replicas needs vLLM's router: pip install 'goose[router]' (vllm-router)") from None
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    reps = replica_commands(args.replicas, args.host, args.port, serve_args, args.memory_snapshot_dir,
                            args.threads, args.drain_timeout)
    if args.memory_snapshot_dir is not None:
        cachefs.private_dirs(Path(args.memory_snapshot_dir))  # (the snapshots hold the traffic: 0700)
    metrics_port = args.metrics_port or args.port + args.replicas + 1
    cmd = router_command(args.host, args.port, [r.url for r in reps], args.policy, metrics_port,
                         args.health_interval)
    print(f"goose replicas: {args.replicas} x goose serve ({', '.join(r.url for r in reps)}) behind vllm-router "
          f"on http://{args.host}:{args.port} (policy {args.policy}; router metrics on port {metrics_port})",
          file=sys.stderr)
    return Replicas(reps, cmd, args.startup_timeout, args.max_restarts, args.drain_timeout,
                    args.unhealthy_timeout).run()
