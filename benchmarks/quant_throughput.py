"""Throughput of goose's quantized linear kernel by row count, against the machine's FMA peak: one decoder
layer's four projections of SmolLM2's shapes (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536) on
random GGUF blocks, median over interleaved repeats, in GFMA/s (multiply-adds per second, float32 lanes).
The weights of one layer (~1-2 MB) stay in cache, so this is the kernel's compute rate, not the memory's.

    python benchmarks/quant_throughput.py [--format Q4_0] [--rows 1,4,8,16,32,64,128] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from model_scale import BUILD_FORMATS, random_rows  # benchmarks/model_scale.py: random blocks of a format

from goose.backends import quant
from goose.machine import cpu_name

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", default="Q4_0", choices=BUILD_FORMATS)
    ap.add_argument("--rows", default="1,4,8,16,32,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kern = quant.kernels()
    if kern is None:
        raise SystemExit(f"no quantized kernel here: {quant.unavailable_reason()}")
    rng = np.random.default_rng(0)
    weights = [(kern.pack(args.format, list(random_rows(args.format, n, k, rng)), k), n, k) for n, k in SHAPES.values()]
    fmas = sum(n * k for n, k in SHAPES.values())
    counts = [int(m) for m in args.rows.split(",")]
    xs = {(m, k): torch.randn(m, k) for m in counts for _, _, k in weights}
    samples: dict[int, list[float]] = {m: [] for m in counts}
    for _ in range(args.repeats):
        for m in counts:
            t0 = time.perf_counter()
            for _ in range(10):
                for w, n, k in weights:
                    kern.linear(xs[m, k], w, n)
            samples[m].append((time.perf_counter() - t0) / 10)
    print(f"{args.format}, kernel variant {kern.variant}, {args.threads} threads, CPU: {cpu_name()}\n")
    print("| rows | us per layer | GFMA/s |\n|---|---|---|")
    for m in counts:
        s = statistics.median(samples[m])
        print(f"| {m} | {s * 1e6:.1f} | {m * fmas / s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
