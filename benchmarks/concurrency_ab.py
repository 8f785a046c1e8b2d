"""Methods (and `worth_margin` variants) through the `Engine`, compared in turns: each round gives every variant an
engine of its own (``thread=False``) with the first Spec-Bench question of every category (``--limit N``: the first
N of each), chat template, 128 new tokens, and one loop advances the engines one step each in turn (`Engine.step`)
until all are done. By default every request is submitted at once (at most CONCURRENCY decode together, the rest
wait); with ``--closed`` CONCURRENCY clients run a closed loop instead: each submits the next prompt as soon as its
request ends, so CONCURRENCY are always in flight until the prompts run out. Each variant's tokens/s counts the time
of its own steps only, so the machine's drift hits every variant alike within a step or two; the figure to compare
is the median over rounds of each variant's ratio to the first; so is each variant's mean request latency (its own
step time from a request's submission to its end). A variant is a method name, optionally ``~N``
(`AcceptanceConfig.explore_trials`), ``@margin`` (`EngineConfig.worth_margin`) and ``/fixed`` (`EngineConfig.track_cost`
False), defaults otherwise.

    .venv/bin/python benchmarks/concurrency_ab.py CONCURRENCY ar,goose[,goose@100,goose~0] [--rounds 4] \
        [--arith int8] [--closed] [--limit 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from goose import Engine, EngineConfig, load_model
from goose.bench import datasets
from goose.config import GooseConfig
from goose.decoding import encode
from goose.machine import cpu_name


def variant_engine(model, tok, v: str, c: int) -> Engine:
    """The engine of variant `v` (``method[+head][~explore_trials][@worth_margin][/fixed]``; ``+head``: with the
    packaged draft head; ``/fixed``: the cost curve as measured, not tracked), at most `c` requests per step."""
    v, _, fixed = v.partition("/")
    m, _, wm = v.partition("@")
    m, _, ex = m.partition("~")
    m, head, _ = m.partition("+head")
    config = None
    if ex or head:
        g = GooseConfig(eagle=dataclasses.replace(GooseConfig().eagle, head="packaged")) if head else GooseConfig()
        acc = dataclasses.replace(g.device_aware.acceptance, explore_trials=int(ex)) if ex else \
            g.device_aware.acceptance
        config = dataclasses.replace(g, device_aware=dataclasses.replace(g.device_aware, acceptance=acc))
    settings = EngineConfig(max_batch=c, track_cost=fixed != "fixed", **({"worth_margin": float(wm)} if wm else {}))
    return Engine(model, tok, m, config=config, engine_config=settings, thread=False)


def one_round(model, tok, prompts: list[list[int]], c: int, variants: list[str], closed: bool = False) -> dict:
    """Every variant's tokens/s over its own steps, its requests' mean latency (seconds of its own steps from each
    request's submission to its end) and its outputs, for one round in turns."""
    engines, live, spent, nxt, lat, outs = {}, {}, dict.fromkeys(variants, 0.0), {}, {}, {}
    for v in variants:
        engines[v] = variant_engine(model, tok, v, c)
        nxt[v] = c if closed else len(prompts)
        live[v] = [(i, engines[v].submit(prompts[i], 128), 0.0) for i in range(min(nxt[v], len(prompts)))]
        lat[v], outs[v] = [], {}
    going = list(variants)
    while going:
        for v in list(going):
            t = time.perf_counter()
            engines[v].step()
            spent[v] += time.perf_counter() - t
            still = []
            for i, r, t0 in live[v]:
                if not r.done:
                    still.append((i, r, t0))
                    continue
                lat[v].append(spent[v] - t0)
                outs[v][i] = r.result().token_ids
                if nxt[v] < len(prompts):  # a closed loop's client sends its next prompt
                    still.append((nxt[v], engines[v].submit(prompts[nxt[v]], 128), spent[v]))
                    nxt[v] += 1
            live[v] = still
            if not still:
                going.remove(v)
    out = {}
    for v in variants:
        tokens = [outs[v][i] for i in range(len(prompts))]
        out[v] = (sum(len(t) for t in tokens) / spent[v], statistics.fmean(lat[v]), tokens)
        engines[v].close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("concurrency", type=int)
    ap.add_argument("variants", help="comma-separated: method[+head][~explore_trials][@worth_margin]; ratios are to "
                    "the first")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--arith", default="exact", choices=("exact", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--closed", action="store_true", help="CONCURRENCY clients in a closed loop")
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench questions per category")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", arith=args.arith)
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load("spec-bench", None, args.limit)]
    variants = args.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    lats: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for v, (rate, lat, tokens) in one_round(model, tok, prompts, args.concurrency, variants, args.closed).items():
            rates[v].append(rate)
            lats[v].append(lat)
            outputs.setdefault(v, tokens)
    first, base, base_lat = outputs[variants[0]], rates[variants[0]], lats[variants[0]]
    loop = " (closed loop)" if args.closed else ""
    print(f"concurrency {args.concurrency}{loop}, {len(prompts)} requests, arith {args.arith}, {args.threads} "
          f"threads, CPU: {cpu_name()}; {args.rounds} rounds, engines in turns step by step")
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
