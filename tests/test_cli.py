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

    from goose.loading.model import model_dir

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
    from goose.loading import model as gm

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setitem(gm.PACKAGED, "nope-1m", gm.Packaged("goose_no_such_package", "pip install nope==1"))
    code, _, err = run(["generate", "--model", "nope-1m", "hi"], capsys)
    assert code == 2 and "needs the 'goose_no_such_package' package: pip install nope==1" in err


def test_packaged_gguf_that_fails_to_assemble(monkeypatch, tmp_path, capsys):
    import importlib.machinery
    import types

    from goose.loading import model as gm

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
    from goose.backends import cpukernel
    from goose.engine import measure as costmodel

    monkeypatch.setattr(costmodel, "cache_root", lambda: tmp_path / "cache")  # measured here, not read from a cache
    monkeypatch.setattr(costmodel, "MAX_SPREAD", float("inf"))  # cached even when the machine is busy
    plot = tmp_path / "curve.png"
    code, out, err = run(["profile", "--model", str(tiny_dir), "--plot", str(plot)], capsys)
    assert code == 0, err
    header, _, *rows, context, _ = out.splitlines()
    assert context.startswith("(on 256 cached tokens; each query row costs ") and "us more per" in context
    assert "LeanForward" in header and "kernels: " in header
    if cpukernel.kernel() is not None:
        assert f"kernels: goose-{cpukernel.kernel().variant}+attention)" in header
    else:
        assert "goose's CPU kernel unavailable: " + cpukernel.unavailable_reason() in header
    sizes = [int(r.split()[0]) for r in rows]
    ms = [float(r.split()[1]) for r in rows]
    assert sizes[0] == 1 and sizes == sorted(sizes) and ms == sorted(ms)  # a non-decreasing curve
    assert plot.is_file() and list((tmp_path / "cache" / "cost").glob("*.json"))


def test_profile_measures_the_engines_curves_up_to_max_batch(tiny_dir, capsys, tmp_path, monkeypatch):
    """`--max-batch N` also measures (or shows) the curves the Engine with `max_batch` N prices its steps with,
    one per sequence count of `measure.batch_counts` beyond one, and `--remeasure` measures them again."""
    from goose.engine import measure as costmodel

    monkeypatch.setattr(costmodel, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(costmodel, "MAX_SPREAD", float("inf"))
    calls = []
    real = costmodel.measure
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: calls.append(k.get("sequences", 1)) or real(*a, **k))
    code, out, err = run(["profile", "--model", str(tiny_dir), "--plot", "", "--max-batch", "3"], capsys)
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if "sequences in one forward" in ln]
    assert costmodel.batch_counts(3) == [1, 2, 4]
    assert [int(ln.split()[0]) for ln in lines] == [2, 4] and sorted(calls) == [1, 2, 4]
    assert "ms for 2 rows" in lines[0] and "ms for 4 rows" in lines[1]
    assert len(list((tmp_path / "cache" / "cost").glob("*.json"))) == 3
    calls.clear()
    assert run(["profile", "--model", str(tiny_dir), "--plot", "", "--max-batch", "3"], capsys)[0] == 0
    assert calls == []  # cached
    assert run(["profile", "--model", str(tiny_dir), "--plot", "", "--max-batch", "3", "--remeasure"], capsys)[0] == 0
    assert sorted(calls) == [1, 2, 4]


