"""goose bench: runner, resume, summary, report and plots on a tiny random Llama (no download)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from goose.bench import store
from goose.bench.cli import render_dir
from goose.bench.datasets import BUILTIN
from goose.bench.engines import hf_stats
from goose.bench.runner import Prompter, Runner
from goose.errors import GooseError

METHODS = ["pld", "tr", "goose", "hf-ar", "hf-pld"]  # `ar` is added by the runner
QUESTIONS = [BUILTIN[0], BUILTIN[2], BUILTIN[3]]  # coding, writing (two turns), qa
MAX_NEW = 12
PLOTS = ("speedup_by_category.png", "tau_by_category.png", "accept_length_hist.png", "tree_size_hist.png",
         "acceptance_by_depth.png")
METRICS = ("questions", "turns", "new_tokens", "wall_time_s", "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf_ar",
           "tau", "mat", "acceptance_rate_spine", "acceptance_rate_branch", "heterogeneity",
           "spine_continuation_share", "spine_continuation_token_share", "mean_tree_size", "lossless")


def make_tokenizer():
    """A word-level tokenizer over the built-in prompts' words, with a tiny chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    words = ["<unk>", "<s>", "</s>", "user", "assistant", ":"]
    for q in BUILTIN:
        for turn in q.turns:
            for w, _ in pre.pre_tokenize_str(turn):
                if w not in words:
                    words.append(w)
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant :{% endif %}")
    return tok


