"""The Engine at concurrency 1 against a plain `Decoder`: the same step loop behind a thread and a queue.

Both run each prompt in turn, interleaved prompt by prompt (so machine noise hits both alike), after one
warm-up prompt each. Prints tokens/s of each and their ratio, and checks the tokens are identical.

    .venv/bin/python benchmarks/engine_vs_decoder.py --method goose --limit 1 --max-new-tokens 128 [--arith int8]

--arith int8 loads the packaged model's GGUF blocks (weights="gguf") in the integer arithmetic; the default is
the float32 model (exact).
"""

from __future__ import annotations

import argparse
import time

import torch

from goose import Decoder, Engine, load_model
from goose.bench import datasets
from goose.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="goose")
    ap.add_argument("--limit", type=int, default=1, help="Spec-Bench questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--arith", choices=["exact", "int8"], default="exact")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.arith == "int8":
        model, tok = load_model(args.model, weights="gguf", arith="int8")
    else:
        model, tok = load_model(args.model)
    questions = datasets.load("spec-bench", None, args.limit)
    dec = Decoder(model, tok, args.method)
    prompts = [dec.encode(q.turns[0], chat=True) for q in questions]
    times = {"decoder": 0.0, "engine": 0.0}
    tokens = {"decoder": 0, "engine": 0}
    steps = {"decoder": 0, "engine": 0}
    nodes = {"decoder": 0, "engine": 0}
    same = 0
    with Engine(model, tok, args.method, max_batch=1) as eng:
        dec.generate(prompts[0], 16)
        eng.submit(prompts[0], 16).result()
        for ids in prompts:
            t = time.perf_counter()
            ra = dec.generate(ids, args.max_new_tokens)
            times["decoder"] += time.perf_counter() - t
            t = time.perf_counter()
            rb = eng.submit(ids, args.max_new_tokens).result()
            times["engine"] += time.perf_counter() - t
            a, b = ra.token_ids, rb.token_ids
            for k, r in (("decoder", ra), ("engine", rb)):
                steps[k] += len(r.stats.tree_sizes)
                nodes[k] += sum(r.stats.tree_sizes)
            tokens["decoder"] += len(a)
            tokens["engine"] += len(b)
            same += a == b
    rate = {k: tokens[k] / times[k] for k in times}
    print(f"CPU: {cpu_name()}, {args.threads} threads, {args.model}, {args.method}, arith {args.arith}, "
          f"{len(prompts)} prompts x {args.max_new_tokens} tokens")
    print(f"Decoder {rate['decoder']:.1f} tok/s, Engine(max_batch=1) {rate['engine']:.1f} tok/s, "
          f"ratio {rate['engine'] / rate['decoder']:.3f}; identical {same}/{len(prompts)}")
    for k in times:
        print(f"{k}: tokens per step {tokens[k] / max(1, steps[k]):.2f}, verified nodes per step "
              f"{nodes[k] / max(1, steps[k]):.2f}, ms per step {1e3 * times[k] / max(1, steps[k]):.2f}")


if __name__ == "__main__":
    main()
