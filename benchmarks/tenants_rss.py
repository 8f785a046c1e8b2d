"""Resident memory and bookkeeping time of many tenants: does what the engine keeps across requests stay
within its budgets (`prefix_cache_mb`, `memory_mb`, `max_tenants`), and does a finished request's bookkeeping
cost the same with one tenant or a million?

Two parts, each printing one table:

* ``--admission N``: N distinct tenants through what admission and a finished request do to the shared state
  (`MemoryPool.get` at admission; at the end `MemoryPool.insert` of its prompt + output and
  `PrefixCache.store` of its blocks, two blocks of the packaged model's entries), without decoding. Per decade
  of tenants: the microseconds per request and the process's resident memory.
* ``--requests N``: N one-token chat requests, each with a `tenant` of its own (``--same-tenant``: one
  tenant), through a real `Engine` on the packaged model; resident memory after a warm-up of
  ``--warmup`` requests and at the end, against the configured budgets.

    .venv/bin/python benchmarks/tenants_rss.py --admission 1000000 --requests 3000
    .venv/bin/python benchmarks/tenants_rss.py --requests 3000 --prefix-cache-mb 64 --memory-mb 16
"""

from __future__ import annotations

import argparse
import os
import random
import time

MiB = 2**20


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def admission(n: int, prefix_mb: float, memory_mb: float, max_tenants: int) -> None:
    import torch

    import goose
    from goose.drafting.memory import MemoryPool
    from goose.engine.prefix import PrefixCache
    from goose.engine.requests import default_forward
    from goose.protocols import Segment

    model, _ = goose.load_model()
    forward = default_forward(model, "exact")
    prompt = list(range(100, 117))
    cache = forward.new_cache()
    cache.reset()
    with torch.inference_mode():
        forward.run([Segment(cache, prompt)])
    pool = MemoryPool(int(memory_mb * MiB), max_tenants=max_tenants)
    prefixes = PrefixCache(int(prefix_mb * MiB), max_tenants)
    rng = random.Random(0)
    base = rss()
    print("| tenants | us per request (last decade) | RSS growth MiB | pool tenants | pool MiB | prefix tenants "
          "| prefix MiB |\n|---|---|---|---|---|---|---|")
    done, mark, t = 0, 1, time.perf_counter()
    while done < n:
        tenant = f"{rng.getrandbits(256):064x}"  # as the server's digests
        pool.get(tenant)
        pool.insert(tenant, prompt + [rng.randrange(49152) for _ in range(3)])
        prefixes.store(prompt, cache, tenant)
        done += 1
        if done == mark or done == n:
            us = (time.perf_counter() - t) / (done - mark // 10 if mark > 1 else 1) * 1e6
            print(f"| {done:,} | {us:.1f} | {(rss() - base) / MiB:.1f} | {len(pool):,} | {pool.nbytes / MiB:.1f} "
                  f"| {prefixes.tenants:,} | {prefixes.bytes / MiB:.1f} |", flush=True)
            mark *= 10
            t = time.perf_counter()
    print(f"budgets: prefix cache {prefix_mb} MiB + memory {memory_mb} MiB = {prefix_mb + memory_mb} MiB")


def requests(n: int, warmup: int, prefix_mb: float, memory_mb: float, same_tenant: bool, max_batch: int) -> None:
    import goose
    from goose.server.app import tune_malloc

    tune_malloc()  # as `goose serve` does

    model, tok = goose.load_model()
    rng = random.Random(1)
    words = "goose river north winter flock feather lake reed wing song sky marsh".split()
    with goose.Engine(model, tok, "goose", max_batch=max_batch, prefix_cache_mb=prefix_mb,
                      memory_mb=memory_mb) as eng:
        def wave(count: int, start: int) -> None:
            reqs = []
            for i in range(start, start + count):
                text = " ".join(rng.choice(words) for _ in range(12))
                prompt = tok.apply_chat_template([{"role": "user", "content": f"Request {i}: {text}"}],
                                                 add_generation_prompt=True, tokenize=False)
                reqs.append(eng.submit(prompt, 1, tenant="one" if same_tenant else f"user-{i}"))
                if len(reqs) >= 4 * max_batch:
                    [r.result(timeout=600) for r in reqs]
                    reqs = []
            [r.result(timeout=600) for r in reqs]

        start = rss()
        wave(warmup, 0)
        before = rss()
        t = time.perf_counter()
        wave(n, warmup)
        after = rss()
        secs = time.perf_counter() - t
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the allocator holds free, handed back
        trimmed = rss()
        budgets = max(prefix_mb + memory_mb, 1e-9)
        print("| requests | tenants | budgets MiB | RSS at start MiB | growth over the warm-up + requests MiB "
              "(/ budgets) | growth after the warm-up MiB | prefix MiB held | memory MiB held | requests/s |\n"
              "|---|---|---|---|---|---|---|---|---|")
        print(f"| {warmup:,} + {n:,} | {1 if same_tenant else n + warmup:,} | {prefix_mb:g} + {memory_mb:g} "
              f"| {start / MiB:.0f} | {(after - start) / MiB:.1f} ({(after - start) / MiB / budgets:.2f}) "
              f"| {(after - before) / MiB:.1f} | {eng.prefixes.bytes / MiB:.1f} | {eng.memories.nbytes / MiB:.1f} "
              f"| {n / secs:.1f} |")
        print(f"after malloc_trim(0): growth from start {(trimmed - start) / MiB:.1f} MiB "
              f"({(after - trimmed) / MiB:.1f} MiB were free memory the allocator kept)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--admission", type=int, default=0, help="tenants through the admission path (0: skip)")
    ap.add_argument("--requests", type=int, default=0, help="one-token chat requests through an Engine (0: skip)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--prefix-cache-mb", type=float, default=256)
    ap.add_argument("--memory-mb", type=float, default=64)
    ap.add_argument("--max-tenants", type=int, default=10_000)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--same-tenant", action="store_true")
    args = ap.parse_args()
    from goose.machine import cpu_name

    print(f"CPU: {cpu_name()}")
    if args.admission:
        admission(args.admission, args.prefix_cache_mb, args.memory_mb, args.max_tenants)
    if args.requests:
        requests(args.requests, args.warmup, args.prefix_cache_mb, args.memory_mb, args.same_tenant, args.max_batch)


if __name__ == "__main__":
    main()
