"""A benchmark question, and the files questions are read from: Spec-Bench's question file (shipped inside the
package, its sha256 checked) and a user's JSONL. What `goose.bench.datasets` and `goose.bench.workloads` both
build on."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import GooseError

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
        row = json_line(line, path, n)
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


def json_line(line: str, path: Path, n: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise GooseError(f"{path} line {n}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise GooseError(f"{path} line {n}: expected a JSON object")
    return row
