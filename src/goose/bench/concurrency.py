"""`goose bench --concurrency N`: many requests in flight on one `Engine`, per method.

Every question's first turn is one request. With ``--rate R`` requests arrive as a Poisson process of R per
second (seeded); without it all are submitted at once, and the engine keeps N of them running (the rest
wait in its queue). Reported per method: aggregate tokens/s (all generated tokens over the wall time from
the first submission to the last completion), per-request time to first token and time per output token
(p50 / p95, from submission), τ (tokens per forward a request took part in), mean requests per forward, and
the lossless column: requests whose tokens equal `ar` decoding each prompt alone (a plain `Decoder`).
Written to ``OUT/concurrency.json`` and ``OUT/concurrency.md``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

from .. import cachefs
from ..config import DEFAULT_PREFIX_CACHE_MB, DecodeConfig
from ..decoding import Decoder, encode
from ..engine.scheduler import Engine
from ..machine import cpu_name


def percentile(xs: list[float], p: float) -> float:
    """The p-th percentile (0..100) by linear interpolation between order statistics."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def run_method(model, tok, method: str, prompts: list[list[int]], max_new: int, concurrency: int,
               rate: float | None, seed: int, options: dict, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> dict:
    with Engine(model, tok, method, max_batch=concurrency, prefix_cache_mb=prefix_cache_mb) as eng:
        rng = random.Random(seed)
        t0 = time.perf_counter()
        reqs = []
        for ids in prompts:
            if rate:
                time.sleep(rng.expovariate(rate))
            reqs.append(eng.submit(ids, max_new, **options))
        results = [r.result() for r in reqs]
        wall = time.perf_counter() - t0
        counts = list(eng.batch_counts)  # steps per batch size
    tokens = sum(len(r.token_ids) for r in results)
    ttft = [r.ttft_s for r in reqs]
    tpot = [r.tpot_s for r in reqs if r.tpot_s is not None]
    calls = sum(r.stats.forward_calls for r in results)
    return {"method": method, "requests": len(reqs), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "tpot_p50_s": percentile(tpot, 50), "tpot_p95_s": percentile(tpot, 95),
            "tau": tokens / calls if calls else 0.0,
            "mean_batch": sum(n * c for n, c in enumerate(counts)) / sum(counts) if sum(counts) else 0.0,
            "cached_tokens": sum(r.stats.cached_tokens for r in results),
            "prompt_tokens": sum(len(p) for p in prompts), "outputs": [r.token_ids for r in results]}


def run(model, tok, questions, methods: list[str], max_new: int, concurrency: int, rate: float | None, chat: bool,
        out: Path, options: dict, seed: int = 0, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB) -> Path:
    prompts = [encode(tok, q.turns[0], chat) for q in questions]
    ref_dec = Decoder(model, tok, "ar")
    refs = [ref_dec.generate_ids(p, DecodeConfig(max_new_tokens=max_new, **options))[0] for p in prompts]
    rows = []
    for m in methods:
        print(f"bench: {m} at concurrency {concurrency} ({len(prompts)} requests)", file=sys.stderr)
        row = run_method(model, tok, m, prompts, max_new, concurrency, rate, seed, options, prefix_cache_mb)
        row["identical"] = sum(o == r for o, r in zip(row.pop("outputs"), refs))
        rows.append(row)
    from ..backends.quant import weights_kind
    from ..loading.model import model_arith

    meta = {"cpu": cpu_name(), "concurrency": concurrency, "rate": rate, "max_new_tokens": max_new,
            "requests": len(prompts), "chat": chat, "sampling": options or None,
            "threads": __import__("torch").get_num_threads(), "weights": weights_kind(model),
            "arith": model_arith(model), "prefix_cache_mb": prefix_cache_mb}
    out.mkdir(parents=True, exist_ok=True)
    cachefs.write_text(out / "concurrency.json", json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = render(meta, rows)
    cachefs.write_text(out / "concurrency.md", table)
    print(table)
    return out / "concurrency.md"


def render(meta: dict, rows: list[dict]) -> str:
    arrivals = f"Poisson, {meta['rate']}/s" if meta["rate"] else "all at once"
    lines = [f"Concurrency {meta['concurrency']} ({arrivals}), {meta['requests']} requests x "
             f"{meta['max_new_tokens']} new tokens, {meta.get('weights', '?')} weights, "
             f"arith {meta.get('arith', 'exact')}, {meta['threads']} threads, "
             f"prefix cache {meta.get('prefix_cache_mb', DEFAULT_PREFIX_CACHE_MB):g} MiB, CPU: {meta['cpu']}", "",
             "| method | tokens/s | vs ar | TTFT p50 / p95 (s) | TPOT p50 / p95 (ms) | τ | requests per forward | "
             "prompt tokens cached | identical to ar alone |", "|---|---|---|---|---|---|---|---|---|"]
    ar = next((r["tokens_per_s"] for r in rows if r["method"] == "ar"), None)
    for r in rows:
        vs = f"{r['tokens_per_s'] / ar:.2f}x" if ar else "-"
        lines.append(f"| {r['method']} | {r['tokens_per_s']:.1f} | {vs} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | "
                     f"{r['tpot_p50_s'] * 1e3:.1f} / {r['tpot_p95_s'] * 1e3:.1f} | {r['tau']:.2f} | "
                     f"{r['mean_batch']:.2f} | {r.get('cached_tokens', 0)}/{r.get('prompt_tokens', '?')} | "
                     f"{r['identical']}/{r['requests']} |")
    return "\n".join(lines) + "\n"
