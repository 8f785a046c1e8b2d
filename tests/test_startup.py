"""What keeps start-up short: the packed GGUF panels kept on disk (`goose.loading.gguf.cached_gguf_weights`)
give the weights and logits a fresh pack gives, are rebuilt when damaged and never served for other file
content; a first load on GGUF blocks writes only a small folder (config, tokenizer, norms:
`goose.loading.gguf_folder`) identical to what transformers makes from the file, says each first-run step in
one line and nothing on a warm load, rebuilds a damaged folder and survives two processes racing; a cost-curve
measurement stops in bounded time and never caches a disturbed curve."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_llama
from goose import cachefs
from goose.backends import cpukernel, quant
from goose.backends.lean import LeanForward
from goose.engine import measure as costmodel
from goose.loading import gguf as gguf_file
from goose.loading import gguf_folder
from goose.loading import model as loading
from goose.protocols import Forward
from goose.selection.costmodel import CostCurve
from tiny_gguf import write_tiny_gguf

needs_quant = pytest.mark.skipif(not quant.runnable_variants() or quant.kernels() is None,
                                 reason=f"quantized kernels: {quant.unavailable_reason()}")


# ---- the packed-panel cache -----------------------------------------------------------------------------

def _weights(model) -> dict[str, torch.Tensor]:
    return {name: m.weight.data for name, m in model.named_modules()
            if isinstance(getattr(m, "weight", None), quant.QuantWeight)}


def _logits(model) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([[1, 5, 9, 13, 40, 2]])).logits


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    quant.kernels(), cpukernel.kernel()  # loaded from the usual kernel cache before it moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "goose" / "models" / gguf_file.PANEL_DIR


def _load(path):
    from goose.loading.model import load_model

    return load_model(str(path))[0]


def _entry(panels):
    entries = sorted(panels.glob("*.bin"))
    assert len(entries) == 1, entries
    return entries[0]


@needs_quant
def test_cached_panels_equal_a_fresh_pack(tmp_path, fresh_cache, monkeypatch):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    fresh = _load(src)  # packs, and keeps the panels
    entry = _entry(fresh_cache)
    calls = []
    real = gguf_file.use_gguf_weights
    monkeypatch.setattr(gguf_file, "use_gguf_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    warm = _load(src)
    assert calls == []  # read back, not packed
    a, b = _weights(fresh), _weights(warm)
    assert set(a) == set(b) and len(a) == 2 * 7 + 2  # every projection, the embedding and the output head
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert torch.equal(_logits(fresh), _logits(warm))
    q, k, v = (warm.model.layers[0].self_attn.get_submodule(p).weight.data for p in ("q_proj", "k_proj", "v_proj"))
    assert q._base is k._base is v._base is not None  # q/k/v kept fused: one buffer, parts are views of it
    assert q.data_ptr() + q.numel() == k.data_ptr() and k.data_ptr() + k.numel() == v.data_ptr()
    assert _entry(fresh_cache) == entry and not [p for p in fresh_cache.iterdir() if ".tmp-" in p.name]


@needs_quant
@pytest.mark.parametrize("damage", ["truncate", "header", "shape", "garbage", "empty"])
def test_a_damaged_panel_file_is_rebuilt(tmp_path, fresh_cache, damage):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    want = _logits(_load(src))
    entry = _entry(fresh_cache)
    good = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(good[: len(good) - 100])
    elif damage == "header":
        entry.write_bytes(good[:10] + b"\xff" * 20 + good[30:])
    elif damage == "shape":  # a header that parses but does not fit the model
        n = len(gguf_file.PANEL_MAGIC) + 8
        length = int.from_bytes(good[len(gguf_file.PANEL_MAGIC):n], "little")
        header = json.loads(good[n:n + length])
        header["weights"][0]["n"] *= 2
        text = json.dumps(header).encode()[:length].ljust(length)
        entry.write_bytes(good[:n] + text + good[n + length:])
    elif damage == "garbage":
        entry.write_bytes(os.urandom(len(good)))
    else:
        entry.write_bytes(b"")
    assert torch.equal(_logits(_load(src)), want)
    assert entry.read_bytes() == good  # written again, whole


@needs_quant
def test_changed_gguf_content_is_not_served_stale(tmp_path, fresh_cache):
    src = tmp_path / "tiny.gguf"
    write_tiny_gguf(src, seed=0, quant="Q8_0")
    first = _load(src)
    st = src.stat()
    write_tiny_gguf(src, seed=1, quant="Q8_0")  # same name and size, other weights
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = _load(src)
    other = tmp_path / "other" / "tiny.gguf"
    other.parent.mkdir()
    write_tiny_gguf(other, seed=1, quant="Q8_0")
    assert len(list(fresh_cache.glob("*.bin"))) == 2  # one entry per content
    ref = _weights(_load(other))  # the same content: the same entry
    a, b = _weights(first), _weights(second)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj"], b["model.layers.0.self_attn.q_proj"])
    assert all(torch.equal(b[n], ref[n]) for n in ref)


# ---- the cost-curve measurement's bound -----------------------------------------------------------------

class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeCache:
    def reset(self) -> None:
        pass

    def keep(self, rows) -> None:
        pass


class FakeForward(Forward):
    """A forward whose n-row call takes `ms(n)` of fake time; `noisy` makes every other call of each size 3x
    slower (passes that disagree, as on a busy machine)."""

    weight_bytes = None  # (a test sets it)

    def __init__(self, clock: FakeClock, ms=lambda n: 1.0 + n, noisy: bool = False) -> None:
        self.clock, self.ms, self.noisy, self.calls = clock, ms, noisy, []

    def new_cache(self) -> FakeCache:
        return FakeCache()

    def run(self, segments) -> None:
        n = sum(len(s.tokens) for s in segments)
        self.calls.append(n)
        slow = 3.0 if self.noisy and self.calls.count(n) % 2 else 1.0
        self.clock.now += self.ms(n) * slow / 1e3


class FakeModel:
    class config:  # noqa: N801
        model_type = "fake"

    def __init__(self) -> None:
        self.w = torch.nn.Parameter(torch.zeros(2))

    def parameters(self):
        return iter([self.w])

    def get_output_embeddings(self):
        return torch.nn.Linear(1, 50)


def _grid_passes(fwd: FakeForward) -> int:
    return fwd.calls.count(costmodel.GRID[-1])  # the largest tree: once per pass over the grid


def test_quiet_measurement_uses_every_pass_and_is_cached(tmp_path):
    clock = FakeClock()
    fwd = FakeForward(clock)
    curve = costmodel.load_or_measure(FakeModel(), fwd, path=tmp_path / "c.json", clock=clock)
    assert _grid_passes(fwd) == costmodel.REPEATS + 1
    assert curve.ms == pytest.approx(tuple(1.0 + n for n in costmodel.GRID)) and curve.spread == pytest.approx(1.0)
    assert CostCurve.from_json(json.loads((tmp_path / "c.json").read_text())).ms == curve.ms


def test_slow_measurement_stops_at_the_budget(tmp_path):
    clock = FakeClock()
    fwd = FakeForward(clock, ms=lambda n: 1000.0)  # a second per forward: a pass is 30 s
    curve = costmodel.load_or_measure(FakeModel(), fwd, path=tmp_path / "c.json", budget_s=10.0, clock=clock)
    assert _grid_passes(fwd) == 1 + costmodel.MIN_REPEATS  # warm-up and the minimum, then the budget is spent
    assert len(curve.sizes) == len(costmodel.GRID) and (tmp_path / "c.json").is_file()  # steady: cached
    fwd.calls.clear()
    assert costmodel.load_or_measure(FakeModel(), fwd, path=tmp_path / "c.json", clock=clock) == curve
    assert fwd.calls == []


@pytest.mark.parametrize("budget", [1.0, 1000.0])
def test_disturbed_measurement_is_bounded_and_never_cached(tmp_path, budget, capsys):
    clock = FakeClock()
    fwd = FakeForward(clock, noisy=True)
    path = tmp_path / "c.json"
    curve = costmodel.load_or_measure(FakeModel(), fwd, path=path, budget_s=budget, clock=clock)
    assert curve.spread > costmodel.MAX_SPREAD and not path.exists()
    assert "not cached" in capsys.readouterr().err
    tries = 1 if budget < 5 else costmodel.MEASURE_TRIES  # no second try once the budget is spent
    passes = 1 + (costmodel.MIN_REPEATS if budget < 5 else costmodel.REPEATS)
    assert _grid_passes(fwd) == tries * passes


def test_a_starved_measurement_is_used_but_never_cached(tmp_path, capsys):
    """Forwards that read their weights far slower than memory allows (another process's threads spinning on the
    same cores: every size costs the same long wait) give a flat curve that is not kept for later runs."""
    clock = FakeClock()
    fwd = FakeForward(clock, ms=lambda n: 2000.0 + n)  # 2 s per forward, whatever its size
    fwd.weight_bytes = 100e6  # 100 MB in 2 s: 0.05 GB/s
    path = tmp_path / "c.json"
    curve = costmodel.load_or_measure(FakeModel(), fwd, path=path, clock=clock)
    assert costmodel.starved(fwd, curve) == pytest.approx(0.05, rel=0.01) and not path.exists()
    assert "100 MB of weights at 0.050 GB/s" in capsys.readouterr().err
    fwd.ms = lambda n: 250.0 + n  # the same weights at 0.4 GB/s: slow, but a machine's real speed
    assert costmodel.starved(fwd, costmodel.load_or_measure(FakeModel(), fwd, path=path, clock=clock)) is None
    assert path.is_file()
    fwd.weight_bytes = 1e5  # a tiny model: its forward's time is fixed work, not reading 0.1 MB
    assert costmodel.starved(fwd, CostCurve((1, 2), (costmodel.STARVED_MS, 60.0))) is None
    assert costmodel.starved(fwd, CostCurve((1, 2), (costmodel.STARVED_MS + 1.0, 60.0))) == pytest.approx(1e5 / 51e6)


def test_the_lean_forward_counts_the_weights_each_forward_reads(tiny_model):
    fwd = LeanForward(tiny_model)
    linears = [m for m in tiny_model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.weight.numel() for m in linears) + tiny_model.lm_head.weight.numel()
    size = tiny_model.lm_head.weight.element_size()
    assert weights * size <= fwd.weight_bytes <= weights * size * 1.5  # (goose's panels pad to 16 columns)


@needs_quant
def test_a_gguf_without_quantized_tensors_keeps_no_panel_file(tmp_path, fresh_cache):
    model = _load(write_tiny_gguf(tmp_path / "tiny.gguf"))  # float32 tensors only
    assert _weights(model) == {} and not list(fresh_cache.glob("*.bin"))


# ---- the first run: a small folder from one read of the GGUF ---------------------------------------------

SRC = Path(__file__).resolve().parents[1] / "src"


def _blocks_folder(cache: Path) -> Path:
    folders = [p for p in (cache / "goose" / "models" / gguf_folder.BLOCKS_DIR).iterdir()
               if p.is_dir() and ".tmp-" not in p.name]
    assert len(folders) == 1, folders
    return folders[0]


def _goose_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("goose: ")]


@needs_quant
@pytest.mark.parametrize("quant_fmt", ["Q8_0", "Q4_0"])
def test_first_load_on_blocks_writes_no_float32_copy_and_says_each_step(tmp_path, fresh_cache, monkeypatch,
                                                                        capsys, quant_fmt):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant=quant_fmt)
    monkeypatch.setattr(loading, "_dequantize", lambda *a: pytest.fail("a float32 copy was written"))
    capsys.readouterr()
    first, tok = loading.load_model(str(src))
    steps = _goose_lines(capsys.readouterr().err)
    assert [next(w for w in ("hashing", "config, tokenizer and norms", "packing its blocks") if w in line)
            for line in steps] == ["hashing", "config, tokenizer and norms", "packing its blocks"], steps
    cache = tmp_path / "cache"
    tensors = sorted(p.relative_to(cache) for p in cache.rglob("*.safetensors"))
    folder = _blocks_folder(cache)
    assert tensors == [(folder / gguf_folder.SMALL_FILE).relative_to(cache)]  # no float32 model anywhere
    with safe_open(str(folder / gguf_folder.SMALL_FILE), framework="pt") as st:
        shapes = {k: st.get_slice(k).get_shape() for k in st.keys()}
    assert shapes and all(len(s) == 1 for s in shapes.values())  # the norms only: the matrices stay blocks
    assert len(shapes) == 2 * 2 + 1  # two per layer and the final norm
    warm, _ = loading.load_model(str(src))
    assert _goose_lines(capsys.readouterr().err) == []  # a warm load is silent
    assert torch.equal(_logits(first), _logits(warm))
    assert tok("abc").input_ids == loading.load_model(str(src))[1]("abc").input_ids


@needs_quant
@pytest.mark.parametrize("quant_fmt,tied", [(None, False), ("Q8_0", False), ("Q8_0", True), ("Q4_1", True)])
def test_small_folder_equals_what_transformers_makes_from_the_file(tmp_path, fresh_cache, quant_fmt, tied):
    """config, generation config and tokenizer files byte for byte, and every small tensor bit for bit, as
    in the float32 folder transformers' GGUF loader writes (`model_dir`); the config dict as its legacy
    parser gives it; the logits on the blocks as on transformers' float32 model (tied heads included)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant=quant_fmt, tied=tied)
    blocks, _ = loading.load_model(str(src), weights="gguf")
    assert (blocks.lm_head.weight is blocks.model.embed_tokens.weight) == tied
    plain, _ = loading.load_model(str(src), weights="float32", pack=False)  # Hugging Face's own modules
    assert torch.allclose(_logits(blocks), _logits(plain), atol=1e-4)  # (PyTorch sums in another order)
    assert torch.equal(_logits(blocks), _logits(loading.load_model(str(src), weights="float32")[0]))
    folder = _blocks_folder(tmp_path / "cache")
    full = loading.model_dir(str(src))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (full / name).read_bytes(), name
    with safe_open(str(folder / gguf_folder.SMALL_FILE), framework="pt") as small, \
            safe_open(str(next(full.glob("*.safetensors"))), framework="pt") as ref:
        keys = set(small.keys())
        assert keys and keys <= set(ref.keys())
        assert all(torch.equal(small.get_tensor(k), ref.get_tensor(k)) for k in keys)
    meta, names = gguf_folder._metadata(src)
    assert gguf_folder.gguf_config(meta, names) == load_gguf_checkpoint(str(src), return_tensors=False)["config"]
    if quant_fmt is None:  # float32 matrices have no kernel: they are the folder's too, q/k in HF's row order
        assert "model.layers.0.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys


