"""Top-1 acceptance by depth of draft heads on Spec-Bench's questions, answered by the target itself: the same
measure as a head's manifest (`goose.headtrain.evaluate`: the head's first choice equals the target's greedy token,
depth u reading the features the head predicted at depths before), on the text `goose bench --dataset spec-bench
--chat` decodes, not on ShareGPT's held-out split. Independent of timing, so heads compare exactly.

    python benchmarks/head_specbench.py [--limit 1] [--new-tokens 128] [--arith int8] HEAD [HEAD ...]

HEAD: a head folder or "packaged". Prints one JSON line per head: top-1 by depth and the share of the target's
tokens its draft vocabulary holds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from goose import load_model
from goose.backends.head import load_head, packaged_head
from goose.bench.datasets import load
from goose.engine.requests import default_forward, eos_ids
from goose.headtrain import IGNORE, evaluate, regenerate_collect


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--limit", type=int, default=1, help="questions per category (default 1)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--arith", default="int8", choices=["exact", "int8"])
    ap.add_argument("--unroll", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model(arith=args.arith)
    fwd = default_forward(model, args.arith)
    qs = load("spec-bench", limit=args.limit)
    convs = [(i, [{"role": "user", "content": q.turns[0]}]) for i, q in enumerate(qs)]
    heads = [(packaged_head(model) if name == "packaged" else Path(name)) for name in args.heads]
    heads = [(path, load_head(path, model)) for path in heads]
    taps = sorted({t for _, h in heads for t in h.cfg.feature_layers})  # every fused head's layers, read once
    data = regenerate_collect(fwd, tok, convs, 1024, args.new_tokens, eos_ids(model, tok),
                              features=tuple(taps) or True)
    H = model.config.hidden_size
    starts, asked = data["starts"].tolist(), data["prompt_lengths"].tolist()
    ends = starts[1:] + [len(data["tokens"])]
    # row j drafts the token after j + 1; decoding drafts from the answer's second token on (the first comes from
    # the prefill): rows s + n - 1 onward, whose labels are the answers' tokens
    scored = torch.zeros(len(data["tokens"]), dtype=torch.bool)
    for s, n, e in zip(starts, asked, ends):
        scored[s + n - 1 : e] = True
    answers = data["labels"][scored].long()
    vocab = model.get_output_embeddings().weight.shape[0]
    for path, head in heads:
        blocks = [taps.index(t) for t in head.cfg.feature_layers] + [len(taps)]  # its layers, then the final state
        mine = dict(data, feats=torch.cat([data["feats"][:, b * H : (b + 1) * H] for b in blocks], 1))
        t2d = torch.full((vocab,), IGNORE, dtype=torch.long)
        t2d[head.d2t] = torch.arange(len(head.d2t))
        covered = float((t2d[answers] != IGNORE).float().mean())
        acc = evaluate(head, mine, t2d, args.unroll, 256, scored)
        print(json.dumps({"head": str(path), "questions": len(qs), "tokens": len(data["tokens"]),
                          "answer_rows": int(scored.sum()), "top1_by_depth": acc,
                          "draft_vocab_coverage_of_answers": round(covered, 4)}))


if __name__ == "__main__":
    main()
