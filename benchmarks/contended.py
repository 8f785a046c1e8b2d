"""Speed on a contended CPU: `ar` and `goose` quiet and beside 1 and 2 busy processes, with the thread governor
(`EngineConfig.adapt_threads`, the default) and without it, side by side in one run; with ``--fixed``, also
without the governor on one OpenMP thread (`one`) and on one OpenMP thread with the projections on the kernels'
claim pool of all threads (`pool`: the governor's one-thread setting).

    python benchmarks/contended.py [--arith int8] [--max-new-tokens 96] [--busy 0,1,2] [--fixed]

Each busy process is a Python busy loop (`while True: pass`), started before and killed after its rows. Prints a
markdown table: tokens/s, and each row's speed as a fraction of the same configuration's quiet speed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from goose import Engine, load_model
from goose.config import EngineConfig
from goose.engine.threads import on_threads
from goose.machine import cpu_identity

PROMPTS = ["Explain how a bicycle gear works.", "Write a short story about a lighthouse keeper."]


def speed(model, tok, method: str, setting: str, n: int) -> tuple[float, list]:
    """tokens/s and outputs of `method` with the governor (`on`), without (`off`), or fixed on one OpenMP thread
    (`one`) or on one with the claim pool (`pool`)."""
    settings = EngineConfig(max_batch=1, prefix_cache_mb=0, memory_mb=0, adapt_threads=setting == "on")
    run = {"on": lambda fn: fn(), "off": lambda fn: fn(), "one": one_thread,
           "pool": lambda fn: on_threads(1, fn)}[setting]
    with Engine(model, tok, method, engine_config=settings, thread=False) as eng:
        def drive():
            outs, tokens, t0 = [], 0, time.perf_counter()
            for p in PROMPTS:
                req = eng.submit(p, n, chat=True)
                for _ in eng.drive(req):
                    pass
                outs.append(req.token_ids)
                tokens += len(req.token_ids)
            return tokens / (time.perf_counter() - t0), outs
        return run(drive)


def one_thread(fn):
    """`fn()` on one OpenMP thread, the projections on OpenMP too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arith", default="int8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--busy", default="0,1,2")
    ap.add_argument("--fixed", action="store_true", help="also rows on one OpenMP thread, without and with the pool")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m", arith=args.arith)
    speed(model, tok, "goose", "off", 16)  # warm-up: the process's first forwards (and cost curves) are not timed
    modes = ("on", "off", "one", "pool") if args.fixed else ("on", "off")
    rows, quiet, ref = [], {}, {}
    for busy in [int(b) for b in args.busy.split(",")]:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            for method in ("ar", "goose"):
                for mode in modes:
                    tps, outs = speed(model, tok, method, mode, args.max_new_tokens)
                    assert ref.setdefault(method, outs) == outs, "outputs differ"
                    quiet.setdefault((method, mode), tps)
                    rows.append((busy, method, mode, tps, tps / quiet[method, mode]))
        finally:
            for p in procs:
                p.kill()
                p.wait()
    print(f"CPU: {cpu_identity()}; arith {args.arith}; {args.max_new_tokens} tokens x {len(PROMPTS)} prompts\n")
    print("| busy processes | method | threads (governor on, off; fixed: one, pool) | tokens/s | of its quiet speed |")
    print("|---|---|---|---|---|")
    for busy, method, mode, tps, frac in rows:
        print(f"| {busy} | {method} | {mode} | {tps:.1f} | {frac:.2f}x |")


if __name__ == "__main__":
    main()
