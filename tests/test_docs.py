"""The documentation's links resolve, and nothing in the repository reads data from outside it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor; a repeated heading gets -1, -2, ... as on GitHub."""
    out: set[str] = set()
    count: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            s = slug(m.group(1))
            out.add(f"{s}-{count[s]}" if s in count else s)
            count[s] = count.get(s, 0) + 1
    return out


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t) and ("." in t or t.startswith("#"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_reach_a_file_and_its_heading(doc):
    broken = []
    for target in links(doc):
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_slug_follows_github():
    assert slug("2026-12-02: AMD EPYC Zen 5 with AVX-512 (VNNI, no AMX)") == (
        "2026-12-02-amd-epyc-zen-5-with-avx-512-vnni-no-amx")
    assert slug("Session workloads, cold and warm (`goose bench --memory`)") == (
        "session-workloads-cold-and-warm-goose-bench---memory")
    assert slug("vLLM's `suffix` method on the same sessions") == "vllms-suffix-method-on-the-same-sessions"


def test_nothing_reads_the_folder_beside_the_repository():
    """Commands, code and tests use the packaged data; only the dated records of past runs
    (docs/performance-log.md, docs/results/*/) keep the commands as they were run."""
    beside, data = ".." + "/shared", "shared" + "/data"
    files = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "benchmarks").glob("*.py")),
             *sorted((ROOT / "tests").glob("*.py")), ROOT / "docs" / "results" / "current.md"]
    found = [f"{f.relative_to(ROOT)}:{n}" for f in files if f.name != "performance-log.md"
             for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
             if beside in line or data in line]
    assert not found, found
