"""Methods (and `worth_margin` variants) on one `Engine` each, in interleaved rounds in one process, so the
machine's drift hits every variant alike: the aggregate tokens/s of each over the first Spec-Bench question of
every category (chat template, 128 new tokens, all submitted at once), and the median over rounds of each
variant's ratio to the first variant in the same round (the figure to compare: a round's variants run minutes,
not hours, apart). A variant is a method name, optionally ``@margin`` (`EngineConfig.worth_margin` for that
run, default EngineConfig's).

    .venv/bin/python benchmarks/concurrency_ab.py CONCURRENCY ar,goose[,goose@0.8] [--rounds 3] [--arith int8]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("concurrency", type=int)
    ap.add_argument("variants", help="comma-separated: method or method@worth_margin; ratios are to the first")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arith", default="exact", choices=("exact", "int8"))
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", arith=args.arith)
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load(f"spec-bench:{SPEC}", None, 1)]
    c, variants = args.concurrency, args.variants.split(",")
    res: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for v in variants:
            m, _, wm = v.partition("@")
            settings = EngineConfig(max_batch=c, **({"worth_margin": float(wm)} if wm else {}))
            with Engine(model, tok, m, engine_config=settings) as eng:
                t = time.perf_counter()
                out = eng.generate_batch(prompts, 128)
                wall = time.perf_counter() - t
            res[v].append(sum(len(r.token_ids) for r in out) / wall)
            outputs.setdefault(v, [r.token_ids for r in out])
    first, base = outputs[variants[0]], res[variants[0]]
    print(f"concurrency {c}, {len(prompts)} requests, arith {args.arith}, {args.threads} threads, CPU: {cpu_name()}; "
          f"{args.rounds} rounds")
    for v, xs in res.items():
        same = sum(a == b for a, b in zip(outputs[v], first))
        ratios = [x / b for x, b in zip(xs, base)]
        print(f"{v}: median {statistics.median(xs):.1f} tok/s {[round(x, 1) for x in xs]}; vs {variants[0]} "
              f"{statistics.median(ratios):.3f}x (rounds {min(ratios):.2f}-{max(ratios):.2f}); outputs equal to "
              f"{variants[0]}'s: {same}/{len(first)}")


if __name__ == "__main__":
    main()
