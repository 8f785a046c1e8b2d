"""How speculation fares when sampling: τ (tokens per target forward) and tokens/s by temperature.

Runs `ar` and the chosen methods on the first turn of Spec-Bench / HumanEval questions (chat template),
greedy and at each temperature (top-p as given, one seed per request), checks every sampled output against
`ar` with the same seed (goose's sampler makes them token-identical), and prints one table.

    python benchmarks/temperature.py [--temperatures 0,0.3,0.7,1.0] [--methods pld,goose] [--limit 2]
"""

from __future__ import annotations

import argparse
import time

from goose.bench import datasets
from goose.bench.runner import Prompter
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.loading.model import load_model

CATEGORIES = ["humaneval", "translation", "summarization", "qa", "math_reasoning", "rag"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="pld,goose")
    ap.add_argument("--temperatures", default="0,0.3,0.7,1.0", help="0 = greedy")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--limit", type=int, default=2, help="questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    spec = ",spec-bench"
    questions = datasets.load("humaneval" + spec, CATEGORIES, args.limit)
    prompter = Prompter(tok, model, chat=True)
    prompts = [prompter.turn_ids(q, 0, []) for q in questions]
    methods = ["ar"] + [m for m in args.methods.split(",") if m != "ar"]
    decoders = {m: Decoder(model, tok, m) for m in methods}
    print(f"{len(prompts)} prompts, {args.max_new_tokens} tokens, top-p {args.top_p}, model {args.model}")
    print(f"{'temperature':>11} {'method':>8} {'tau':>6} {'tok/s':>7} {'vs ar':>6} {'identical to ar':>16}")
    for t in (float(x) for x in args.temperatures.split(",")):
        totals = {m: [0, 0, 0.0, 0] for m in methods}  # tokens, forwards, seconds, identical prompts
        for i, ids in enumerate(prompts):
            opts = {} if t == 0 else {"do_sample": True, "temperature": t, "top_p": args.top_p, "seed": args.seed + i}
            cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, **opts)
            ref = None
            for m in methods:  # interleaved, so machine noise hits every method alike
                t0 = time.perf_counter()
                out, stats = decoders[m].generate_ids(ids, cfg)
                row = totals[m]
                row[0] += len(out)
                row[1] += stats.forward_calls
                row[2] += time.perf_counter() - t0
                ref = out if m == "ar" else ref
                row[3] += out == ref
        for m in methods:
            tokens, fwd, secs, same = totals[m]
            base = totals["ar"][0] / totals["ar"][2]
            print(f"{t if t else 'greedy':>11} {m:>8} {tokens / fwd:>6.2f} {tokens / secs:>7.1f} "
                  f"{tokens / secs / base:>5.2f}x {same:>9}/{len(prompts)}")


if __name__ == "__main__":
    main()
