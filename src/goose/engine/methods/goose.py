"""`goose`: GOOSE's spine trees sized by the device's measured cost curve, drafting from the context and the
cross-request suffix memory (`load_budget`: the candidate tree's size under load), and from a trained draft head
when one is named (`EagleConfig.head`: a folder or "packaged"; by default `goose` is training-free, and
`goose-nohead` always is). The head's EAGLE-2 tree (`eagle2.HeadDrafter`) is merged into the spine tree's candidates:
its confident chain competes with the context and memory spines, its top-k with the adjacency branches, and
its nodes' acceptance is learned per head confidence and depth (`acceptance.head_key`) like every other
source's, so the selector verifies the subtree that pays whichever source drafted it."""

from __future__ import annotations

import math
import time

from ...config import DeviceAwareConfig, GooseConfig
from ...drafting.memory import MemoryDraft
from ...drafting.ngram import NgramIndex, Proposal, chain_confidence
from ...drafting.spine import build_spine_tree
from ...drafting.tree import BRANCH, DraftTree
from ...selection.acceptance import SHORT, AcceptanceModel, match_kind, memory_rank
from ...selection.costmodel import CostCurve
from ...selection.selector import Candidates, allocate
from ..measure import load_or_measure
from ..verify import WalkResult
from .eagle2 import HeadDrafter, HeadState, find_head, merge
from .goose_paper import GoosePaper

HEAD_MS_RATE = 0.25  # weight of each step's drafting time in the head's moving average (`_head_may_pay`)
PROBE_BACKOFF = 16  # a probe of the resting arm that loses doubles the steps to the next, up to probe_every x this


def load_budget(min_prob: float, spine: int = 0, cfg: DeviceAwareConfig = DeviceAwareConfig()) -> int | None:
    """The most candidate nodes worth building when a node must reach path probability `min_prob` to pay for
    its row and `spine` spine nodes can: one depth's path probabilities sum to at most 1, so at most
    1 / min_prob branch nodes per depth can, for `cfg.load_depths` depths (under load: a few nodes, not a full
    tree), and never fewer than `cfg.load_min_budget`. None: no cap."""
    if min_prob <= 0:
        return None
    return max(cfg.load_min_budget, 1 + spine + math.ceil(cfg.load_depths / min_prob))


class PayRates:
    """Tokens per millisecond of the steps drafted with the head and of those without (`_HeadPay`), learned
    across the requests of one method (its forks share them, as they share the acceptance statistics): one
    request's few dozen steps, of one or two tokens each, are too few to tell arms 10% apart."""

    def __init__(self) -> None:
        self.rate = {True: 0.0, False: 0.0}  # tokens per ms, with / without the head
        self.seen = {True: 0, False: 0}  # steps measured per arm
        self.interval = 0  # each request's steps between probes of the resting arm (0: `EagleConfig.probe_every`)


class _HeadPay:
    """Whether drafting with the head pays, measured as what it is for: tokens committed per millisecond of the
    step (from the method's `candidates` to its `observe`: drafting, the forward and the walk), averaged apart over
    the steps drafted with the head and those without (`PayRates`: the first samples' mean, then a moving average
    of weight `EagleConfig.pay_rate`). The faster arm drafts; the other is tried one step in `probe_every` of each
    request, so both averages follow the text; a probe whose step is slower than the drafting arm's average doubles
    that interval (shared by the requests, as the rates are; at most `probe_every` x `PROBE_BACKOFF` steps), one that
    is faster sets it back, so a head that does not pay costs its probes less and less. A new request drafts with the
    head first (that step, which runs the prompt's positions through the head, is not measured); until both arms are
    measured, each request's steps alternate between them. A head that rests skips the positions of its resting
    steps (`HeadState.skip`), so a probe costs what a step of a drafting head costs. In a batch the step's clock is
    shared: a request's drafting holds up every other request of the step, so its step is also charged its drafting
    time once per other request (`charge`), and the head pays only where it pays the batch."""

    def __init__(self, cfg, rates: PayRates | None = None, clock=time.perf_counter) -> None:
        self.cfg, self.clock = cfg, clock
        self.rates = rates if rates is not None else PayRates()
        self.since = 0  # steps since the slower arm was last tried
        self.on: bool | None = None  # this step's arm, until `observe`
        self.t = 0.0
        self.warm = False  # the head's first step (the prompt's catch-up) is done
        self.last = False  # the arm of this request's last measured step
        self.extra = 0.0  # ms this step's drafting held up the batch's other requests (`charge`)
        self.probing = False  # this step tries the resting arm

    def drafts(self) -> bool:
        c, rates = self.cfg, self.rates
        if c.probe_every == 0:
            return True
        if not self.warm:
            self.warm, self.on = True, None
            return True
        probing = False
        if not rates.seen[True] or not rates.seen[False]:
            on = not self.last
        else:
            on = rates.rate[True] >= rates.rate[False]
            self.since += 1
            if self.since >= (rates.interval or c.probe_every):
                on, self.since, probing = not on, 0, True
        self.on, self.t, self.last, self.extra, self.probing = on, self.clock(), on, 0.0, probing
        return on

    def charge(self, ms: float) -> None:
        """Add `ms` to this step's time: the milliseconds the head's drafting held up the other requests of the
        step (its time times theirs), which their own clocks see and this request's does not (a step that is not
        measured: nothing)."""
        if self.on is not None:
            self.extra += ms

    def observe(self, tokens: int) -> None:
        if self.on is None:
            return
        arm, self.on = self.on, None
        rate = tokens / max((self.clock() - self.t) * 1e3 + self.extra, 1e-6)
        rates = self.rates
        if self.probing:  # the resting arm lost again: probe it half as often; it won: as often as at first
            every = self.cfg.probe_every
            rates.interval = min(2 * (rates.interval or every), every * PROBE_BACKOFF) \
                if rate < rates.rate[not arm] else every
        rates.seen[arm] += 1
        w = max(self.cfg.pay_rate, 1.0 / rates.seen[arm])  # (the first sample: w = 1)
        rates.rate[arm] += w * (rate - rates.rate[arm])