def make_model(vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture(scope="module")
def tiny():
    tok = make_tokenizer()
    return make_model(len(tok)), tok


def bench(tiny, out: Path, questions=QUESTIONS, methods=METHODS, model_id="tiny", chat=False):
    model, tok = tiny
    store.open_run(out, {"model": model_id, "dtype": "float32", "max_new_tokens": MAX_NEW, "chat": chat,
                         "methods": ["ar"] + methods, "dataset": "builtin", "commands": ["goose bench (test)"],
                         **{k: v for k, v in store.environment(model_id, model, "float32", "cpu", []).items()
                            if k not in ("model", "commands")}})
    runner = Runner(model, tok, methods, MAX_NEW, chat=chat, model_id=model_id)
    return runner.run(questions, out, progress=False)


@pytest.fixture(scope="module")
def run_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests that resume it run (threads are part of a run's settings)
    try:
        res = bench(tiny, out)
    finally:
        torch.set_num_threads(threads)
    assert (res.done, res.skipped, res.interrupted) == (3, 0, False)
    render_dir(out)
    return out


def test_answers_files_follow_spec_bench_format(run_dir):
    for m in ["ar"] + METHODS:
        rows = store.read_answers(store.answers_path(run_dir, m))
        assert [r["question_id"] for r in rows] == [q.question_id for q in QUESTIONS]
        for r, q in zip(rows, QUESTIONS):
            assert r["category"] == q.category and r["method"] == m and r["model_id"] == "tiny"
            c = r["choices"][0]
            n = len(q.turns)
            assert all(len(c[k]) == n for k in ("turns", "decoding_steps", "new_tokens", "wall_time"))
            assert all(isinstance(t, str) for t in c["turns"])
            assert all(0 < k <= MAX_NEW for k in c["new_tokens"])
            assert all(isinstance(a, int) and a >= 1 for a in c["accept_lengths"])
            assert len(r["token_ids"]) == len(r["lossless"]) == len(r["stats"]) == len(r["wall_times"]) == n
            assert [len(t) for t in r["token_ids"]] == c["new_tokens"]
            for s in r["stats"]:
                assert {"new_tokens", "forward_calls", "wall_time_s", "tau", "accept_lengths"} <= set(s)


def test_every_method_is_lossless_against_ar(run_dir):
    ar = store.read_answers(store.answers_path(run_dir, "ar"))
    for m in METHODS:
        rows = store.read_answers(store.answers_path(run_dir, m))
        for r, ref in zip(rows, ar):
            assert r["token_ids"] == ref["token_ids"]
            assert r["lossless"] == [True] * len(r["token_ids"])
            assert r["mismatches"] == [None] * len(r["token_ids"])


def test_hf_pld_steps_add_up(run_dir):
    # HF's prompt lookup, seen from outside: prefill token + tokens of every later step = new tokens
    for r in store.read_answers(store.answers_path(run_dir, "hf-pld")):
        c = r["choices"][0]
        assert 1 + sum(c["accept_lengths"]) == sum(c["new_tokens"]) - (len(c["new_tokens"]) - 1)
        assert sum(c["decoding_steps"]) == len(c["accept_lengths"]) + len(c["new_tokens"])


def test_summary_schema_and_lossless_column(run_dir):
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["methods"] == ["ar"] + METHODS
    assert s["categories"] == ["coding", "writing", "qa", "all"]
    assert s["questions"] == 3
    for key in ("model", "dtype", "device", "threads", "versions", "git_commit", "commands", "max_new_tokens"):
        assert key in s["meta"]
    for m in s["methods"]:
        for c in s["categories"]:
            cell = s["table"][m][c]
            assert set(METRICS) <= set(cell)
            assert cell["lossless"] == cell["turns"]
        assert s["table"][m]["all"]["turns"] == 4
        assert s["table"][m]["all"]["tau"] >= 1.0
    assert s["table"]["ar"]["all"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert s["table"]["hf-ar"]["all"]["speedup_vs_hf_ar"] == pytest.approx(1.0)
    assert s["table"]["ar"]["all"]["tau"] == pytest.approx(1.0)
    assert s["table"]["goose"]["all"]["mean_tree_size"] >= 1.0
    assert s["table"]["hf-pld"]["all"]["acceptance_rate_spine"] is None  # not observable from outside
    assert s["mismatches"] == []


def test_report_and_plots_written(run_dir):
    text = (run_dir / "report.md").read_text()
    assert "# goose bench report" in text and "## All categories" in text
    for m in ["ar"] + METHODS:
        assert f"| {m} |" in text
    for name in PLOTS:
        data = (run_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
        assert f"({name})" in text


def test_report_rerenders_from_files(run_dir, capsys):
    from goose.cli import main

    for name in PLOTS + ("report.md", "summary.json"):
        (run_dir / name).unlink()
    assert main(["report", str(run_dir)]) == 0
    assert all((run_dir / name).stat().st_size > 0 for name in PLOTS + ("report.md", "summary.json"))
    assert "speedup vs ar by category" in capsys.readouterr().out


def test_resume_skips_done_rows(tiny, run_dir, tmp_path):
    import shutil

    out = tmp_path / "resume"
    shutil.copytree(run_dir, out)
    before = {m: store.read_answers(store.answers_path(out, m)) for m in ["ar"] + METHODS}
    res = bench(tiny, out, questions=QUESTIONS + [BUILTIN[4]])
    assert (res.done, res.skipped) == (1, 3)
    for m, rows in before.items():
        after = store.read_answers(store.answers_path(out, m))
        assert after[:3] == rows and after[3]["question_id"] == BUILTIN[4].question_id
    # a method added later runs alone on the old questions, checked against the stored ar rows
    res = bench(tiny, out, questions=QUESTIONS + [BUILTIN[4]], methods=METHODS + ["iso3"])
    assert (res.done, res.skipped) == (4, 0)
    iso = store.read_answers(store.answers_path(out, "iso3"))
    assert len(iso) == 4 and all(all(r["lossless"]) for r in iso)
    assert len(store.read_answers(store.answers_path(out, "ar"))) == 4


def test_ctrl_c_keeps_finished_questions(tiny, tmp_path):
    model, tok = tiny
    out = tmp_path / "int"
    store.open_run(out, {"model": "tiny", "dtype": "float32", "max_new_tokens": MAX_NEW, "chat": False})
    runner = Runner(model, tok, ["pld"], MAX_NEW)
    real, calls = runner.engines["pld"], []

    class Interrupting:
        def generate(self, ids, n):
            calls.append(n)
            if len(calls) == 3:  # warm-up, question 1, then Ctrl-C during question 2
                raise KeyboardInterrupt
            return real.generate(ids, n)

    runner.engines["pld"] = Interrupting()
    res = runner.run(QUESTIONS[:2], out, progress=False)
    assert res.interrupted and res.done == 1
    assert len(store.read_answers(store.answers_path(out, "pld"))) == 1
    assert len(store.read_answers(store.answers_path(out, "ar"))) == 1


def test_multi_turn_prompts_carry_the_first_answer(tiny):
    model, tok = tiny
    q = BUILTIN[2]
    raw = Prompter(tok, model, chat=False)
    first = raw.turn_ids(q, 0, [])
    answer = [5, 6, 7, 2]  # ends with the stop token, which a raw context drops
    second = raw.turn_ids(q, 1, [answer])
    assert second[: len(first) + 3] == first + [5, 6, 7]
    assert second[len(first) + 3:] == tok("\n\n" + q.turns[1], add_special_tokens=False)["input_ids"]
    chat = Prompter(tok, model, chat=True)
    text = tok.decode(chat.turn_ids(q, 1, [answer]))
    assert text.count("user") == 2 and text.count("assistant") == 2


def test_chat_mode_runs_both_turns(tiny, tmp_path):
    res = bench(tiny, tmp_path / "chat", questions=[BUILTIN[2]], methods=["goose"], chat=True)
    assert res.done == 1
    row = store.read_answers(store.answers_path(tmp_path / "chat", "goose"))[0]
    assert len(row["choices"][0]["turns"]) == 2 and all(row["lossless"])


def test_chat_needs_a_template(tiny):
    model, tok = tiny
    plain = make_tokenizer()
    plain.chat_template = None
    with pytest.raises(GooseError, match="chat template"):
        Prompter(plain, model, chat=True)


def test_run_dir_of_another_model_is_refused(run_dir):
    meta = store.read_meta(run_dir)
    with pytest.raises(GooseError, match="model='tiny'"):
        store.open_run(run_dir, {**meta, "model": "other"})
    with pytest.raises(GooseError, match="max_new_tokens"):
        store.open_run(run_dir, {**meta, "max_new_tokens": MAX_NEW + 1})
    assert store.read_meta(run_dir)["model"] == "tiny"  # nothing changed


def test_reopening_a_run_removes_what_a_killed_run_was_writing(tmp_path):
    """A run killed while writing a plot (or summary, or answers file) leaves a temporary; the next run of the
    same directory removes it (its writer is gone) and keeps a live writer's."""
    from goose import cachefs

    out = tmp_path / "run"
    meta = {"model": "m", "dtype": "float32", "max_new_tokens": 4, "chat": False}
    store.open_run(out, meta)
    store.answers_dir(out).mkdir()
    dead = 2**22 + 12345  # above any pid this machine hands out (pid_max is at most 2^22)
    left = [out / f".speedup_by_category.png{cachefs.TMP_TAG}{dead}-00c0ffee",
            store.answers_dir(out) / f".ar.jsonl{cachefs.TMP_TAG}{dead}-00c0ffee"]
    live = cachefs.temp_path(out / "summary.json")  # this process's own, being written
    for p in left + [live]:
        p.write_bytes(b"partial")
    store.open_run(out, meta)
    assert not any(p.exists() for p in left) and live.exists()


def test_torn_last_line_is_repaired_and_bad_line_named(tmp_path):
    out = tmp_path / "torn"
    store.open_run(out, {"model": "m", "dtype": "float32", "max_new_tokens": 4, "chat": False})
    store.append_row(out, "ar", {"question_id": 1})
    path = store.answers_path(out, "ar")
    with path.open("a") as f:
        f.write('{"question_id": 2, "cho')  # killed mid-write
    store.open_run(out, {"model": "m", "dtype": "float32", "max_new_tokens": 4, "chat": False})
    assert store.read_answers(path) == [{"question_id": 1}] and path.read_text().endswith("}\n")
    path.write_text('{"question_id": 1}\nnot json\n{"question_id": 3}\n')
    with pytest.raises(GooseError, match="line 2"):
        store.read_answers(path)


def test_hf_stats_from_cache_lengths():
    # prompt 5; prefill, then forwards starting at cache 5, 6 (1 token), 9 (3 tokens), last one 2 tokens
    s = hf_stats(list(range(7)), [0, 5, 6, 9], 5, 1.0)
    assert s["forward_calls"] == 4 and s["accept_lengths"] == [0, 2, 1] and s["tau"] == pytest.approx(7 / 4)
    assert hf_stats([1, 2, 3], [0, 9, 9], 5, 1.0)["accept_lengths"] is None  # inconsistent: not guessed


def saved(tiny, tmp_path) -> Path:
    """The tiny model and tokenizer as a Hugging Face model directory."""
    model, tok = tiny
    mdir = tmp_path / "model"
    model.save_pretrained(mdir)
    tok.save_pretrained(mdir)
    return mdir


def test_cli_bench_on_a_model_directory(tiny, tmp_path, capsys):
    from goose.cli import main

    mdir = saved(tiny, tmp_path)
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "a", "category": "x", "turns": ["Write a short story about a robot"]}\n'
                    '{"id": "b", "category": "y", "turns": ["What is the capital of France ?"]}\n')
    out = tmp_path / "out"
    argv = ["bench", "--model", str(mdir), "--dataset", f"jsonl:{data}", "--methods", "pld,hf-ar",
            "--max-new-tokens", "6", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert (out / "report.md").is_file() and len(store.read_answers(store.answers_path(out, "ar"))) == 2
    assert main(argv) == 0  # resumed: nothing to run, report rendered again
    assert "2 questions already done" in capsys.readouterr().err
    assert main(argv[:-5] + ["--max-new-tokens", "7", "--out", str(out)]) == 2
    assert "max_new_tokens=6" in capsys.readouterr().err


def test_sampled_bench_checks_goose_methods_and_leaves_hf_unchecked(tiny, tmp_path, capsys):
    from goose.cli import main

    mdir = saved(tiny, tmp_path)
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "a", "category": "x", "turns": ["Write a short story about a robot"]}\n')
    out = tmp_path / "out"
    argv = ["bench", "--model", str(mdir), "--dataset", f"jsonl:{data}", "--methods", "pld,goose,hf-ar",
            "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--temperature", "1.5", "--top-p", "0.9",
            "--seed", "3"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    cells = {m: summary["table"][m]["all"] for m in ("ar", "pld", "goose", "hf-ar")}
    assert all(cells[m]["lossless"] == cells[m]["checked"] == 1 for m in ("ar", "pld", "goose"))
    assert cells["hf-ar"]["checked"] == 0
    report = (out / "report.md").read_text()
    assert "sampling (temperature 1.5, top-p 0.9, seed 3 per request)" in report and "n/a" in report
    assert main(argv[:-6] + ["--out", str(out)]) == 2  # greedy into a sampled run directory is refused
    assert "sampling=" in capsys.readouterr().err


def test_cli_bench_runs_lookahead_and_rest_and_reports_their_settings(tiny, tmp_path, monkeypatch, capsys):
    from goose.cli import main
    from goose.drafting import datastore

    mdir = saved(tiny, tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(mdir), "--dataset", "builtin", "--limit", "1", "--categories", "coding",
            "--methods", "lookahead,rest", "--max-new-tokens", "6", "--out", str(out), "--no-progress"]
    assert main(argv) == 2  # no datastore yet: refused before the model load, with the build command
    assert "goose datastore build --name default" in capsys.readouterr().err
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(" ".join(t for q in BUILTIN for t in q.turns))
    datastore.build(tiny[1], [str(corpus)], model=str(mdir))
    assert main(argv) == 0
    report = (out / "report.md").read_text()
    assert "- lookahead: window=7, ngram_size=5, guess_set_size=7" in report
    assert "- rest: datastore=default" in report and "datastore `default`" in report
    s = json.loads((out / "summary.json").read_text())
    assert s["methods"] == ["ar", "lookahead", "rest"]
    assert all(s["table"][m]["all"]["lossless"] == s["table"][m]["all"]["turns"] for m in s["methods"])


def test_resume_with_other_threads_device_or_code_is_refused(run_dir, tmp_path):
    """The timings of one run directory come from one setting: threads, device and code are pinned too."""
    import shutil

    out = tmp_path / "pinned"
    shutil.copytree(run_dir, out)
    meta = store.read_meta(out)
    assert meta["threads"] == 1 and meta["device"] == "cpu" and set(meta["software"]) >= {"goose", "torch"}
    for change, needle in (({"threads": 2}, "threads=1, not 2"), ({"device": "cuda"}, "device='cpu'"),
                           ({"software": {**meta["software"], "goose": "0.0.0+other"}}, "other software (goose")):
        with pytest.raises(GooseError, match=re.escape(needle)):
            store.open_run(out, {**meta, **change})
    assert store.read_meta(out) == meta  # nothing changed
    legacy = {k: v for k, v in meta.items() if k != "software"}
    (out / "run.json").write_text(json.dumps(legacy), encoding="utf-8")
    with pytest.raises(GooseError, match="recorded without its software"):
        store.open_run(out, meta)


def test_resume_keeps_the_first_runs_record(run_dir, tmp_path):
    import shutil

    out = tmp_path / "keep"
    shutil.copytree(run_dir, out)
    meta = store.read_meta(out)
    store.open_run(out, {**meta, "git_commit": "abc", "platform": "elsewhere", "commands": ["goose bench (again)"]})
    after = store.read_meta(out)
    assert after["platform"] == meta["platform"] and after["git_commit"] == meta["git_commit"]
    assert after["git_commits"] == [meta["git_commit"], "abc"]
    assert after["commands"] == meta["commands"] + ["goose bench (again)"]


def test_cli_bench_concurrency(tiny, tmp_path, capsys):
    """`--concurrency`: every method through one Engine, the lossless column against `ar` alone, and
    percentiles of TTFT / TPOT in the report; hf methods are refused there."""
    import json

    from goose.cli import main

    mdir = saved(tiny, tmp_path)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": i, "category": "x", "turns": [t]}) + "\n" for i, t in
                            enumerate(["Write a short story about a robot", "What is the capital of France ?",
                                       "a b c a b c a b", "One two three"])))
    out = tmp_path / "out"
    argv = ["bench", "--model", str(mdir), "--dataset", f"jsonl:{data}", "--methods", "goose,pld",
            "--max-new-tokens", "12", "--out", str(out), "--concurrency", "3"]
    assert main(argv) == 0
    rows = json.loads((out / "concurrency.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["goose", "pld", "ar"]  # in the order given, ar added last
    assert all(0 <= r["cached_tokens"] < r["prompt_tokens"] for r in rows)
    assert "prompt tokens cached" in (out / "concurrency.md").read_text()
    assert all(r["identical"] == r["requests"] == 4 and r["tokens"] > 0 for r in rows)
    assert all(0 <= r["ttft_p50_s"] <= r["ttft_p95_s"] for r in rows)
    assert "| goose |" in (out / "concurrency.md").read_text()
    assert json.loads((out / "concurrency.json").read_text())["meta"]["weights"] == "float32"  # a safetensors folder
    assert "float32 weights" in (out / "concurrency.md").read_text()
    assert main(argv[:-2] + ["--rate", "50"]) == 0  # Poisson arrivals
    assert main(argv[:6] + ["hf-ar"] + argv[7:]) == 2
    assert "cannot run there" in capsys.readouterr().err


def _linears(model) -> list:
    """Every module that multiplies by a weight matrix: `nn.Linear` and whatever goose swaps in for one."""
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) or type(m).__name__.endswith("Linear")]


def test_hf_baselines_run_on_their_own_plain_transformers_copy(tiny, tmp_path, monkeypatch):
    """`hf-ar` / `hf-pld` time Hugging Face's own modules and kernels: a copy of the model whose linear layers
    are all plain `nn.Linear`, never the model goose's methods run on (packed or quantized by goose)."""
    from goose.bench import engines, runner
    from goose.cli import main

    loaded, runners = [], []
    real_load, real_runner = engines.load_baseline, runner.Runner

    def spy_load(*a, **k):
        loaded.append(real_load(*a, **k))
        return loaded[-1]

    def spy_runner(*a, **k):
        runners.append(real_runner(*a, **k))
        return runners[-1]

    monkeypatch.setattr(engines, "load_baseline", spy_load)
    monkeypatch.setattr(runner, "Runner", spy_runner)
    mdir = saved(tiny, tmp_path)
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "a", "category": "x", "turns": ["Write a short story about a robot"]}\n')
    out = tmp_path / "out"
    assert main(["bench", "--model", str(mdir), "--dataset", f"jsonl:{data}", "--methods", "goose,hf-ar,hf-pld",
                 "--max-new-tokens", "6", "--out", str(out), "--no-progress"]) == 0
    assert len(loaded) == 1 and len(runners) == 1
    base = loaded[0][0]
    layers = _linears(base)
    assert layers and all(type(m) is torch.nn.Linear for m in layers)
    engines_ = runners[0].engines
    assert engines_["hf-ar"].model is base and engines_["hf-pld"].model is base
    assert engines_["goose"].decoder.model is not base  # goose's methods keep their own (packed) model
    assert json.loads((out / "run.json").read_text())["baseline_weights"] == "float32 (transformers)"


