"""The attention kernel alone (`CpuKernels.attention_step`): one forward's attention over every layer of a
static KV cache, for N query tokens (a draft tree of N nodes, or a causal chain with --causal) on a cache of
L tokens, with SmolLM2-135M's shapes by default (30 layers, 9 query heads, 3 kv heads, head dim 64).
Prints ms per forward and GFMA/s: 2 D multiply-adds per (query row, visible key) (scores and weighted sum).

    python benchmarks/attention_cost.py [--cache-lens 256,1024] [--sizes 1,8,16,32] [--threads 1,2]
                                        [--baseline /path/to/other/cpu_kernels.cpp] [--repeats 15] [--bf16]

--baseline builds a second library from another copy of the source (e.g. main's) and times it interleaved
with this one in the same process, and checks that both give the same bits. --bf16 also times this kernel on
a bfloat16 copy of the cache (the cache `arith="int8"` keeps; its outputs are those of the rounded entries, so
they are not compared). Timings are minima over --repeats rounds: with one thread the process's CPU time (a
shared machine then adds little), with more the wall time. The cache holds random values; the layers' caches
together (2 x 30 x 3 x L x 64 floats, 47 MB at L = 1024) exceed the L2 caches, as a real model's do.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from goose.backends import cpukernel


def random_tree(n: int, rng: random.Random) -> torch.Tensor:
    """allowed [n, n]: a random tree of n nodes in topological order (node 0 the root)."""
    parent = [-1] + [rng.randrange(i) for i in range(1, n)]
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            allowed[i, j] = True
            j = parent[j]
    return allowed


def load(source: str | None) -> cpukernel.CpuKernels:
    if source is None:
        kern = cpukernel.kernel()
        if kern is None:
            raise SystemExit(f"no kernel: {cpukernel.unavailable_reason()}")
        return kern
    variant = cpukernel.runnable_variants()[0]
    lib, path, why = cpukernel.build_library(Path(source), variant)
    if lib is None:
        raise SystemExit(why)
    return cpukernel.CpuKernels(lib, path, variant)


def forward_fn(kern, step, qkv: torch.Tensor, layers: int):
    """A callable running `step` on every layer through ctypes directly (no per-call Python checks)."""
    fn, args, tail, out = step._fn, step._args, step._tail, torch.empty(step._out)
    base = step._cache.data_ptr()
    calls = [(qkv.data_ptr(), *args, base + layer * step._layer_bytes, base + layer * step._layer_bytes + step._half,
              *tail, out.data_ptr(), step.kv16) for layer in range(layers)]

    def run() -> torch.Tensor:
        for c in calls:
            fn(*c)
        return out
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-lens", default="256,1024")
    ap.add_argument("--sizes", default="1,8,16,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--causal", action="store_true", help="a causal chain of N tokens instead of a tree")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--baseline", default=None, help="another cpu_kernels.cpp to time side by side")
    ap.add_argument("--bf16", action="store_true", help="also time this kernel on a bfloat16 cache")
    args = ap.parse_args()
    kerns = {"this": load(None)}
    if args.baseline:
        kerns["baseline"] = load(args.baseline)
    H, Kh, D, layers = args.heads, args.kv_heads, args.head_dim, args.layers
    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    print(f"{kerns['this'].variant}; {layers} layers, {H} heads, {Kh} kv heads, head dim {D}; "
          f"{'causal chain' if args.causal else 'tree'}; min of {args.repeats}")
    names = list(kerns) + (["this-bf16"] if args.bf16 else [])
    head = f"{'thr':>3} {'L':>5} {'N':>3}" + "".join(f" {name + ' ms':>14} {'GFMA/s':>7}" for name in names)
    print(head + ("  baseline/this" if args.baseline else "") + ("  float32/bf16" if args.bf16 else ""))
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        clock = time.process_time if threads == 1 else time.perf_counter
        for L in [int(x) for x in args.cache_lens.split(",")]:
            for n in [int(x) for x in args.sizes.split(",")]:
                qkv = torch.randn(n, (H + 2 * Kh) * D, generator=g)
                ang = torch.rand(n, D // 2, generator=g) * 6.3
                cos, sin = ang.cos().repeat(1, 2).contiguous(), ang.sin().repeat(1, 2).contiguous()
                allowed = None if args.causal or n == 1 else random_tree(n, rng)
                cache = torch.randn(layers, 2, Kh, L + n, D, generator=g)
                runs, outs = {}, {}
                for name, kern in kerns.items():
                    step = kern.attention_step(H, cos, sin, cache, L, allowed, D ** -0.5)
                    runs[name] = forward_fn(kern, step, qkv, layers)
                    outs[name] = runs[name]().clone()
                if args.bf16:
                    step = kerns["this"].attention_step(H, cos, sin, cache.to(torch.bfloat16), L, allowed, D ** -0.5)
                    runs["this-bf16"] = forward_fn(kerns["this"], step, qkv, layers)
                if len(outs) > 1 and not torch.equal(outs["this"], outs["baseline"]):
                    raise SystemExit(f"outputs differ at L={L} N={n}")
                best = {name: float("inf") for name in runs}
                for _ in range(args.repeats):
                    for name, run in runs.items():
                        t0 = clock()
                        run()
                        best[name] = min(best[name], clock() - t0)
                visible = (L + 1) * n if not args.causal else sum(L + i + 1 for i in range(n))
                if allowed is not None:
                    visible = L * n + int(allowed.sum())
                fma = 2 * D * H * visible * layers
                line = f"{threads:>3} {L:>5} {n:>3}" + "".join(
                    f" {best[k] * 1e3:>14.3f} {fma / best[k] / 1e9:>7.1f}" for k in runs)
                if args.baseline:
                    line += f"  {best['baseline'] / best['this']:>13.2f}x"
                if args.bf16:
                    line += f"  {best['this'] / best['this-bf16']:>11.2f}x"
                print(line, flush=True)


if __name__ == "__main__":
    main()
