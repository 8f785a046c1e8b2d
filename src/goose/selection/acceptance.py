"""Online acceptance model: P(a draft node is accepted | its parent was accepted).

Nodes are grouped by what is known when drafting: spine nodes by match kind (consensus / long / short
chain) and depth, branch nodes by adjacency rank and branch depth, memory nodes (the cross-request suffix
memory) by how often their token followed the match (`memory_rank`) and depth. Each group keeps Beta-smoothed
counts that start from a prior and are updated from every verification, where each node whose parent
lay on the accepted path is one trial. The expected accepted length of a tree is then the sum over
nodes of the product of these probabilities along the node's path (independence model).
"""

from __future__ import annotations

from bisect import bisect_left

from ..config import AcceptanceConfig
from ..drafting.tree import HEAD, MEMORY, SPINE, DraftTree, WalkResult

CONSENSUS, LONG, SHORT, WEAK = 0, 1, 2, 3
_SPINE_DEPTH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # depth buckets: <=1, <=2, ..., >32


def match_kind(consensus: bool, chain_len: int, weak: bool = False) -> int:
    """A chain's match kind: WEAK after a match of few tokens (`weak`, whatever its followers), else CONSENSUS when
    every occurrence had the same follower, LONG for chains of 8 tokens or more, SHORT otherwise."""
    if weak:
        return WEAK
    return CONSENSUS if consensus else LONG if chain_len >= 8 else SHORT


MEMORY_GROUPS = 8  # memory groups (`memory_rank`: 4 by count, times long or short match)
MEMORY_LONG_MATCH = 8  # memory matches of this many context tokens or more are grouped apart from shorter ones


def memory_rank(count: int, total: int, match: int = MEMORY_LONG_MATCH) -> int:
    """A memory node's group: 0 when all of >= 2 matching occurrences continued with it, 1 when the one
    occurrence did, 2 when most did, 3 otherwise; plus 4 when the match is shorter than MEMORY_LONG_MATCH."""
    if count == total:
        rank = 0 if count >= 2 else 1
    else:
        rank = 2 if 2 * count > total else 3
    return rank if match >= MEMORY_LONG_MATCH else rank + 4


def depth_bucket(depth: int, edges: tuple[int, ...]) -> int:
    """Index of the first edge >= depth (len(edges) past the last one); `edges` ascending."""
    return bisect_left(edges, depth)


def _spine_bucket(depth: int) -> int:
    return depth_bucket(depth, _SPINE_DEPTH_EDGES)


def spine_key(kind: int, depth: int) -> tuple:
    """The group of a spine node of match `kind` at `depth`."""
    return ("s", kind, _spine_bucket(depth))


def memory_key(rank: int, depth: int) -> tuple:
    """The group of a memory node of group `rank` (`memory_rank`) at `depth`."""
    return ("m", min(rank, MEMORY_GROUPS - 1), _spine_bucket(depth))


HEAD_GROUPS = 10  # a draft head's nodes, by its own probability for them: [0.9, 1], [0.8, 0.9), ..., [0, 0.1)


def head_rank(p: float) -> int:
    """The group of a draft-head node the head gives probability `p` (0: the most confident)."""
    return min(HEAD_GROUPS - 1, max(0, int((1.0 - p) * HEAD_GROUPS)))


def head_key(rank: int, depth: int) -> tuple:
    """The group of a draft-head node of group `rank` (`head_rank`) at `depth`: its acceptance is learned
    per confidence and depth, starting from the head's own confidence."""
    return ("h", min(rank, HEAD_GROUPS - 1), _spine_bucket(depth))


