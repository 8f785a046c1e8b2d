"""goose bench datasets: the real packages, the packaged Spec-Bench file, and bad input."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import goose
from goose.bench import datasets, questions
from goose.bench.cli import parse_methods
from goose.errors import GooseError

SPEC_BENCH = questions.SPEC_BENCH_FILE


def test_humaneval_has_164_prompts():
    qs = datasets.load("humaneval")
    assert len(qs) == 164 and qs[0].question_id == "HumanEval/0"
    assert {q.category for q in qs} == {"humaneval"} and all(len(q.turns) == 1 for q in qs)
    assert "def " in qs[0].turns[0]


def test_sharegpt_first_human_turns():
    qs = datasets.load("sharegpt", limit=5)
    assert len(qs) == 5 and {q.category for q in qs} == {"sharegpt"}
    assert all(len(q.turns) == 1 and q.turns[0].strip() for q in qs)
    assert qs[0].turns[0].startswith("Summarize the main ideas of Jeff Walker")


def test_spec_bench_ships_inside_the_package_with_its_checksum(monkeypatch, tmp_path):
    """`spec-bench` without a path reads the copy inside the installed package (no folder beside the repository),
    whose sha256 is the one its NOTICE states."""
    monkeypatch.chdir(tmp_path)  # nothing found from the working directory
    path = datasets.spec_bench_file()
    assert path == SPEC_BENCH and path.is_file()
    assert path.is_relative_to(Path(goose.__file__).resolve().parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == questions.SPEC_BENCH_SHA256
    assert questions.SPEC_BENCH_SHA256 in (path.parent / "NOTICE.md").read_text(encoding="utf-8")
    qs = datasets.load("spec-bench")
    assert len(qs) == 480 and len({q.category for q in qs}) == 13
    assert {q.category for q in qs} == set(datasets.SPEC_BENCH_CATEGORIES)


def test_spec_bench_file_and_subsets(tmp_path):
    qs = datasets.load("spec-bench")
    assert len(qs) == 480
    cats = {q.category for q in qs}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag"} <= cats
    assert set(datasets.MT_BENCH_CATEGORIES) <= cats
    mt = datasets.load("mt-bench")
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    gsm = datasets.load("gsm8k")
    assert len(gsm) == 80 and {q.category for q in gsm} == {"math_reasoning"}
    copy = tmp_path / "question.jsonl"  # an explicit PATH is read as it is
    shutil.copyfile(SPEC_BENCH, copy)
    assert datasets.load(f"spec-bench:{copy}") == qs and datasets.load(f"mt-bench:{copy}") == mt
    copy.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n', encoding="utf-8")
    assert [q.question_id for q in datasets.load(f"spec-bench:{copy}")] == [1]


def test_a_changed_packaged_spec_bench_file_is_a_one_line_error(monkeypatch, tmp_path):
    bad = tmp_path / "question.jsonl"
    bad.write_bytes(SPEC_BENCH.read_bytes().replace(b"Hawaii", b"Hawai'i", 1))
    monkeypatch.setattr(questions, "SPEC_BENCH_FILE", bad)
    for spec in ("spec-bench", "multiturn"):
        with pytest.raises(GooseError) as err:
            datasets.load(spec)
        assert "sha256" in str(err.value) and questions.SPEC_BENCH_SHA256 in str(err.value)
        assert "\n" not in str(err.value)
    monkeypatch.setattr(questions, "SPEC_BENCH_FILE", tmp_path / "missing.jsonl")
    with pytest.raises(GooseError, match="cannot be read"):
        datasets.load("gsm8k")


def test_limit_is_per_category_and_categories_filter():
    qs = datasets.load("humaneval,spec-bench", ["humaneval", "qa", "rag"], limit=3)
    assert [q.category for q in qs] == ["humaneval"] * 3 + ["qa"] * 3 + ["rag"] * 3
    assert len(datasets.load("spec-bench", limit=2)) == 2 * 13


def test_builtin_and_jsonl(tmp_path):
    assert len(datasets.load("builtin")) == len(datasets.BUILTIN)
    p = tmp_path / "q.jsonl"
    p.write_text('{"id": 1, "category": "a", "turns": ["hi", "again"]}\n\n{"id": "x", "turns": ["yo"]}\n')
    qs = datasets.load(f"jsonl:{p}")
    assert qs == [datasets.Question(1, "a", ("hi", "again")), datasets.Question("x", "default", ("yo",))]


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown dataset 'nope'"),
    ("jsonl", "needs a file"),
    ("jsonl:/does/not/exist.jsonl", "not found"),
    ("builtin,builtin", "appears more than once"),
])
def test_bad_dataset_specs(spec, message):
    with pytest.raises(GooseError, match=message):
        datasets.load(spec)


@pytest.mark.parametrize("text, message", [
    ('{"id": 1, "turns": ["a"]}\n{"id": 2, "turns": ["b"\n', "line 2: not valid JSON"),
    ('{"id": 1, "turns": ["a"]}\n{"id": 2, "turns": []}\n', "line 2: 'turns'"),
    ('{"id": 1, "turns": "a"}\n', "line 1: 'turns'"),
    ('{"turns": ["a"]}\n', "line 1: needs an 'id'"),
    ('[1, 2]\n', "line 1: expected a JSON object"),
    ('{"id": 1, "category": 3, "turns": ["a"]}\n', "line 1: 'category'"),
    ('\n', "holds no questions"),
])
def test_malformed_files_name_the_line(tmp_path, text, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(text)
    with pytest.raises(GooseError, match=message):
        datasets.load(f"jsonl:{p}")


def test_unknown_category_and_bad_limit():
    with pytest.raises(GooseError, match="unknown category 'poetry'.*it has: coding"):
        datasets.load("builtin", ["poetry"])
    with pytest.raises(GooseError, match="--limit must be >= 1"):
        datasets.load("builtin", limit=0)


def test_unknown_method():
    assert parse_methods("ar, goose,hf-pld") == ["ar", "goose", "hf-pld"]
    with pytest.raises(GooseError, match="unknown method 'eagle'"):
        parse_methods("ar,eagle")


@pytest.mark.parametrize("argv, message", [
    (["bench", "--dataset", "nope"], "unknown dataset"),
    (["bench", "--limit", "0"], "--limit must be >= 1"),
    (["bench", "--methods", "ar,fast"], "unknown method 'fast'"),
    (["bench", "--categories", "poetry"], "unknown category"),
    (["report", "/does/not/exist"], "not a directory"),
])
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path):
    from goose.cli import main

    assert main(argv + (["--out", str(tmp_path / "o")] if argv[0] == "bench" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("goose: error:") and message in err and "\n" not in err
    assert not (tmp_path / "o").exists()  # nothing created before the input is valid


def test_report_of_a_dir_without_run(tmp_path, capsys):
    from goose.cli import main

    assert main(["report", str(tmp_path)]) == 2
    assert "not a goose bench directory" in capsys.readouterr().err
