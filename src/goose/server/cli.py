"""`goose serve` and `goose bench-serve`: registered into goose's command line by `register`."""

from __future__ import annotations

import argparse

from ..cliargs import (
    add_head_arg,
    add_model_args,
    cli_arith,
    goose_config,
    int_in,
    method_name,
    positive_int,
    prefix_cache_mb,
)
from ..config import (
    BODY_TIMEOUT_S,
    DEFAULT_MAX_TENANTS,
    DEFAULT_MEMORY_MB,
    DEFAULT_PREFIX_CACHE_MB,
    DEFAULT_SNAPSHOT_S,
    HEADER_TIMEOUT_S,
    LIMIT_CONNECTIONS,
    DecodeConfig,
    EngineConfig,
)
from ..config import DEFAULT_STALL_S as STALL_S
from .keys import MAX_KEY_CHARS, MAX_KEY_LINES, MAX_TENANT_CHARS, read_key_file

_port = int_in(1, 65535)
_non_negative_int = int_in(0)


def secret(flag: str | None, path: str | None, env: str, what: str) -> str | None:
    """A key from its flag, else the first line of its file, else the environment variable `env` (None: none).
    GooseError for an unreadable or empty file, or for both a flag and a file."""
    import os

    from ..errors import GooseError

    if flag is not None and path is not None:
        raise GooseError(f"give the {what} with its flag or its file, not both")
    if flag is not None:
        if not flag.strip():  # (it used to turn authentication off silently, whatever the environment said)
            raise GooseError(f"the {what} given is empty: give a key, or leave the flag out")
        return flag
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise GooseError(f"cannot read the {what} file {path}: {exc}") from None
        if not key:
            raise GooseError(f"the {what} file {path} is empty")
        return key
    return os.environ.get(env) or None


def _memory_mb(text: str) -> float:
    """``--memory-mb``: MiB for the engine's suffix memories (`EngineConfig.memory_mb`)."""
    try:
        return EngineConfig(memory_mb=float(text)).memory_mb
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc) if "memory_mb" in str(exc) else f"expected a number, got '{text}'")


SERVE_METHODS = ("pld", "goose-nohead")  # `goose serve --methods` unless given (beside --method and "ar")


