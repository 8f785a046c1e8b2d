"""Two-turn Spec-Bench (MT-Bench) sessions, cold and warm: `goose` with the suffix memory, `goose` without it,
and `ar`, side by side in one process on the same model and token ids.

Each session answers a question's first turn, then its second turn with the first answer in the context
(the tokenizer's chat template). Pass 1 ("cold") starts every decoder's memory empty (the second turn can
draft from the first turn's prompt and answer, which the context holds too). Pass 2 ("warm") runs the same
sessions again: the memory holds pass 1's sessions, as for a user or agent who repeats a conversation. The
three decoders take turns request by request, so load on the machine affects all of them alike. Every output
of `goose` must equal `ar`'s.

    .venv/bin/python benchmarks/memory_sessions.py [--limit 1] [--max-new-tokens 96] [--sessions N] \
        [--data question.jsonl]
"""

from __future__ import annotations

import argparse
import time

from goose import load_model
from goose.bench import datasets
from goose.decoding import Decoder, encode_chat
from goose.machine import cpu_name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--limit", type=int, default=1, help="questions per MT-Bench category (8 categories)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--data", help="Spec-Bench's question.jsonl (default: the copy packaged with goose)")
    ap.add_argument("--sessions", type=int, default=None, help="only the first N sessions")
    args = ap.parse_args()
    model, tok = load_model(args.model)
    questions = [q for q in datasets.load(f"mt-bench:{args.data}" if args.data else "mt-bench", None, args.limit)
                 if len(q.turns) >= 2][: args.sessions]
    decoders = {"ar": Decoder(model, tok, "ar", memory_mb=0),
                "goose (no memory)": Decoder(model, tok, "goose", memory_mb=0),
                "goose (memory)": Decoder(model, tok, "goose")}
    print(f"{len(questions)} two-turn sessions, {args.max_new_tokens} new tokens a turn, {cpu_name()}", flush=True)
    for name in ("cold", "warm"):
        totals = {k: [0, 0, 0.0, 0, 0] for k in decoders}  # tokens, forwards, seconds, memory drafted, accepted
        for q in questions:
            history = {k: [] for k in decoders}
            outs = {}
            for turn in q.turns[:2]:
                for k, dec in decoders.items():
                    msgs = history[k] + [{"role": "user", "content": turn}]
                    ids = encode_chat(tok, msgs)
                    t = time.perf_counter()
                    out, st = dec.generate_ids(ids, dec_cfg(args.max_new_tokens))
                    dt = time.perf_counter() - t
                    tot = totals[k]
                    tot[0] += len(out)
                    tot[1] += st.forward_calls
                    tot[2] += dt
                    tot[3] += st.drafted["memory"]
                    tot[4] += st.accepted["memory"]
                    outs[k] = out
                    history[k] = msgs + [{"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)}]
                print(f"  {name} {q.question_id} turn done", flush=True)
                same = outs["goose (memory)"] == outs["goose (no memory)"] == outs["ar"]
                assert same, f"output differs on {q.question_id}"
        ar_rate = totals["ar"][0] / totals["ar"][2]
        for k, (n, calls, secs, drafted, accepted) in totals.items():
            rate = n / secs
            share = accepted / n if n else 0.0
            print(f"{name:4s}  {k:18s}  tau {n / calls:5.2f}  {rate:6.1f} tok/s  {rate / ar_rate:4.2f}x ar  "
                  f"memory drafted {drafted:5d} accepted {accepted:5d} ({share:.0%} of tokens)")


def dec_cfg(max_new: int):
    from goose.config import DecodeConfig

    return DecodeConfig(max_new_tokens=max_new)


if __name__ == "__main__":
    main()
