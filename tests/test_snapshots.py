"""Memory snapshots (`goose.drafting.snapshot`, `goose serve --memory-snapshot`): a snapshot restores the same
tenants and sequences, is written atomically, and a damaged or foreign one is refused in one line naming the
file, never loaded; a server loads one at start-up and writes one on shutdown, and a restored engine drafts from
it with outputs still equal to greedy decoding."""

from __future__ import annotations

import json
import random
from array import array

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
                status = _settled_status(base)
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


def _settled_status(base: str) -> str:
    """/health's memory_snapshot once the start-up load (a background task) has ended."""
    import time

    from serving import raw

    deadline = time.monotonic() + 30
    while True:
        status = json.loads(raw(base, "GET", "/health")[2])["memory_snapshot"]
        if not status.startswith(("not loaded", "loading")) or time.monotonic() > deadline:
            return status
        time.sleep(0.02)


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


def test_a_snapshot_is_private_and_a_shared_or_foreign_one_is_refused(tmp_path):
    """The file is 0600 and missing folders 0700 whatever the umask; a snapshot others may write, one another
    user owns, a link, and a folder others may write (without the sticky bit) are refused in one line."""
    import os

    old = os.umask(0o000)
    try:
        path = tmp_path / "new" / "deeper" / "mem.snap"
        write_snapshot(path, IDENTITY, _pool(3).export())
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700 == path.parent.stat().st_mode & 0o777
    assert len(read_snapshot(path, IDENTITY, 128)) > 0
    path.chmod(0o666)
    with pytest.raises(GooseError, match="group or others may write it") as err:
        read_snapshot(path, IDENTITY, 128)
    assert "\n" not in str(err.value)
    with pytest.raises(GooseError, match="group or others may write it"):
        write_snapshot(path, IDENTITY, [])
    path.chmod(0o600)
    if os.getuid() == 0:  # (root can hand the file to another user)
        os.chown(path, 12345, 12345)
        with pytest.raises(GooseError, match="owned by uid 12345"):
            read_snapshot(path, IDENTITY, 128)
        os.chown(path, 0, 0)
    link = tmp_path / "link.snap"
    link.symlink_to(path)
    with pytest.raises(GooseError, match="symbolic link"):
        read_snapshot(link, IDENTITY, 128)
    path.parent.chmod(0o777)
    with pytest.raises(GooseError, match="others may write it"):
        read_snapshot(path, IDENTITY, 128)
    path.parent.chmod(0o1777)  # sticky, as /tmp: nobody else can replace our file there
    assert len(read_snapshot(path, IDENTITY, 128)) > 0


@pytest.mark.parametrize("field, value", [
    ("tokens_bytes", "1e999"), ("tokens_bytes", "Infinity"), ("tokens_bytes", "-4"), ("tokens_bytes", '"12"'),
    ("tokens_bytes", "1.5"), ("tokens_bytes", "true"), ("tokens_bytes", "null"), ("tokens_bytes", "9" * 5000),
    ("tokens_sha256", "12"), ("tokens_sha256", "[]"), ("identity", '"x"'), ("identity", "1e999"),
    ("tenants", '{"a":1}'), ("tenants", '[["a",[-1]]]'), ("tenants", '[["a",[1e999]]]'), ("tenants", '[[1,[4]]]'),
    ("tenants", '[["a"]]'), ("tenants", '[["a",[4],5]]'), ("tenants", '[["a",4]]'), ("tenants", '"' + "a" * 999 + '"'),
])
def test_every_header_field_damaged_is_refused_in_one_line(tmp_path, field, value):
    """Huge, negative, wrong-typed or malformed header values (each field) are a one-line GooseError, never
    another exception (OverflowError used to escape and stop the server from starting)."""
    path = tmp_path / "mem.snap"
    write_snapshot(path, IDENTITY, _pool(4).export())
    data = path.read_bytes()
    head, tokens = data[len(MAGIC):].split(b"\n", 1)
    header = json.loads(head)
    text = json.dumps({k: ("@@" if k == field else v) for k, v in header.items()}).replace('"@@"', value)
    path.write_bytes(MAGIC + text.encode() + b"\n" + tokens)
    with pytest.raises(GooseError) as err:
        read_snapshot(path, IDENTITY, 128)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("cut", [len(MAGIC) - 3, len(MAGIC) + 5, -1])
