"""The SGLang plugin's pure parts: GOOSE trees -> SGLang's NGRAM (tokens, ancestor mask) format, and the
drafter. tests_vllm/test_sglang_format.py checks the format against SGLang's own mask utilities (its
Python sources are in the vLLM venv); the worker itself needs SGLang's kernels (GPU) and is not run here."""

from __future__ import annotations

import numpy as np
import torch

from goose.drafting.tree import BRANCH, SPINE, DraftTree
from goose.integrations.sglang import (
    GooseTreeDrafter,
    accepted_path,
    batch_to_sglang,
    parents_from_mask,
    tree_to_sglang,
)


def random_tree(rng: np.random.Generator, n: int, vocab: int = 50) -> DraftTree:
    tree = DraftTree.root(int(rng.integers(vocab)))
    while len(tree) < n:
        parent = int(rng.integers(len(tree)))
        tree.add(parent, int(rng.integers(vocab)), SPINE if parent == len(tree) - 1 else BRANCH)
    return tree


def paths(tree: DraftTree, n: int) -> set[tuple[int, ...]]:
    """Token paths (root excluded) of every leaf among the first n nodes."""
    keep = range(min(n, len(tree)))
    kids = {p for i, p in enumerate(tree.parents) if i in keep and p >= 0}
    return {tuple(tree.tokens[j] for j in tree.path_to(i)[1:]) for i in keep if i not in kids and i > 0}


def test_small_tree_exact():
    #   0(a) ─ 1(b) ─ 2(c)
    #    └──── 3(d)
    tree = DraftTree.root(10)
    tree.add(0, 11, SPINE)
    tree.add(1, 12, SPINE)
    tree.add(0, 13, BRANCH)
    tokens, mask = tree_to_sglang(tree, 6)
    assert tokens.tolist() == [10, 11, 12, 13, 0, 0]
    assert tokens.dtype == np.int64 and mask.dtype == bool and mask.shape == (36,)
    want = np.array([[1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0],
                     [1, 0, 0, 1, 0, 0],
                     [1, 0, 0, 0, 1, 0],   # padding: token 0 under the root, as SGLang pads
                     [1, 0, 0, 0, 0, 1]], dtype=bool)
    assert (mask.reshape(6, 6) == want).all()


def test_round_trip_and_truncation():
    rng = np.random.default_rng(1)
    for _ in range(50):
        tree = random_tree(rng, int(rng.integers(1, 30)))
        n = int(rng.integers(2, 24))
        tokens, mask = tree_to_sglang(tree, n)
        keep = min(n, len(tree))
        assert parents_from_mask(mask, n)[:keep] == tree.parents[:keep]
        assert tokens[:keep].tolist() == tree.tokens[:keep]
    toks, masks = batch_to_sglang([random_tree(rng, 5), random_tree(rng, 9)], 8)
    assert toks.shape == (16,) and masks.shape == (128,)


def test_accepted_path():
    tree = DraftTree.root(1)
    a = tree.add(0, 2, SPINE)
    b = tree.add(a, 3, SPINE)
    c = tree.add(0, 4, BRANCH)
    assert accepted_path(tree, [2, 3]) == [0, a, b]
    assert accepted_path(tree, [4]) == [0, c]
    assert accepted_path(tree, [5, 2]) == [0]


def test_drafter_fills_the_budget_with_spine_and_branches():
    """A repeated context gives a spine; after one harvest the root and spine get branches; every
    tree fits SGLang's node count and its nodes come in SGLang-compatible (topological) order."""
    vocab, n = 40, 12
    d = GooseTreeDrafter(vocab, n)
    ctx = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]
    tree = d.draft("r1", ctx)
    assert tree.tokens[0] == 8 and tree.count(SPINE) >= 3
    assert [tree.tokens[i] for i in tree.path_to(3)[1:]] == [9, 10, 11]
    logits = torch.randn(len(tree), vocab)
    d.harvest(tree, logits)
    d.observe("r1", tree, [9, 10])
    tree2 = d.draft("r1", ctx + [9, 10, 11])
    assert 1 < len(tree2) <= n and tree2.count(BRANCH) >= 1
    assert all(p < i for i, p in enumerate(tree2.parents) if i)
    d.retain([])
    assert not d.requests


def test_drafter_state_follows_the_request():
    d = GooseTreeDrafter(30, 8)
    d.draft("a", [1, 2, 3, 1, 2])
    st = d.requests["a"]
    d.draft("a", [1, 2, 3, 1, 2, 3, 4])
    assert d.requests["a"] is st and st.index.tokens == [1, 2, 3, 1, 2, 3, 4]
    d.draft("a", [9, 9, 9])  # a different context under the same id starts fresh
    assert d.requests["a"] is not st
