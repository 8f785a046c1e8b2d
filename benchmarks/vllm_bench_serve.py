"""vLLM's own benchmark client (`vllm bench serve`, run through `benchmarks/vllm_cli.py`) against a running
OpenAI-compatible server on this machine (`goose serve`, or vLLM's server), at several concurrencies.

Each level: `--num-prompts` requests (default 4x the concurrency, at least 8) of vLLM's `random` dataset
(random token ids decoded to text, `--input-len` tokens, a fixed seed: the same prompts on every server),
`--backend openai-chat` streaming chat requests with `ignore_eos` (every request generates exactly
`--output-len` tokens) and temperature 0 (greedy), one warm-up request. Prints one markdown row per level:
completed / failed requests, TTFT, TPOT and ITL (median / p95, ms, as vLLM's client measures them: from its
own send time to the first chunk, per output token after the first, between chunks) and output tokens/s;
vLLM's result JSON of every level goes to --out.

    .venv/bin/python benchmarks/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --concurrency 1,4,8 --label goose
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[1]


def run_level(args, c: int) -> dict:
    n = args.num_prompts or max(8, 4 * c)
    name = f"{args.label}-c{c}.json"
    cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_cli.py"), "bench", "serve",
           "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", args.base_url,
           "--model", args.model, "--tokenizer", args.tokenizer, "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--num-prompts", str(n), "--max-concurrency", str(c), "--ignore-eos", "--temperature", "0",
           "--seed", str(args.seed), "--num-warmups", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "50,95", "--save-result", "--result-dir", str(args.out),
           "--result-filename", name, "--disable-tqdm"]
    log = args.out / f"{args.label}-c{c}.log"
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
    if rc != 0:
        raise SystemExit(f"vllm bench serve failed at concurrency {c} (exit {rc}); see {log}")
    return json.loads((args.out / name).read_text())


def failed(r: dict) -> int:
    """Failed requests of a level's result (older clients report only the prompts and the completed ones)."""
    return r.get("failed", r.get("num_prompts", 0) - r.get("completed", 0))


def row(label: str, c: int, r: dict) -> str:
    def ms(key):
        v = r.get(key)
        return "-" if v is None else f"{v:.0f}"

    return (f"| {label} | {c} | {r.get('completed')} | {failed(r)} | {ms('median_ttft_ms')} / {ms('p95_ttft_ms')} | "
            f"{ms('median_tpot_ms')} / {ms('p95_tpot_ms')} | {ms('median_itl_ms')} / {ms('p95_itl_ms')} | "
            f"{r.get('output_throughput', 0):.1f} | {r.get('request_throughput', 0):.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m", help="the served model name")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: goose's packaged model's)")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per level (default 4x concurrency, >= 8)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="goose")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", type=Path, default=Path("runs/vllm_bench_serve"))
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds one level may take")
    args = ap.parse_args()
    if urlparse(args.base_url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("loopback servers only")
    if args.tokenizer is None:
        from goose.loading.model import model_dir

        args.tokenizer = str(model_dir("smollm2-135m"))
    args.out.mkdir(parents=True, exist_ok=True)
    print("| server | concurrency | completed | failed | TTFT p50 / p95 ms | TPOT p50 / p95 ms | ITL p50 / p95 ms "
          "| output tok/s | req/s |\n|---|---|---|---|---|---|---|---|---|")
    for c in [int(x) for x in args.concurrency.split(",")]:
        print(row(args.label, c, run_level(args, c)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
