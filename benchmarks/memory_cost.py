"""Cost of the cross-request suffix memory at ~1M stored tokens: lookup and insert time per step, and its real
memory use (tracemalloc) against the accounted `nbytes` that `memory_mb` bounds.

The stored text is synthetic but repetitive like real traffic: sessions of ~1,000 tokens (SmolLM2's vocabulary
size) built from a pool of 2,000 phrases of 4-40 tokens (so k-grams recur and lookups find many occurrences)
with 20% fresh random tokens. Lookups use contexts cut from stored sessions (hits) and random contexts (misses).
Per step, `goose` does one lookup, and a finished request inserts its prompt + output once: its insert time per
token times the tokens a step commits (τ) is the insert's share of a step.

    .venv/bin/python benchmarks/memory_cost.py [--tokens 1000000] [--lookups 20000]
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from goose.drafting.memory import SuffixMemory

VOCAB = 49152


def session(rng: random.Random, phrases: list[list[int]], length: int) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        if rng.random() < 0.2:
            out.extend(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8)))
        else:
            out.extend(phrases[min(int(rng.paretovariate(1.1)) - 1, len(phrases) - 1)])
    return out[:length]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000)
    ap.add_argument("--lookups", type=int, default=20_000)
    ap.add_argument("--tau", type=float, default=3.0, help="tokens committed per step, for the insert's share")
    args = ap.parse_args()
    rng = random.Random(0)
    phrases = [[rng.randrange(VOCAB) for _ in range(rng.randrange(4, 41))] for _ in range(2000)]
    sessions = [session(rng, phrases, rng.randrange(500, 1500)) for _ in range(args.tokens // 1000)]
    total = sum(map(len, sessions))

    tracemalloc.start()  # the real size, built once under tracemalloc (which slows allocation down)
    traced = SuffixMemory(1 << 40)
    for s in sessions:
        traced.insert(s)
    real = tracemalloc.get_traced_memory()[0]
    accounted = traced.nbytes
    tracemalloc.stop()
    del traced

    mem = SuffixMemory(1 << 40)  # no eviction: all of it stays
    t = time.perf_counter()
    for s in sessions:
        mem.insert(s)
    insert_s = time.perf_counter() - t

    hits = []
    for _ in range(args.lookups):
        s = rng.choice(sessions)
        end = rng.randrange(40, len(s))
        hits.append(s[end - 40 : end])
    misses = [[rng.randrange(VOCAB) for _ in range(40)] for _ in range(args.lookups)]
    timings = {}
    for name, ctxs in (("hit", hits), ("miss", misses)):
        found = 0
        t = time.perf_counter()
        for c in ctxs:
            found += bool(mem.lookup(c).spine)
        timings[name] = ((time.perf_counter() - t) / len(ctxs) * 1e3, found / len(ctxs))

    # eviction: drop the least recently used sessions until a tenth of the tokens is gone
    t = time.perf_counter()
    evicted_tokens, n = 0, 0
    while evicted_tokens < total // 10:
        before = mem.tokens
        mem.evict_one()
        evicted_tokens += before - mem.tokens
        n += 1
    evict_s = time.perf_counter() - t

    per_token_us = insert_s / total * 1e6
    print(f"stored tokens       {total:,} in {len(sessions):,} sequences; index entries {len(mem._head) + 0:,}")
    print(f"memory: real (tracemalloc) {real / 2**20:.1f} MiB = {real / total:.1f} B/token; accounted (nbytes, what "
          f"memory_mb bounds) {accounted / 2**20:.1f} MiB = {accounted / total:.1f} B/token")
    print(f"insert              {per_token_us:.2f} us/token ({insert_s:.2f} s for all)")
    for name, (ms, rate) in timings.items():
        print(f"lookup ({name:4s})       {ms * 1e3:.1f} us/lookup ({rate:.0%} found a draft)")
    print(f"evict               {evict_s / evicted_tokens * 1e6:.2f} us/token ({n} sequences)")
    step_ms = timings["hit"][0] + per_token_us * args.tau / 1e3
    print(f"per step (lookup hit + insert of tau={args.tau:g} tokens): {step_ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
