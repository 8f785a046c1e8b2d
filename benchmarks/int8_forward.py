"""One LeanForward over GGUF blocks in each arithmetic, ``exact`` (float32 products of the weights' values) and
``int8`` (`goose.backends.int8`), timed interleaved in one process: the cost of a forward of N query
tokens (a draft tree of N nodes) on a KV cache of --cache-len tokens, and its ratio to N = 1. Then, with
--decode, greedy decoding of one chat prompt by `ar`, `pld` and `goose` on the int8 forward: tokens must
be identical to `ar` in the same arithmetic (and are compared with exact `ar`), with tokens per second.

    python benchmarks/int8_forward.py [--model smollm2-135m] [--cache-len 256] [--sizes 1,2,4,8,16,32]
                                      [--repeats 9] [--threads 2] [--decode 128] [--clock cpu --threads 1]

Timings are the minimum and the median over --repeats interleaved rounds (a shared machine only adds time).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch
from forward_cost import random_tree

from goose.backends.lean import LeanForward
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.loading.model import load_model

CLOCK = time.perf_counter


def time_call(fwd, tokens, tree) -> float:
    """ms of one forward of `tokens` (a tree when more than one), then back to the prefix."""
    t0 = CLOCK()
    if len(tokens) == 1:
        fwd(tokens)
    else:
        fwd(tokens, tree[1], tree[0])
    dt = CLOCK() - t0
    fwd.keep([])
    return dt * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache-len", type=int, default=256)
    ap.add_argument("--sizes", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode", type=int, default=0, help="new tokens of the decoding check (0: skip)")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: the calling thread's CPU time, with --threads 1 (not counting time spent descheduled)")
    args = ap.parse_args()
    global CLOCK
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu needs --threads 1")
        CLOCK = time.thread_time
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    model, tok = load_model(args.model, weights="gguf")
    forwards = {"exact": LeanForward(model), "int8": LeanForward(model, arith="int8")}
    vocab = model.get_output_embeddings().weight.shape[0]
    rng = random.Random(0)
    prompt = [rng.randrange(3, vocab) for _ in range(args.cache_len)]
    trees = {n: random_tree(rng, n) for n in sizes}
    toks = {n: [rng.randrange(3, vocab) for _ in range(n)] for n in sizes}
    times = {(k, n): [] for k in forwards for n in sizes}
    with torch.inference_mode():
        for fwd in forwards.values():
            fwd.reset()
            fwd(prompt)
            for n in sizes:
                time_call(fwd, toks[n], trees[n])
        for _ in range(args.repeats):
            for n in sizes:
                for k, fwd in forwards.items():
                    times[(k, n)].append(time_call(fwd, toks[n], trees[n]))
    print(f"model {args.model}, cache {args.cache_len}, {args.threads} threads, {args.clock} clock, "
          f"{args.repeats} rounds; "
          + ", ".join(f"{k}={f.backend}" for k, f in forwards.items()))
    print(f"{'N':>4} " + " ".join(f"{k + ' ms min/med':>22} {'c(N)/c(1)':>9}" for k in forwards) + "  exact/int8")
    for n in sizes:
        cells = []
        for k in forwards:
            lo, med = min(times[(k, n)]), statistics.median(times[(k, n)])
            cells.append(f"{lo:>10.2f} /{med:>9.2f} {lo / min(times[(k, sizes[0])]):>9.2f}")
        print(f"{n:>4} " + " ".join(cells) + f"  {min(times[('exact', n)]) / min(times[('int8', n)]):>10.2f}")
    if args.decode:
        msgs = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number, "
                                            "then explain how it works."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        cfg = DecodeConfig(args.decode)
        outs = {}
        for label, fwd, method in (("exact ar", forwards["exact"], "ar"), ("int8 ar", forwards["int8"], "ar"),
                                   ("int8 pld", forwards["int8"], "pld"), ("int8 goose", forwards["int8"], "goose")):
            t0 = CLOCK()
            out, _ = Decoder(model, tok, method, forward=fwd).generate_ids(ids, cfg)
            dt = CLOCK() - t0
            outs[label] = out
            same = "" if label == "exact ar" else f", identical to int8 ar: {out == outs['int8 ar']}"
            print(f"{label:>11}: {len(out)} tokens, {len(out) / dt:6.1f} tok/s{same}")
        agree = next((i for i, (a, b) in enumerate(zip(outs["exact ar"], outs["int8 ar"])) if a != b), None)
        print(f"int8 ar vs exact ar: {'identical' if agree is None else f'first differs at token {agree}'}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
