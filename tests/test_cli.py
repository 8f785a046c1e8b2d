"""Command line: output formats and one-line errors for bad input (never a traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import make_tiny_llama
from goose.cli import main


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved with a real tokenizer (SmolLM2's vocabulary, no chat template)."""
    from transformers import AutoTokenizer

    from goose.model import model_dir

    path = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    tok.chat_template = None
    model = make_tiny_llama(dtype=__import__("torch").float32, vocab=len(tok))
    model.config.max_position_embeddings = 256
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_json_output_with_verify(tiny_dir, capsys):
    code, out, err = run(["generate", "--model", str(tiny_dir), "--method", "goose-paper", "--max-new-tokens", "12",
                          "--json", "--verify", "hello hello hello hello"], capsys)
    assert code == 0, err
    payload = json.loads(out)
    assert set(payload) >= {"text", "token_ids", "stats", "lossless"}
    assert payload["lossless"] is True
    assert payload["stats"]["new_tokens"] == len(payload["token_ids"]) <= 12
    for key in ("forward_calls", "tau", "mat", "wall_time_s", "tokens_per_s", "drafted", "accepted",
                "spine_continuations", "spine_continuation_tokens", "accept_lengths", "tree_sizes"):
        assert key in payload["stats"]


def test_plain_output_is_the_text(tiny_dir, capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one two three")
    code, out, _ = run(["generate", "--model", str(tiny_dir), "--max-new-tokens", "5", "--prompt-file", str(f)], capsys)
    assert code == 0 and out.endswith("\n")


@pytest.mark.parametrize("argv, needle", [
    (["generate", ""], "empty"),
    (["generate", "   "], "empty"),
    (["generate"], "PROMPT"),
    (["generate", "--max-new-tokens", "0", "hi"], ">= 1"),
    (["generate", "--method", "nope", "hi"], "unknown method 'nope'"),
    (["generate", "--model", "/no/such/dir", "hi"], "unknown model"),
    (["generate", "--prompt-file", "/no/such/file"], "not found"),
    (["generate", "--dtype", "int3", "hi"], "unknown dtype"),
])
def test_bad_input_gives_one_line_error(argv, needle, capsys):
    code, _, err = run(argv, capsys)
    assert code == 2
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_unreadable_gguf(tmp_path, capsys):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf file at all")
    code, _, err = run(["generate", "--model", str(bad), "hi"], capsys)
    assert code == 2 and "cannot read GGUF" in err


def test_context_overflow_and_missing_chat_template(tiny_dir, capsys):
    code, _, err = run(["generate", "--model", str(tiny_dir), "--max-new-tokens", "1000", "hi"], capsys)
    assert code == 2 and "exceeds the model's context of 256" in err
    code, _, err = run(["generate", "--model", str(tiny_dir), "--chat", "hi"], capsys)
    assert code == 2 and "chat template" in err


def test_python_dash_m_entry_point():
    res = subprocess.run([sys.executable, "-m", "goose", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "generate" in res.stdout


def test_stream_prints_the_same_text_as_generate(tiny_dir, capsys):
    base = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "30", "--method", "goose", "a b a b a b"]
    for extra in ([], ["--temperature", "0.9", "--top-p", "0.95", "--seed", "4"]):
        code, plain, err = run(base + extra, capsys)
        assert code == 0, err
        code, streamed, err = run(base + extra + ["--stream"], capsys)
        assert code == 0, err
        assert streamed == plain


def test_sampled_json_is_reproducible_and_verified(tiny_dir, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "20", "--json", "--verify",
            "--temperature", "1.2", "--top-k", "20", "--seed", "7", "hello hello hello"]
    outs = []
    for _ in range(2):
        code, out, err = run(argv, capsys)
        assert code == 0, err
        outs.append(json.loads(out))
    assert outs[0]["lossless"] is True  # same seed: same tokens as ar
    assert outs[0]["token_ids"] == outs[1]["token_ids"]


@pytest.mark.parametrize("argv, needle", [
    (["--top-p", "1.5", "--temperature", "1"], "top_p must be in (0, 1]"),
    (["--top-k", "5"], "need sampling"),
    (["--temperature", "-1"], "must be >= 0"),
    (["--stream", "--json"], "cannot be combined"),
])
def test_bad_sampling_options_fail_before_loading(argv, needle, capsys):
    code, _, err = run(["generate", "--model", "/no/such/dir", "hi"] + argv, capsys)
    assert code == 2 and needle in err and "unknown model" not in err


def test_packaged_model_without_its_package(monkeypatch, tmp_path, capsys):
    from goose import model as gm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(gm.PACKAGED, "nope-1m", gm.Packaged("goose_no_such_package", "pip install nope==1"))
    code, _, err = run(["generate", "--model", "nope-1m", "hi"], capsys)
    assert code == 2 and "needs the 'goose_no_such_package' package: pip install nope==1" in err


def test_packaged_gguf_that_fails_to_assemble(monkeypatch, tmp_path, capsys):
    import importlib.machinery
    import types

    from goose import model as gm

    fake = types.ModuleType("goose_fake_chunks")
    fake.__spec__ = importlib.machinery.ModuleSpec("goose_fake_chunks", None)
    fake.MODEL_NAME = "fake.gguf"

    def assemble(path):
        raise ValueError("Assembled file sha256 did not match expected value")

    fake.assemble = assemble
    monkeypatch.setitem(sys.modules, "goose_fake_chunks", fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(gm.PACKAGED, "fake-1m", gm.Packaged("goose_fake_chunks", "pip install fake==1"))
    code, _, err = run(["generate", "--model", "fake-1m", "hi"], capsys)
    assert code == 2 and "cannot assemble the GGUF" in err and "sha256" in err
    left = [p.name for p in (tmp_path / "goose" / "models").iterdir() if not p.name.endswith(".lock")]
    assert not left  # the scratch directory is gone (the lock file stays: it is never used as data)


def test_profile_prints_the_curve_and_the_kernels(tiny_dir, capsys, tmp_path, monkeypatch):
    from goose import costmodel, cpukernel

    monkeypatch.setattr(costmodel, "cache_root", lambda: tmp_path / "cache")  # measured here, not read from a cache
    plot = tmp_path / "curve.png"
    code, out, err = run(["profile", "--model", str(tiny_dir), "--plot", str(plot)], capsys)
    assert code == 0, err
    header, _, *rows = out.splitlines()[:-1]
    assert "LeanForward" in header and "kernels: " in header
    if cpukernel.kernel() is not None:
        assert "kernels: goose-avx2+attention)" in header
    else:
        assert "goose's CPU kernel unavailable: " + cpukernel.unavailable_reason() in header
    sizes = [int(r.split()[0]) for r in rows]
    ms = [float(r.split()[1]) for r in rows]
    assert sizes[0] == 1 and sizes == sorted(sizes) and ms == sorted(ms)  # a non-decreasing curve
    assert plot.is_file() and list((tmp_path / "cache" / "cost").glob("*.json"))
