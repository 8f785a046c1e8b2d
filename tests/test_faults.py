"""Fault injection: ``kill -9`` at random moments of every cache write (GGUF dequantization, datastore build,
cost-curve measurement, kernel build) and of a bench run, then a rerun. The rerun must succeed and nothing
half-written may ever be used. Also: two processes racing on an empty cache, GGUF copies keyed by content,
and damaged stores refused in one line. (docs/reliability.md has the table of faults and outcomes.)

The kill moments are drawn from a seeded generator (``GOOSE_FAULT_SEED``, default 17) over the operation's
duration, so a failure can be replayed; each assertion message names the moment.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fault_child import CharTokenizer
from goose import cachefs
from goose.errors import GooseError
from tiny_gguf import write_tiny_gguf

CHILD = Path(__file__).with_name("fault_child.py")
RNG = random.Random(int(os.environ.get("GOOSE_FAULT_SEED", "17")))
KILLS = 2  # kill moments per operation


def child_env(cache: Path, kernel: bool = False) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    if not kernel:
        env["GOOSE_CPU_KERNEL"] = "0"  # only the kernel test builds the kernel in a fresh cache
    return env


def spawn(args: list[str], cache: Path, kernel: bool = False) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(CHILD), *args], env=child_env(cache, kernel), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_ready(p: subprocess.Popen, timeout: float = 180) -> None:
    """Wait for the child's ``ready`` line (its imports are done and the operation starts now)."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if line.strip() != "ready":
        p.kill()
        raise AssertionError(f"child did not start: {line!r} {p.stderr.read()[-2000:]}")


def kill_after(p: subprocess.Popen, delay: float) -> bool:
    """SIGKILL the child's whole process group `delay` seconds from now; True if it had finished before."""
    time.sleep(delay)
    finished = p.poll() is not None
    if not finished:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    p.stdout.close()
    p.stderr.close()
    return finished and p.returncode == 0


def finish(p: subprocess.Popen, timeout: float = 300) -> str:
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return out


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if cachefs.TMP_TAG in p.name) if folder.is_dir() else []


def moments(duration: float, n: int = KILLS) -> list[float]:
    """Kill moments spread over the operation: one draw in each of n equal slices of its duration."""
    return [round((i + RNG.random()) * duration / n, 3) for i in range(n)]


# ---- GGUF dequantization ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def raced(gguf_file, tmp_path_factory) -> dict:
    """Two processes load the same GGUF at once on an empty cache."""
    cache = tmp_path_factory.mktemp("race-cache")
    procs = [spawn(["dequantize", str(gguf_file)], cache) for _ in range(2)]
    outs = [finish(p).split("\n") for p in procs]
    dirs = {o[1] for o in outs}
    seconds = max(float(o[2].split()[1]) for o in outs)
    return {"cache": cache, "dirs": dirs, "seconds": seconds}


def weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_two_first_loads_on_an_empty_cache_both_succeed(raced, gguf_file):
    assert len(raced["dirs"]) == 1
    target = Path(raced["dirs"].pop())
    raced["dirs"].add(str(target))
    models = raced["cache"] / "goose" / "models"
    assert temps(models) == []
    assert [p.name for p in models.iterdir() if p.is_dir()] == [target.name]
    record = json.loads((target / "goose-source.json").read_text())
    assert record["gguf"] == str(gguf_file) and record["bytes"] == gguf_file.stat().st_size
    assert target.name == f"tiny-{record['sha256'][:16]}"
    assert weights(target)


def test_kill_during_dequantization_then_rerun(raced, gguf_file, tmp_path, monkeypatch):
    from goose.loading.model import _complete, model_dir

    reference = weights(Path(next(iter(raced["dirs"]))))
    cache = tmp_path / "cache"
    models = cache / "goose" / "models"
    for delay in moments(raced["seconds"] * 1.1):
        p = spawn(["dequantize", str(gguf_file)], cache)
        wait_ready(p)
        kill_after(p, delay)
        entries = models.iterdir() if models.is_dir() else []
        for d in (x for x in entries if x.is_dir() and cachefs.TMP_TAG not in x.name):
            assert _complete(d), f"killed at {delay}s: incomplete model folder {d.name} in place"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    got = weights(model_dir(str(gguf_file)))
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)
    assert temps(models) == [], "the rerun removes the temporaries of killed runs"


