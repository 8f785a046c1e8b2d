"""Methods (and `worth_margin` variants) through the `Engine`, compared in turns: each round gives every variant an
engine of its own (``thread=False``) with the first Spec-Bench question of every category submitted at once (chat
template, 128 new tokens), and one loop advances the engines one step each in turn (`Engine.step`) until all are
done. Each variant's tokens/s counts the time of its own steps only, so the machine's drift hits every variant
alike within a step or two; the figure to compare is the median over rounds of each variant's ratio to the
first; so is each variant's mean request latency (its own step time from the submission of all requests to each
one's end). A variant is a method name, optionally ``@margin`` (`EngineConfig.worth_margin`, default EngineConfig's).

    .venv/bin/python benchmarks/concurrency_ab.py CONCURRENCY ar,goose[,goose@100] [--rounds 4] [--arith int8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from goose import Engine, EngineConfig, load_model
from goose.bench import datasets
from goose.bench.concurrency import cpu_name
from goose.decoding import encode

SPEC = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def one_round(model, tok, prompts: list[list[int]], c: int, variants: list[str]) -> dict[str, tuple]:
    """Every variant's tokens/s over its own steps, its requests' mean latency (seconds of its own steps from the
    submission of all to each one's end) and its outputs, for one round in turns."""
    engines, reqs, spent, ends = {}, {}, dict.fromkeys(variants, 0.0), {v: {} for v in variants}
    for v in variants:
        m, _, wm = v.partition("@")
        settings = EngineConfig(max_batch=c, **({"worth_margin": float(wm)} if wm else {}))
        engines[v] = Engine(model, tok, m, engine_config=settings, thread=False)
        reqs[v] = [engines[v].submit(p, 128) for p in prompts]
    live = list(variants)
    while live:
        for v in list(live):
            t = time.perf_counter()
            if not engines[v].step():
                live.remove(v)
            spent[v] += time.perf_counter() - t
            for i, r in enumerate(reqs[v]):
                if i not in ends[v] and r.done:
                    ends[v][i] = spent[v]
    out = {}
    for v in variants:
        results = [r.result() for r in reqs[v]]
        out[v] = (sum(len(r.token_ids) for r in results) / spent[v], statistics.fmean(ends[v].values()),
                  [r.token_ids for r in results])
        engines[v].close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("concurrency", type=int)
    ap.add_argument("variants", help="comma-separated: method or method@worth_margin; ratios are to the first")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arith", default="exact", choices=("exact", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", arith=args.arith)
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load(f"spec-bench:{SPEC}", None, 1)]
    variants = args.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    lats: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for v, (rate, lat, tokens) in one_round(model, tok, prompts, args.concurrency, variants).items():
            rates[v].append(rate)
            lats[v].append(lat)
            outputs.setdefault(v, tokens)
    first, base, base_lat = outputs[variants[0]], rates[variants[0]], lats[variants[0]]
    print(f"concurrency {args.concurrency}, {len(prompts)} requests, arith {args.arith}, {args.threads} threads, "
          f"CPU: {cpu_name()}; {args.rounds} rounds, engines in turns step by step")
    for v, xs in rates.items():
        same = sum(a == b for a, b in zip(outputs[v], first))
        ratios = [x / b for x, b in zip(xs, base)]
        lat = [b / x for x, b in zip(lats[v], base_lat)]  # > 1: requests end sooner on average
        print(f"{v}: median {statistics.median(xs):.1f} tok/s {[round(x, 1) for x in xs]}; vs {variants[0]} "
              f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.3f}-{max(ratios):.3f}); mean latency "
              f"{statistics.median(lats[v]):.2f} s, {statistics.median(lat):.3f}x shorter (rounds {min(lat):.3f}-"
              f"{max(lat):.3f}); outputs equal to {variants[0]}'s: {same}/{len(first)}")


if __name__ == "__main__":
    main()