def test_goose_methods_alone_load_no_baseline(tiny, tmp_path, monkeypatch):
    from goose.bench import engines
    from goose.cli import main

    def refuse(*a, **k):
        raise AssertionError("a baseline copy was loaded without an hf-* method")

    monkeypatch.setattr(engines, "load_baseline", refuse)
    mdir = saved(tiny, tmp_path)
    data = tmp_path / "q.jsonl"
    data.write_text('{"id": "a", "category": "x", "turns": ["What is the capital of France ?"]}\n')
    assert main(["bench", "--model", str(mdir), "--dataset", f"jsonl:{data}", "--methods", "pld",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "out"), "--no-progress"]) == 0


def test_results_file_names_cpu_commit_command_and_every_method(run_dir):
    from goose.bench import results
    from goose.bench.summary import summarize

    summary = summarize(run_dir)
    load = results.load_line((1.5, 1.0, 1.0), (2.0, 1.0, 1.0))
    text = results.render(summary, "make results", "goose bench --limit 1", "Some CPU", "2026-01-01 00:00 UTC", load)
    assert "- CPU: Some CPU" in text and "before 1.5, after 2.0" in text
    assert "`make results`" in text and "goose bench --limit 1" in text
    assert "2026-01-01 00:00 UTC" in text and f"`{summary['meta'].get('git_commit')}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [r.split(" | ")[0][2:] for r in rows] == summary["methods"]
    hf = next(r for r in rows if r.startswith("| hf-ar "))
    assert " 1.00x " in hf  # hf-ar against itself
    assert results.cpu_name()  # lscpu, /proc/cpuinfo or platform: never empty


