"""Caches on disk are verified and owned (`goose.cachefs`): every entry carries a digest of its bytes, checked
before use, so a flipped byte is rebuilt or refused and never decoded; `goose cache verify` names each bad
entry; the cache root is created 0700; entries and compiled kernels that another user owns or that group or
others may write are refused, and a symbolic link planted at a lock file is never followed."""

from __future__ import annotations

import json
import os
import platform
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from goose import cachefs
from goose.backends import cpukernel, quant
from goose.cli import main
from goose.drafting import datastore
from goose.errors import GooseError
from goose.loading import gguf as gguf_file
from goose.loading import model as loading
from tiny_gguf import write_tiny_gguf

needs_quant = pytest.mark.skipif(not quant.runnable_variants() or quant.kernels() is None,
                                 reason=f"quantized kernels: {quant.unavailable_reason()}")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache root (the kernels already loaded from the usual one)."""
    quant.kernels(), cpukernel.kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "goose"


def foreign(path: Path, monkeypatch) -> None:
    """Make `path` another user's: chown as root (the tests' usual user), else pretend to be another user."""
    if os.geteuid() == 0:
        os.chown(path, 4242, 4242, follow_symlinks=False)
    else:
        monkeypatch.setattr(cachefs, "_uid", lambda: os.geteuid() + 1)


def flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x5A]))


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([[1, 5, 9, 13, 40, 2]])).logits


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: m.weight.data.clone() for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), quant.QuantWeight)}


def panel_entry(cache: Path) -> Path:
    (entry,) = (cache / "models" / gguf_file.PANEL_DIR).glob("*.bin")
    return entry


def inside_a_weight(entry: Path) -> int:
    """A byte position in the packed bytes of the entry's first weight (the header and padding left alone)."""
    raw = entry.read_bytes()
    n0 = len(gguf_file.PANEL_MAGIC) + 8
    length = int.from_bytes(raw[len(gguf_file.PANEL_MAGIC):n0], "little")
    header = json.loads(raw[n0:n0 + length])
    start = -(-(n0 + length) // gguf_file.PANEL_ALIGN) * gguf_file.PANEL_ALIGN
    w = header["weights"][0]
    return start + header["buffers"][w["buffer"]]["offset"] + w["offset"] + w["nbytes"] // 2


# ---- digests ------------------------------------------------------------------------------------------------

def test_a_digest_is_the_same_from_memory_and_from_the_file_and_sees_one_flipped_bit(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 2 * cachefs.CHUNK + 12345, dtype=np.uint8)
    path = tmp_path / "blob"
    path.write_bytes(data.tobytes())
    assert cachefs.file_digest(path) == (data.nbytes, cachefs.digest(data))
    data[cachefs.CHUNK + 7] ^= 1
    assert cachefs.digest(data) != cachefs.file_digest(path)[1]


@needs_quant
def test_a_flipped_byte_in_the_packed_panels_is_packed_again_never_decoded(tmp_path, cache, capsys):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    first = loading.load_model(str(src))[0]
    want, weights = _logits(first), _weights(first)
    entry = panel_entry(cache)
    good = entry.read_bytes()
    flip(entry, inside_a_weight(entry))  # the header still parses and fits: only the digest tells
    capsys.readouterr()
    again = loading.load_model(str(src))[0]
    got = _weights(again)
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert torch.equal(_logits(again), want)
    assert f"the packed panels in {entry} are damaged" in capsys.readouterr().err
    assert entry.read_bytes() == good  # written again, whole


@needs_quant
@pytest.mark.parametrize("unsafe", ["other-owner", "group-writable"])
def test_a_panel_entry_of_another_user_or_writable_by_others_is_refused(tmp_path, cache, unsafe, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    loading.load_model(str(src))
    entry = panel_entry(cache)
    good = entry.read_bytes()
    if unsafe == "other-owner":
        foreign(entry, monkeypatch)
    else:
        entry.chmod(0o664)
    with pytest.raises(cachefs.UnsafeCache, match=f"refusing {entry}: ") as info:
        loading.load_model(str(src))
    assert ("owned by uid" if unsafe == "other-owner" else "group or others may write") in str(info.value)
    assert entry.read_bytes() == good  # neither loaded nor rebuilt over


def test_a_damaged_datastore_is_refused_in_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    store = datastore.from_token_ids([[3, 4, 5, 6], [7, 8, 9]] * 50, {"name": "d"})
    path = datastore.save(store, datastore.store_dir("d"))
    assert datastore.load("d").tokens.tolist() == store.tokens.tolist()
    tokens = np.load(path / "tokens.npy")
    flip(path / "tokens.npy", (path / "tokens.npy").stat().st_size - tokens.nbytes + 40)  # a token, same size
    with pytest.raises(GooseError, match=r"datastore 'd' at .* is damaged \(tokens.npy does not match its digest\)"):
        datastore.load("d")


def test_a_datastore_of_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = datastore.save(datastore.from_token_ids([[3, 4, 5]], {"name": "d"}), datastore.store_dir("d"))
    foreign(path / "sa.npy", monkeypatch)
    with pytest.raises(cachefs.UnsafeCache, match="refusing .*sa.npy: it is owned by uid"):
        datastore.load("d")


def test_a_damaged_gguf_hash_memo_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    right = loading.file_sha256(src)
    memo = tmp_path / "xdg" / "goose" / "models" / loading.HASH_MEMO
    text = memo.read_text()
    memo.write_text(text.replace(right, right[::-1]))  # another hash, same size: it would name another entry
    assert loading.file_sha256(src) == right


# ---- compiled kernels ---------------------------------------------------------------------------------------

@pytest.fixture
def fake_cxx(tmp_path, monkeypatch) -> Path:
    """A compiler that writes a small fake library (and counts its builds), in an empty cache."""
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\n[ "$1" = --version ] && { echo "fake 1"; exit 0; }\n'
                   'while [ "$#" -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                   f'echo built >> {tmp_path}/builds\nprintf "library bytes" > "$out"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return cxx


def _built(cxx: Path) -> tuple[Path, str | None]:
    return cpukernel.built(str(cxx), ["-O3"], cpukernel.SOURCE, "avx2")


def _builds(cxx: Path) -> int:
    builds = cxx.with_name("builds")
    return len(builds.read_text().splitlines()) if builds.exists() else 0


def test_a_damaged_kernel_library_is_compiled_again(fake_cxx, capsys):
    path, failed = _built(fake_cxx)
    assert failed is None and path.read_bytes() == b"library bytes" and _builds(fake_cxx) == 1
    assert _built(fake_cxx) == (path, None) and _builds(fake_cxx) == 1  # whole: used as it is
    flip(path, 3)
    capsys.readouterr()
    assert _built(fake_cxx) == (path, None) and _builds(fake_cxx) == 2
    assert path.read_bytes() == b"library bytes"
    assert f"{path} is damaged (its bytes do not match its digest)" in capsys.readouterr().err


@pytest.mark.parametrize("unsafe", ["group-writable", "world-writable", "other-owner", "kernels-folder"])
def test_a_kernel_library_others_can_write_or_own_is_never_loaded(fake_cxx, unsafe, monkeypatch):
    path, _ = _built(fake_cxx)
    target = path.parent if unsafe == "kernels-folder" else path
    if unsafe == "other-owner":
        foreign(path, monkeypatch)
    else:
        target.chmod(stat.S_IMODE(target.stat().st_mode) | (0o002 if unsafe == "world-writable" else 0o020))
    with pytest.raises(cachefs.UnsafeCache, match=f"refusing {target}: ") as info:
        _built(fake_cxx)
    assert ("owned by uid" if unsafe == "other-owner" else "chmod go-w") in str(info.value)
    assert _builds(fake_cxx) == 1  # not compiled over either


def test_every_kernel_loader_goes_through_the_checked_build(monkeypatch):
    """cpukernel, quant and int8 load their libraries from `cpukernel.built` (where the checks are) only."""
    from goose.backends import int8

    calls = []

    def refuse(cxx, flags, source, variant):
        calls.append(source.name)
        raise cachefs.UnsafeCache(Path("/nowhere") / source.name, "test")

    monkeypatch.setattr(cpukernel, "built", refuse)
    monkeypatch.setattr(cpukernel, "_compiler", lambda: "/bin/true")
    monkeypatch.setattr(cpukernel, "_gnu_openmp_loaded", lambda: True)
    monkeypatch.setattr(cpukernel, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for load in (cpukernel._load, quant._load, int8._load):
        with pytest.raises(cachefs.UnsafeCache):
            load("avx2")
    assert calls == ["cpu_kernels.cpp", "quant_kernels.cpp", "int8_kernels.cpp"]


# ---- locks, the root and modes ------------------------------------------------------------------------------

def test_a_symlink_planted_at_a_lock_file_is_refused_not_followed(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    target = tmp_path / "xdg" / "goose" / "cost" / "curve.json"
    target.parent.mkdir(parents=True)
    victim = tmp_path / "victim"
    target.with_name("curve.json.lock").symlink_to(victim)
    with pytest.raises(cachefs.UnsafeCache, match=r"refusing .*curve\.json\.lock: it is a symbolic link"):
        with cachefs.lock(target):
            pass
    assert not victim.exists()  # not created through the link


def test_the_cache_root_is_created_0700_and_entries_stay_unwritable_by_others(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "goose"
    old = os.umask(0o002)  # a umask that lets the group write
    try:
        with cachefs.lock(root / "cost" / "curve.json"):
            cachefs.write_text(root / "cost" / "curve.json", "{}")
        store = datastore.save(datastore.from_token_ids([[3, 4]], {"name": "d"}), datastore.store_dir("d"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    written = [root / "cost", root / "cost" / "curve.json", store, *store.iterdir()]
    assert all(not p.stat().st_mode & 0o022 for p in written)
    assert cachefs.verify_tree(root) == (4, [])  # the curve, the store and their locks


# ---- goose cache verify / path / clear ----------------------------------------------------------------------

@needs_quant
def test_cache_verify_names_each_bad_entry_and_fails(tmp_path, cache, capsys, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    loading.load_model(str(src))
    datastore.save(datastore.from_token_ids([[3, 4, 5]], {"name": "d"}), datastore.store_dir("d"))
    assert main(["cache", "verify"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "all whole" in out
    entry = panel_entry(cache)
    flip(entry, inside_a_weight(entry))
    (blocks,) = (p for p in (cache / "models" / "blocks").iterdir() if p.is_dir())
    flip(blocks / "config.json", 2)
    (cache / "datastores" / "d" / "meta.json").chmod(0o666)
    assert main(["cache", "verify"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[:-1] == sorted(lines[:-1]) and len(lines) == 4
    assert f"{blocks}: config.json does not match its digest" in lines
    assert f"{cache / 'datastores' / 'd'}: {cache / 'datastores' / 'd' / 'meta.json'}: group or others may " \
           f"write it" in lines[0]
    assert f"{entry}: its bytes do not match its digest" in lines
    assert lines[-1].startswith(f"{len(cachefs.entries(cache))} entries in {cache}: 3 bad")


def test_cache_path_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "goose"
    cachefs.write_text(root / "cost" / "curve.json", "{}")
    assert main(["cache", "path"]) == 0 and capsys.readouterr().out == f"{root}\n"
    assert main(["cache", "clear"]) == 0 and list(root.iterdir()) == []
    assert main(["cache", "verify"]) == 0 and "0 entries" in capsys.readouterr().out


def test_an_altered_cost_curve_is_measured_again_not_used(cache):
    """A curve edited in place (still a valid curve) fails its digest: it is never priced with."""
    from goose.engine.measure import _read_curve
    from goose.selection.costmodel import CostCurve

    path = cache / "cost" / "curve.json"
    good = CostCurve((1, 2, 4), (1.0, 1.2, 1.5))
    cachefs.write_bytes(path, json.dumps(good.to_json()).encode())
    assert _read_curve(path).ms == good.ms
    path.write_text(json.dumps(CostCurve((1, 2, 4), (1.0, 9.0, 9.5)).to_json()))
    assert _read_curve(path) is None