def test_a_truncated_snapshot_is_refused(tmp_path, cut):
    path = tmp_path / "mem.snap"
    write_snapshot(path, IDENTITY, _pool(5).export())
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut > 0 else data[: data.index(b"\n", len(MAGIC)) - 10])
    with pytest.raises(GooseError, match="refused"):
        read_snapshot(path, IDENTITY, 128)


def test_a_write_killed_at_any_point_leaves_the_old_snapshot_whole(tmp_path):
    """A writer killed at random points of its writes (SIGKILL) never leaves a partial snapshot: each read
    after a kill gives one of the snapshots written whole."""
    import os
    import signal
    import time

    path = tmp_path / "mem.snap"
    pools = [_pool(10 + i).export() for i in range(3)]
    write_snapshot(path, IDENTITY, pools[0])
    wanted = [MemoryPool(1 << 20, MemoryConfig(), 8) for _ in pools]
    for w, p in zip(wanted, pools):
        w.restore([(n, [memoryview(b).cast("i").tolist() for b in seqs]) for n, seqs in p])
    rng = random.Random(0)
    for _ in range(100):
        pid = os.fork()
        if pid == 0:  # the child writes snapshots until it is killed
            try:
                while True:
                    for p in pools:
                        write_snapshot(path, IDENTITY, p)
            finally:
                os._exit(0)
        time.sleep(rng.uniform(0.0, 0.02))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        got = MemoryPool(1 << 20, MemoryConfig(), 8)
        got.restore(read_snapshot(path, IDENTITY, 128))
        assert any(got.export() == w.export() for w in wanted)


def _served_snapshots(worded, path):
    from goose.server.snapshots import MemorySnapshots, snapshot_identity

    model, tok = worded
    return MemorySnapshots(path, snapshot_identity(model, tok, MemoryConfig().min_match), len(tok))


def test_a_server_starts_on_any_damaged_header_and_health_names_it(worded, tmp_path):
    """A header number too large for an integer (`1e999`) used to raise OverflowError out of the lifespan: the
    server never started. Now it starts empty and /health says the file is refused."""
    from serving import live_server

    model, tok = worded
    path = tmp_path / "serve.snap"
    snaps = _served_snapshots(worded, path)
    write_snapshot(path, snaps.identity, [("x", [b"\x01\x00\x00\x00" * 8])])
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"tokens_bytes":32', b'"tokens_bytes":1e999', 1))
    eng = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
    try:
        with live_server(eng, snapshots=snaps) as base:
            status = _settled_status(base)
    finally:
        eng.close(timeout=10, cancel=True)
    assert "is refused" in status and "tokens_bytes" in status and "starting with empty memories" in status
    assert path.read_bytes() != data  # (the shutdown's save replaced it with the live, empty memories)


def test_two_servers_on_one_snapshot_path_the_second_neither_loads_nor_saves(worded, tmp_path):
    """The first server holds the file's lock for its lifetime; a second one on the same path starts with
    empty memories, says so in /health, and never overwrites the first one's snapshot; stale temporaries of
    an earlier writer are removed."""
    from serving import live_server, raw

    model, tok = worded
    path = tmp_path / "serve.snap"
    stale = tmp_path / ".serve.snap.tmp-999999-abcd"
    stale.write_bytes(b"half")
    first_snaps, second_snaps = _served_snapshots(worded, path), _served_snapshots(worded, path)
    a = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
    b = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
    body = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 16, "temperature": 0}
    try:
        with live_server(a, snapshots=first_snaps) as first:
            _settled_status(first)
            assert not stale.exists()
            with live_server(b, snapshots=second_snaps) as second:
                assert "in use by another server" in _settled_status(second)
                assert raw(second, "POST", "/v1/completions", {**body, "user": "bob"})[0] == 200
            assert not path.exists()  # the second server wrote nothing on its shutdown
            assert raw(first, "POST", "/v1/completions", {**body, "user": "ann"})[0] == 200
    finally:
        a.close(timeout=10, cancel=True)
        b.close(timeout=10, cancel=True)
    assert [name for name, _ in read_snapshot(path, first_snaps.identity, len(tok))] == [
        hashlib_tenant("ann")]


