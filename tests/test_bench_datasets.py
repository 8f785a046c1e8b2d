"""goose bench datasets: the real packages, the shared Spec-Bench file, and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from goose.bench import datasets
from goose.bench.cli import parse_methods
from goose.errors import GooseError

SHARED = Path(__file__).resolve().parents[2] / "shared"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
needs_spec_bench = pytest.mark.skipif(not SPEC_BENCH.is_file(), reason=f"{SPEC_BENCH} not present")


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


@needs_spec_bench
def test_spec_bench_file_and_subsets():
    qs = datasets.load(f"spec-bench:{SPEC_BENCH}")
    assert len(qs) == 480
    cats = {q.category for q in qs}
    assert {"translation", "summarization", "qa", "math_reasoning", "rag"} <= cats
    assert set(datasets.MT_BENCH_CATEGORIES) <= cats
    mt = datasets.load(f"mt-bench:{SPEC_BENCH}")
    assert len(mt) == 80 and all(len(q.turns) == 2 for q in mt)
    gsm = datasets.load(f"gsm8k:{SPEC_BENCH}")
    assert len(gsm) == 80 and {q.category for q in gsm} == {"math_reasoning"}


@needs_spec_bench
def test_limit_is_per_category_and_categories_filter():
    qs = datasets.load(f"humaneval,spec-bench:{SPEC_BENCH}", ["humaneval", "qa", "rag"], limit=3)
    assert [q.category for q in qs] == ["humaneval"] * 3 + ["qa"] * 3 + ["rag"] * 3
    assert len(datasets.load(f"spec-bench:{SPEC_BENCH}", limit=2)) == 2 * 13


def test_builtin_and_jsonl(tmp_path):
    assert len(datasets.load("builtin")) == len(datasets.BUILTIN)
    p = tmp_path / "q.jsonl"
    p.write_text('{"id": 1, "category": "a", "turns": ["hi", "again"]}\n\n{"id": "x", "turns": ["yo"]}\n')
    qs = datasets.load(f"jsonl:{p}")
    assert qs == [datasets.Question(1, "a", ("hi", "again")), datasets.Question("x", "default", ("yo",))]


@pytest.mark.parametrize("spec, message", [
    ("nope", "unknown dataset 'nope'"),
    ("spec-bench", "needs a file"),
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


@needs_spec_bench
def test_demo_finds_the_shared_spec_bench_file():
    from goose.bench.cli import spec_bench_file

    assert spec_bench_file().resolve() == SPEC_BENCH.resolve()
