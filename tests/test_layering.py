"""Imports between goose's packages go one way (docs/architecture.md); front ends reach the engine's requests and
goose's protocol objects only through their members.

Every module's imports are read with `ast` (top-level, inside functions, under ``TYPE_CHECKING``, relative or
absolute) and checked against the layers below: a module may import its own package, its layer's leaves and
anything in a lower layer, never a higher one, and never one of the pairs in FORBIDDEN. Nor may two modules import
each other, directly or around a longer loop (an import circle), beyond those in ALLOWED_CIRCLE (none).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# top-level package or module of goose -> its layer (higher layers import lower ones, never the reverse)
LEAVES = ("config", "errors", "paths", "cachefs", "theory", "protocols", "progress", "machine", "names")
FRONT_ENDS = ("decoding", "server", "bench", "cli", "cliargs", "integrations", "hub", "headtrain", "__init__",
              "__main__")
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
# Import circles allowed, as the (importer, imported) pairs left out when circles are looked for: none (the GGUF
# reader lives in loading/gguf_file.py and the file digest in loading/digest.py, below the loader in
# loading/gguf.py). Any circle fails.
ALLOWED_CIRCLE: dict[tuple[str, str], str] = {}


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


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, dict[str, int]]:
    """module -> {goose module it imports: the line of the first such import}, for every module in `sources`
    (module -> (source, is_package)); a module's imports of itself left out."""
    modules = set(sources)
    graph: dict[str, dict[str, int]] = {}
    for module, (source, is_package) in sources.items():
        edges = graph[module] = {}
        for target, line in imports(module, source, is_package, modules):
            if target in modules and target != module:
                edges.setdefault(target, line)
    return graph


def _loop(graph: dict[str, dict[str, int]], group: set[str]) -> list[str]:
    """The shortest loop through `group`'s first module (by name) inside `group`, as its modules in order."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for module in frontier:
            for target in sorted(graph[module]):
                if target == start:
                    path = [module]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return path[::-1]
                if target in group and target not in came:
                    came[target] = module
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"no loop through {start}")


def circles(sources: dict[str, tuple[str, bool]], allowed=ALLOWED_CIRCLE) -> list[str]:
    """Every import circle among `sources`' modules (the imports in `allowed` left out), one line each: a loop
    through it with the line of each import, and the modules it joins when those are more than the loop."""
    graph = import_graph(sources)
    for importer, imported in allowed:
        graph.get(importer, {}).pop(imported, None)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []
    for root in sorted(graph):  # Tarjan's strongly connected components, without recursion
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[module])
                if low[module] == index[module]:
                    group = set()
                    while True:
                        member = stack.pop()
                        group.add(member)
                        if member == module:
                            break
                    if len(group) > 1:
                        groups.append(group)
            elif target not in index:
                index[target] = low[target] = len(index)
                stack.append(target)
                work.append((target, iter(sorted(graph[target]))))
            elif target in stack:
                low[module] = min(low[module], index[target])
    found = []
    for group in sorted(groups, key=min):
        loop = _loop(graph, group)
        steps = " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(loop, loop[1:] + loop[:1]))
        rest = sorted(group - set(loop))
        found.append(f"{steps} -> {loop[0]}" + (f" (the circle also holds {', '.join(rest)})" if rest else ""))
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


def test_no_import_circles():
    found = circles(goose_sources())
    assert not found, ("import circles between goose's modules (module:line of each import; move what both need "
                       "into the lower module or a new one):\n" + "\n".join(found))


def test_the_allowed_circle_is_still_one():
    """An entry of ALLOWED_CIRCLE that no longer closes a circle is removed, so the exception never outlives it."""
    sources = goose_sources()
    graph = import_graph(sources)
    for importer, imported in ALLOWED_CIRCLE:
        assert imported in graph.get(importer, {}), f"{importer} no longer imports {imported}: remove the pair " \
                                                    f"from ALLOWED_CIRCLE in tests/test_layering.py"
        others = {pair: why for pair, why in ALLOWED_CIRCLE.items() if pair != (importer, imported)}
        assert set(circles(sources, others)) - set(circles(sources)), \
            f"{importer} -> {imported} closes no circle: remove it from ALLOWED_CIRCLE in tests/test_layering.py"


# names under which goose's own protocol objects travel (`goose.protocols`: a forward, its caches and segments,
# a cost model; `goose.engine.methods.Method`): their optional behaviour is a protocol member with a default, so
# nothing probes them with getattr / hasattr
PROTOCOL_NAMES = {"forward", "fwd", "cache", "kv_cache", "segment", "seg", "cost", "curve", "method", "template",
                  "tpl"}


def _name(node) -> str | None:
    """The last identifier of a name or attribute expression (``self.forward`` -> ``forward``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def reaches_inside(module: str, source: str) -> list[str]:
    """Where `module`, a front end, reads a request's engine-side state (`.slot`; the layers below the engine
    cannot import it, so never hold a request), or any module probes a protocol object with getattr / hasattr,
    one line each."""
    found = []
    front_end = LAYERS.get(part(module)) == LAYERS["decoding"]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "slot" and front_end:
            found.append(f"{module}:{node.lineno} reads .slot (a request's engine-side state): use the Request's "
                         f"own members")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args and _name(node.args[0]) in PROTOCOL_NAMES):
            found.append(f"{module}:{node.lineno} {node.func.id}() on {_name(node.args[0])}: make it a protocol "
                         f"member with a default (goose.protocols)")
    return found


def test_front_ends_use_requests_and_protocols_through_their_members():
    found = [line for module, (source, _) in sorted(goose_sources().items()) for line in reaches_inside(module, source)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module, source, bad", [
    ("goose.server.app", "def f(req):\n    return req.slot.stats\n", "goose.server.app:2 reads .slot"),
    ("goose.engine.measure", "def f(forward):\n    return getattr(forward, 'weight_bytes', None)\n",
     "goose.engine.measure:2 getattr() on forward"),
    ("goose.bench.x", "def f(self):\n    return hasattr(self.method, 'memory')\n",
     "goose.bench.x:2 hasattr() on method"),
])
def test_reaching_inside_is_found(module, source, bad):
    assert any(line.startswith(bad) for line in reaches_inside(module, source))
    assert reaches_inside("goose.engine.scheduler", "def f(r):\n    return r.slot.out\n") == []


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


@pytest.mark.parametrize("sources, loop", [
    # two modules, one import inside a function
    ({"goose.bench.a": "from .b import x\n", "goose.bench.b": "def f():\n    from . import a\n"},
     "goose.bench.a:1 -> goose.bench.b:2 -> goose.bench.a"),
    # three, across packages, absolute and relative
    ({"goose.engine.x": "import goose.drafting.y\n", "goose.drafting.y": "from ..selection import z\n",
      "goose.selection.z": "x = 1\nfrom goose.engine.x import f\n"},
     "goose.drafting.y:1 -> goose.selection.z:2 -> goose.engine.x:1 -> goose.drafting.y"),
])
def test_circles_are_found_and_listed(sources, loop):
    found = circles({m: (s, False) for m, s in sources.items()}, allowed={})
    assert found == [loop]


def test_an_allowed_import_closes_no_circle():
    sources = {"goose.bench.a": ("from .b import x\n", False), "goose.bench.b": ("from .a import y\n", False),
               "goose.bench.c": ("from .a import y\n", False)}
    assert circles(sources, allowed={("goose.bench.b", "goose.bench.a"): "why"}) == []
    assert len(circles(sources, allowed={})) == 1