class AcceptanceModel:
    def __init__(self, cfg: AcceptanceConfig = AcceptanceConfig()) -> None:
        self.cfg = cfg
        self.counts: dict[tuple, list[float]] = {}  # key -> [accepted, trials]
        self.verified: set[tuple] = set()  # groups with a verified trial (`update`): no longer explored
        self._best_branch: float | None = None  # the best depth-1 branch probability (asked by every request's step)
        self._best_child: tuple[float, tuple] | None = None  # the best depth-1 probability of any group, and its group
        self._best_head: float | None = None  # the best depth-1 probability of a head group (`head_best`)

    def reset(self) -> None:
        self.counts.clear()
        self.verified.clear()
        self._best_branch = None
        self._best_child = None
        self._best_head = None

    def _prior(self, key: tuple) -> float:
        if key[0] == "s":
            return self.cfg.spine_prior[key[1]]
        if key[0] == "m":
            return self.cfg.memory_prior[key[1]] if key[1] < 4 else self.cfg.memory_short_prior[key[1] - 4]
        if key[0] == "h":
            return 1.0 - (key[1] + 0.5) / HEAD_GROUPS
        rank = key[1]
        return self.cfg.branch_prior[min(rank, len(self.cfg.branch_prior) - 1)]

    def keys(self, tree: DraftTree, kind: int) -> list[tuple]:
        """The group of every node (index 0, the root, gets None)."""
        out: list[tuple | None] = [None]
        bdepth = [0] * len(tree)
        for i in range(1, len(tree)):
            p = tree.parents[i]
            if tree.sources[i] == SPINE:
                out.append(spine_key(kind, tree.depths[i]))
            elif tree.sources[i] == MEMORY:
                out.append(memory_key(tree.ranks[i], tree.depths[i]))
            elif tree.sources[i] == HEAD:
                out.append(head_key(tree.ranks[i], tree.depths[i]))
            else:
                bdepth[i] = bdepth[p] + 1
                out.append(self.branch_key(tree.ranks[i], bdepth[i]))
        return out

    def branch_key(self, rank: int, depth: int) -> tuple:
        """The group of an adjacency branch node of successor `rank` at branch `depth` (both capped)."""
        return ("b", min(rank, self.cfg.max_rank), min(depth, self.cfg.max_branch_depth))

    def prob(self, key: tuple) -> float:
        s = self.cfg.prior_strength
        acc, trials = self.counts.get(key, (0.0, 0.0))
        p = (acc + s * self._prior(key)) / (trials + s)
        return min(p, self.cfg.max_prob)

    def best_child(self, kind: int, spine: bool) -> float:
        """The highest acceptance probability any child of the root can have (a spine child of match `kind`
        when `spine`, a branch child of any rank): every node's path probability is at most its depth-1
        ancestor's."""
        best = self.branch_best()
        return max(best, self.prob(spine_key(kind, 1))) if spine else best

    def memory_best(self, rank: int) -> float:
        """`best_child` for a root whose memory child has group `rank` (adjacency children included)."""
        return max(self.branch_best(), self.prob(memory_key(rank, 1)))

    def branch_best(self) -> float:
        """The highest probability of a branch child of the root, any rank (kept until the counts change): an
        upper bound on the path probability of every adjacency branch node, wherever it hangs."""
        if self._best_branch is None:
            self._best_branch = max(self.prob(self.branch_key(r, 1)) for r in range(self.cfg.max_rank + 1))
        return self._best_branch

    def child_best(self) -> float:
        """The highest probability a child of the root can have, whatever the step drafts (a spine child of any
        match kind, a memory child of any group, a branch of any rank): when a step's `min_prob` is above it, no
        draft node can pay and nothing needs to be looked up. Kept between calls, updated by `count`."""
        if self._best_child is None:
            keys = ([spine_key(kind, 1) for kind in (CONSENSUS, LONG, SHORT, WEAK)]
                    + [memory_key(rank, 1) for rank in range(MEMORY_GROUPS)]
                    + [self.branch_key(rank, 1) for rank in range(self.cfg.max_rank + 1)])
            self._best_child = max((self.prob(k), k) for k in keys)
        return self._best_child[0]

    def head_best(self) -> float:
        """The highest probability a draft head's child of the root can have (any confidence group): an upper
        bound on the path probability of every head node. When a step's `min_prob` is above it, the head need
        not run (a loaded batch, where no drafted row pays). Kept until a head group's counts change."""
        if self._best_head is None:
            self._best_head = max(self.prob(head_key(rank, 1)) for rank in range(HEAD_GROUPS))
        return self._best_head

    def memory_reach(self, ranks: list[int], min_prob: float) -> int:
        """How many leading nodes of a memory spine with groups `ranks` keep a path probability >= `min_prob`."""
        p = 1.0
        for d, rank in enumerate(ranks, start=1):
            p *= self.prob(memory_key(rank, d))
            if p < min_prob:
                return d - 1
        return len(ranks)

    def spine_reach(self, kind: int, length: int, min_prob: float) -> int:
        """How many leading nodes of a spine chain of `length` (match `kind`) keep a path probability of at
        least `min_prob`."""
        p = 1.0
        for d in range(1, length + 1):
            p *= self.prob(spine_key(kind, d))
            if p < min_prob:
                return d - 1
        return length

    def node_probs(self, tree: DraftTree, kind: int) -> tuple[list[float], list[tuple]]:
        keys = self.keys(tree, kind)
        return [1.0] + [self.prob(k) for k in keys[1:]], keys

    def count(self, key: tuple, accepted: bool) -> None:
        """One trial of group `key`: a node of it whose parent was accepted, `accepted` or not."""
        if key[0] == "b":
            self._best_branch = None
        elif key[0] == "h":
            self._best_head = None
        c = self.counts.setdefault(key, [0.0, 0.0])
        c[1] += 1.0
        if accepted:
            c[0] += 1.0
        best = self._best_child
        if best is not None and key[2] == (1 if key[0] == "b" else 0):  # a depth-1 group
            p = self.prob(key)
            if p >= best[0]:
                self._best_child = (p, key)
            elif key == best[1]:  # the best one fell: find the new best when next asked
                self._best_child = None

    def explore_chain(self, kind: int, chain: list[int], known: list[int], tree: DraftTree,
                      memory_ranks: list[int] | None = None) -> None:
        """Count the nodes of a spine `chain` that `tree` did not verify as trials of their groups, along the
        target's `known` tokens after the anchor: a node is a trial when every node above it was accepted, and
        accepted when its token is the known one. The groups: an n-gram chain's by match `kind`, a memory
        spine's by its nodes' `memory_ranks`. Only groups that no verified node has tried yet are counted, for at
        most `cfg.explore_trials` trials: so a group the cost curve never lets verify still learns its rate,
        and a group that is verified learns from its verified nodes alone."""
        node: int | None = 0  # the chain's node in `tree` so far (None: the chain left the tree)
        for d, tok in enumerate(chain[:len(known)], start=1):
            node = None if node is None else tree.children[node].get(tok)
            if node is None:  # not verified: no trial was counted for it
                key = spine_key(kind, d) if memory_ranks is None else memory_key(memory_ranks[d - 1], d)
                if self.explorable(key):
                    self.count(key, tok == known[d - 1])
            if tok != known[d - 1]:
                return

    def explorable(self, key: tuple) -> bool:
        """Whether `explore_chain` still counts trials of group `key`."""
        return key not in self.verified and self.counts.get(key, (0.0, 0.0))[1] < self.cfg.explore_trials

    def update(self, tree: DraftTree, keys: list[tuple], walk: WalkResult) -> None:
        on_path = set(walk.path)
        for i in range(1, len(tree)):
            if tree.parents[i] in on_path:
                self.verified.add(keys[i])
                self.count(keys[i], i in on_path)
