"""`goose replicas`: one replica against several behind vLLM's router, and the router's policies, on this machine.

Sessions (multi-turn chats: a Spec-Bench question, then follow-ups that carry the whole conversation so far,
each session its own tenant) run in parallel, one client thread per session, through `goose replicas` started
per configuration. Reports output tokens/s over the whole run, the prefix-cache hit rate of the follow-up
turns (prompt tokens copied from a replica's prefix cache / prompt tokens, from the replicas' /metrics), the same
for a replay (every session's last request sent again once all are done, as a client's retry), each replica's
share of the requests, and whether every answer equals the first configuration's (greedy).

    python benchmarks/replicas.py [--configs 1x2,2x1] [--policies consistent_hash,round_robin]
                                  [--sessions 8] [--turns 3] [--max-tokens 64] [--arith int8]

A configuration RxT is R replicas of T threads each (1x2: one replica on both cores; 2x1: two of one thread).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

from goose.bench.questions import read_jsonl, spec_bench_file

FOLLOW_UPS = ["Tell me more about that.", "Summarize your answer in two sentences.", "Give one more example.",
              "Why does that matter?"]


def call(port, path, body=None, headers=None, timeout=600):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST" if body is not None else "GET", path, json.dumps(body) if body is not None else None,
                  {"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def metric(port, name):
    data = call(port, "/metrics")[1].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in data.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def run_config(replicas, threads, policy, questions, turns, max_tokens, arith, port):
    cmd = [sys.executable, "-m", "goose", "replicas", "--replicas", str(replicas), "--threads", str(threads),
           "--port", str(port), "--policy", policy, "--", "--arith", arith, "--max-batch", "8"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    reps = [port + 1 + i for i in range(replicas)]
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if call(port, "/v1/models", timeout=5)[0] == 200 and all(call(r, "/health")[0] == 200
                                                                         for r in reps):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"goose replicas ({replicas}x{threads}) did not start")
            time.sleep(0.5)
        answers: dict[int, list[str]] = {}
        last: dict[int, list] = {}
        tokens = [0]
        lock = threading.Lock()
        barrier = threading.Barrier(len(questions) + 1)

        def session(i, q):
            msgs, outs = [], []
            for t in range(turns):
                msgs.append({"role": "user", "content": q if t == 0 else FOLLOW_UPS[(t - 1) % len(FOLLOW_UPS)]})
                last[i] = list(msgs)
                status, data = call(port, "/v1/chat/completions",
                                    {"model": "smollm2-135m", "messages": msgs, "max_tokens": max_tokens,
                                     "temperature": 0, "user": f"session-{i}"}, {"X-Session-ID": f"session-{i}"})
                assert status == 200, data[:300]
                d = json.loads(data)
                text = d["choices"][0]["message"]["content"]
                msgs.append({"role": "assistant", "content": text})
                outs.append(text)
                with lock:
                    tokens[0] += d["usage"]["completion_tokens"]
                if t == 0:
                    barrier.wait()  # every session's first turn done: the follow-ups' hit rate is measured alone
            answers[i] = outs

        workers = [threading.Thread(target=session, args=(i, q)) for i, q in enumerate(questions)]
        t0 = time.monotonic()
        for w in workers:
            w.start()
        barrier.wait()
        after_first = {"prompt": [metric(r, "goose_prompt_tokens_total") for r in reps],
                       "cached": [metric(r, "goose_prompt_tokens_cached_total") for r in reps]}
        for w in workers:
            w.join()
        wall = time.monotonic() - t0
        prompt = sum(metric(r, "goose_prompt_tokens_total") for r in reps) - sum(after_first["prompt"])
        cached = sum(metric(r, "goose_prompt_tokens_cached_total") for r in reps) - sum(after_first["cached"])
        p0 = sum(metric(r, "goose_prompt_tokens_total") for r in reps)
        c0 = sum(metric(r, "goose_prompt_tokens_cached_total") for r in reps)
        for i in range(len(questions)):  # the replay: each session's last request again
            status, data = call(port, "/v1/chat/completions",
                                {"model": "smollm2-135m", "messages": last[i], "max_tokens": max_tokens,
                                 "temperature": 0, "user": f"session-{i}"}, {"X-Session-ID": f"session-{i}"})
            assert status == 200 and json.loads(data)["choices"][0]["message"]["content"] == answers[i][-1]
        replay = (sum(metric(r, "goose_prompt_tokens_cached_total") for r in reps) - c0) / max(
            1, sum(metric(r, "goose_prompt_tokens_total") for r in reps) - p0)
        share = [metric(r, "goose_requests_total") for r in reps]
        return {"tokens_per_s": tokens[0] / wall, "tokens": tokens[0], "wall_s": wall,
                "hit_rate": cached / max(1, prompt), "replay_hit_rate": replay,
                "share": "/".join(f"{x / sum(share):.0%}" for x in share),
                "answers": [answers[i] for i in range(len(questions))]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="1x2,2x1")
    ap.add_argument("--policies", default="consistent_hash,round_robin")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--arith", default="int8")
    ap.add_argument("--port", type=int, default=8600)
    args = ap.parse_args()
    qs = read_jsonl(spec_bench_file())
    picked, seen = [], set()
    for q in qs:  # one question of each category first, then the rest in order
        if q.category not in seen:
            seen.add(q.category)
            picked.append(q.turns[0])
    picked += [q.turns[0] for q in qs if q.turns[0] not in picked]
    questions = picked[: args.sessions]
    rows, first = [], None
    for conf in args.configs.split(","):
        r, t = (int(x) for x in conf.split("x"))
        for policy in args.policies.split(",") if r > 1 else ["consistent_hash"]:
            res = run_config(r, t, policy, questions, args.turns, args.max_tokens, args.arith, args.port)
            first = first or res["answers"]
            rows.append((conf, policy, res, res["answers"] == first))
            print(f"{conf} {policy}: {res['tokens_per_s']:.1f} tok/s, hit rate {res['hit_rate']:.3f}, replay "
                  f"{res['replay_hit_rate']:.3f}, requests {res['share']}, same answers {rows[-1][3]}", flush=True)
    print(f"\n{args.sessions} sessions x {args.turns} turns, {args.max_tokens} tokens, arith {args.arith}, "
          f"{os.cpu_count()} CPUs\n")
    print("| replicas x threads | policy | output tokens/s | vs 1 replica | prefix-cache hit rate, follow-ups | "
          "replays | requests per replica | answers = first |")
    print("|---|---|---|---|---|---|---|---|")
    base = rows[0][2]["tokens_per_s"]
    for conf, policy, res, same in rows:
        print(f"| {conf} | {policy} | {res['tokens_per_s']:.1f} | {res['tokens_per_s'] / base:.2f}x | "
              f"{res['hit_rate']:.1%} | {res['replay_hit_rate']:.1%} | {res['share']} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