class DeviceAwareGoose(GoosePaper):
    """`goose`: a generous spine tree as candidates, verified as the subtree with the best expected
    tokens per millisecond under the device's measured cost curve (n = 1, a plain step, included)."""

    name = "goose"
    offers_candidates = True

    def __init__(self, vocab_size: int, cfg: GooseConfig = GooseConfig(), cost: CostCurve | None = None) -> None:
        super().__init__(vocab_size, cfg)
        self.acc = AcceptanceModel(cfg.device_aware.acceptance)
        self.prefill_harvest = cfg.device_aware.prefill_harvest
        self._kind = SHORT
        self._root_succ = None  # the adjacency successors of the step's anchor, as drafted (`_observe_unbuilt`)
        self._chain = None  # the step's spine chain (n-gram or memory), as drafted (`_observe_unbuilt`)
        self._chain_ranks = None  # its nodes' memory groups (None: an n-gram chain)
        self._learn = True  # harvest the next verified step (False: its candidates had no branch that could pay)
        self._set_cost(cost)
        self.drafter: HeadDrafter | None = None  # the draft head's (set by `prepare` when there is one)
        self.hst = HeadState()
        self._pay = PayRates()  # shared by the forks (`carry_over`), as `acc` is
        self._head = _HeadPay(cfg.eagle, self._pay)
        self._head_ms = 0.0  # the head's drafting per step, ms (a moving average of weight HEAD_MS_RATE)

    def _set_cost(self, cost: CostCurve | None) -> None:
        self.cost = cost
        if cost is not None:
            size = min(self.cfg.device_aware.candidate_budget, cost.max_size)
            self.candidate_cfg = self.cfg.with_budget(size)
            self.cost_table = cost.table(size)

    def prepare(self, model, forward, tokenizer=None) -> None:
        if self.cost is None:
            self._set_cost(load_or_measure(model, forward))
        head = find_head(model, self.cfg.eagle, required=False)
        if head is not None:
            self.drafter = HeadDrafter(head, self.cfg.eagle)
            self.features = head.cfg.features

    def start(self) -> None:
        super().start()
        self._learn = True  # before the prefill, whose chunks are harvested
        self.hst = HeadState()
        self._head = _HeadPay(self.cfg.eagle, self._pay if self.cfg.device_aware.carry_over else None)
        self._head_ms = 0.0

    def take_features(self, hidden) -> None:
        self.hst.take_features(hidden)

    def new_index(self) -> NgramIndex:
        """Matches down to `DeviceAwareConfig.ngram_sizes` (2 tokens by default; their chains priced apart)."""
        return NgramIndex(self.cfg.device_aware.ngram_sizes, self.cfg.ngram.max_chain)

    def begin(self, tokens: list[int]) -> None:
        super().begin(tokens)
        if not self.cfg.device_aware.carry_over:
            self.acc.reset()
        if self.drafter is not None:
            self.drafter.begin(self.hst, tokens)

    def commit(self, tokens: list[int]) -> None:
        super().commit(tokens)
        if self.drafter is not None:
            self.hst.commit(tokens)

    def candidates(self, anchor: int, prev: int | None, max_depth: int | None = None,
                   min_prob: float = 0.0, token_ms: float = 0.0, batch: int = 1) -> Candidates:
        """The context/memory spine tree's candidates (`_spine_candidates`), with the draft head's tree merged in
        when there is a head: each head node priced by its group's learned acceptance (`head_key`). The head
        does not run in a step where it cannot pay (`_head_may_pay`: a loaded batch), nor while it rests
        (`_HeadPay`)."""
        base = self._spine_candidates(anchor, prev, max_depth, min_prob)
        if self.drafter is None:
            return base
        if not self._head_may_pay(min_prob, token_ms) or not self._head.drafts():
            self.hst.skip()
            return base
        t = time.perf_counter()
        htree, _ = self.drafter.grow(self.hst, anchor, max_depth, min_prob, token_ms)
        ms = (time.perf_counter() - t) * 1e3
        self._head.charge(ms * (batch - 1))
        self._head_ms = ms if self._head_ms == 0.0 else self._head_ms + HEAD_MS_RATE * (ms - self._head_ms)
        if len(htree) == 1:
            return base
        hq = [1.0] + self.acc.node_probs(htree, self._kind)[0][1:]
        bt, bp = base.tree, base.probs
        qb = [1.0] + [bp[i] / bp[bt.parents[i]] if bp[bt.parents[i]] > 0 else 0.0 for i in range(1, len(bt))]
        tree, q = merge(bt, qb, htree, hq)
        return Candidates(tree, q)

    def _head_may_pay(self, min_prob: float, token_ms: float) -> bool:
        """Whether the head's nodes can pay for its drafting in this step: the most they can add, a chain of
        `EagleConfig.depth` nodes each with the best acceptance of any head group (`head_best`), net of the
        price of their rows (`min_prob` each, the step loop's), against the tokens the head's own milliseconds
        are worth in this step (its measured drafting time times `token_ms`). Without a price (`min_prob` 0) it
        always may; under a loaded batch (rows near a token's worth each, and many requests' tokens per
        millisecond) it does not run at all."""
        best, p, gain = self.acc.head_best(), 1.0, 0.0
        for _ in range(self.cfg.eagle.depth):
            p *= best
            if p <= min_prob:
                break
            gain += p - min_prob
        return gain > self._head_ms * token_ms

    def _spine_candidates(self, anchor: int, prev: int | None, max_depth: int | None = None,
                          min_prob: float = 0.0) -> Candidates:
        """The candidate tree (cut at `max_depth`) and its nodes' path probabilities; the step loop chooses
        the subtree to verify (`selector.allocate`, for one request the same rule as `draft`). `min_prob`:
        the caller's estimate of the path probability a node must reach to pay for its row. When no child of
        the root can reach it, the tree is not built (a plain step); when no adjacency branch can
        (`AcceptanceModel.branch_best`), the tree is its spine alone. Either way the step is not harvested. When
        `min_prob` is above any probability a child of the root can have (`AcceptanceModel.child_best`, at most
        `AcceptanceConfig.max_prob`: a loaded batch, where a row costs more than a token brings), nothing is looked
        up either: the step costs what `ar`'s does."""
        if min_prob > self.acc.child_best():
            self._root_succ = self._chain = None
            self._learn = False
            return Candidates(DraftTree.root(anchor, route="ar"), [1.0])
        first = self.index.propose()
        self._kind = match_kind(first.consensus, len(first.chain), 0 < first.ngram <= self.cfg.device_aware.weak_ngram)
        self._root_succ = self.adj.successors(anchor, prev)
        mem = self._memory_draft(first)
        self._chain, self._chain_ranks = first.chain, None
        if mem is not None:
            return self._memory_candidates(anchor, prev, mem, max_depth, min_prob)
        plain = self._gate(anchor, self.acc.best_child(self._kind, bool(first.chain)), min_prob)
        if plain is not None:  # (an extended chain is empty exactly when `first`'s is)
            return plain
        prop = self.index.propose_extended(self.cfg.ngram, first)
        reach = self.acc.spine_reach(self._kind, len(prop.chain), min_prob) if min_prob > 0 else 0
        cand = build_spine_tree(anchor, prev, prop.chain, first.confidence, 1.0, self.adj, self.candidate_cfg,
                                cap=load_budget(min_prob, reach, self.cfg.device_aware), branches=self._learn,
                                branch_cap=self.cfg.device_aware.candidate_branches)
        return self._priced(cand, max_depth)

    def _gate(self, anchor: int, best_child: float, min_prob: float) -> Candidates | None:
        """A plain step's candidates when no child of the root (best probability `best_child`) reaches
        `min_prob`; else None. Sets whether the step is harvested: only when an adjacency branch can pay."""
        if min_prob > 0 and best_child < min_prob:
            self._learn = False
            return Candidates(DraftTree.root(anchor, route="ar"), [1.0])
        self._learn = min_prob <= 0 or self.acc.branch_best() >= min_prob
        return None

    def _priced(self, cand: DraftTree, max_depth: int | None) -> Candidates:
        if max_depth is not None:
            cand = cand.within_depth(max_depth)
        if len(cand) == 1:
            cand.route = "ar"
            return Candidates(cand, [1.0])
        q, _ = self.acc.node_probs(cand, self._kind)
        return Candidates(cand, q)

    def _memory_draft(self, first: Proposal) -> MemoryDraft | None:
        """The memory's draft when it matches a longer suffix than the context's own n-gram index (or the
        context has no match); None otherwise."""
        if self.memory is None:
            return None
        mem = self.memory.lookup(self.index.tokens)
        if not mem.spine or (first.chain and mem.match <= first.ngram):
            return None
        return mem

    def _memory_candidates(self, anchor: int, prev: int | None, mem: MemoryDraft, max_depth: int | None,
                           min_prob: float) -> Candidates:
        """A spine tree whose spine (and its alternatives) come from the memory, adjacency branches around."""
        ranks = [memory_rank(c, t, mem.match) for c, t in zip(mem.counts, mem.totals)]
        self._chain, self._chain_ranks = mem.spine, ranks
        plain = self._gate(anchor, self.acc.memory_best(ranks[0]), min_prob)
        if plain is not None:
            return plain
        reach = self.acc.memory_reach(ranks, min_prob) if min_prob > 0 else 0
        alternatives = [(at, toks, memory_rank(c, t, mem.match)) for at, toks, c, t in mem.branches]
        cand = build_spine_tree(anchor, prev, mem.spine, chain_confidence(len(mem.spine), ranks[0] == 0), 1.0,
                                self.adj, self.candidate_cfg, cap=load_budget(min_prob, reach, self.cfg.device_aware),
                                spine_ranks=ranks, alternatives=alternatives, branches=self._learn,
                                branch_cap=self.cfg.device_aware.candidate_branches)
        return self._priced(cand, max_depth)

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        return allocate([self.candidates(anchor, prev)], cost=self.cost_table)[0]

    def harvest(self, tokens: list[int], prevs: list[int], logits) -> None:
        """As every adjacency method, except after a step whose candidates held no adjacency branch because
        none could pay for its row (`candidates` with `min_prob`): that step is not harvested, so a request
        that cannot use the table does not pay for filling it (the vocabulary-wide top-k of each row), and a
        request that cannot speculate at all costs what an `ar` request costs. The table misses those
        positions' successors; drafts only, never outputs, depend on it. `min_prob` carries the step loop's
        `worth_margin`, so a branch below it could still have been chosen now and then (on the Zen 5 table
        of docs/performance-log.md, 6 of 1,262 drafted nodes were branches before this rule)."""
        if not self._learn:
            self._learn = True
            return
        super().harvest(tokens, prevs, logits)

    def observe(self, tree: DraftTree, walk: WalkResult) -> None:
        super().observe(tree, walk)
        self._head.observe(len(walk.path))
        if len(tree) > 1:
            self.acc.update(tree, self.acc.keys(tree, self._kind), walk)
        self._observe_unbuilt(tree, walk)

    def _observe_unbuilt(self, tree: DraftTree, walk: WalkResult) -> None:
        """Children of the root that the step did not verify count as trials of their groups all the same: the
        target's tokens after the anchor are known now (the accepted path and the bonus token).

        - The anchor's adjacency successors, always: such a child is accepted exactly when it is the target's
          next token. So a branch group that a few early rejections put below `min_prob` keeps being measured
          at no row's cost, and returns when its true rate pays for a row (without it, 0 of 5 early trials held
          the rank-0 group at 0.13 for a whole run, against a measured rate of 0.27-0.30).
        - The spine's chain (n-gram or memory), node by node along the known tokens, for groups that no verified
          node has tried yet (`AcceptanceModel.explore_chain`): where the cost curve prices a row above what the
          priors promise, no spine node is ever verified, so without this a spine group would never learn (the
          real model on a repetitive prompt stayed at one token per step with rows at 1.4x)."""
        nxt = tree.tokens[walk.path[1]] if len(walk.path) > 1 else walk.bonus
        built = tree.children[0]  # token -> node of the verified root children
        succ = self._root_succ
        if succ is not None:
            branches = {tree.ranks[i] for i in built.values() if tree.sources[i] == BRANCH}
            min_score, max_rank = self.cfg.tree.min_score, self.acc.cfg.max_rank
            for rank, (tok, score) in enumerate(zip(*succ)):
                if rank > max_rank or score < min_score:
                    break
                if rank not in branches and tok not in built:
                    self.acc.count(self.acc.branch_key(rank, 1), tok == nxt)
        if self._chain:
            known = [tree.tokens[i] for i in walk.path[1:]] + [walk.bonus]
            self.acc.explore_chain(self._kind, self._chain, known, tree, self._chain_ranks)
