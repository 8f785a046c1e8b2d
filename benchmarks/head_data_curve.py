"""Held-out acceptance of a draft head against the data it saw: `goose train-head`'s training on the first N
conversations of features already collected (its `--workdir`), for each N, with every other setting at its
default. Prints one JSON line per N.

    python benchmarks/head_data_curve.py --workdir /tmp/headwork --sizes 150,300 [--arith int8]

The workdir is the one a default `goose train-head --workdir DIR` run filled (its data.pt); each N trains in
DIR-curve-N (its own features file and checkpoint, so an interrupted run resumes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from goose import load_model
from goose.backends.head import HeadConfig
from goose.engine.requests import default_forward
from goose.headtrain import TrainConfig, train_head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a `goose train-head` workdir holding data.pt")
    ap.add_argument("--sizes", default="150,300", help="conversation counts, comma-separated")
    ap.add_argument("--arith", default="int8", choices=["exact", "int8"])
    args = ap.parse_args()
    model, tok = load_model(arith=args.arith)
    full = torch.load(Path(args.workdir) / "data.pt")
    train = full["train"]
    for n in (int(x) for x in args.sizes.split(",")):
        starts = train["starts"]
        if n > len(starts):
            raise SystemExit(f"the workdir holds {len(starts)} conversations, fewer than {n}")
        end = int(starts[n]) if n < len(starts) else len(train["tokens"])
        sub = {k: train[k][:end] for k in ("tokens", "feats", "labels")}
        sub["starts"] = starts[:n]
        cfg = TrainConfig(conversations=n)
        spec = {"first": cfg.first, "conversations": n, "held_out": list(cfg.held_out), "max_tokens": cfg.max_tokens,
                "target": HeadConfig.for_target(model, 1).target}
        work = Path(f"{args.workdir}-curve-{n}")
        work.mkdir(exist_ok=True)
        if not (work / "data.pt").exists():
            torch.save({"spec": spec, "train": sub, "held_out": full["held_out"]}, work / "data.pt")
        man = train_head(model, tok, default_forward(model, args.arith), work / "head", work, cfg)
        print(json.dumps({"conversations": n, "tokens": end, "steps": man["steps"],
                          "held_out_top1_by_depth": man["held_out_top1_by_depth"],
                          "coverage": man["draft_vocab_coverage"], "train_seconds": man["train_seconds"]}), flush=True)


if __name__ == "__main__":
    main()