def _write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("config, needle", [
    (b"{}", "names no 'model_type'"),
    (b"not json at all", "is not valid JSON"),
    (b"[1, 2]", "must hold a JSON object"),
    (b"\xff\xfe{}", "is not UTF-8"),
    (b'{"model_type": "llama"}', "cannot load the model"),  # no weights, no tokenizer
])
def test_bad_model_folder_gives_one_line(tmp_path, config, needle, capsys):
    _write(tmp_path / "m" / "config.json", config)
    code, _, err = run(["generate", "--model", str(tmp_path / "m"), "hi"], capsys)
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("data, needle", [
    (b"caf\xe9 au lait", "is not UTF-8 text (byte 3)"),
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "not UTF-8"),
    (b"hello\x00world", "looks binary"),
])
def test_prompt_file_that_is_not_text(tmp_path, data, needle, capsys):
    f = _write(tmp_path / "p.bin", data)
    code, _, err = run(["generate", "--model", "/no/such/dir", "--prompt-file", str(f)], capsys)
    assert code == 2 and needle in err and err.count("\n") == 1, err
    code, _, err = run(["generate", "--model", "/no/such/dir", "--prompt-file", str(tmp_path)], capsys)
    assert code == 2 and "not found" in err


@pytest.mark.parametrize("seed, ok", [(str(2**70), False), ("-1", False), ("1e3", False), (str(2**64 - 1), True)])
def test_seed_range(seed, ok, capsys):
    code, _, err = run(["generate", "--model", "/no/such/dir", "--temperature", "1", "--seed", seed, "hi"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert ("unknown model" in err) == ok and (("0..2^64-1" in err) or "expected an integer" in err) != ok, err


def test_large_seed_samples(tiny_dir, capsys):
    argv = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "6", "--temperature", "1", "--json", "--verify",
            "--seed", str(2**64 - 1), "hello"]
    code, out, err = run(argv, capsys)
    assert code == 0 and json.loads(out)["lossless"] is True, err


def test_jsonl_dataset_not_utf8(tmp_path, capsys):
    f = _write(tmp_path / "q.jsonl", b'{"id": 1, "turns": ["hi"]}\n{"id": 2, "turns": ["caf\xe9"]}\n')
    code, _, err = run(["bench", "--dataset", f"jsonl:{f}", "--model", "/no/such/dir", "--out", str(tmp_path / "o")],
                       capsys)
    assert code == 2 and "line 2: not UTF-8" in err and err.count("\n") == 1, err


def test_verify_without_json(tiny_dir, capsys):
    base = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "8", "--method", "goose", "a b a b a b"]
    code, plain, _ = run(base, capsys)
    code, out, err = run(base + ["--verify"], capsys)
    assert code == 0 and out == plain  # the text alone on stdout
    last = err.strip().split("\n")[-1]  # after any progress bar of the model load
    assert last.startswith("goose: verify: the ") and "identical to ar" in last, err
    code, _, err = run(base + ["--verify", "--stream"], capsys)
    assert code == 2 and "cannot be combined with --stream" in err


def test_datastore_info_missing_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code, _, err = run(["datastore", "info", "--name", "nothing"], capsys)
    assert code == 2 and "no datastore 'nothing'" in err and err.count("\n") == 1


def test_multi_line_errors_are_printed_on_one_line(monkeypatch, capsys):
    from goose import cli
    from goose.errors import GooseError

    def boom(args):
        raise GooseError("first line\nsecond line")

    monkeypatch.setattr(cli, "cmd_datastore_info", boom)
    code, _, err = run(["datastore", "info"], capsys)
    assert code == 2 and err == "goose: error: first line second line\n"


HEAVY = ("torch", "transformers", "matplotlib", "numpy")


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--max-new-tokens", "x"], ["bench", "--methods", "nope"],
                                  ["demo", "--limit", "0"], ["report", "/nonexistent-goose-dir"]])
def test_help_and_argument_errors_import_no_torch(argv):
    """`goose --help` and bad arguments answer before torch, transformers, matplotlib or numpy load."""
    code = ("import sys\nfrom goose.cli import main\ntry:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    rc = e.code\nheavy = sorted({m.split('.')[0] for m in sys.modules} & set(%r))\n"
            "print('HEAVY', ','.join(heavy))\nsys.exit(rc)\n" % (HEAVY,))
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert res.returncode in (0, 2), res.stderr
    assert res.stdout.strip().splitlines()[-1] == "HEAVY", res.stdout[-300:]
    if argv != ["--help"]:
        assert res.returncode == 2 and res.stderr.startswith("goose: error:") and res.stderr.count("\n") == 1


