"""What a wheel built from the repository holds: every kernel source and every local header the sources include
(`team.h` was left out of the package data once, so a wheel could not compile its kernels while editable
installs never noticed), matched by pyproject.toml's package-data patterns."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "src" / "goose" / "backends"


def _included(path: Path, seen: set[Path]) -> set[Path]:
    """`path` and every local header it includes (``#include "x.h"``), transitively."""
    if path in seen:
        return seen
    seen.add(path)
    for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', path.read_text(encoding="utf-8"), re.M):
        _included((path.parent / name).resolve(), seen)
    return seen


def test_the_package_data_holds_every_kernel_source_and_header_they_include():
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    backend_patterns = patterns["goose.backends"]
    needed: set[Path] = set()
    for source in BACKENDS.glob("*.cpp"):
        _included(source.resolve(), needed)
    assert {p.name for p in needed} >= {"cpu_kernels.cpp", "int8_kernels.cpp", "quant_kernels.cpp", "team.h"}
    missing = [p.name for p in needed if p.parent != BACKENDS.resolve()
               or not any(fnmatch.fnmatch(p.name, pat) for pat in backend_patterns)]
    assert not missing, f"kernel files a wheel would lack: {missing}"
