"""GOOSE trees in SGLang's NGRAM format, read back by SGLang's own mask utilities, and the plugin's
registration. Runs from the vLLM venv (`make vllm` installs SGLang's Python sources with --no-deps);
SGLang's kernels have no CPU build, so its worker is not run here."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
from pathlib import Path

import numpy as np
import torch

from goose.drafting.tree import BRANCH, SPINE, DraftTree
from goose.integrations.sglang import batch_to_sglang, parents_from_mask, tree_to_sglang


def random_tree(rng: np.random.Generator, n: int, vocab: int = 50) -> DraftTree:
    tree = DraftTree.root(int(rng.integers(vocab)))
    while len(tree) < n:
        parent = int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)), SPINE if parent == len(tree) - 1 else BRANCH)
    return tree


def paths(tree: DraftTree, n: int) -> set[tuple[int, ...]]:
    """Token paths (from the root's token) of every leaf among the first n nodes."""
    keep = range(min(n, len(tree)))
    kids = {p for i, p in enumerate(tree.parents) if i in keep and p >= 0}
    return {tuple(tree.tokens[j] for j in tree.path_to(i)) for i in keep if i not in kids and i > 0}


def test_format_matches_sglang_mask_utilities():
    """SGLang's own readers of the mask: the NGRAM worker's host-side tree links (first child, next
    sibling) and its corpus's leaf-path extraction, on GOOSE trees."""
    import sglang.srt.speculative.cpp_ngram.ngram_corpus as corpus_mod

    # `_derive_tree_links` lives in ngram_worker, whose module imports SGLang's GPU kernels; take the
    # function's own source from the installed file
    src_file = Path(importlib.util.find_spec("sglang").origin).parent / "srt/speculative/ngram_worker.py"
    module = ast.parse(src_file.read_text())
    fn = next(node for node in module.body if isinstance(node, ast.FunctionDef) and node.name == "_derive_tree_links")
    ns = {"np": np, "torch": torch}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src_file), "exec"), ns)
    derive = ns["_derive_tree_links"]

    rng = np.random.default_rng(7)
    for _ in range(30):
        n = int(rng.integers(2, 20))
        trees = [random_tree(rng, int(rng.integers(1, n + 1))) for _ in range(int(rng.integers(1, 4)))]
        tokens, mask = batch_to_sglang(trees, n)
        nxt, sib = derive(mask, len(trees), n)
        for b, tree in enumerate(trees):
            full = tree_to_sglang(tree, n)
            parents = parents_from_mask(full[1], n)
            for i in range(n):
                kids = [k for k in range(n) if parents[k] == i]
                assert int(nxt[b, i]) == (kids[0] if kids else -1)
                p = parents[i]
                later = [k for k in range(i + 1, n) if p >= 0 and parents[k] == p]
                assert int(sib[b, i]) == (later[0] if later else -1)
            leafs = corpus_mod.NgramCorpus.leaf_paths_from_mask(None, full[0].tolist(),
                                                                 full[1].reshape(n, n).astype(int).tolist())
            pad = {(tree.tokens[0], 0)} if len(tree) < n else set()
            assert {tuple(p) for p in leafs} == paths(tree, n) | pad


def test_plugin_registers_goose():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from goose.integrations import sglang as plugin

    plugin.register()
    plugin.register()  # idempotent
    algo = SpeculativeAlgorithm.from_string("goose")
    assert algo.name == "GOOSE" and algo.is_ngram() and algo.is_speculative() and not algo.has_draft_kv()
    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "goose"]
    assert eps and eps[0].value == "goose.integrations.sglang:register"

