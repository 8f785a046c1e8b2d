"""DraftTree: the currency between drafting, tensorizing and verification.

Nodes are stored in topological order (a parent always precedes its children); node 0 is the root,
the anchor token (last committed token, not yet in the KV cache). Every node carries the source that
proposed it, so acceptance can be counted per source::

        0 (root, anchor)
       / \\
      1   3          1, 2: spine (context match)   3: branch (adjacency)
      |
      2

A tree may also carry *extra* nodes (Lookahead decoding's Jacobi window): they come after every tree node,
hang off the tree or off earlier extras (``extra_parents`` index the combined list), and run in the same
forward with their own mask rows (their ancestors) and positions (their depths). They are never
verified: the walk only follows ``children`` of tree nodes, KV compaction drops them, and the method that
added them reads their logits (rows ``len(tree):``) in `harvest`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROOT, SPINE, BRANCH, MEMORY, HEAD = 0, 1, 2, 3, 4  # MEMORY: the cross-request suffix memory; HEAD: a draft head


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    sources: list[int] = field(default_factory=lambda: [ROOT])
    depths: list[int] = field(default_factory=lambda: [0])
    children: list[dict[int, int]] = field(default_factory=lambda: [{}])  # token -> child index
    ranks: list[int] = field(default_factory=lambda: [0])  # rank among the source's candidates (0 = best)
    route: str = "tree"  # "tree", "chain" or "ar": how the step was drafted
    extra_tokens: list[int] = field(default_factory=list)  # unverified extra nodes, after the tree nodes
    extra_parents: list[int] = field(default_factory=list)  # index into tree nodes + extras
    extra_depths: list[int] = field(default_factory=list)

    @classmethod
    def root(cls, anchor: int, route: str = "tree") -> "DraftTree":
        return cls(tokens=[anchor], route=route)

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, source: int, rank: int = 0) -> int:
        """Add a child of `parent`; returns its index, or -1 if that sibling token already exists."""
        if self.extra_tokens:
            raise ValueError("tree nodes must all be added before the extra nodes")
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

    def insert(self, tokens: list[int], source: int) -> list[int]:
        """Merge a path under the root, trie-style (reuse matching children); returns its node indices."""
        node, out = 0, []
        for t in tokens:
            nxt = self.children[node].get(t)
            if nxt is None:
                nxt = self.add(node, t, source)
            out.append(nxt)
            node = nxt
        return out

    def add_extra(self, parent: int, token: int) -> int:
        """Add an unverified extra node under `parent` (a tree node or an earlier extra); returns its
        index in the combined list (tree nodes, then extras)."""
        n = len(self.tokens)
        depth = self.depths[parent] if parent < n else self.extra_depths[parent - n]
        self.extra_tokens.append(token)
        self.extra_parents.append(parent)
        self.extra_depths.append(depth + 1)
        return n + len(self.extra_tokens) - 1

    @property
    def all_tokens(self) -> list[int]:
        """Tokens of the forward: tree nodes, then extras."""
        return self.tokens + self.extra_tokens if self.extra_tokens else self.tokens

    @property
    def all_parents(self) -> list[int]:
        return self.parents + self.extra_parents if self.extra_parents else self.parents

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def topology(self) -> tuple[int, ...]:
        """A hashable key for the shape of tree + extras (what masks and positions depend on)."""
        return tuple(self.all_parents)

    def count(self, source: int) -> int:
        return sum(1 for s in self.sources if s == source)

    def subtree(self, keep: list[int]) -> "DraftTree":
        """The tree of nodes `keep` (must contain the root and be closed under parents), renumbered.

        Extra nodes are not carried over."""
        keep = sorted(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        out = DraftTree.root(self.tokens[0], route=self.route)
        for old in keep[1:]:
            out.add(new_index[self.parents[old]], self.tokens[old], self.sources[old], self.ranks[old])
        return out

    def within_depth(self, max_depth: int) -> "DraftTree":
        """This tree without the nodes deeper than `max_depth` (itself if none are; extras go if any is)."""
        if max(self.depths + self.extra_depths) <= max_depth:
            return self
        return self.subtree([i for i, d in enumerate(self.depths) if d <= max(0, max_depth)])


@dataclass(frozen=True)
class WalkResult:
    """What a verification walk accepted: plain data that selection and the engine both read."""

    path: list[int]  # accepted node indices, root first
    bonus: int  # the target's token after the last accepted node

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (the root is the already-committed anchor)."""
        return len(self.path) - 1
