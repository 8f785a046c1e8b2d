"""Replay greedy outputs through chain proposers, without an engine: how many verify steps each proposer
needs and what they would cost under vLLM's step-cost model, for GooseProposer's variants against vLLM's
`suffix` (arctic-inference's SuffixDecodingCache, called as vLLM's SuffixDecodingProposer calls it).

A step verifies the proposer's chain against the known greedy continuation: the matching prefix plus one
token are committed, exactly as a lossless engine would commit them. A step that verifies T draft tokens costs
``1 + slope * T`` one-token steps (vLLM's CPU step: mostly fixed work; the slope is what `GooseProposer`
fits online, 0.03-0.07 measured on these machines); the proposer's own time is measured and added.
Requests run one after another (batch 1), each proposer keeping what it learnt, as in `goose bench --engine
vllm`. The outputs come from goose's `ar` on the same model (the tokens vLLM plain gives, up to near-ties),
computed once and cached in --outputs.

    .venv-vllm/bin/python benchmarks/proposer_replay.py \
        --dataset humaneval,spec-bench --limit 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def greedy_outputs(path: Path, dataset: str, limit: int, max_new: int) -> list[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    from goose.bench import datasets
    from goose.decoding import Decoder
    from goose.loading.model import load_model

    model, tok = load_model("smollm2-135m")  # GGUF blocks: the tokens of ar on the float32 model, faster
    dec = Decoder(model, tok, "ar")
    out = []
    for q in datasets.load(dataset, None, limit):
        ids = dec.encode(q.turns[0], chat=True)
        out.append({"prompt": ids, "output": dec.generate(ids, max_new).token_ids})
    path.write_text(json.dumps(out))
    return out


class FakeRow:
    """What vLLM hands a proposer for one request: its tokens so far (row of token_ids_cpu)."""

    def __init__(self, tokens: list[int]) -> None:
        import numpy as np

        self.np = np
        self.buf = np.zeros(len(tokens) + 4096, dtype=np.int64)
        self.n = 0
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.buf[self.n: self.n + len(tokens)] = tokens
        self.n += len(tokens)


def replay_goose(reqs: list[dict], make, clock) -> tuple[list[int], list[int], float]:
    prop = make()
    steps, drafted, spent = [], [], 0.0
    for r in reqs:
        row = FakeRow(r["prompt"])
        out = r["output"]
        done, sampled, n_steps, n_draft = 0, [r["output"][0]], 0, 0
        row.extend(sampled)
        done = 1
        while done < len(out):
            t0 = time.perf_counter()
            chain = prop.propose([sampled], [row.n], [row.buf])[0]
            spent += time.perf_counter() - t0
            clock.t += clock.step * (1 + clock.slope * len(chain))  # the verify step the chain costs
            acc = 0
            while acc < len(chain) and done + acc < len(out) and chain[acc] == out[done + acc]:
                acc += 1
            take = out[done: done + acc + 1]
            sampled = take
            row.extend(take)
            done += len(take)
            n_steps += 1
            n_draft += len(chain)
        steps.append(n_steps)
        drafted.append(n_draft)
        prop.propose([[]], [0], [row.buf])  # a step without this request: it left the batch
    return steps, drafted, spent


def replay_suffix(reqs: list[dict], depth: int = 24, factor: float = 1.0, min_prob: float = 0.1):
    import numpy as np
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
    steps, drafted, spent = [], [], 0.0
    for i, r in enumerate(reqs):
        out, ctx = r["output"], list(r["prompt"])
        cache.start_request(i, np.array(r["prompt"], dtype=np.int32))
        sampled = [out[0]]
        ctx += sampled
        done, n_steps, n_draft = 1, 0, 0
        while done < len(out):
            t0 = time.perf_counter()
            cache.add_active_response(i, sampled)
            draft = cache.speculate(i, np.array(ctx[-depth:], dtype=np.int32), max_spec_tokens=depth,
                                    max_spec_factor=factor, min_token_prob=min_prob).token_ids
            spent += time.perf_counter() - t0
            acc = 0
            while acc < len(draft) and done + acc < len(out) and draft[acc] == out[done + acc]:
                acc += 1
            sampled = out[done: done + acc + 1]
            ctx += sampled
            done += len(sampled)
            n_steps += 1
            n_draft += len(draft)
        cache.stop_request(i)
        steps.append(n_steps)
        drafted.append(n_draft)
    return steps, drafted, spent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="humaneval,spec-bench")
    ap.add_argument("--limit", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--outputs", default="runs/replay_outputs.json")
    ap.add_argument("--slopes", default="0.03,0.066")
    ap.add_argument("--step-ms", type=float, default=29.0, help="vLLM's one-token step (plain 34 tok/s here)")
    args = ap.parse_args()
    Path(args.outputs).parent.mkdir(parents=True, exist_ok=True)
    reqs = greedy_outputs(Path(args.outputs), args.dataset, args.limit, args.max_new_tokens)
    tokens = sum(len(r["output"]) for r in reqs)
    from goose.integrations.vllm import GooseProposer

    for slope in (float(s) for s in args.slopes.split(",")):
        rows = {}
        clock = Clock(slope, args.step_ms)
        for name, fn in (("suffix", lambda: replay_suffix(reqs)),
                         ("goose", lambda: replay_goose(reqs, lambda: GooseProposer(num_speculative_tokens=24,
                                                                                   clock=clock), clock))):
            steps, drafted, spent = fn()
            cost = sum(steps) + slope * sum(drafted)  # in one-token steps
            rows[name] = (sum(steps), sum(drafted), cost, spent)
        plain = tokens
        print(f"slope {slope}: {len(reqs)} requests, {tokens} tokens; plain = {plain} steps")
        for name, (st, dr, cost, spent) in rows.items():
            ms = cost * args.step_ms + spent * 1e3
            print(f"  {name:8s} steps {st:5d}  drafted {dr:6d}  cost {cost:8.1f} steps  "
                  f"proposer {spent * 1e3:7.1f} ms  "
                  f"speed-up vs plain {plain * args.step_ms / ms:5.2f}x")


class Clock:
    """A fake clock for GooseProposer's step-cost fit: each step takes step_ms * (1 + slope * T)."""

    def __init__(self, slope: float, step_ms: float) -> None:
        self.t, self.slope, self.step = 0.0, slope, step_ms / 1e3

    def __call__(self) -> float:
        return self.t


if __name__ == "__main__":
    main()