def hashlib_tenant(user: str) -> str:
    from goose.server.app import tenant_of

    return tenant_of(None, user, None)


def test_an_engine_restart_keeps_every_memory_and_the_shutdown_too(worded, tmp_path):
    """A failed engine's memories go to the snapshot and into the engine that replaces it (loaded while it
    already serves, as the oldest memories); the shutdown's save holds both engines' requests. `save(force=True)`
    writes an engine it has not seen (it used to load instead)."""
    from serving import live_server, raw
    from test_server_faults import Fault, fail_next_step, wait_for

    model, tok = worded
    path = tmp_path / "serve.snap"
    snaps = _served_snapshots(worded, path)
    built: list = []

    def restart():
        built.append(Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2)))
        return built[-1]

    eng = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
    body = {"model": "tiny", "prompt": "one two three four five six", "max_tokens": 16, "temperature": 0}
    try:
        with live_server(eng, snapshots=snaps, restart=restart) as base:
            _settled_status(base)
            assert raw(base, "POST", "/v1/completions", {**body, "user": "ann"})[0] == 200
            fault = Fault()
            fail_next_step(eng, fault)
            raw(base, "POST", "/v1/completions", {**body, "user": "zed"})  # (fails with the engine)
            wait_for(lambda: raw(base, "GET", "/health")[0] == 200 and built, what="the restarted engine")
            wait_for(lambda: built[0].memory_report.tenants == 1, what="the carried memories")
            assert built[0].export_memories(timeout=30) == eng.export_memories()
            assert raw(base, "POST", "/v1/completions", {**body, "user": "bob"})[0] == 200
    finally:
        eng.close(timeout=10, cancel=True)
        for e in built:
            e.close(timeout=10, cancel=True)
    names = [name for name, _ in read_snapshot(path, snaps.identity, len(tok))]
    assert names == [hashlib_tenant("ann"), hashlib_tenant("bob")]
    other = Engine(model, tok, "goose", engine_config=EngineConfig(max_batch=2))
    try:
        assert snaps.save(other, force=True) and read_snapshot(path, snaps.identity, len(tok)) == []
    finally:
        other.close(timeout=10)


def test_a_late_restore_keeps_what_the_live_pool_learned_as_the_newest(model):
    """`Engine.restore_memories` on an engine that already holds memories: the restored sequences come first
    (oldest), the live ones after them, in their order."""
    with Engine(model, None, "goose", engine_config=EngineConfig(max_batch=1, memory_mb=4)) as eng:
        eng.submit([5, 9, 17, 33, 60, 61, 62], 8, tenant="live").result(timeout=60)
        live = eng.export_memories(timeout=30)
        old = [("old", [list(range(10, 30))]), ("live", [list(range(40, 60))])]
        eng.restore_memories(old, timeout=30)
        got = eng.export_memories(timeout=30)
    as_bytes = [(n, [array("i", s).tobytes() for s in seqs]) for n, seqs in old]
    assert got == [as_bytes[0], ("live", as_bytes[1][1] + live[0][1])]


def test_float32_and_bfloat16_replicas_share_a_snapshot(worded):
    """A snapshot holds token ids: a bfloat16 copy of the same weights has the same identity (the output head's
    digest compared exactly used to refuse it); another model's weights do not."""
    import copy

    import torch

    from goose.server.snapshots import snapshot_identity

    model, tok = worded
    half = copy.deepcopy(model).to(torch.bfloat16)
    assert snapshot_identity(half, tok, 3) == snapshot_identity(model, tok, 3)
    other = make_tiny_llama(torch.float32, vocab=len(tok), seed=99)
    assert snapshot_identity(other, tok, 3) != snapshot_identity(model, tok, 3)
