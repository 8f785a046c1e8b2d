"""`goose serve` against vLLM's OpenAI server on the CPU: the same load benchmark, the same prompts.

One server at a time on a loopback port (they would fight for the 2 cores otherwise): goose (device-aware
`goose`), then vLLM plain, vLLM `ngram` (num_speculative_tokens 5, prompt_lookup 2..4) and vLLM `suffix`
(arctic-inference), then goose once more (so drift of the machine over the run shows; a server named
`goose-exact` runs `--arith exact`); by default every concurrency level on a fresh server (no prefix cache or
answer memory carried from the previous level, whose prompts are the same). Each server gets
`goose bench-serve`'s load (`goose.server.bench.bench`: streaming greedy chat requests through the `openai`
async client, concurrency levels one after the other, bounded in requests and time), after a warm-up
request. vLLM runs from the venv `make vllm` builds, with its CPU build's preloads (tcmalloc, the venv's
libiomp5) and OMP_NUM_THREADS = --threads, on the packaged model's float32 safetensors (the dequantized
GGUF: the same weight values goose multiplies from the GGUF blocks).

    .venv/bin/python benchmarks/vs_vllm_serve.py --limit 1 --concurrency 1,4 --max-tokens 128

With `--client vllm` each server gets vLLM's own client instead (`vllm bench serve` through
`benchmarks/vllm_bench_serve.py`: its `random` dataset, --input-len / --output-len tokens (128 / 64), `ignore_eos`,
greedy, 4x the concurrency in requests and at least 8, the same prompts for every server; random prompts, so no
server reuses a prompt), the load the serving targets name:

    .venv/bin/python benchmarks/vs_vllm_serve.py --client vllm --servers goose,suffix --concurrency 1,4,8,16

Writes OUT/vs_vllm_serve.json (everything, texts included) and OUT/vs_vllm_serve.md (the table: tokens/s,
TTFT and TPOT p50/p95, errors, ratios against vLLM plain and vLLM's best speculative server at each level,
and how many prompts' texts equal goose's). Not part of `make test` (minutes, and vLLM's venv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from goose.bench import datasets
from goose.bench.vllm_engine import SPEC_CONFIGS, TCMALLOC
from goose.loading.model import model_dir
from goose.machine import cpu_name
from goose.server.bench import bench

ROOT = Path(__file__).resolve().parents[1]
SERVED = "smollm2-135m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(name: str, port: int, args) -> tuple[list[str], dict]:
    """The server's command line and environment."""
    if name.startswith("goose"):  # goose-exact: `--arith exact` (float32's tokens); others: the default, auto
        arith = ["--arith", "exact"] if name.endswith("-exact") else []
        return ([sys.executable, "-m", "goose", "serve", "--model", args.model, "--port", str(port),
                 "--max-batch", str(args.max_batch), "--max-queue", "256", *arith],
                dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    vpy = Path(args.vllm_python)
    if not vpy.is_file():
        raise SystemExit(f"{vpy} not found: build vLLM's venv with `make vllm`")
    cmd = [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir(args.model)),
           "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--max-num-seqs", str(args.max_batch), "--seed", "0",
           "--no-enable-log-requests"]
    spec = SPEC_CONFIGS[name]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    libiomp = vpy.parent.parent / "lib" / "libiomp5.so"  # the vLLM venv's, as worker_env does for its own
    env = dict(os.environ, LD_PRELOAD=f"{TCMALLOC}:{libiomp}", OMP_NUM_THREADS=str(args.threads),
               VLLM_LOGGING_LEVEL="WARNING", PATH=f"{vpy.parent}:{os.environ.get('PATH', '')}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return cmd, env


def wait_ready(proc: subprocess.Popen, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_server(name: str, args, prompts: list[str], concurrencies: list[int], log_dir: Path) -> dict:
    """The load levels on one server, or (the default) each level on a fresh server: vLLM's prefix cache and
    `suffix`'s tree of earlier answers would otherwise replay the previous level's prompts and answers."""
    if not args.fresh_per_level or len(concurrencies) == 1:
        return _run_server(name, args, prompts, concurrencies, log_dir)
    runs = [_run_server(name, args, prompts, [c], log_dir) for c in concurrencies]
    merged = dict(runs[0])
    merged["levels"] = [lv for r in runs for lv in r["levels"]]
    merged["table"] = "\n".join(r["table"] for r in runs)
    return merged


def _run_server(name: str, args, prompts: list[str], concurrencies: list[int], log_dir: Path) -> dict:
    port = free_port()
    cmd, env = command(name, port, args)
    log = open(log_dir / f"{name}-c{'-'.join(map(str, concurrencies))}.log", "w")
    print(f"[{name}] starting on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        t0 = time.perf_counter()
        wait_ready(proc, port, args.start_timeout)
        print(f"[{name}] ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        url = f"http://127.0.0.1:{port}/v1"
        if args.client == "vllm":  # vLLM's client makes its own warm-up request
            return vllm_client_levels(name, url, args, concurrencies, log_dir)
        asyncio.run(bench(url, None, "none", [1], 1, prompts[:1], 8, {}, 0, 120, 0, name))  # warm-up
        return asyncio.run(bench(url, None, "none", concurrencies, args.requests, prompts, args.max_tokens, {}, 0,
                                 args.timeout, 0, name))
    finally:
        stop(proc)
        log.close()


def vllm_client_levels(name: str, url: str, args, concurrencies: list[int], log_dir: Path) -> dict:
    """Each level through `vllm bench serve` (`benchmarks/vllm_bench_serve.py`), in this script's result form."""
    import vllm_bench_serve

    opts = argparse.Namespace(base_url=url.removesuffix("/v1"), model=SERVED, tokenizer=str(model_dir(args.model)),
                              num_prompts=args.requests, input_len=args.input_len, output_len=args.output_len,
                              seed=0, label=name, vllm_python=args.vllm_python, out=log_dir, timeout=args.timeout)
    levels, rows = [], []
    for c in concurrencies:
        r = vllm_bench_serve.run_level(opts, c)
        ms = lambda key: None if r.get(key) is None else r[key] / 1e3  # noqa: E731
        levels.append({"concurrency": c, "requests": r.get("completed"), "tok_s": r.get("output_throughput", 0.0),
                       "errors": vllm_bench_serve.failed(r),
                       "ttft_p50": ms("median_ttft_ms"), "ttft_p95": ms("p95_ttft_ms"),
                       "tpot_p50": ms("median_tpot_ms"), "tpot_p95": ms("p95_tpot_ms")})
        rows.append(vllm_bench_serve.row(name, c, r))
        print(f"  concurrency {c}: {levels[-1]['tok_s']:.1f} tok/s, {levels[-1]['errors']} failed", file=sys.stderr,
              flush=True)
    return {"levels": levels, "texts": {}, "table": "\n".join(rows)}


def report(results: dict[str, dict], concurrencies: list[int], meta: dict) -> str:
    lines = [f"CPU: {meta['cpu']}, {meta['threads']} threads; {meta['prompts']} prompts, greedy, max_tokens "
             f"{meta['max_tokens']}, max batch {meta['max_batch']}", "",
             "| server | concurrency | requests | errors | output tok/s | vs vLLM plain | vs best vLLM spec. "
             "| TTFT p50 / p95 ms | TPOT p50 / p95 ms | texts = goose's |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    goose_texts = results.get("goose", {}).get("texts", {})
    for c in concurrencies:
        lv = {n: next(x for x in r["levels"] if x["concurrency"] == c) for n, r in results.items()}
        plain = lv.get("plain", {}).get("tok_s")
        spec = max((lv[n]["tok_s"] for n in ("ngram", "suffix") if n in lv), default=None)
        for n, x in lv.items():
            ms = lambda v: "-" if v is None else f"{v * 1e3:.0f}"  # noqa: E731
            same = sum(1 for i, t in results[n]["texts"].items() if goose_texts.get(i) == t)
            texts = f"{same}/{len(results[n]['texts'])}" if results[n]["texts"] else "-"  # (vLLM's client: none)
            tok_s = x["tok_s"]
            vs_plain = "-" if not plain else f"{tok_s / plain:.2f}x"
            vs_spec = "-" if not spec else f"{tok_s / spec:.2f}x"
            lines.append(
                f"| {n} | {c} | {x['requests']} | {x['errors']} | {tok_s:.1f} | {vs_plain} | {vs_spec} | "
                f"{ms(x['ttft_p50'])} / {ms(x['ttft_p95'])} | {ms(x['tpot_p50'])} / {ms(x['tpot_p95'])} | "
                f"{texts} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", default="spec-bench")
    ap.add_argument("--limit", type=int, default=1, help="questions per category")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default: the prompts, "
                    "at least twice the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", default="goose,plain,ngram,suffix,goose-again")
    ap.add_argument("--same-server", dest="fresh_per_level", action="store_false",
                    help="run every level on one server (default: a fresh server per level)")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--start-timeout", type=float, default=900.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per level")
    ap.add_argument("--out", default=str(ROOT / "runs" / "vs_vllm_serve"))
    ap.add_argument("--client", choices=["goose", "vllm"], default="goose",
                    help="the load: goose's bench-serve client on --prompts (default), or `vllm bench serve`")
    ap.add_argument("--input-len", type=int, default=128, help="--client vllm: random prompt tokens")
    ap.add_argument("--output-len", type=int, default=64, help="--client vllm: output tokens (ignore_eos)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    concurrencies = sorted({int(x) for x in args.concurrency.split(",")})
    prompts = [q.turns[0] for q in datasets.load(args.prompts, limit=args.limit)]
    results: dict[str, dict] = {}
    for name in args.servers.split(","):
        results[name] = run_server(name, args, prompts, concurrencies, out)
        print(results[name]["table"], file=sys.stderr, flush=True)
    meta = {"cpu": cpu_name(), "threads": args.threads, "prompts": len(prompts), "max_tokens": args.max_tokens,
            "max_batch": args.max_batch, "servers": args.servers, "client": args.client}
    if args.client == "vllm":
        meta["prompts"], meta["max_tokens"] = f"`vllm bench serve` random {args.input_len}-token", args.output_len
    (out / "vs_vllm_serve.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    md = report(results, concurrencies, meta)
    (out / "vs_vllm_serve.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
