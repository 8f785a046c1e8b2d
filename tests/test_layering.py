"""Imports between goose's packages go one way (docs/architecture.md).

Every module's imports are read with `ast` (top-level, inside functions, under ``TYPE_CHECKING``, relative or
absolute) and checked against the layers below: a module may import its own package, its layer's leaves and
anything in a lower layer, never a higher one, and never one of the pairs in FORBIDDEN.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# top-level package or module of goose -> its layer (higher layers import lower ones, never the reverse)
LEAVES = ("config", "errors", "paths", "cachefs", "theory", "protocols", "progress", "machine")
FRONT_ENDS = ("decoding", "server", "bench", "cli", "cliargs", "integrations", "hub", "__init__", "__main__")
LAYERS: dict[str, int] = {
    **{name: 0 for name in LEAVES},
    "drafting": 1,
    "selection": 2,
    "backends": 3,
    "loading": 3,  # beside the backends: builds models on their modules
    "engine": 4,
    **{name: 5 for name in FRONT_ENDS},
}
# (importer, imported) pairs that the order alone would allow, or that sit in one layer, and must not happen
FORBIDDEN: dict[tuple[str, str], str] = {
    ("backends", "drafting"): "backends take plain data (parent lists, a Segment), not drafting's trees",
    ("backends", "loading"): "loading builds on the backends, not the other way round",
}


def part(module: str) -> str:
    """The top-level package or module of `module` (``goose.engine.step`` -> ``engine``; ``goose`` ->
    ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str, source: str, is_package: bool, modules: set[str]) -> list[tuple[str, int]]:
    """(imported goose module, line) for every import in `source`, relative ones resolved against `module`.
    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "goose"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "goose":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub if sub in modules else target, node.lineno))
    return list(dict.fromkeys(out))


def violations(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Every import in `sources` (module -> (source, is_package)) that breaks the layering, as one line each."""
    modules = set(sources)
    found = []
    for module, (source, is_package) in sorted(sources.items()):
        here = part(module)
        if here not in LAYERS:
            found.append(f"{module}: '{here}' has no layer; add it to LAYERS in tests/test_layering.py")
            continue
        for target, line in imports(module, source, is_package, modules):
            there = part(target)
            if there == here:
                continue
            if there not in LAYERS:
                found.append(f"{module}:{line} imports {target}: '{there}' has no layer")
            elif LAYERS[there] > LAYERS[here]:
                found.append(f"{module}:{line} imports {target}: '{here}' (layer {LAYERS[here]}) must not "
                             f"import '{there}' (layer {LAYERS[there]}, above it)")
            elif (here, there) in FORBIDDEN:
                found.append(f"{module}:{line} imports {target}: {FORBIDDEN[here, there]}")
    return found


def goose_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in sorted((SRC / "goose").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        out[module] = (path.read_text(encoding="utf-8"), is_package)
    return out


def test_goose_imports_follow_the_layers():
    found = violations(goose_sources())
    assert not found, "imports against the layering (docs/architecture.md):\n" + "\n".join(found)


def test_every_package_has_a_layer():
    names = {part(m) for m in goose_sources()}
    assert names <= set(LAYERS), f"no layer for: {sorted(names - set(LAYERS))}"


@pytest.mark.parametrize("module, source, is_package, bad", [
    # an upward import inside a function, relative
    ("goose.selection.acceptance", "def f():\n    from ..engine.verify import walk\n", False,
     "goose.selection.acceptance:2 imports goose.engine.verify: 'selection' (layer 2) must not import 'engine'"),
    # absolute, under TYPE_CHECKING
    ("goose.drafting.tree", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import goose.bench.cli\n", False,
     "goose.drafting.tree:3 imports goose.bench.cli: 'drafting' (layer 1) must not import 'bench'"),
    # `from .. import module` names the module
    ("goose.backends.lean", "from .. import loading\n", False, "goose.backends.lean:1 imports goose.loading: loading"),
    # a forbidden pair in the allowed direction of the order
    ("goose.backends", "from ..drafting.tree import DraftTree\n", True,
     "goose.backends:1 imports goose.drafting.tree: backends take plain data"),
    # an unknown top-level module
    ("goose.newthing", "x = 1\n", False, "goose.newthing: 'newthing' has no layer"),
])
def test_violations_are_found_and_named(module, source, is_package, bad):
    sources = {module: (source, is_package), "goose.engine.verify": ("", False), "goose.bench.cli": ("", False),
               "goose.loading": ("", True), "goose.drafting.tree": ("", False)}
    sources[module] = (source, is_package)
    found = violations(sources)
    assert any(line.startswith(bad) for line in found), found


def test_allowed_imports_pass():
    sources = {
        "goose.engine.step": ("from ..drafting.tree import ROOT\nfrom ..protocols import Segment\n"
                              "from . import stats\n", False),
        "goose.loading.gguf": ("from ..backends.quant import FORMATS\nfrom .stream import stream_load\n", False),
        "goose.cli": ("def main():\n    from .server.cli import register\n", False),
        "goose.config": ("from .errors import GooseError\n", False),
    }
    assert violations(sources) == []
