"""Cost of a draft head's drafting calls (`goose.backends.head.FastHead`) on the packaged SmolLM2 head: one
layer call (input projection, decoder layer, attention over the head's cache of 300 rows) for 1 and 2 causal rows
(a step's catch-up) and for 4 tree rows that see the cache and, of the step's earlier draft rows, their own
ancestors (`back` 4 and 8: the second and third drafted depth), and the logits of those rows.

    python benchmarks/head_cost.py [--threads 2] [--repeats 7] [--bits 4,8]

Prints the minimum over --repeats rounds of the mean ms per call of 200 calls. Also runs against an older
checkout whose `FastHead.layer` took a whole mask ``[n, at + n]`` (PYTHONPATH=that/src), for a side-by-side.
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch

from goose.backends.head import FastHead, HeadCache, load_head, packaged_head
from goose.loading.model import load_model
from goose.loading.packaged import DEFAULT_MODEL


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bits", default="4,8", help="the head's weight blocks, comma-separated: 4 (Q4_0), 8 (Q8_0)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(DEFAULT_MODEL, "float32", "cpu", arith="int8")
    head = load_head(packaged_head(model), model)
    takes_fmt = "fmt" in inspect.signature(FastHead).parameters  # (an older FastHead had Q8_0 blocks only)
    for bits in args.bits.split(",") if takes_fmt else ["8"]:
        measure(args, head, FastHead(head, {"4": "Q4_0", "8": "Q8_0"}[bits.strip()]) if takes_fmt else FastHead(head))


def measure(args, head, fast) -> None:
    windowed = "allowed" in inspect.signature(fast.layer).parameters  # (an older FastHead took a whole mask)
    hid, cached = head.cfg.hidden_size, 300
    cache = HeadCache()
    gen = torch.Generator().manual_seed(0)

    def call(n: int, back: int) -> torch.Tensor:
        toks, feats = torch.randint(0, 4000, (n,), generator=gen), torch.randn(n, hid, generator=gen)
        if back == 0:
            return fast.layer(toks, feats, torch.arange(cached, cached + n), cache, cached)
        at = cached + back
        allowed = torch.zeros(n, back + n, dtype=torch.bool)
        allowed[:, back:] = torch.eye(n, dtype=torch.bool)
        pos = torch.full((n,), cached)
        if windowed:
            return fast.layer(toks, feats, pos, cache, at, allowed, back)
        return fast.layer(toks, feats, pos, cache, at, torch.cat([torch.ones(n, at - back, dtype=torch.bool),
                                                                  allowed], 1))

    with torch.inference_mode():
        fast.layer(torch.randint(0, 4000, (cached,), generator=gen), torch.randn(cached, hid, generator=gen),
                   torch.arange(cached), cache, 0)
        print(f"head {fast.kind}, {args.threads} threads, {cached} cached rows")
        for n, back in ((1, 0), (2, 0), (4, 4), (4, 8)):
            for _ in range(20):
                call(n, back)
            layer, logits = [], []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(200):
                    out = call(n, back)
                layer.append((time.perf_counter() - t0) / 200 * 1e3)
                t0 = time.perf_counter()
                for _ in range(200):
                    fast.logits(out)
                logits.append((time.perf_counter() - t0) / 200 * 1e3)
            print(f"rows {n} back {back}: layer {min(layer):.3f} ms, logits {min(logits):.3f} ms", flush=True)


if __name__ == "__main__":
    main()
