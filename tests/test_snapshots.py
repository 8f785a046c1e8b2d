"""Memory snapshots (`goose.drafting.snapshot`, `goose serve --memory-snapshot`): a snapshot restores the same
tenants and sequences, is written atomically, and a damaged or foreign one is refused in one line naming the
file, never loaded; a server loads one at start-up and writes one on shutdown, and a restored engine drafts from
it with outputs still equal to greedy decoding."""

from __future__ import annotations

import json
import random

import pytest

from conftest import greedy_memo, make_tiny_llama
from goose import Engine
from goose.config import EngineConfig, MemoryConfig
from goose.drafting.memory import MemoryPool
from goose.drafting.snapshot import MAGIC, read_snapshot, write_snapshot
from goose.errors import GooseError

IDENTITY = {"model": {"vocab_size": 128, "lm_head_digest": 12.5}, "tokenizer": "abc", "min_match": 3}


def _pool(seed: int = 0) -> MemoryPool:
    rng = random.Random(seed)
    pool = MemoryPool(1 << 20, MemoryConfig(), max_tenants=8)
    for _ in range(12):
        tenant = rng.choice(["", "alice", "bob", "ünïcode"])
        pool.insert(tenant, [rng.randrange(128) for _ in range(rng.randint(5, 40))])
    return pool


def test_a_snapshot_restores_the_same_tenants_and_sequences_in_order(tmp_path):
    pool = _pool()
    path = tmp_path / "mem.snap"
    write_snapshot(path, IDENTITY, pool.export())
    again = MemoryPool(1 << 20, MemoryConfig(), max_tenants=8)
    again.restore(read_snapshot(path, IDENTITY, 128))
    assert again.export() == pool.export() and again.tenant_bytes() == pool.tenant_bytes()
    write_snapshot(path, IDENTITY, [])  # replaced whole; no temporary file left beside it
    assert read_snapshot(path, IDENTITY, 128) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.snap", "mem.snap.lock"]


@pytest.mark.parametrize("damage, why", [
    (lambda d: d[:-3], "damaged"),  # truncated
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "damaged"),  # a flipped bit in the tokens
    (lambda d: b"PK\x03\x04" + d[4:], "not a goose memory snapshot"),
    (lambda d: d.replace(b'"tenants"', b'"tenantz"', 1), "header is damaged"),
    (lambda d: d.replace(b'"min_match":3', b'"min_match":4', 1), "another model or setting: min_match 4 vs 3"),
    (lambda d: d.replace(b'"tokenizer":"abc"', b'"tokenizer":"xyz"', 1), "tokenizer 'xyz' vs 'abc'"),
])
def test_a_damaged_or_foreign_snapshot_is_refused_in_one_line(tmp_path, damage, why):
    path = tmp_path / "mem.snap"
    write_snapshot(path, IDENTITY, _pool(1).export())
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(GooseError, match=why) as err:
        read_snapshot(path, IDENTITY, 128)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_tokens_outside_the_vocabulary_and_missing_files_are_refused(tmp_path):
    path = tmp_path / "mem.snap"
    write_snapshot(path, IDENTITY, _pool(2).export())
    with pytest.raises(GooseError, match="outside the vocabulary of 50"):
        read_snapshot(path, IDENTITY, 50)
    with pytest.raises(GooseError, match="cannot read the memory snapshot"):
        read_snapshot(tmp_path / "none.snap", IDENTITY, 128)
    header = json.loads(path.read_bytes()[len(MAGIC):].split(b"\n", 1)[0])
    assert header["identity"] == IDENTITY and header["tokens_bytes"] % 4 == 0


@pytest.fixture(scope="module")
def model():
    import torch

    return make_tiny_llama(torch.float32, seed=7)


def test_a_restored_engine_drafts_from_the_snapshot_and_stays_lossless(model, tmp_path):
    """An engine's memories exported between steps (its own thread running) and restored into a new engine:
    the same content, the restored one accepts memory drafts at once, and every output equals greedy."""
    prompt = [5, 9, 17, 33, 60, 61, 62, 63, 9, 17]
    settings = EngineConfig(max_batch=2, memory_mb=4)
    with Engine(model, None, "goose", engine_config=settings) as first:
        out = first.submit(prompt, 40, tenant="t1").result(timeout=60)
        assert out.token_ids == greedy_memo(model, prompt, 40)
        exported = first.export_memories(timeout=30)
    assert [name for name, _ in exported] == ["t1"]
    write_snapshot(tmp_path / "m.snap", IDENTITY, exported)
    tenants = read_snapshot(tmp_path / "m.snap", IDENTITY, 128)
    with Engine(model, None, "goose", engine_config=settings) as second:
        second.restore_memories(tenants, timeout=30)
        assert second.export_memories(timeout=30) == exported and second.memory_report.tenants == 1
        again = second.submit(prompt, 40, tenant="t1").result(timeout=60)
        other = second.submit(prompt, 40, tenant="t2").result(timeout=60)  # another tenant: none of it
    assert again.token_ids == other.token_ids == out.token_ids
    assert again.stats.accepted["memory"] > 0 and other.stats.accepted["memory"] == 0


def test_goose_serve_writes_a_snapshot_on_shutdown_and_loads_it(worded, tmp_path):
    from goose.server.snapshots import MemorySnapshots, snapshot_identity
    from serving import live_server, raw

    model, tok = worded
    identity = snapshot_identity(model, tok, MemoryConfig().min_match)
    path = tmp_path / "serve.snap"

    def served(body):
        eng = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
        snaps = MemorySnapshots(path, identity, len(tok))
        try:
            with live_server(eng, snapshots=snaps) as base:
                status = json.loads(raw(base, "GET", "/health")[2])["memory_snapshot"]
                if body is not None:
                    assert raw(base, "POST", "/v1/completions", body)[0] == 200
        finally:
            eng.close(timeout=10, cancel=True)
        return status, snaps.status

    body = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 16, "temperature": 0,
            "user": "carol"}
    at_start, at_end = served(body)
    assert at_start.startswith("no snapshot") and at_end.startswith("wrote 1 tenants")
    at_start, _ = served(None)
    assert at_start == f"loaded 1 tenants from {path}"
    path.write_bytes(path.read_bytes()[:-2])  # damaged: refused, the server starts empty
    at_start, _ = served(None)
    assert "is refused" in at_start and "starting with empty memories" in at_start
    foreign = MemorySnapshots(path, {**identity, "min_match": 99}, len(tok))
    write_snapshot(path, foreign.identity, [("x", [b"\x01\x00\x00\x00" * 8])])
    at_start, _ = served(None)
    assert "made for another model or setting: min_match 99" in at_start


def test_engine_call_runs_on_the_loops_thread_and_after_it_on_the_callers(model):
    """`Engine.call`: on the engine's own thread while its loop runs (results and exceptions come back), on the
    calling thread once the engine is closed; with thread=False, on the caller's thread."""
    import threading

    with Engine(model, None, "ar", engine_config=EngineConfig(max_batch=1)) as eng:
        assert eng.call(lambda: threading.current_thread().name, timeout=30) == "goose-engine"
        with pytest.raises(ZeroDivisionError):
            eng.call(lambda: 1 / 0, timeout=30)
    assert eng.call(lambda: threading.current_thread().name) == threading.current_thread().name
    with Engine(model, None, "ar", thread=False) as eng:
        assert eng.call(lambda: threading.current_thread()) is threading.current_thread()
