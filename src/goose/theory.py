"""Executable theory of anisotropic speculation trees: the two-source acceptance model.

A draft tree is verified in one forward; the greedy walk accepts the longest root path that matches
the target. Under the standard independence model, node v is accepted with probability
P(v) = prod of the conditional acceptance probabilities on its root path, so

    E[accepted tokens] = sum over non-root nodes v of P(v)          (expected_accepted)

**Two sources.** A spine chain (context matching) whose next token is right with probability p_s,
and adjacency candidates whose k-th ranked successor is right with probability q_k (``p_t``: a float
for q_k = p_t, or a non-increasing per-rank list). Children of one node are *mutually exclusive*
alternatives (distinct tokens, one target token), so their probabilities must sum to at most 1.
The sources are independent; a token proposed by both appears once. At a node that has a spine
continuation the two candidate lists are merged and each candidate keeps the mass not already covered
by the siblings ranked before it: the spine goes before branch j iff its remaining mass
p_s·(1-q_1-...-q_{j-1}) exceeds q_j; branches after it get (1-p_s)·q_k. Masses sum to
p_s + (1-p_s)·sum(q) <= 1, ranks stay non-increasing, and the values are exact under independence for
every sibling set that is a rank prefix (the only kind the optimiser below builds). Spine-only and
branch-only trees use their own single-source candidates (no discount); the GOOSE tree always puts
the spine first (the paper's rule: branches skip the spine token), so its branch siblings of a spine node get
(1-p_s)·q_k.

**Optimality of best-first.** Every conditional probability is <= 1, so P(child) <= P(parent). Let
S_n be the n-1 non-root nodes of largest P (ties: shallower first). If v is in S_n, its parent has
P >= P(v) and is shallower, so it is in S_n too: S_n is a rooted subtree. No set of n-1 nodes has a
larger sum of P, hence S_n maximises E[accepted] over *all* rooted subtrees of size n. Best-first
search (repeatedly add the frontier node of largest P) builds exactly S_n: the best node outside the
current set always has its parent inside it, so it is on the frontier. The trees are nested in n,
so one run gives the optimum for every budget. Non-increasing ranks add one thing: a node's children
can be pushed lazily (only the next-ranked sibling), which makes the infinite candidate tree of a
model searchable. tests/test_theory.py checks both against brute-force enumeration.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

ROOT, SPINE, BRANCH = "root", "spine", "branch"

#: Forward latency (ms) of SmolLM2-135M on the 2-core CPU by query size: Hugging Face's float32 forward, a KV cache
#: of 300 tokens, 2 threads, medians (measured 2026-11, before goose's own kernels).
CPU_COST_MS = {1: 58.0, 2: 93.0, 4: 95.0, 8: 98.0, 16: 118.0, 32: 154.0, 64: 232.0, 128: 407.0}


@dataclass
class Tree:
    """A draft tree: parents[0] = -1 is the root; probs[v] = P(v accepted | parent accepted)."""

    parents: list[int] = field(default_factory=lambda: [-1])
    probs: list[float] = field(default_factory=lambda: [1.0])
    kinds: list[str] = field(default_factory=lambda: [ROOT])
    ranks: list[int] = field(default_factory=lambda: [0])  # rank of a branch node in its source list
    depths: list[int] = field(default_factory=lambda: [0])

    def __len__(self) -> int:
        return len(self.parents)

    def add(self, parent: int, prob: float, kind: str = BRANCH, rank: int = 0) -> int:
        self.parents.append(parent)
        self.probs.append(prob)
        self.kinds.append(kind)
        self.ranks.append(rank)
        self.depths.append(self.depths[parent] + 1)
        return len(self.parents) - 1

    def path_probs(self) -> list[float]:
        """P(v) for every node (root = 1); parents precede children."""
        out = [1.0] * len(self)
        for v in range(1, len(self)):
            out[v] = out[self.parents[v]] * self.probs[v]
        return out

    def width(self) -> int:
        """Largest number of children of one node."""
        return int(max(np.bincount(self.parents[1:]))) if len(self) > 1 else 0


def expected_accepted(tree: Tree | tuple[Sequence[int], Sequence[float]]) -> float:
    """Sum over non-root nodes of the product of acceptance probabilities on the root path."""
    if not isinstance(tree, Tree):  # (parents, probs), parents before children
        parents, probs = tree
        tree = Tree(list(parents), list(probs), [ROOT] + [BRANCH] * (len(parents) - 1), [0] * len(parents))
    return float(sum(tree.path_probs()[1:]))


@dataclass(frozen=True)
class TwoSourceModel:
    """Spine acceptance p_s, branch acceptance p_t (float or per-rank list), top-K, spine length."""

    p_s: float
    p_t: float | tuple[float, ...] = 0.1
    k: int = 10  # adjacency candidates per node (top-K)
    spine_len: int | None = None  # tokens in the context-matched chain (None: as long as needed)

    def branch_probs(self) -> tuple[float, ...]:
        """q_1 >= q_2 >= ... with sum <= 1 (a constant p_t keeps floor(1/p_t) ranks at most)."""
        if isinstance(self.p_t, (int, float)):
            n = min(self.k, math.floor(1.0 / self.p_t + 1e-9)) if self.p_t > 0 else 0
            return (float(self.p_t),) * n
        q = tuple(float(x) for x in self.p_t[: self.k])
        if any(a < b for a, b in zip(q, q[1:])) or sum(q) > 1 + 1e-9 or min(q, default=0) < 0:
            raise ValueError("per-rank p_t must be non-negative, non-increasing and sum to <= 1")
        return q

    def has_spine(self, kind: str, depth: int) -> bool:
        return kind in (ROOT, SPINE) and self.p_s > 0 and (self.spine_len is None or depth < self.spine_len)

    def children(self, kind: str, depth: int, sources: str = "both") -> list[tuple[float, str, int]]:
        """Candidate children (conditional prob, kind, rank) of a node, in non-increasing order."""
        q = self.branch_probs() if sources != "spine" else ()
        if sources == "branch" or not self.has_spine(kind, depth):
            return [(x, BRANCH, r) for r, x in enumerate(q)]
        j, covered = 0, 0.0  # spine goes after the branches it cannot beat (see module docstring)
        while j < len(q) and self.p_s * (1 - covered) <= q[j]:
            covered += q[j]
            j += 1
        return ([(q[r], BRANCH, r) for r in range(j)] + [(self.p_s * (1 - covered), SPINE, 0)]
                + [((1 - self.p_s) * q[r], BRANCH, r) for r in range(j, len(q))])


def best_subtree(cand: Tree, budget: int) -> list[int]:
    """Best-first selection of the optimal rooted subtree of an explicit candidate tree.

    Returns node ids in selection order (root first); any prefix of length n is optimal for n.
    Works for any probabilities in [0, 1] (no rank assumption): the whole frontier is in the heap.
    """
    kids: list[list[int]] = [[] for _ in range(len(cand))]
    for v in range(1, len(cand)):
        kids[cand.parents[v]].append(v)
    pp = cand.path_probs()
    heap = [(-pp[c], cand.depths[c], c) for c in kids[0]]
    heapq.heapify(heap)
    order = [0]
    while heap and len(order) < budget:
        _, _, v = heapq.heappop(heap)
        order.append(v)
        for c in kids[v]:
            heapq.heappush(heap, (-pp[c], cand.depths[c], c))
    return order


def optimal_tree(budget: int, model: TwoSourceModel, sources: str = "best") -> Tree:
    """The rooted tree of `budget` nodes (root included) maximising E[accepted] under `model`.

    Lazy best-first over the model's infinite candidate tree: when a node is added, push its
    best-ranked child and its next-ranked sibling. Node order = selection order, so the first n
    nodes are the optimum for budget n (see optimal_values). sources: "both" (merged candidates),
    "spine" or "branch" (one source), or "best": the better of "both" and "branch" (skipping the
    spine everywhere can win when the adjacency list is near-exhaustive, sum(q) ~ 1, and p_s is low).
    """
    if sources == "best":
        return max((optimal_tree(budget, model, s) for s in ("both", "branch")), key=expected_accepted)
    tree = Tree()
    heap: list[tuple[float, int, int, int]] = []  # (-P(child), tiebreak, parent, child index)
    pp = [1.0]
    count = 0

    def push(parent: int, idx: int) -> None:
        nonlocal count
        cands = model.children(tree.kinds[parent], tree.depths[parent], sources)
        if idx < len(cands) and cands[idx][0] > 0:
            count += 1
            heapq.heappush(heap, (-pp[parent] * cands[idx][0], count, parent, idx))

    push(0, 0)
    while heap and len(tree) < budget:
        negp, _, parent, idx = heapq.heappop(heap)
        prob, kind, rank = model.children(tree.kinds[parent], tree.depths[parent], sources)[idx]
        v = tree.add(parent, prob, kind, rank)
        pp.append(-negp)
        push(parent, idx + 1)
        push(v, 0)
    return tree


def optimal_values(max_budget: int, model: TwoSourceModel, sources: str = "best") -> np.ndarray:
    """values[n] = optimal E[accepted] with n nodes incl. the root (values[0] = values[1] = 0)."""
    if sources == "best":
        return np.maximum(optimal_values(max_budget, model, "both"), optimal_values(max_budget, model, "branch"))
    pp = optimal_tree(max_budget, model, sources).path_probs()
    vals = np.zeros(max_budget + 1)
    vals[1 : len(pp) + 1] = np.cumsum([0.0] + pp[1:])
    vals[len(pp) + 1 :] = vals[len(pp)]  # candidates ran out: bigger budgets cannot help
    return vals


def isotropic_tree(budget: int, model: TwoSourceModel, k: int, sources: str = "both") -> Tree:
    """k-ary BFS tree: every node gets its top-k candidates, level by level, until the budget."""
    tree = Tree()
    queue = deque([0])
    while queue and len(tree) < budget:
        u = queue.popleft()
        for prob, kind, rank in model.children(tree.kinds[u], tree.depths[u], sources)[:k]:
            if len(tree) >= budget:
                break
            queue.append(tree.add(u, prob, kind, rank))
    return tree


def best_isotropic(budget: int, model: TwoSourceModel, sources: str = "both",
                   k_max: int | None = None) -> tuple[float, int, Tree]:
    """(E[accepted], k, tree) of the best k-ary BFS tree, k = 1..k_max (default: all candidates).

    sources="both": same candidates as the optimum, only the shape differs (pure shape effect);
    sources="branch": the paper's isotropic control (adjacency only, iso3/iso5 are k = 3/5).
    """
    k_max = k_max or len(model.children(ROOT, 0, sources))
    trees = [(expected_accepted(t), k, t) for k in range(1, k_max + 1)
             for t in [isotropic_tree(budget, model, k, sources)]]
    return max(trees, key=lambda x: (x[0], -x[1]))


def spine_only(budget: int, model: TwoSourceModel) -> Tree:
    """The context-matched chain alone (as PLD verifies it), up to budget - 1 tokens."""
    return optimal_tree(budget, model, "spine")


def branch_only(budget: int, model: TwoSourceModel) -> Tree:
    """The best adjacency-only tree (an upper bound on any Token-Recycling-style template)."""
    return optimal_tree(budget, model, "branch")


def goose_tree(budget: int, model: TwoSourceModel, confidence: float = 0.0, ema: float | None = None,
               spine_branch_share: float = 0.5, max_branch_depth: int = 6, min_score: float = 0.01) -> Tree:
    """The paper's spine tree shape (src/goose/drafting/spine.py) under the model, at equal budget.

    The paper's budget bonus int(c * 40) is not applied: trees are compared at the same size.
    ema=None: the long-run EMA, i.e. the paper's EMA update fed with the expected spine acceptance
    rate (accepted / drafted spine nodes) of the tree it produces.
    A branch node's adjacency score is taken to be its rank's marginal probability q_rank.
    """
    if ema is None:  # run the paper's update ema = 0.3 * rate + 0.7 * ema with the expected rate
        hist = [0.5]
        for _ in range(60):
            t = goose_tree(budget, model, confidence, hist[-1], spine_branch_share, max_branch_depth, min_score)
            pp, n_sp = t.path_probs(), t.kinds.count(SPINE)
            rate = sum(p for p, k in zip(pp, t.kinds) if k == SPINE) / n_sp if n_sp else hist[-1]
            hist.append(0.3 * rate + 0.7 * hist[-1])
        ema = float(np.median(hist[-20:]))  # it may hover at a tier boundary: take the majority tier
    base = 0.15 if ema < 0.2 else 0.30 if ema < 0.4 else 0.50
    ratio = base + confidence * (1 - base)
    q = model.branch_probs()
    n_spine = min(model.spine_len if model.spine_len is not None else budget, int(budget * ratio),
                  budget - 1)
    tree, spine = Tree(), []
    for i in range(n_spine):
        spine.append(tree.add(spine[-1] if spine else 0, model.p_s, SPINE))
    branch_budget = budget - 1 - n_spine
    spine_share = max(1, int(branch_budget * spine_branch_share)) if n_spine and branch_budget > 0 else 0
    queue: deque[tuple[int, int]] = deque()  # (node, branch depth)

    def hang(u: int, limit: int, depth: int) -> int:
        """Add up to `limit` branch children of u (ranks in order) at branch depth `depth`."""
        has_spine_child = tree.kinds[u] in (ROOT, SPINE) and u + 1 < len(tree) and tree.parents[u + 1] == u \
            and tree.kinds[u + 1] == SPINE
        added = 0
        for r, qr in enumerate(q):
            if added >= limit or len(tree) >= budget or qr < min_score:
                break
            queue.append((tree.add(u, qr * ((1 - model.p_s) if has_spine_child else 1.0), BRANCH, r), depth))
            added += 1
        return added

    hang(0, branch_budget - spine_share, 1)
    weights = [1.0 / (i + 1) for i in range(n_spine)]
    left = spine_share
    for i, u in enumerate(spine):
        if left <= 0:
            break
        left -= hang(u, min(left, max(1, round(spine_share * weights[i] / sum(weights)))), 1)
    while queue and len(tree) < budget:  # FIFO BFS extension
        u, depth = queue.popleft()
        if depth >= max_branch_depth:
            continue
        width = max(1, min(len(q), math.ceil((budget - len(tree)) * q[tree.ranks[u]])))
        hang(u, min(width, max(1, len(q) // depth)), depth + 1)
    return tree


def interp_cost(cost: dict[int, float], n: np.ndarray | int) -> np.ndarray:
    """Per-forward cost at query size n, linear between the measured grid points."""
    xs = sorted(cost)
    return np.interp(n, xs, [cost[x] for x in xs])


def best_size(values: Sequence[float], cost: dict[int, float]) -> tuple[int, np.ndarray]:
    """argmax over n >= 1 of (values[n] + 1) / cost(n), and the rate curve (index n; rate[0] = 0)."""
    n = np.arange(len(values))
    rate = np.where(n >= 1, (np.asarray(values) + 1.0) / interp_cost(cost, np.maximum(n, 1)), 0.0)
    return int(np.argmax(rate)), rate
