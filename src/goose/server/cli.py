"""`goose serve` and `goose bench-serve`: registered into goose's command line by `register`."""

from __future__ import annotations

from ..cliargs import add_model_args, int_in, method_name, positive_int, prefix_cache_mb
from ..engine.prefix import DEFAULT_PREFIX_CACHE_MB

_port = int_in(1, 65535)
_non_negative_int = int_in(0)


def cmd_serve(args) -> int:
    from .app import serve

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        import sys

        print(f"goose: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)
    serve(args.model, args.method, args.host, args.port, args.max_batch, args.max_queue, args.api_key, args.dtype,
          args.device, served_name=args.served_model_name, drain_timeout=args.drain_timeout,
          max_body_bytes=args.max_body_kb * 1024, default_max_tokens=args.default_max_tokens,
          weights=getattr(args, "weights", None), prefix_cache_mb=args.prefix_cache_mb)
    return 0


def cmd_bench_serve(args) -> int:
    from .bench import run_cli

    return run_cli(args)


def register(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (with a web playground)")
    add_model_args(s)
    s.add_argument("--method", type=method_name, default="goose",
                   help="default method of every request (a request's 'speculative' field overrides it)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8000, help="default 8000")
    s.add_argument("--max-batch", type=positive_int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--max-queue", type=_non_negative_int, default=64,
                   help="waiting requests beyond which new ones get 429 (default 64)")
    s.add_argument("--prefix-cache-mb", type=prefix_cache_mb, default=DEFAULT_PREFIX_CACHE_MB,
                   help="room for stored prompt prefixes' keys and values, reused by requests that start with "
                        f"them (a shared system prompt, earlier turns); 0 = off (default {DEFAULT_PREFIX_CACHE_MB})")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    s.add_argument("--served-model-name", default=None, help="the model id of the API (default: --model's name)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM / Ctrl-C, seconds running requests get to finish (default 30)")
    s.add_argument("--max-body-kb", type=positive_int, default=1024, help="request body limit in KiB (default 1024)")
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
                   help="builtin (default), or spec-bench:PATH / jsonl:PATH (any dataset of `goose bench`)")
    b.add_argument("--limit", type=positive_int, default=None, help="first N prompts of each category")
    b.add_argument("--max-tokens", type=positive_int, default=128, help="max_tokens per request (default 128)")
    b.add_argument("--speculative", default=None, help="send this 'speculative' field (goose servers: 'off', ...)")
    b.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    b.add_argument("--soak", type=_non_negative_int, default=0,
                   help="after the levels, N more requests at the highest concurrency, a random ~20%% of them "
                        "cancelled by the client mid-stream (issue: 500)")
    b.add_argument("--timeout", type=float, default=600.0, help="seconds a whole level may take (default 600)")
    b.add_argument("--seed", type=int, default=0, help="shuffling / cancellation seed (default 0)")
    b.add_argument("--json", default=None, help="also write the results to this JSON file")
    b.add_argument("--label", default=None, help="name of this run in the table (default: the URL)")
    b.set_defaults(func=cmd_bench_serve)
