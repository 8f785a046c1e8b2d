"""Speed on a contended CPU: `ar` and `goose` quiet and beside 1 and 2 busy processes, with the thread governor
(`EngineConfig.adapt_threads`, the default) and without it, side by side in one run.

    python benchmarks/contended.py [--arith int8] [--max-new-tokens 96] [--busy 0,1,2]

Each busy process is a Python busy loop (`while True: pass`), started before and killed after its rows. Prints a
markdown table: tokens/s, and each row's speed as a fraction of the same configuration's quiet speed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from goose import Engine, load_model
from goose.config import EngineConfig
from goose.machine import cpu_identity

PROMPTS = ["Explain how a bicycle gear works.", "Write a short story about a lighthouse keeper."]


def speed(model, tok, method: str, adapt: bool, n: int) -> tuple[float, list]:
    settings = EngineConfig(max_batch=1, prefix_cache_mb=0, memory_mb=0, adapt_threads=adapt)
    with Engine(model, tok, method, engine_config=settings, thread=False) as eng:
        outs, tokens, t0 = [], 0, time.perf_counter()
        for p in PROMPTS:
            req = eng.submit(p, n, chat=True)
            for _ in eng.drive(req):
                pass
            outs.append(req.token_ids)
            tokens += len(req.token_ids)
        return tokens / (time.perf_counter() - t0), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arith", default="int8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--busy", default="0,1,2")
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m", arith=args.arith)
    speed(model, tok, "goose", False, 16)  # warm-up: the process's first forwards (and cost curves) are not timed
    rows, quiet, ref = [], {}, {}
    for busy in [int(b) for b in args.busy.split(",")]:
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            for method in ("ar", "goose"):
                for adapt in (True, False):
                    tps, outs = speed(model, tok, method, adapt, args.max_new_tokens)
                    assert ref.setdefault(method, outs) == outs, "outputs differ"
                    quiet.setdefault((method, adapt), tps)
                    rows.append((busy, method, adapt, tps, tps / quiet[method, adapt]))
        finally:
            for p in procs:
                p.kill()
                p.wait()
    print(f"CPU: {cpu_identity()}; arith {args.arith}; {args.max_new_tokens} tokens x {len(PROMPTS)} prompts\n")
    print("| busy processes | method | thread governor | tokens/s | of its quiet speed |")
    print("|---|---|---|---|---|")
    for busy, method, adapt, tps, frac in rows:
        print(f"| {busy} | {method} | {'on' if adapt else 'off'} | {tps:.1f} | {frac:.2f}x |")


if __name__ == "__main__":
    main()
