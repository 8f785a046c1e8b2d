"""Choose the subtree to verify: the best expected tokens per millisecond on this device.

Given per-node conditional acceptance probabilities q, a node's path probability is the product of q
along its root path; the expected accepted length of a rooted subtree is the sum of its nodes' path
probabilities. Since q < 1, a child's path probability is below its parent's, so the n-1 nodes with the
highest path probabilities always form a rooted subtree, and it is the best one of its size (see
docs/theory.md). The selector sorts once, then picks the size n maximising (E[accepted](n) + 1) / cost(n);
n = 1 is a plain autoregressive step.
"""

from __future__ import annotations

from .tree import DraftTree


def path_probs(tree: DraftTree, q: list[float]) -> list[float]:
    probs = [1.0] * len(tree)
    for i in range(1, len(tree)):
        probs[i] = probs[tree.parents[i]] * q[i]
    return probs


def select(tree: DraftTree, q: list[float], cost: list[float]) -> tuple[DraftTree, float]:
    """Best subtree by (expected accepted + 1) / cost(size); `cost[n]` is the cost of n query tokens.

    Returns the subtree and its expected accepted length.
    """
    probs = path_probs(tree, q)
    order = sorted(range(1, len(tree)), key=lambda i: -probs[i])[: len(cost) - 2]
    best_n, best_rate, best_e, e = 0, 1.0 / cost[1], 0.0, 0.0
    for m, i in enumerate(order, start=1):
        e += probs[i]
        rate = (e + 1.0) / cost[m + 1]
        if rate > best_rate:
            best_n, best_rate, best_e = m, rate, e
    if best_n == len(tree) - 1:
        return tree, best_e
    chosen = tree.subtree([0] + order[:best_n])
    if best_n == 0:
        chosen.route = "ar"
    return chosen, best_e
