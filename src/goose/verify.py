"""Greedy verification walk (pure).

pred[u] = argmax of the target's logits at node u. From the root, step to the child whose token equals
pred[u]; stop when no child matches. The accepted path is lossless by construction: every accepted token
is exactly what greedy decoding would have produced after its ancestors, and the bonus token pred[last]
is the target's own next token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .tree import DraftTree


@dataclass(frozen=True)
class WalkResult:
    path: list[int]  # accepted node indices, root first
    bonus: int  # the target's token after the last accepted node

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the root is the already-committed anchor)."""
        return len(self.path) - 1


def greedy_walk(tree: DraftTree, pred: Sequence[int]) -> WalkResult:
    node = 0
    path = [0]
    while True:
        nxt = tree.children[node].get(pred[node])
        if nxt is None:
            return WalkResult(path, int(pred[node]))
        path.append(nxt)
        node = nxt
