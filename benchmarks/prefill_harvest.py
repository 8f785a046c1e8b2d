"""How many prompt positions `goose` should harvest into its adjacency table at prefill.

Each harvested position costs a vocabulary-wide output projection; this runs `goose` with several
`DeviceAwareConfig.prefill_harvest` values side by side (interleaved per prompt, greedy, chat template) and
prints τ, tokens/s and the share of time spent in the prefill.

    python benchmarks/prefill_harvest.py [--model smollm2-135m] [--values 0,64,all] [--limit 2]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from goose.bench import datasets
from goose.bench.runner import Prompter
from goose.config import DecodeConfig, DeviceAwareConfig, GooseConfig
from goose.decoding import Decoder
from goose.loading.model import load_model

CATEGORIES = ["humaneval", "translation", "summarization", "qa", "math_reasoning", "rag"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--values", default="0,64,all", help="prefill_harvest values; 'all' = every position")
    ap.add_argument("--limit", type=int, default=2, help="questions per category")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--categories", default=",".join(CATEGORIES))
    args = ap.parse_args()
    model, tok = load_model(args.model)
    spec = ",spec-bench"
    questions = datasets.load("humaneval" + spec, args.categories.split(","), args.limit)
    prompter = Prompter(tok, model, chat=bool(getattr(tok, "chat_template", None)))
    prompts = [prompter.turn_ids(q, 0, []) for q in questions]
    values = [None if v == "all" else int(v) for v in args.values.split(",")]
    decoders = {v: Decoder(model, tok, "goose", GooseConfig(device_aware=replace(DeviceAwareConfig(),
                                                                                   prefill_harvest=v)))
                for v in values}
    totals = {v: [0, 0, 0.0] for v in values}
    outputs = {}
    for i, ids in enumerate(prompts):
        for v in values:
            t0 = time.perf_counter()
            out, stats = decoders[v].generate_ids(ids, DecodeConfig(max_new_tokens=args.max_new_tokens))
            totals[v][0] += len(out)
            totals[v][1] += stats.forward_calls
            totals[v][2] += time.perf_counter() - t0
            outputs.setdefault(i, out)
            assert out == outputs[i], "outputs differ between settings"
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} prompt tokens), {args.max_new_tokens} tokens, "
          f"{args.model}")
    base = totals[values[0]][0] / totals[values[0]][2]
    for v in values:
        tokens, fwd, secs = totals[v]
        print(f"prefill_harvest={'all' if v is None else v:>4}  tau {tokens / fwd:.2f}  "
              f"{tokens / secs:.2f} tok/s  ({tokens / secs / base:.2f}x of the first)")


if __name__ == "__main__":
    main()
