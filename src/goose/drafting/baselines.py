"""Tree builders of the comparison methods: chains (PLD), Token Recycling's template, isotropic trees,
REST's frequency trie."""

from __future__ import annotations

from collections import Counter, deque
from typing import Iterable

from ..config import IsotropicConfig, TRConfig
from .adjacency import AdjacencyTable
from .tree import BRANCH, SPINE, DraftTree


def build_chain(anchor: int, chain: list[int], route: str = "chain") -> DraftTree:
    """root -> c1 -> c2 -> ... : a plain chain of context-matched tokens (empty chain = AR step)."""
    tree = DraftTree.root(anchor, route=route if chain else "ar")
    tree.add_chain(0, chain, SPINE)
    return tree


def build_tr_tree(anchor: int, adj: AdjacencyTable, cfg: TRConfig) -> DraftTree:
    """Fill Token Recycling's static template by BFS over the id matrix.

    A template path (r1, ..., rd) is the r_d-th successor of the node at (r1, ..., r_{d-1}). Paths whose
    parent is missing (unobserved token, or a duplicate sibling) are skipped.
    """
    tree = DraftTree.root(anchor)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for path in cfg.template:
        parent = node_of.get(path[:-1])
        if parent is None:
            continue
        succ = adj.successors(tree.tokens[parent])
        if succ is None or path[-1] >= len(succ[0]):
            continue
        idx = tree.add(parent, succ[0][path[-1]], BRANCH, path[-1])
        if idx >= 0:
            node_of[path] = idx
    if len(tree) == 1:
        tree.route = "ar"
    return tree


def build_isotropic_tree(anchor: int, prev_anchor: int | None, chain: list[int], budget: int,
                         adj: AdjacencyTable, cfg: IsotropicConfig) -> DraftTree:
    """Balanced control: BFS from the root, every node up to `width` children.

    Same sources as GOOSE: a node on the context chain offers the next chain token first, then its
    adjacency successors (score >= min_score); nodes at depth >= max_depth are not expanded.
    """
    tree = DraftTree.root(anchor)
    queue: deque[int] = deque([0])
    on_chain = {0: 0}  # node on the chain path -> position in the chain of its next token
    while queue and len(tree) < budget:
        node = queue.popleft()
        if tree.depths[node] >= cfg.max_depth:
            continue
        added = 0
        pos = on_chain.get(node)
        if pos is not None and pos < len(chain):
            idx = tree.add(node, chain[pos], SPINE)
            if idx >= 0:
                on_chain[idx] = pos + 1
                queue.append(idx)
                added += 1
        parent = tree.parents[node]
        succ = adj.successors(tree.tokens[node], prev_anchor if parent < 0 else tree.tokens[parent])
        if succ is not None:
            for rank, (tok, score) in enumerate(zip(*succ)):
                if added >= cfg.width or len(tree) >= budget or score < cfg.min_score:
                    break
                idx = tree.add(node, tok, BRANCH, rank)
                if idx >= 0:
                    queue.append(idx)
                    added += 1
    return tree


def build_trie(anchor: int, continuations: Iterable[tuple[int, ...]], budget: int) -> DraftTree:
    """REST's trie: the `budget` most frequent prefixes of the retrieved continuations, under the anchor.

    A prefix's count is the number of continuations that start with it, so a parent never counts less than
    its child: taking prefixes by (count desc, length asc, first seen) keeps the trie closed under parents.
    Siblings are ranked by count (0 = most frequent)."""
    counts: Counter = Counter()
    for cont in continuations:
        for d in range(1, len(cont) + 1):
            counts[cont[:d]] += 1
    order = {p: i for i, p in enumerate(counts)}  # first seen (Counter keeps insertion order)
    chosen = sorted(counts, key=lambda p: (-counts[p], len(p), order[p]))[: max(0, budget)]
    tree = DraftTree.root(anchor)
    node_of: dict[tuple[int, ...], int] = {(): 0}
    for prefix in chosen:
        parent = node_of[prefix[:-1]]
        node_of[prefix] = tree.add(parent, prefix[-1], SPINE, len(tree.children[parent]))
    if len(tree) == 1:
        tree.route = "ar"
    return tree
