"""DraftTree: the currency between drafting, tensorizing and verification.

Nodes are stored in topological order (a parent always precedes its children); node 0 is the root,
the anchor token (last committed token, not yet in the KV cache). Every node carries the source that
proposed it, so acceptance can be counted per source::

        0 (root, anchor)
       / \\
      1   3          1, 2: spine (context match)   3: branch (adjacency)
      |
      2
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT, SPINE, BRANCH = 0, 1, 2


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    sources: list[int] = field(default_factory=lambda: [ROOT])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # token -> child index
    ranks: list[int] = field(default_factory=lambda: [0])  # rank among the source's candidates (0 = best)
    route: str = "tree"  # "tree", "chain" or "ar": how the step was drafted

    @classmethod
    def root(cls, anchor: int, route: str = "tree") -> "DraftTree":
        return cls(tokens=[anchor], route=route)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, source: int, rank: int = 0) -> int:
        """Add a child of `parent`; returns its index, or -1 if that sibling token already exists."""
        kids = self.children[parent]
        if token in kids:
            return -1
        idx = len(self.tokens)
        kids[token] = idx
        self.tokens.append(token)
        self.parents.append(parent)
        self.sources.append(source)
        self.depths.append(self.depths[parent] + 1)
        self.children.append({})
        self.ranks.append(rank)
        return idx

    def add_chain(self, parent: int, tokens: list[int], source: int) -> list[int]:
        """Hang a chain of tokens under `parent`; returns the node indices (stops at a duplicate)."""
        out = []
        for t in tokens:
            nxt = self.add(parent, t, source)
            if nxt < 0:
                break
            out.append(nxt)
            parent = nxt
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def topology(self) -> tuple[int, ...]:
        """A hashable key for the tree's shape (what masks and positions depend on)."""
        return tuple(self.parents)

    def count(self, source: int) -> int:
        return sum(1 for s in self.sources if s == source)

    def subtree(self, keep: list[int]) -> "DraftTree":
        """The tree of nodes `keep` (must contain the root and be closed under parents), renumbered."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        out = DraftTree.root(self.tokens[0], route=self.route)
        for old in keep[1:]:
            out.add(new_index[self.parents[old]], self.tokens[old], self.sources[old], self.ranks[old])
        return out

    def within_depth(self, max_depth: int) -> "DraftTree":
        """This tree without the nodes deeper than `max_depth` (itself if none are)."""
        if max(self.depths) <= max_depth:
            return self
        return self.subtree([i for i, d in enumerate(self.depths) if d <= max(0, max_depth)])
