"""Cost of goose's quantized projections vs rows M: the float32 path (`goose.backends.quant`, weights
dequantized in registers, float32 FMAs) against the integer path (`goose.backends.int8`, 8-bit activations,
int32 dot products), interleaved in one process on SmolLM2-135M's shapes (random blocks of the packaged
file's formats: Q4_1 projections, the Q8_0 tied embedding as the output head).

    python benchmarks/int8_cost.py [--rows 1,2,4,8,16,32] [--repeats 9] [--threads 2] [--variants all]
                                   [--variants best|all|vnni512,amx] [--clock cpu --threads 1]

Prints per shape and M the median microseconds per call of each path, the cost ratio to M = 1 of each, and
for one whole layer set (30 x (qkv, o, gate_up, down) + head) the projected milliseconds of a forward's
projections. Timings: the minimum (or --stat median) over --repeats rounds of ~20 ms each, the paths interleaved;
on a shared machine compare ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from goose.backends import int8, quant

# (name, N, K, format, calls per forward)
SHAPES = [("qkv 960x576", 960, 576, "Q4_1", 30), ("o 576x576", 576, 576, "Q4_1", 30),
          ("k/v 192x576", 192, 576, "Q4_1", 0), ("gate_up 3072x576", 3072, 576, "Q4_1", 30),
          ("up 1536x576", 1536, 576, "Q4_1", 0), ("down 576x1536", 576, 1536, "Q4_1", 30),
          ("head 49152x576", 49152, 576, "Q8_0", 1)]


def blocks(fmt: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    _, block, bbytes = quant.FORMATS[fmt]
    raw = rng.integers(0, 256, size=(n, k // block, bbytes), dtype=np.uint8)
    for off in ([0, 2] if fmt == "Q4_1" else [0]):
        raw[:, :, off:off + 2] = rng.uniform(-0.05, 0.05, (n, k // block)).astype(np.float16).view(np.uint8).reshape(
            n, k // block, 2)
    return raw.reshape(n, -1)


CLOCK = time.perf_counter


def timed(fn, reps: int) -> float:
    t0 = CLOCK()
    for _ in range(reps):
        fn()
    return (CLOCK() - t0) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=float, default=5.0, help="ms of calls per timing")
    ap.add_argument("--variants", default="best",
                    help="'best', 'all' or a comma list (e.g. vnni512,amx) of integer variants")
    ap.add_argument("--stat", default="min", choices=["min", "median"],
                    help="per-call time over the rounds: min (robust on a shared machine) or median")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="wall: elapsed time; cpu: the calling thread's CPU time (with --threads 1 the kernel runs "
                         "on that thread only, so time spent descheduled on a shared machine is not counted)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu needs --threads 1")
        CLOCK = time.thread_time
    stat = min if args.stat == "min" else statistics.median
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    qk = quant.kernels()
    if args.variants in ("all", "best"):
        variants = int8.runnable_variants() if args.variants == "all" else [int8.kernels().variant]
    else:
        variants = [v.strip() for v in args.variants.split(",")]
        for v in variants:
            if int8.kernels(v) is None:
                ap.error(f"int8 variant {v}: {int8.unavailable_reason(v)}")
    iks = {v: int8.kernels(v) for v in variants}
    rng = np.random.default_rng(0)
    paths = {"float": None, **{f"int8-{v}": k for v, k in iks.items()}}
    print(f"threads {args.threads}, {args.clock} clock; float path: quant {qk.variant}; "
          f"integer variants: {', '.join(variants)}")
    total = {p: {m: 0.0 for m in rows} for p in paths}
    for name, n, k, fmt, per_forward in SHAPES:
        raw = blocks(fmt, n, k, rng)
        w = qk.pack(fmt, list(raw), k)
        xs = {m: torch.randn(m, k) for m in rows}
        # a call takes about n * k * m / 50e9 s at best; ~20 ms per timing
        inner = {m: max(1, int(args.window * 1e-3 / max(2e-6, n * k * max(m, 4) / 60e9))) for m in rows}
        res: dict = {p: {m: [] for m in rows} for p in paths}
        for _ in range(args.repeats):
            for m in rows:
                for p, ik in paths.items():
                    kern = qk if ik is None else ik
                    fn = lambda x=xs[m], kern=kern: kern.linear(x, w, n)  # noqa: E731
                    fn()
                    res[p][m].append(timed(fn, inner[m]))
        print(f"\n{name} ({fmt}): {args.stat} us per call (cost / cost at M={rows[0]})")
        print("   M  " + "  ".join(f"{p:>22}" for p in paths) + "   float/int8")
        for m in rows:
            med = {p: stat(res[p][m]) for p in paths}
            base = {p: stat(res[p][rows[0]]) for p in paths}
            first_int = next(p for p in paths if p != "float")
            cells = "  ".join(f"{med[p]:10.1f} ({med[p] / base[p]:5.2f}x)    " for p in paths)
            print(f"{m:4d}  {cells}   {med['float'] / med[first_int]:5.2f}")
            for p in paths:
                total[p][m] += per_forward * med[p] / 1e3
    print("\nprojections of one SmolLM2 forward (30 layers + head), projected ms (cost / cost at M=1):")
    for p in paths:
        print(f"  {p:>14}: " + "  ".join(f"M={m}: {total[p][m]:6.2f} ({total[p][m] / total[p][rows[0]]:4.2f}x)"
                                         for m in rows))


if __name__ == "__main__":
    main()