def _method_list(text: str) -> tuple[str, ...]:
    """``--methods``: comma-separated method names."""
    names = tuple(m.strip() for m in text.split(",") if m.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected one or more method names, comma-separated")
    return tuple(method_name(m) for m in names)


def _seconds(text: str) -> float:
    """A number of seconds > 0 (finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got '{text}'") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def api_keys(args):
    """(the single API key, or None; a key file's keys, or None) of `goose serve`'s arguments. GooseError for
    both --api-key and --api-key-file, or a malformed key file."""
    from ..errors import GooseError

    if args.api_key_file is None:
        return secret(args.api_key, None, "GOOSE_API_KEY", "API key"), None
    if args.api_key is not None:
        raise GooseError("give the API key with its flag or its file, not both")
    return None, read_key_file(args.api_key_file)


def cmd_serve(args) -> int:
    import sys

    from .app import serve
    from .connections import ServeLimits

    api_key, keys = api_keys(args)
    metrics_key = secret(args.metrics_key, args.metrics_key_file, "GOOSE_METRICS_KEY", "metrics key")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key and not keys:
        print(f"goose: warning: serving on {args.host} without an API key: anyone who reaches it can use it",
              file=sys.stderr)
    hosts = None if args.allowed_hosts is None else [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
    offered = (args.method, *args.methods) if args.methods is not None else (args.method, *SERVE_METHODS)
    engine = EngineConfig(max_batch=args.max_batch, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                          prefix_cache_mb=args.prefix_cache_mb, memory_mb=args.memory_mb,
                          max_tenants=args.max_tenants, methods=offered)
    return serve(args.model, args.method, args.host, args.port, engine, api_key, args.dtype, args.device,
                 served_name=args.served_model_name, drain_timeout=args.drain_timeout,
                 max_body_bytes=args.max_body_kb * 1024, default_max_tokens=args.default_max_tokens,
                 weights=getattr(args, "weights", None), arith=cli_arith(args), metrics_key=metrics_key,
                 allowed_hosts=hosts, max_restarts=args.max_restarts, api_keys=keys,
                 hide_sources=args.hide_draft_sources, stall_s=args.stall_timeout, config=goose_config(args),
                 memory_snapshot=args.memory_snapshot, snapshot_interval_s=args.snapshot_interval,
                 limits=ServeLimits(args.limit_concurrency, args.header_timeout, args.body_timeout))


def cmd_bench_serve(args) -> int:
    from .bench import run_cli

    return run_cli(args)


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (with a web playground)")
    add_model_args(s)
    s.add_argument("--method", type=method_name, default="goose",
                   help="default method of every request (a request's 'speculative' field overrides it)")
    s.add_argument("--methods", type=_method_list, default=None,
                   help="methods a request may name in its 'speculative' field, comma-separated, each prepared at "
                        "start-up (with --method; 'ar', plain decoding, always); another is refused with 400 "
                        f"(default: {','.join(SERVE_METHODS)})")
    add_head_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="default 8000")
    s.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=_non_negative_int, default=64,
                   help="waiting requests beyond which new ones get 429 (default 64)")
    s.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="prompt tokens all new requests may add in one step, which bounds how long a long prompt "
                        f"holds up the running requests (default: a request's own chunk, {DecodeConfig.prefill_chunk})")
    s.add_argument("--prefix-cache-mb", type=prefix_cache_mb, default=DEFAULT_PREFIX_CACHE_MB,
                   help="room for stored prompt prefixes' keys and values, reused by requests that start with "
                        f"them (a shared system prompt, earlier turns); 0 = off (default {DEFAULT_PREFIX_CACHE_MB})")
    s.add_argument("--memory-mb", type=_memory_mb, default=DEFAULT_MEMORY_MB,
                   help="room for earlier requests' prompts and outputs that goose drafts from, one memory per "
                        f"tenant (key file tenant, user, cache_salt); 0 = off (default {DEFAULT_MEMORY_MB})")
    s.add_argument("--memory-snapshot", default=None, metavar="PATH",
                   help="load the suffix memories from PATH at start-up (refused in one line, and started empty, "
                        "when damaged or made for another model), and write them there atomically every "
                        "--snapshot-interval seconds when they changed and on shutdown (default: none)")
    s.add_argument("--snapshot-interval", type=_seconds, default=DEFAULT_SNAPSHOT_S,
                   help=f"seconds between memory snapshots (default {DEFAULT_SNAPSHOT_S:g})")
    s.add_argument("--max-tenants", type=positive_int, default=DEFAULT_MAX_TENANTS,
                   help="tenants the suffix memory keeps, and tenants with blocks in the prefix cache (the least "
                        f"recently used tenant goes first; default {DEFAULT_MAX_TENANTS:,})")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints (visible "
                   "to other local users in the process list: prefer --api-key-file or GOOSE_API_KEY)")
    s.add_argument("--api-key-file", default=None,
                   help=f"accept the keys of this file: one 'KEY [TENANT]' per line (# comments; at most "
                        f"{MAX_KEY_LINES:,} lines, keys of up to {MAX_KEY_CHARS} characters, tenants of up to "
                        f"{MAX_TENANT_CHARS}); a key's tenant shares the prefix cache and suffix memory of its "
                        "requests")
    s.add_argument("--hide-draft-sources", action="store_true",
                   help="responses and streams carry no draft sources (the 'sources' pieces, goose.accepted and "
                        "goose.drafted)")
    s.add_argument("--stall-timeout", type=_seconds, default=STALL_S,
                   help="/health answers 503 when requests wait or run and no engine step finished for this "
                        f"many seconds (default {STALL_S:g})")
    s.add_argument("--metrics-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /metrics (also --metrics-key-file, GOOSE_METRICS_KEY); "
                        "without it, /metrics is open, or loopback clients only when an API key is set")
    s.add_argument("--metrics-key-file", default=None, help="read the metrics key from the first line of this file")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names served ('*': any); default: localhost,127.0.0.1,::1 "
                        "when --host is a loopback address, else any")
    s.add_argument("--max-restarts", type=_non_negative_int, default=1,
                   help="times a failed engine is rebuilt before the server exits with status 1 (default 1)")
    s.add_argument("--served-model-name", default=None, help="the model id of the API (default: --model's name)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds running requests get to finish (default 30)")
    s.add_argument("--max-body-kb", type=positive_int, default=1024, help="request body limit in KiB (default 1024)")
    s.add_argument("--limit-concurrency", type=positive_int, default=LIMIT_CONNECTIONS,
                   help="connections held at once, idle keep-alive ones included; one more is answered 503 and "
                        f"closed (default {LIMIT_CONNECTIONS})")
    s.add_argument("--header-timeout", type=_seconds, default=HEADER_TIMEOUT_S,
                   help="seconds a connection may take to send a request's headers (from its start or its last "
                        f"response); then 408 and closed (default {HEADER_TIMEOUT_S:g})")
    s.add_argument("--body-timeout", type=_seconds, default=BODY_TIMEOUT_S,
                   help=f"seconds a request's body may take to arrive; then 408 (default {BODY_TIMEOUT_S:g})")
    s.add_argument("--default-max-tokens", type=positive_int, default=512,
                   help="max_tokens of chat requests that give none (default 512)")
    s.set_defaults(func=cmd_serve)
    b = sub.add_parser("bench-serve", help="load-test an OpenAI-compatible server (loopback only)")
    b.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's base URL (default "
                   "http://127.0.0.1:8000/v1)")
    b.add_argument("--model", default=None, help="model id to request (default: the server's first model)")
    b.add_argument("--api-key", default="none", help="bearer token (default 'none')")
    b.add_argument("--concurrency", default="1,2,4,8", help="comma-separated client concurrencies (default 1,2,4,8)")
    b.add_argument("--requests", type=positive_int, default=None,
                   help="requests per concurrency level (default: the number of prompts, at least 2x concurrency)")
    b.add_argument("--prompts", default="builtin",
                   help="builtin (default), or spec-bench[:PATH] / jsonl:PATH (any dataset of `goose bench`)")
    b.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each category")
    b.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens per request (default 128)")
    b.add_argument("--speculative", default=None, help="send this 'speculative' field (goose servers: 'off', ...)")
    b.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    b.add_argument("--soak", type=_non_negative_int, default=0,
                   help="after the levels, N more requests at the highest concurrency, a random ~20%% of them "
                        "cancelled by the client mid-stream")
    b.add_argument("--soak-unique", action="store_true",
                   help="give every soak request a prompt of its own (a numbered tail): a working set that outgrows "
                        "the server's prefix cache, so it evicts")
    b.add_argument("--soak-stop-rate", type=float, default=0.0,
                   help="fraction of soak requests sent with stop strings (default 0)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds a whole level may take (default 600)")
    b.add_argument("--seed", type=int, default=0, help="shuffling / cancellation seed (default 0)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.add_argument("--label", default=None, help="name of this run in the table (default: the URL)")
    b.set_defaults(func=cmd_bench_serve)