@pytest.mark.slow
@needs_quant
def test_packaged_model_small_folder_equals_transformers(tmp_path, monkeypatch):
    from goose.loading.packaged import DEFAULT_MODEL

    full = loading.model_dir(DEFAULT_MODEL)  # the float32 folder transformers wrote (the usual cache)
    quant.kernels(), cpukernel.kernel()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    gguf = loading.gguf_source(DEFAULT_MODEL)
    folder = gguf_folder.blocks_dir(gguf, loading.file_sha256(gguf))
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        assert (folder / name).read_bytes() == (full / name).read_bytes(), name
    with safe_open(str(folder / gguf_folder.SMALL_FILE), framework="pt") as small, \
            safe_open(str(next(full.glob("*.safetensors"))), framework="pt") as ref:
        keys = set(small.keys())
        assert len(keys) == 2 * 30 + 1 and all(torch.equal(small.get_tensor(k), ref.get_tensor(k)) for k in keys)


@needs_quant
@pytest.mark.parametrize("damage", ["truncate-tensors", "no-record", "bad-config", "other-record", "empty-dir"])
def test_a_damaged_small_folder_is_rebuilt(tmp_path, fresh_cache, damage, capsys):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    want = _logits(loading.load_model(str(src))[0])
    folder = _blocks_folder(tmp_path / "cache")
    good = {p.name: p.read_bytes() for p in folder.iterdir()}
    if damage == "truncate-tensors":
        small = folder / gguf_folder.SMALL_FILE
        small.write_bytes(small.read_bytes()[:-40])
    elif damage == "no-record":
        (folder / gguf_folder.RECORD).unlink()
    elif damage == "bad-config":
        (folder / "config.json").write_text("{")
    elif damage == "other-record":
        record = json.loads((folder / gguf_folder.RECORD).read_text())
        record["key"] = "something-else"
        (folder / gguf_folder.RECORD).write_text(json.dumps(record))
    else:
        for p in folder.iterdir():
            p.unlink()
    capsys.readouterr()
    assert torch.equal(_logits(loading.load_model(str(src))[0]), want)
    assert "config, tokenizer and norms" in capsys.readouterr().err  # built again, and said so
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == good


