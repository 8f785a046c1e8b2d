"""The anisotropic spine tree under a node budget (GOOSE's draft tree).

A deep spine of context-matched tokens under the root, wide shallow branches of adjacency successors
hung off the root and the spine nodes, then a BFS extension of those branches while budget remains::

    root ── s1 ── s2 ── s3 ── s4          spine: chain[:L_s]
     ├─ b  ├─ b   └─ b                     branches: successors, skipping the next spine token
     └─ b  │                               (root first, then spine nodes with weights 1/(i+1))
           └─ b ── b                       BFS extension, width ~ remaining * score
"""

from __future__ import annotations

import math
from collections import deque

from ..config import GooseConfig, SpineTreeConfig
from .adjacency import AdjacencyTable
from .tree import BRANCH, MEMORY, SPINE, DraftTree


def spine_ratio(confidence: float, ema: float, cfg: SpineTreeConfig) -> float:
    """Share of the budget given to the spine: an EMA tier as base, pushed to 1 by confidence."""
    base = cfg.ema_top_base
    for below, tier_base in cfg.ema_tiers:
        if ema < below:
            base = tier_base
            break
    return base + confidence * (1.0 - base)


def tree_budget(confidence: float, cfg: GooseConfig) -> int:
    """B + int(c * (max_extended_chain - B)): confident chains may use more nodes."""
    b = cfg.tree.budget
    return b + int(confidence * max(0, cfg.ngram.max_extended_chain - b))


class _Brancher:
    """Hangs adjacency successors under tree nodes and keeps the FIFO for the BFS extension."""

    def __init__(self, tree: DraftTree, adj: AdjacencyTable, prev_anchor: int | None, budget: int,
                 cfg: SpineTreeConfig) -> None:
        self.tree, self.adj, self.prev_anchor, self.budget, self.cfg = tree, adj, prev_anchor, budget, cfg
        self.queue: deque[tuple[int, int, float]] = deque()  # (node, branch depth, score)

    def successors(self, node: int):
        parent = self.tree.parents[node]
        prev = self.prev_anchor if parent < 0 else self.tree.tokens[parent]
        return self.adj.successors(self.tree.tokens[node], prev)

    def hang(self, node: int, limit: int, skip: int | None, depth: int) -> int:
        """Add up to `limit` successors of `node` (not `skip`) as branch nodes at branch depth `depth`."""
        succ = self.successors(node)
        if succ is None:
            return 0
        added = 0
        for rank, (tok, score) in enumerate(zip(*succ)):
            if added >= limit or len(self.tree) >= self.budget or score < self.cfg.min_score:
                break
            if tok == skip:
                continue
            idx = self.tree.add(node, tok, BRANCH, rank)
            if idx >= 0:
                self.queue.append((idx, depth, score))
                added += 1
        return added

    def extend(self) -> None:
        """BFS over queued branch nodes: width = max(1, min(|succ|, ceil(remaining * score)))."""
        k = self.adj.k
        while self.queue and len(self.tree) < self.budget:
            node, depth, score = self.queue.popleft()
            if depth >= self.cfg.max_branch_depth:
                continue
            succ = self.successors(node)
            if succ is None:
                continue
            remaining = self.budget - len(self.tree)
            width = max(1, min(len(succ[0]), math.ceil(remaining * score)))
            width = min(width, max(1, k // depth))
            self.hang(node, width, None, depth + 1)


def build_spine_tree(anchor: int, prev_anchor: int | None, chain: list[int], confidence: float,
                     ema: float, adj: AdjacencyTable, cfg: GooseConfig, cap: int | None = None,
                     spine_ranks: list[int] | None = None, alternatives=(), branches: bool = True,
                     branch_cap: int | None = None) -> DraftTree:
    """The GOOSE tree for one step; with no chain it is a pure adjacency tree. `cap`: at most this
    many nodes, root included, whatever the chain's confidence allows. `branches`: False builds the spine (and
    any memory alternatives) without adjacency branches; `branch_cap`: at most this many adjacency branch
    nodes (shared as without it: root, spine nodes, BFS extension), the spine's share of the budget unchanged.

    A spine from the suffix memory comes with `spine_ranks` (its nodes are MEMORY nodes of these ranks) and
    `alternatives`: (spine index or -1 for the root, tokens, rank) paths hung as MEMORY nodes before any
    adjacency branch."""
    tcfg = cfg.tree
    tree = DraftTree.root(anchor)
    budget = tree_budget(confidence, cfg) if cap is None else max(2, min(cap, tree_budget(confidence, cfg)))
    n_spine = min(len(chain), int(budget * spine_ratio(confidence, ema, tcfg)), budget - 1)
    if spine_ranks is None:
        spine = tree.add_chain(0, chain[:n_spine], SPINE)
    else:
        spine, parent = [], 0
        for tok, rank in zip(chain[:n_spine], spine_ranks):
            parent = tree.add(parent, tok, MEMORY, rank)
            spine.append(parent)
        for at, toks, rank in alternatives:
            if at >= len(spine):
                continue
            parent = 0 if at < 0 else spine[at]
            for tok in toks:
                if len(tree) >= budget:
                    break
                parent = tree.add(parent, tok, MEMORY, rank)
                if parent < 0:
                    break
    if not branches:
        return tree
    n_spine = len(spine)
    branch_budget = budget - 1 - n_spine
    if branch_cap is not None and branch_budget > branch_cap:
        branch_budget = branch_cap
        budget = len(tree) + branch_cap
    spine_share = max(1, int(branch_budget * tcfg.spine_branch_share)) if n_spine and branch_budget > 0 else 0
    root_share = branch_budget - spine_share

    br = _Brancher(tree, adj, prev_anchor, budget, tcfg)
    br.hang(0, root_share, chain[0] if n_spine else None, 1)
    weights = [1.0 / (i + 1) for i in range(n_spine)]
    total_w = sum(weights)
    left = spine_share
    for i, node in enumerate(spine):
        if left <= 0:
            break
        want = min(left, max(1, round(spine_share * weights[i] / total_w)))
        skip = chain[i + 1] if i + 1 < n_spine else None
        left -= br.hang(node, want, skip, 1)
    br.extend()
    return tree
