"""Methods (and `worth_margin` variants) on one `Engine` each, in interleaved rounds in one process, so the
machine's drift hits every variant alike: the median aggregate tokens/s of each over the first Spec-Bench
question of every category (chat template, 128 new tokens, all submitted at once). A variant is a method
name, optionally ``@margin`` (`EngineConfig.worth_margin` for that run, default EngineConfig's).

    .venv/bin/python benchmarks/concurrency_ab.py CONCURRENCY goose,ar[,goose@0.8] [ROUNDS=3]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from goose import Engine, EngineConfig, load_model
from goose.bench import datasets
from goose.bench.concurrency import cpu_name
from goose.decoding import encode

SPEC = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def main() -> None:
    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m")
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load(f"spec-bench:{SPEC}", None, 1)]
    c, variants = int(sys.argv[1]), sys.argv[2].split(",")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    res: dict[str, list[float]] = {v: [] for v in variants}
    outputs: dict[str, list] = {}
    for _ in range(rounds):
        for v in variants:
            m, _, wm = v.partition("@")
            settings = EngineConfig(max_batch=c, **({"worth_margin": float(wm)} if wm else {}))
            with Engine(model, tok, m, engine_config=settings) as eng:
                t = time.perf_counter()
                out = eng.generate_batch(prompts, 128)
                wall = time.perf_counter() - t
            res[v].append(sum(len(r.token_ids) for r in out) / wall)
            outputs.setdefault(v, [r.token_ids for r in out])
    first = outputs[variants[0]]
    print(f"concurrency {c}, {len(prompts)} requests, 2 threads, CPU: {cpu_name()}; median of {rounds} rounds")
    for v, xs in res.items():
        same = sum(a == b for a, b in zip(outputs[v], first))
        print(f"{v}: {statistics.median(xs):.1f} tok/s {[round(x, 1) for x in xs]}, outputs equal to "
              f"{variants[0]}'s: {same}/{len(first)}")


if __name__ == "__main__":
    main()
