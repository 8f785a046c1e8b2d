"""Chain selection for a proposer that verifies one draft chain per request (vLLM's speculative decoding).

`ChainAcceptance` keeps online P(draft token d accepted | tokens 1..d-1 accepted) per (match kind, n, depth
bucket); `StepCost` fits one engine step's wall time against its verified tokens; `allocate` cuts every
row's chain so that the step's expected tokens per unit of time is largest.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from typing import Sequence

from ..config import ProposerConfig
from ..drafting.ngram import Proposal
from .acceptance import SHORT, depth_bucket, match_kind

_DEPTH_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # depth buckets of the acceptance model
MEMORY = 3  # match kind of a chain copied from an earlier request's context


def _bucket(depth: int) -> int:
    return depth_bucket(depth, _DEPTH_EDGES)


class ChainAcceptance:
    """Online P(draft token d accepted | tokens 1..d-1 accepted), per (match kind, n, depth bucket)."""

    def __init__(self, cfg: ProposerConfig) -> None:
        self.cfg = cfg
        self.counts: dict[tuple[int, int, int], list[float]] = {}  # key -> [accepted, trials]

    def kind(self, prop: Proposal, memory: bool = False) -> int:
        if memory:
            return MEMORY
        if prop.ngram <= self.cfg.weak_ngram and not prop.consensus:
            return SHORT
        return match_kind(prop.consensus, len(prop.chain))

    def prob(self, kind: int, ngram: int, depth: int) -> float:
        acc, trials = self.counts.get((kind, ngram, _bucket(depth)), (0.0, 0.0))
        s = self.cfg.prior_strength
        return min(self.cfg.max_prob, (acc + s * self.cfg.prior[kind]) / (trials + s))

    def path_probs(self, kind: int, ngram: int, length: int) -> list[float]:
        """Probability that the first d tokens are all accepted, d = 1..length (non-increasing)."""
        out, p = [], 1.0
        for d in range(1, length + 1):
            p *= self.prob(kind, ngram, d)
            out.append(p)
        return out

    def update(self, kind: int, ngram: int, drafted: int, accepted: int) -> None:
        """A chain of `drafted` tokens of which the first `accepted` were accepted."""
        for d in range(1, min(drafted, accepted + 1) + 1):
            c = self.counts.setdefault((kind, ngram, _bucket(d)), [0.0, 0.0])
            c[1] += 1.0
            if d <= accepted:
                c[0] += 1.0


class StepCost:
    """Online model of one engine step's wall time: C(T) = a * (1 + slope * T), T verified tokens.

    Only the relative slope matters to the allocation. It is the least-squares slope through the median
    step time of each T among the recent samples, divided by the intercept, shrunk towards the prior by
    `cost_prior_weight` pseudo-samples, and kept in [cost_min_slope, 1]."""

    def __init__(self, cfg: ProposerConfig) -> None:
        self.cfg = cfg
        self.samples: deque[tuple[int, float]] = deque(maxlen=cfg.cost_window)
        self.slope = cfg.cost_prior_slope
        self._scale: float | None = None  # seconds of a one-token step (a), once fitted

    def predict(self, tokens: int) -> float | None:
        return None if self._scale is None else self._scale * (1.0 + self.slope * tokens)

    def observe(self, tokens: int, seconds: float) -> None:
        pred = self.predict(tokens)
        if pred is not None and seconds > self.cfg.cost_outlier * pred:
            return  # an idle gap or a hiccup, not a step
        self.samples.append((tokens, seconds))
        self._fit()

    def _fit(self) -> None:
        """Weighted least squares over the median step time of each T (medians: a busy machine's slow
        steps do not drag the line), shrunk towards the prior slope."""
        n = len(self.samples)
        by_t: dict[int, list[float]] = {}
        for t, sec in self.samples:
            by_t.setdefault(t, []).append(sec)
        pts = [(t, statistics.median(v), len(v)) for t, v in by_t.items()]
        w_sum = sum(w for _, _, w in pts)
        mx = sum(t * w for t, _, w in pts) / w_sum
        my = sum(m * w for _, m, w in pts) / w_sum
        sxx = sum(w * (t - mx) ** 2 for t, _, w in pts)
        prior = self.cfg.cost_prior_slope
        if sxx <= 0 or n < self.cfg.cost_min_samples:
            slope = prior
        else:
            b = sum(w * (t - mx) * (m - my) for t, m, w in pts) / sxx
            a = my - b * mx
            fitted = b / a if a > 0 else 1.0
            k = self.cfg.cost_prior_weight
            slope = (n * fitted + k * prior) / (n + k)
        self.slope = min(1.0, max(self.cfg.cost_min_slope, slope))
        self._scale = my / (1.0 + self.slope * mx)


def allocate(chains: Sequence[Sequence[float]], slope: float, min_prob: float = 0.0) -> list[int]:
    """How many tokens of each chain to verify this step.

    `chains[r][d-1]` is the probability that the first d tokens of row r's chain are accepted
    (non-increasing in d). With every row producing one token anyway, tokens are added in decreasing
    probability while each raises expected tokens per unit cost, N / C with C = 1 + slope * T."""
    rows = len(chains)
    n_tok = float(rows)  # each row yields at least its bonus token
    cost = 1.0 + slope * rows
    take = [0] * rows
    heap = [(-c[0], r) for r, c in enumerate(chains) if c]
    heapq.heapify(heap)
    while heap:
        neg_p, r = heapq.heappop(heap)
        p = -neg_p
        if p < min_prob or p * cost <= slope * n_tok:
            break  # every remaining token is at most this likely
        take[r] += 1
        n_tok += p
        cost += slope
        if take[r] < len(chains[r]):
            heapq.heappush(heap, (-chains[r][take[r]], r))
    return take
