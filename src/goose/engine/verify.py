"""The verification walk (pure).

choose(u) = the target's token after node u (argmax for greedy, a sample for sampling; see sampling.py).
From the root, step to the child whose token equals choose(u); stop when no child matches. Every accepted
token is exactly what the target would have produced after its ancestors, and the bonus token choose(last)
is the target's own next token, so the output equals plain decoding.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..drafting.tree import DraftTree, WalkResult


def walk(tree: DraftTree, choose: Callable[[int], int]) -> WalkResult:
    """`choose` is called once per node on the path, in path order."""
    node = 0
    path = [0]
    while True:
        tok = int(choose(node))
        nxt = tree.children[node].get(tok)
        if nxt is None:
            return WalkResult(path, tok)
        path.append(nxt)
        node = nxt


def greedy_walk(tree: DraftTree, pred: Sequence[int]) -> WalkResult:
    """The greedy walk given pred[u] = argmax of the logits at every node u."""
    return walk(tree, pred.__getitem__)