def test_gguf_copies_are_keyed_by_content(tmp_path, monkeypatch):
    """Same file name and size, other weights: another copy; a file rewritten in place: hashed again."""
    from goose.loading import digest
    from goose.loading import model as gm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    a = write_tiny_gguf(tmp_path / "a" / "tiny.gguf", seed=1)
    b = write_tiny_gguf(tmp_path / "b" / "tiny.gguf", seed=2)
    assert a.stat().st_size == b.stat().st_size and a.name == b.name
    da, db = gm.model_dir(str(a)), gm.model_dir(str(b))
    assert da != db
    wa, wb = weights(da), weights(db)
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])

    calls = []  # the GGUF hashed ("hashing ... to name its cached copy")
    monkeypatch.setattr(digest, "note", lambda msg: calls.append(1) if msg.startswith("hashing") else None)
    assert gm.model_dir(str(a)) == da and calls == []  # remembered: not hashed again
    time.sleep(0.01)
    write_tiny_gguf(a, seed=2)  # same path and size, new content (and mtime)
    assert gm.model_dir(str(a)) == db and calls == [1]  # b's content: b's copy
    memo = json.loads((tmp_path / "cache" / "goose" / "models" / gm.HASH_MEMO).read_text())
    assert sum(k.startswith(f"{a}|") for k in memo) == 1  # the old entry of that path is dropped


@pytest.mark.parametrize("damage", ["torn-config", "flipped-weight"])
def test_damaged_model_copy_is_rebuilt(raced, gguf_file, tmp_path, monkeypatch, damage):
    """A copy damaged from outside (config.json torn, one byte of the weights flipped: the file still parses)
    is never used: it is dequantized again."""
    import shutil

    from goose.loading.model import model_dir

    reference = weights(Path(next(iter(raced["dirs"]))))
    cache = tmp_path / "cache"
    shutil.copytree(raced["cache"], cache)
    target = cache / "goose" / "models" / Path(next(iter(raced["dirs"]))).name
    if damage == "torn-config":
        (target / "config.json").write_text('{"model_type": "lla')
    else:
        (tensors,) = target.glob("*.safetensors")
        data = bytearray(tensors.read_bytes())
        data[-100] ^= 0x40  # inside the last tensor's values
        tensors.write_bytes(bytes(data))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    assert model_dir(str(gguf_file)) == target
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    got = weights(target)
    assert got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got)


# ---- datastore ----------------------------------------------------------------------------------------------

def corpus_dir(path: Path, seed: int, files: int = 300) -> Path:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "def", "return", "x", "print", "if", "else", "for", "in", "range"]
    path.mkdir()
    for i in range(files):
        (path / f"f{i}.py").write_text(" ".join(rng.choice(words) for _ in range(300)))
    return path


def same_store(a, b) -> bool:
    return np.array_equal(a.tokens, b.tokens) and np.array_equal(a.sa, b.sa)


def test_kill_during_datastore_build_then_rerun(tmp_path):
    from goose.drafting import datastore

    src_old, src_new = corpus_dir(tmp_path / "old", 1), corpus_dir(tmp_path / "new", 2)
    ref_new = datastore.build(CharTokenizer(), [str(src_new)], "ref", path=tmp_path / "ref")
    where = tmp_path / "stores" / "faults"
    t0 = time.perf_counter()
    old = datastore.build(CharTokenizer(), [str(src_old)], "faults", path=where)
    seconds = time.perf_counter() - t0
    for delay in moments(seconds * 1.2, 3):  # a rebuild from another source, killed
        p = spawn(["datastore", str(src_new), str(where)], tmp_path / "cache")
        wait_ready(p)
        finished = kill_after(p, delay)
        got = datastore.load("faults", where)  # never a mix: the old store or the new one, whole
        assert same_store(got, old) or same_store(got, ref_new), f"killed at {delay}s (finished: {finished})"
        old = got
    # killed first builds: no store at all, or a whole one
    empty = tmp_path / "stores2" / "faults"
    for delay in moments(seconds, 1):
        p = spawn(["datastore", str(src_new), str(empty)], tmp_path / "cache")
        wait_ready(p)
        kill_after(p, delay)
        try:
            assert same_store(datastore.load("faults", empty), ref_new), f"killed at {delay}s"
        except GooseError as exc:
            assert "no datastore" in str(exc), f"killed at {delay}s: {exc}"
    again = datastore.build(CharTokenizer(), [str(src_new)], "faults", path=where)
    assert same_store(again, ref_new) and temps(where.parent) == []


@pytest.fixture()
def saved_store(tmp_path, monkeypatch):
    from goose.drafting import datastore

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = datastore.from_token_ids([[3, 4, 5, 6], [7, 8, 9]], {"name": "bad"})
    datastore.save(store, datastore.store_dir("bad"))
    return datastore.store_dir("bad")


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 8])


def _flip_sa(p: Path) -> None:
    np.save(p, np.arange(3, dtype=np.int32))


@pytest.mark.parametrize("damage, needle", [
    (lambda d: _truncate(d / "tokens.npy"), "tokens.npy holds"),
    (lambda d: (d / "meta.json").write_text("{not json"), "meta.json is not valid JSON"),
    (lambda d: (d / "meta.json").write_bytes(b"\xff\xfe\x00"), "meta.json is not valid JSON"),
    (lambda d: (d / "meta.json").write_text("[]"), "not a JSON object"),
    (lambda d: _flip_sa(d / "sa.npy"), "sa.npy holds"),
    (lambda d: (d / "sa.npy").write_bytes(b"garbage"), "sa.npy holds"),
])
def test_damaged_datastore_is_refused_in_one_line(saved_store, damage, needle, capsys):
    from goose.cli import main

    damage(saved_store)
    code = main(["datastore", "info", "--name", "bad"])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "is damaged" in err and err.count("\n") == 1, err


