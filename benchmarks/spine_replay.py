"""Replay greedy outputs through the context n-gram index (the spine source) with different n-gram sizes: how
often a chain is proposed, how often its first token is the model's next token, and the tokens per step of
chains cut at K tokens, with no engine and no acceptance model.

The outputs are `ar`'s (int8 arithmetic, chat template, every turn of each question, 128 new tokens) on the
Spec-Bench questions [--skip, --skip + --limit) of every category, computed once and cached in --outputs. A
step proposes a chain from the committed tokens (`NgramIndex.propose`, the earliest occurrence of the longest
matching n-gram), keeps its first K tokens, and commits the prefix that equals the known continuation plus one
token, as a lossless engine would.

    .venv/bin/python benchmarks/spine_replay.py [--skip 3 --limit 4] [--sizes 5,4,3/5,4,3,2/5,4,3,2,1] [--chains 1,4,8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from goose.drafting.ngram import NgramIndex


def greedy_outputs(path: Path, skip: int, limit: int, max_new: int) -> list[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    import torch

    from goose.bench import datasets
    from goose.bench.runner import Prompter
    from goose.config import DecodeConfig
    from goose.decoding import Decoder
    from goose.loading.model import load_model

    torch.set_num_threads(2)
    model, tok = load_model("smollm2-135m", arith="int8")
    dec = Decoder(model, tok, "ar", memory_mb=0)
    prompter = Prompter(tok, model, chat=True)
    by_category: dict[str, list] = {}
    for q in datasets.load("spec-bench", limit=skip + limit):
        by_category.setdefault(q.category, []).append(q)
    out = []
    for questions in by_category.values():
        for q in questions[skip : skip + limit]:
            answers: list[list[int]] = []
            for turn in range(len(q.turns)):
                ids = prompter.turn_ids(q, turn, answers)
                tokens, _ = dec.generate_ids(ids, DecodeConfig(max_new))
                answers.append(tokens)
                out.append({"category": q.category, "prompt": ids, "output": tokens})
    path.write_text(json.dumps(out))
    return out


def replay(requests: list[dict], sizes: tuple[int, ...], k: int) -> tuple[float, float, float]:
    """(tokens per step, share of steps with a chain, share of those whose first token was right)."""
    steps = tokens = proposed = right = 0
    for r in requests:
        seq = r["prompt"] + r["output"]
        t = len(r["prompt"]) + 1  # the prefill gave the first output token
        index = NgramIndex(sizes, max_chain=max(k, 1))
        index.extend(seq[:t])
        while t < len(seq):
            chain = index.propose().chain[:k]
            a = 0
            while a < len(chain) and t + a < len(seq) and chain[a] == seq[t + a]:
                a += 1
            if chain:
                proposed += 1
                right += chain[0] == seq[t]
            step = min(a + 1, len(seq) - t)
            index.extend(seq[t : t + step])
            steps += 1
            tokens += step
            t += step
    return tokens / steps, proposed / steps, right / max(1, proposed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip", type=int, default=3, help="questions of each category skipped first")
    ap.add_argument("--limit", type=int, default=4, help="questions of each category replayed")
    ap.add_argument("--sizes", default="5,4,3/5,4,3,2/5,4,3,2,1", help="n-gram size sets, '/'-separated")
    ap.add_argument("--chains", default="1,4,8", help="chain lengths K")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--outputs", type=Path, default=Path("runs/spine_replay_outputs.json"))
    args = ap.parse_args()
    args.outputs.parent.mkdir(parents=True, exist_ok=True)
    requests = greedy_outputs(args.outputs, args.skip, args.limit, args.max_new_tokens)
    print(f"{len(requests)} requests, {sum(len(r['output']) for r in requests)} tokens")
    print(f"{'sizes':>12} {'K':>3} {'tokens/step':>12} {'with chain':>11} {'first right':>12}")
    for k in (int(x) for x in args.chains.split(",")):
        for spec in args.sizes.split("/"):
            sizes = tuple(int(x) for x in spec.split(","))
            tau, share, right = replay(requests, sizes, k)
            print(f"{spec:>12} {k:>3} {tau:12.3f} {share:11.3f} {right:12.3f}")


if __name__ == "__main__":
    main()