def test_make_results_benches_the_packaged_spec_bench_questions(monkeypatch, tmp_path):
    import goose.cli
    from goose.bench import results

    seen = []
    monkeypatch.setattr(goose.cli, "main", lambda argv: seen.append(argv) or 3)
    assert results.main(["--out", str(tmp_path / "r"), "--write", str(tmp_path / "r.md"), "--readme", ""]) == 3
    assert seen[0][:3] == ["bench", "--dataset", "spec-bench"] and "--chat" in seen[0]


def test_results_are_quoted_between_the_readme_markers():
    from goose.bench import results

    readme = "# x\n\nintro\n<!-- results: file -->\nold table\nold line\n<!-- end results -->\n\nrest\n"
    out = results.quote(readme, "# Current results\n\n- CPU: c\n\n| a |\n")
    assert out == "# x\n\nintro\n<!-- results: file -->\n- CPU: c\n\n| a |\n<!-- end results -->\n\nrest\n"
    assert results.quote(out, "# Current results\n\n- CPU: c\n\n| a |\n") == out  # idempotent
    with pytest.raises(GooseError, match="results"):
        results.quote("# no markers\n", "x")


def test_demo_verdict_says_what_the_numbers_mean(run_dir):
    from goose.bench.cli import demo_verdict
    from goose.bench.summary import summarize

    summary = summarize(run_dir)
    line = demo_verdict(summary)
    cell = summary["table"]["goose"]["all"]
    assert line.startswith("demo: goose made ") and "\n" not in line
    hf = summary["table"]["hf-ar"]["all"]["tokens_per_s"]
    assert f"{cell['tokens_per_s'] / hf:.2f}x Hugging Face generate" in line
    assert "hf-pld" in line and "(ar)" in line
    assert f"{cell['lossless']} of {cell['checked']} answers token-identical to ar" in line