def test_store_without_digest_is_refused_with_the_rebuild_command(saved_store):
    """Stores written before digests were kept (no ``goose-digest.json``; the oldest, no sizes in meta.json
    either) are refused in one line that says how to rebuild them."""
    from goose.drafting import datastore

    meta = json.loads((saved_store / "meta.json").read_text())
    del meta["files"]
    (saved_store / "meta.json").write_text(json.dumps(meta))
    (saved_store / cachefs.MANIFEST).unlink()
    with pytest.raises(GooseError, match=r"is damaged \(it has no digest.*rebuild it with: goose datastore build"):
        datastore.load("bad", saved_store)


def test_rebuild_keeps_a_mapped_store_readable(saved_store):
    """A decoder that has a store memory-mapped keeps reading the old arrays while it is rebuilt."""
    from goose.drafting import datastore

    before = datastore.load("bad", saved_store)
    tokens = before.tokens.copy()
    datastore.save(datastore.from_token_ids([[1, 2]] * 50, {"name": "bad"}), saved_store)
    assert np.array_equal(before.tokens, tokens)
    assert len(datastore.load("bad", saved_store)) == 150


# ---- cost curve ---------------------------------------------------------------------------------------------

def test_kill_during_cost_curve_measurement_then_rerun(tmp_path, monkeypatch):
    from conftest import make_tiny_llama
    from goose.decoding import default_forward
    from goose.engine import measure as costmodel
    from goose.engine.measure import load_or_measure
    from goose.selection.costmodel import CostCurve

    monkeypatch.setattr(costmodel, "MAX_SPREAD", float("inf"))  # cached even when the machine is busy
    curve_file = tmp_path / "cost" / "tiny.json"
    model = make_tiny_llama(dtype=torch.float32)
    fwd = default_forward(model)
    t0 = time.perf_counter()
    load_or_measure(model, fwd, path=tmp_path / "timing.json")
    seconds = time.perf_counter() - t0
    for delay in moments(seconds * 1.5):
        p = spawn(["costcurve", str(curve_file)], tmp_path / "cache")
        wait_ready(p)
        kill_after(p, delay)
        if curve_file.exists():  # whole or absent
            CostCurve.from_json(json.loads(curve_file.read_text()))
    curve_file.parent.mkdir(parents=True, exist_ok=True)
    curve_file.write_text('{"sizes": [1, 2], "ms": [1.0')  # torn by something else: measured again
    curve = load_or_measure(model, fwd, path=curve_file)
    assert CostCurve.from_json(json.loads(curve_file.read_text())) == curve
    assert temps(curve_file.parent) == []


# ---- kernel build -------------------------------------------------------------------------------------------

def test_kill_during_kernel_build_then_rerun(tmp_path):
    import ctypes

    from goose.backends import cpukernel

    if cpukernel.unavailable_reason() is not None:
        pytest.skip(f"goose's kernel is not available here: {cpukernel.unavailable_reason()}")
    cache = tmp_path / "cache"
    kernels = cache / "goose" / "kernels"
    for delay in moments(3.0):
        p = spawn(["kernel"], cache, kernel=True)
        wait_ready(p)
        kill_after(p, delay)
        for so in kernels.glob("cpu_kernels-*.so") if kernels.is_dir() else []:
            assert ctypes.CDLL(str(so)).goose_kernels_abi() == cpukernel.ABI, f"killed at {delay}s"
    finish(spawn(["kernel"], cache, kernel=True))
    assert temps(kernels) == [] and len(list(kernels.glob("cpu_kernels-*.so"))) == 1


# ---- bench --------------------------------------------------------------------------------------------------

def test_kill_during_bench_then_resume(raced, tmp_path):
    model = next(iter(raced["dirs"]))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "goose", "bench", "--model", model, "--methods", "ar,pld", "--max-new-tokens", "12",
           "--threads", "1", "--limit", "1", "--no-progress", "--out", str(out)]
    env = child_env(raced["cache"])
    for delay in (RNG.uniform(2.5, 5.5) for _ in range(KILLS)):
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        time.sleep(delay)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        if (out / "run.json").exists():
            json.loads((out / "run.json").read_text())  # whole, never torn
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {m: [json.loads(line) for line in (out / "answers" / f"{m}.jsonl").read_text().splitlines()]
            for m in ("ar", "pld")}
    ids = [r["question_id"] for r in rows["ar"]]
    assert len(ids) == len(set(ids)) == 6 and sorted(r["question_id"] for r in rows["pld"]) == sorted(ids)
    assert all(all(r["lossless"]) for r in rows["pld"])
    assert json.loads((out / "summary.json").read_text())["questions"] == 6
    assert temps(out) == []
