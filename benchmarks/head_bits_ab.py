"""`eagle2` and `goose` with the packaged head, its weights as 4-bit (Q4_0) against 8-bit (Q8_0) blocks
(`EagleConfig.head_bits`), side by side with `ar`: each Spec-Bench first turn (chat template, `--limit` per
category) through every variant in turn, `--rounds` times over, one `Decoder` per variant (its suffix memory and
learned statistics carry over between prompts, as in a session).

    python benchmarks/head_bits_ab.py [--limit 3] [--rounds 2] [--arith int8] [--max-new-tokens 128]

Prints each variant's tokens/s over all its prompts, its ratio to `ar`, and how many outputs equal `ar`'s.
"""

from __future__ import annotations

import argparse
import time

import torch

from goose.bench import datasets
from goose.config import DecodeConfig, EagleConfig, GooseConfig
from goose.decoding import Decoder, encode
from goose.engine.methods import Eagle2
from goose.loading.model import load_model
from goose.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=3, help="Spec-Bench questions per category (default 3)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arith", default="int8", choices=("exact", "int8"))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_model("smollm2-135m", arith=args.arith)
    prompts = [encode(tok, q.turns[0], True) for q in datasets.load("spec-bench", None, args.limit)]
    decoders = {"ar": Decoder(model, tok, "ar")}
    for bits in (8, 4):
        eagle = EagleConfig(head="packaged", head_bits=bits)
        decoders[f"eagle2 q{bits}"] = Decoder(model, tok, Eagle2(eagle))
        decoders[f"goose+head q{bits}"] = Decoder(model, tok, "goose", GooseConfig(eagle=eagle))
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
    spent, made, outs = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0), {k: [] for k in decoders}
    for _ in range(args.rounds):
        for p in prompts:
            for name, dec in decoders.items():
                t = time.perf_counter()
                out, _ = dec.generate_ids(p, cfg)
                spent[name] += time.perf_counter() - t
                made[name] += len(out)
                outs[name].append(out)
    print(f"{len(prompts)} prompts x {args.rounds} rounds, arith {args.arith}, {args.threads} threads, CPU: "
          f"{cpu_name()}")
    base = made["ar"] / spent["ar"]
    for name in decoders:
        rate = made[name] / spent[name]
        same = sum(a == b for a, b in zip(outs[name], outs["ar"]))
        print(f"{name}: {rate:.1f} tokens/s, {rate / base:.3f}x ar, outputs equal to ar's: {same}/{len(outs['ar'])}")


if __name__ == "__main__":
    main()
