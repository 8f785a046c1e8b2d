"""Lookahead decoding's two pieces: the Jacobi window (the lookahead branch) and the n-gram pool.

The window keeps up to N - 1 *levels* of W guessed tokens; level l, column j sits at position
anchor + 1 + l + j. Each step it rides along the verification tree as extra nodes (`DraftTree.add_extra`):
level 0 is a chain hanging off the root, and level l, column j hangs off level l - 1, column j, so the
token sees the prefix, the root, level 0 up to column j and its own column above it (one consistent
sequence of positions)::

    root - (0,0) - (0,1) - (0,2)        W = 3, two levels
             |       |       |
           (1,0)   (1,1)   (1,2)

The target's prediction at the last level's column j is a new token for the next level (one Jacobi
iteration). Once the window holds N - 1 levels, every column plus that prediction is an N-gram: its first
token keys the pool, the other N - 1 tokens are a guess. The oldest level is then dropped. Guesses keyed by
the anchor are verified as a trie next step (the verification branch).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Sequence

from ..config import LookaheadConfig
from .tree import DraftTree


class NgramPool:
    """key token -> at most `guess_set_size` distinct continuations (N - 1 tokens), most recent kept."""

    def __init__(self, guess_set_size: int) -> None:
        self.size = guess_set_size
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        if self.size == 0 or len(ngram) < 2:
            return
        key, rest = int(ngram[0]), tuple(int(t) for t in ngram[1:])
        entries = self.pool.setdefault(key, OrderedDict())
        entries.pop(rest, None)  # a repeat becomes the most recent
        entries[rest] = None
        if len(entries) > self.size:
            entries.popitem(last=False)

    def guesses(self, key: int) -> list[tuple[int, ...]]:
        """Continuations of `key`, most recent first."""
        entries = self.pool.get(key)
        return list(reversed(entries)) if entries else []

    def __len__(self) -> int:
        return sum(len(e) for e in self.pool.values())


class JacobiWindow:
    """The lookahead branch: N - 1 levels of W tokens, filled one level per step, then sliding."""

    def __init__(self, cfg: LookaheadConfig, context: Sequence[int]) -> None:
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        self.levels: list[list[int]] = [[int(rng.choice(context)) for _ in range(cfg.window)]]

    @property
    def size(self) -> int:
        return len(self.levels) * self.cfg.window

    def attach(self, tree: DraftTree) -> None:
        """Add the window to `tree` as extra nodes, level by level (rows ``len(tree):`` of the forward)."""
        prev_level: list[int] = []
        for level, toks in enumerate(self.levels):
            nodes = []
            for j, t in enumerate(toks):
                parent = (0 if j == 0 else nodes[-1]) if level == 0 else prev_level[j]
                nodes.append(tree.add_extra(parent, t))
            prev_level = nodes

    def update(self, preds: Sequence[int]) -> list[list[int]]:
        """One Jacobi iteration from the target's predictions at the window rows (level-major order);
        returns the N-grams completed (none while the window is still filling)."""
        w, full = self.cfg.window, self.cfg.ngram_size - 1
        k = len(self.levels)
        new = [int(t) for t in preds[(k - 1) * w : k * w]]
        if k < full:
            self.levels.append(new)
            return []
        grams = [[lvl[j] for lvl in self.levels] + [new[j]] for j in range(w)]
        self.levels = self.levels[1:] + [new]
        return grams
