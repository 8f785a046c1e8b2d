"""What a forward over several sequences costs as their cached contexts grow: median ms of one `LeanForward`
call for several layouts of query rows over 4 or 8 sequences (e.g. ``3+1+1+1``: a 3-node tree in the first
sequence, plain steps in the others), each sequence on its own cache of ``--contexts`` tokens. The batched
cost curve that `goose` selects under is measured at 256 cached tokens; this shows how far a step's real
cost, and a draft row's, moves from it at longer contexts.

    python benchmarks/row_cost.py [--model smollm2-135m] [--contexts 256,500,1000] [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from goose.backends.lean import LeanForward
from goose.engine.measure import bushy_tree, prefilled_caches, tree_segment
from goose.loading.model import load_model
from goose.machine import cpu_name

LAYOUTS = ((1, 1, 1, 1), (3, 1, 1, 1), (5, 1, 1, 1), (2, 2, 2, 2), (1,) * 8, (4,) + (1,) * 7, (2,) * 8)


def timed(forward, vocab: int, context: int, rows: tuple[int, ...], repeats: int) -> float:
    caches = prefilled_caches(forward, vocab, len(rows), context)
    segments = [tree_segment(c, bushy_tree(n, vocab)) for c, n in zip(caches, rows)]
    samples = []
    for rep in range(repeats + 2):  # two warm-up calls
        t0 = time.perf_counter()
        forward.run(segments)
        dt = (time.perf_counter() - t0) * 1e3
        for c in caches:
            c.keep([])
        if rep >= 2:
            samples.append(dt)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="256,500,1000")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    forward = LeanForward(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    contexts = [int(c) for c in args.contexts.split(",")]
    print(f"{args.model}, {forward.backend}, {args.threads} threads, CPU: {cpu_name()}; ms per forward\n")
    print("| rows per sequence | " + " | ".join(f"{c} cached" for c in contexts) + " |")
    print("|---|" + "---|" * len(contexts))
    for rows in LAYOUTS:
        ms = [timed(forward, vocab, c, rows, args.repeats) for c in contexts]
        print(f"| {'+'.join(map(str, rows))} | " + " | ".join(f"{m:.2f}" for m in ms) + " |")


if __name__ == "__main__":
    main()
