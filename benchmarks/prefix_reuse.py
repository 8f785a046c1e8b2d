"""The engine's prefix cache on requests that share a long system prompt (an agent's instructions, a document
several users ask about): time to first token and aggregate tokens/s with the cache off and on, side by side.

The system prompt is the longest first question of the Spec-Bench categories (a summarization article); each
request asks one of the other categories' first questions about it, as a chat. The same requests run through
``Engine(prefix_cache_mb=0)`` and ``Engine(prefix_cache_mb=256)``, alternating `--rounds` times; the outputs
of the two must be identical.

    .venv/bin/python benchmarks/prefix_reuse.py [--concurrency 1,4] [--max-new-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from goose import Engine, load_model
from goose.bench import datasets
from goose.bench.concurrency import percentile
from goose.decoding import encode_chat
from goose.machine import cpu_name


def serve(model, tok, prompts: list[list[int]], concurrency: int, max_new: int, mb: float, method: str) -> dict:
    with Engine(model, tok, method, max_batch=concurrency, prefix_cache_mb=mb) as eng:
        t0 = time.perf_counter()
        reqs = [eng.submit(p, max_new) for p in prompts]
        results = [r.result() for r in reqs]
        wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(len(r.token_ids) for r in results),
            "ttft": [r.ttft_s for r in reqs], "cached": sum(r.stats.cached_tokens for r in results),
            "outputs": [r.token_ids for r in results]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="goose")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    questions = datasets.load("spec-bench", None, 1)
    doc = max(questions, key=lambda q: len(q.turns[0]))
    prompts = [encode_chat(tok, [{"role": "system", "content": doc.turns[0]}, {"role": "user", "content": q.turns[0]}])
               for q in questions if q is not doc]
    system_len = len(encode_chat(tok, [{"role": "system", "content": doc.turns[0]}]))
    print(f"{args.model}, method {args.method}, {args.threads} threads, CPU: {cpu_name()}; {len(prompts)} requests of "
          f"{min(map(len, prompts))}-{max(map(len, prompts))} prompt tokens sharing a {system_len}-token "
          f"system prompt, {args.max_new_tokens} new tokens; median of {args.rounds} alternating rounds\n")
    print("| concurrency | prefix cache | TTFT p50 / p95 (s) | tokens/s | prompt tokens cached | outputs equal |")
    print("|---|---|---|---|---|---|")
    for c in (int(x) for x in args.concurrency.split(",")):
        runs: dict[float, list[dict]] = {0: [], 256: []}
        for _ in range(args.rounds):
            for mb in runs:
                runs[mb].append(serve(model, tok, prompts, c, args.max_new_tokens, mb, args.method))
        same = all(a["outputs"] == b["outputs"] for a in runs[0] for b in runs[256])
        for mb, rs in runs.items():
            p50 = statistics.median(percentile(r["ttft"], 50) for r in rs)
            p95 = statistics.median(percentile(r["ttft"], 95) for r in rs)
            rate = statistics.median(r["tokens"] / r["wall"] for r in rs)
            print(f"| {c} | {'off' if mb == 0 else f'{mb} MiB'} | {p50:.2f} / {p95:.2f} | {rate:.1f} | "
                  f"{rs[0]['cached']}/{sum(map(len, prompts))} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