def test_import_goose_is_light_and_names_resolve():
    code = ("import sys, goose\nassert not {m.split('.')[0] for m in sys.modules} & set(%r)\n"
            "from goose import Decoder, Engine, load_model, METHODS, DEFAULT_MODEL, GooseError\n"
            "import goose.decoding, goose.engine.scheduler\n"
            "assert goose.Decoder is goose.decoding.Decoder and goose.Engine is goose.engine.scheduler.Engine\n"
            "assert set(goose.__all__) <= set(dir(goose))\n"
            "try:\n    goose.nothing_here\nexcept AttributeError:\n    print('ok')\n" % (HEAVY,))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-500:]


def test_light_names_match_the_engine():
    """The command line's copies of names (checked without importing the engine) equal the engine's."""
    from goose import cliargs
    from goose.config import DEFAULT_PREFIX_CACHE_MB, EngineConfig
    from goose.engine.methods import METHODS

    assert cliargs.METHODS == METHODS
    assert EngineConfig().prefix_cache_mb == DEFAULT_PREFIX_CACHE_MB
    from goose.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]
    assert f"default {DEFAULT_PREFIX_CACHE_MB})" in " ".join(bench.format_help().split())


def test_registered_table_lists_what_each_module_registers():
    """`goose --help` lists other modules' subcommands from `cli.REGISTERED` without importing them: the table
    must name exactly what each module's `register` adds, with the same help."""
    import argparse
    import importlib

    from goose import cli

    for module, commands in cli.REGISTERED.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(module).register(sub)
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps == commands


def test_light_parser_builds_the_chosen_command_in_full(capsys):
    from goose.cli import _modules_for

    assert _modules_for(["bench", "--limit", "1"]) == {"goose.bench.cli"}
    assert _modules_for(["serve"]) == {"goose.server.cli"} and _modules_for(["--help"]) == set()
    assert _modules_for(["generate", "bench"]) == set()  # a prompt that happens to be a command's name
    code, out, _ = run(["demo", "--help"], capsys)
    assert code == 0 and "--limit" in out and "12 questions" in out


def test_a_closed_stdout_ends_quietly(tiny_dir):
    """`goose generate ... | head -c 10`: the reader is gone before goose prints; no traceback, status 141."""
    proc = subprocess.Popen([sys.executable, "-m", "goose", "generate", "--model", str(tiny_dir), "--max-new-tokens",
                             "4", "--json", "hello"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # nobody reads: goose's first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err


def test_no_text_without_chat_names_the_chat_flag(capsys):
    """The packaged instruct model ends at once on this raw prompt; goose says --chat may be what is missing, and
    says nothing when --chat is given."""
    argv = ["generate", "--max-new-tokens", "8", "Tell me a story."]
    code, out, err = run(argv, capsys)
    assert code == 0 and out.strip() == ""
    assert "--chat" in err
    code, out, err = run(argv + ["--stream"], capsys)
    assert code == 0 and out.strip() == "" and "--chat" in err
    code, out, err = run(argv + ["--chat"], capsys)
    assert code == 0 and out.strip() and "--chat" not in err


def test_train_head_refuses_a_bad_learning_rate_or_epochs_before_loading(tmp_path, capsys):
    for flag, value, words in (("--lr", "0", "--lr must be in (0, 1], got 0.0"),
                               ("--lr", "2", "--lr must be in (0, 1], got 2.0"),
                               ("--epochs", "0", "--epochs must be in (0, 100], got 0.0")):
        code, _, err = run(["train-head", "--out", str(tmp_path / "h"), flag, value], capsys)
        assert code == 2 and err == f"goose: error: {words}\n"
        assert not (tmp_path / "h").exists()
