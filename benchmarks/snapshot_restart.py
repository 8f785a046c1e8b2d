"""A restart with a memory snapshot: the first warm session's tau before and after.

A tenant's session (a few multi-turn chat prompts) runs twice on one engine (the second run drafts from the
suffix memory the first filled: "warm"); the memories are written to a snapshot, a new engine (a restarted
server) loads it and runs the session once more. Prints both warm taus (their ratio is the target: within 5%)
and checks every output equals the first run's (greedy, lossless).

    python benchmarks/snapshot_restart.py [--arith int8] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from goose import Engine, load_model
from goose.bench.questions import read_jsonl, spec_bench_file
from goose.config import EngineConfig, MemoryConfig
from goose.drafting.snapshot import read_snapshot, write_snapshot
from goose.server.snapshots import snapshot_identity


def session(engine, prompts, n):
    outs, forwards, tokens = [], 0, 0
    for p in prompts:
        r = engine.submit(p, n, chat=True, tenant="session").result()
        outs.append(r.token_ids)
        forwards += r.stats.forward_calls
        tokens += r.stats.new_tokens
    return outs, tokens / forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arith", default="int8")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=4)
    args = ap.parse_args()
    model, tok = load_model("smollm2-135m", arith=args.arith)
    prompts = [q.turns[0] for q in read_jsonl(spec_bench_file())[: args.prompts]]
    settings = EngineConfig(max_batch=1, prefix_cache_mb=0)
    with Engine(model, tok, "goose", engine_config=settings) as eng:
        cold, tau_cold = session(eng, prompts, args.max_new_tokens)
        warm, tau_warm = session(eng, prompts, args.max_new_tokens)
        tenants = eng.export_memories()
    identity = snapshot_identity(model, tok, MemoryConfig().min_match)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "memory.snap"
        size = write_snapshot(path, identity, tenants)
        with Engine(model, tok, "goose", engine_config=settings) as eng:
            eng.restore_memories(read_snapshot(path, identity, len(tok)))
            restored, tau_restored = session(eng, prompts, args.max_new_tokens)
    assert cold == warm == restored, "outputs differ (lossless violated)"
    print(f"snapshot {size:,} bytes; tau cold {tau_cold:.3f}, warm before restart {tau_warm:.3f}, "
          f"first warm session after restart {tau_restored:.3f} ({tau_restored / tau_warm:.3f}x)")


if __name__ == "__main__":
    main()