@needs_quant
def test_a_stale_partial_folder_is_cleaned_and_not_used(tmp_path, fresh_cache):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    blocks = tmp_path / "cache" / "goose" / "models" / gguf_folder.BLOCKS_DIR
    key = gguf_folder.folder_key(src, loading.file_sha256(src))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    partial = blocks / f".{key}.tmp-{dead}-abcd1234"  # a build killed half-way
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    loading.load_model(str(src))
    assert not partial.exists() and _blocks_folder(tmp_path / "cache").name == key


_RACER = """
import sys, torch
from goose.loading.model import load_model
model, tok = load_model(sys.argv[1])
with torch.inference_mode():
    print(model(torch.tensor([[1, 5, 9, 13, 40, 2]])).logits.sum().item())
"""


@needs_quant
def test_two_processes_racing_on_a_fresh_cache_both_load_one_valid_folder(tmp_path, fresh_cache):
    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    cache = tmp_path / "cache"
    kernels = cache / "goose" / "kernels"  # (the compiled kernels copied in: only the model's files race)
    kernels.mkdir(parents=True)
    for lib in (quant.kernels().path, cpukernel.kernel().path):
        for f in (Path(lib), cachefs.sidecar(lib)):  # (with their digests)
            shutil.copy2(f, kernels / f.name)
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "PYTHONPATH": str(SRC)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(src)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    assert outs[0][0] == outs[1][0]  # the same logits
    folder = _blocks_folder(cache)
    assert gguf_folder.valid(folder, folder.name)
    builds = sum("config, tokenizer and norms" in e for _, e in outs)
    assert builds == 1  # one built it; the other waited for the lock and used it
    models = cache / "goose" / "models"
    assert not [p for p in models.rglob("*") if ".tmp-" in p.name]
    assert len(list((models / gguf_file.PANEL_DIR).glob("*.bin"))) == 1


