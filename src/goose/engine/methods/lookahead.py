"""`lookahead`: Lookahead decoding."""

from __future__ import annotations

from ...config import LookaheadConfig
from ...drafting.lookahead import JacobiWindow, NgramPool
from ...drafting.tree import SPINE, DraftTree
from ..sampling import argmax_rows
from .base import Method


class Lookahead(Method):
    """Lookahead decoding: each step verifies the anchor's pooled n-grams as a trie and, in the same
    forward, advances the Jacobi window whose trajectories fill the pool (`drafting/lookahead.py`)."""

    name = "lookahead"

    def __init__(self, cfg: LookaheadConfig = LookaheadConfig()) -> None:
        self.cfg = cfg
        self._tree_size: int | None = None  # tree nodes of the pending step (window rows follow)

    def begin(self, tokens: list[int]) -> None:
        self.pool = NgramPool(self.cfg.guess_set_size)
        self.window = JacobiWindow(self.cfg, tokens)
        self._tree_size = None

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        tree = DraftTree.root(anchor)
        for guess in self.pool.guesses(anchor):
            tree.insert(list(guess), SPINE)
        if len(tree) == 1:
            tree.route = "ar"
        self.window.attach(tree)
        self._tree_size = len(tree)
        return tree

    def harvest(self, tokens: list[int], prevs: list[int], logits) -> None:
        n, self._tree_size = self._tree_size, None
        if n is None or len(tokens) - n != self.window.size:  # prefill, or the window was cut off
            return
        for gram in self.window.update(argmax_rows(logits[n:])):
            self.pool.add(gram)
