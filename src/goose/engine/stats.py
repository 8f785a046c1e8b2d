"""Per-request decoding statistics under fixed names (τ, acceptance per draft source, spine continuations)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..drafting.tree import BRANCH, HEAD, MEMORY, SPINE, DraftTree
from .verify import WalkResult

SOURCES = {"spine": SPINE, "branch": BRANCH, "memory": MEMORY, "head": HEAD}  # memory: the cross-request suffix
# memory; head: a trained draft head (`eagle2`)


@dataclass
class Stats:
    new_tokens: int = 0
    forward_calls: int = 0  # prefill counts as one call producing one token
    wall_time_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the engine's prefix cache
    drafted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    spine_continuations: int = 0  # steps where both spine and branch tokens were accepted
    spine_continuation_tokens: int = 0  # branch tokens accepted after the spine in those steps
    accept_lengths: list[int] = field(default_factory=list)  # draft tokens accepted per decoding step
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified per decoding step (root included)
    routes: dict[str, int] = field(default_factory=lambda: {"tree": 0, "chain": 0, "ar": 0})
    # milliseconds spent per step stage (draft, tensorize, forward, verify, compact, harvest, commit)
    stage_ms: dict[str, float] = field(default_factory=dict)
    # per source, per depth (index 0 = depth 1): drafted and accepted node counts
    depth_drafted: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in SOURCES})
    depth_accepted: dict[str, list[int]] = field(default_factory=lambda: {k: [] for k in SOURCES})

    @property
    def tau(self) -> float:
        """Mean tokens per target forward (τ)."""
        return self.new_tokens / self.forward_calls if self.forward_calls else 0.0

    @property
    def mat(self) -> float:
        """Spec-Bench's mean accepted tokens: accepted per decoding step + 1."""
        return 1.0 + sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def record_step(self, tree: DraftTree, walk: WalkResult) -> None:
        self.forward_calls += 1
        self.accept_lengths.append(walk.accepted)
        self.tree_sizes.append(len(tree))
        self.routes[tree.route] = self.routes.get(tree.route, 0) + 1
        on_path = set(walk.path)
        for name, src in SOURCES.items():
            drafted, accepted = self.depth_drafted[name], self.depth_accepted[name]
            for i, s in enumerate(tree.sources):
                if s != src:
                    continue
                d = tree.depths[i]
                while len(drafted) < d:
                    drafted.append(0)
                    accepted.append(0)
                drafted[d - 1] += 1
                self.drafted[name] += 1
                if i in on_path:
                    accepted[d - 1] += 1
                    self.accepted[name] += 1
        path_sources = [tree.sources[i] for i in walk.path[1:]]
        if SPINE in path_sources and BRANCH in path_sources:
            self.spine_continuations += 1
            self.spine_continuation_tokens += path_sources.count(BRANCH)

    def acceptance_rate(self, source: str) -> float:
        return self.accepted[source] / self.drafted[source] if self.drafted[source] else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, mat=self.mat, tokens_per_s=self.tokens_per_s,
                 acceptance_rate={k: self.acceptance_rate(k) for k in SOURCES})
        return d