def test_demo_runs_12_questions_with_goose_and_the_three_baselines(monkeypatch):
    from goose.bench import cli as bench_cli
    from goose.cli import main

    seen = {}

    def fake_run(args, questions, dataset, argv, replace=False):
        seen.update(methods=args.methods, questions=questions, dataset=dataset, tokens=args.max_new_tokens,
                    chat=args.chat, replace=replace)
        return 3  # (not 0: no verdict to print)

    monkeypatch.setattr(bench_cli, "run_bench", fake_run)
    assert main(["demo"]) == 3
    assert seen["methods"] == ["goose", "hf-ar", "hf-pld"] and seen["tokens"] == 48  # ar is added by the runner
    assert len(seen["questions"]) == 12 and len({q.question_id for q in seen["questions"]}) == 12
    assert seen["dataset"] == "humaneval,spec-bench"  # the packaged Spec-Bench questions
    assert [q.category for q in seen["questions"]][::2] == ["humaneval", *bench_cli.DEMO_CATEGORIES]
    assert seen["chat"] is True
    assert main(["demo", "--raw"]) == 3 and seen["chat"] is False
    assert seen["replace"] is True  # the demo's own directory: an old run of other software does not block it


def test_demo_moves_an_old_run_it_cannot_continue_aside_and_bench_refuses_it(tmp_path, monkeypatch, capsys):
    """After an upgrade `goose demo` (`make demo`) starts a new run: the old one goes to ``<out>.old`` (an older
    one there is replaced), while `goose bench` still refuses to mix runs in one directory."""
    import goose.loading.model as loading
    from goose.cli import main

    def stop(*a, **k):
        raise GooseError("stopped before loading")

    monkeypatch.setattr(loading, "load_model", stop)
    out = tmp_path / "demo"
    for d, tag in ((out, "new"), (tmp_path / "demo.old", "older")):
        d.mkdir()
        (d / "run.json").write_text(json.dumps({"model": "another", "software": "0.0.1"}), encoding="utf-8")
        (d / "tag").write_text(tag, encoding="utf-8")
    assert main(["bench", "--dataset", "builtin", "--limit", "1", "--out", str(out)]) != 0
    assert "another" in capsys.readouterr().err and (out / "tag").read_text(encoding="utf-8") == "new"
    assert main(["demo", "--out", str(out)]) != 0  # stopped at the model load, after the move
    err = capsys.readouterr().err
    assert f"moved to {tmp_path / 'demo.old'}, starting a new run" in err and "stopped before loading" in err
    assert not out.exists() and (tmp_path / "demo.old" / "tag").read_text(encoding="utf-8") == "new"