def test_an_unreadable_gguf_is_one_error_without_a_fallback(tmp_path, fresh_cache, capsys):
    from goose.errors import GooseError

    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(GooseError, match="cannot read GGUF"):
        loading.load_model(str(bad))
    err = capsys.readouterr().err
    assert "using float32 weights" not in err and "dequantizing" not in err
    assert not (tmp_path / "cache" / "goose" / "models" / gguf_folder.BLOCKS_DIR / "broken").exists()


def test_the_cost_curve_key_tells_cpus_apart(monkeypatch):
    """A cache directory shared by two machines (a home on NFS) keeps a curve per CPU: one measured on another
    CPU is never read."""
    from goose.machine import cpu_identity

    assert "family=" in cpu_identity() and "cpus=" in cpu_identity()
    model = make_tiny_llama()
    forward = LeanForward(model)
    here = costmodel.curve_key(model, forward)
    assert costmodel.curve_key(model, forward) == here
    monkeypatch.setattr(costmodel, "cpu_identity", lambda: "Another CPU family=6 model=143 stepping=8 cpus=2")
    assert costmodel.curve_key(model, forward) != here


def test_dequantizing_a_gguf_file_parses_it_once_into_the_same_folder(tmp_path, fresh_cache, monkeypatch):
    """transformers builds a GGUF reader for the config, the tokenizer and the weights; goose's first use of a
    file lets it build one (its vocabulary is parsed in Python: 25 s for Gemma-3's), with the same folder."""
    import gguf

    src = write_tiny_gguf(tmp_path / "tiny.gguf", quant="Q8_0")
    real, built = gguf.GGUFReader, []

    def counting(path, *args, **kwargs):
        built.append(Path(path).resolve())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    once = loading.model_dir(str(src))
    assert built.count(src.resolve()) == 1 and gguf.GGUFReader is counting  # the reader put back after
    monkeypatch.setattr(loading, "_one_gguf_parse", lambda path: contextlib.nullcontext())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "other"))
    thrice = loading.model_dir(str(src))
    assert built.count(src.resolve()) == 4
    names = sorted(p.name for p in once.iterdir())
    assert names == sorted(p.name for p in thrice.iterdir()) and any(n.endswith(".safetensors") for n in names)
    assert all((once / n).read_bytes() == (thrice / n).read_bytes() for n in names)
