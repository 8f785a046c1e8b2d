"""Choose the subtree to verify: the best expected tokens per millisecond on this device.

Given per-node conditional acceptance probabilities q, a node's path probability is the product of q
along its root path; the expected accepted length of a rooted subtree is the sum of its nodes' path
probabilities. Since q < 1, a child's path probability is below its parent's, so the n-1 nodes with the
highest path probabilities always form a rooted subtree, and it is the best one of its size (see
docs/theory.md). The selector sorts once, then picks the size n maximising (E[accepted](n) + 1) / cost(n);
n = 1 is a plain autoregressive step. For a batch of requests verified in one forward, `allocate` picks every
request's subtree at once, maximising the step's expected committed tokens per millisecond.
"""

from __future__ import annotations

from ..drafting.tree import DraftTree


def path_probs(tree: DraftTree, q: list[float]) -> list[float]:
    probs = [1.0] * len(tree)
    for i in range(1, len(tree)):
        probs[i] = probs[tree.parents[i]] * q[i]
    return probs


def select(tree: DraftTree, q: list[float], cost: list[float]) -> tuple[DraftTree, float]:
    """Best subtree by (expected accepted + 1) / cost(size); `cost[n]` is the cost of n query tokens.

    Returns the subtree and its expected accepted length."""
    cand = Candidates(tree, q)
    m = allocate_counts([cand], cost=cost)[0]
    return cand.pick(m), cand.expected(m)


class Candidates:
    """A request's candidate tree, its nodes' path probabilities, and its non-root nodes by decreasing path
    probability (each prefix of that order is a rooted subtree, the best of its size)."""

    __slots__ = ("tree", "probs", "order")

    def __init__(self, tree: DraftTree, q: list[float]) -> None:
        self.tree = tree
        self.probs = path_probs(tree, q)
        self.order = sorted(range(1, len(tree)), key=lambda i: -self.probs[i])

    def expected(self, m: int) -> float:
        """Expected accepted draft tokens of the best subtree with m draft nodes."""
        return sum(self.probs[i] for i in self.order[:m])

    def pick(self, m: int) -> DraftTree:
        """The best subtree with m draft nodes (m = 0: a plain step)."""
        if m == len(self.tree) - 1:
            return self.tree
        chosen = self.tree.subtree([0] + self.order[:m])
        if m == 0:
            chosen.route = "ar"
        return chosen


def decoding_cost(cost, sequences: int, rows: int, context: float = 0.0, prefill_tokens: int = 0,
                  prefill_sequences: int = 0) -> float:
    """ms of a step's decoding rows priced as a forward of their own (`cost`: a `BatchCostCurve`): the step's
    `rows` of `sequences` sequences without the `prefill_tokens` prompt-chunk rows of `prefill_sequences` of
    them (see `allocate_counts`)."""
    return cost.pricer(max(1, sequences - prefill_sequences), context)(max(1, rows - prefill_tokens))


def allocate(cands: list[Candidates], fixed_tokens: int = 0, fixed_value: float = 0.0, cost=None,
             sequences: int | None = None, context: float = 0.0, prefill_tokens: int = 0,
             prefill_sequences: int = 0) -> list[DraftTree]:
    """The subtree each request verifies (see `allocate_counts`)."""
    counts = allocate_counts(cands, fixed_tokens, fixed_value, cost, sequences, context, prefill_tokens,
                             prefill_sequences)
    return [c.pick(k) for c, k in zip(cands, counts)]


def allocate_counts(cands: list[Candidates], fixed_tokens: int = 0, fixed_value: float = 0.0, cost=None,
                    sequences: int | None = None, context: float = 0.0, prefill_tokens: int = 0,
                    prefill_sequences: int = 0) -> list[int]:
    """How many draft nodes each request verifies so that the whole step's expected committed tokens per millisecond
    is maximal (see docs/theory.md, "Many requests in one forward").

    Request r verifying its best m_r draft nodes commits ``1 + E_r(m_r)`` tokens in expectation (E_r: the sum
    of the top m_r path probabilities); the forward costs ``cost(sequences, N)`` for ``N = fixed_tokens +
    sum(1 + m_r)`` query tokens, where `fixed_tokens` are the step's other rows (prefill chunks, fixed-shape
    drafts) and `fixed_value` the tokens those rows are expected to commit. For a given total of draft nodes
    M the best choice takes the M highest path probabilities over all requests (each request's share is a
    prefix of its own order, hence a rooted subtree), so one merge and one scan over M find the optimum.
    `cost`: a `BatchCostCurve` (`context`: the sequences' mean cached tokens, which price every row alike, so
    rows stay interchangeable and the merge stays optimal), or a per-size list as `select` takes (then
    `sequences` and `context` are ignored); None verifies every candidate node.

    `prefill_tokens` of the fixed rows are prompt chunks of `prefill_sequences` other sequences: their share of
    the step is left out of the price of a token. The step is priced as the decoding rows' forward alone,
    ``cost(sequences - prefill_sequences, N0 - prefill_tokens)`` (N0: the rows without drafts), plus what the
    draft nodes add to the whole step, ``cost(sequences, N0 + M) - cost(sequences, N0)``. Without that, a step
    that carries a long prompt chunk makes every token look dear and every draft row cheap beside it, and
    draft rows that a decoding step would not pay for get verified."""
    if cost is None:
        return [len(c.tree) - 1 for c in cands]
    seqs = sequences or len(cands)
    base_n = fixed_tokens + len(cands)
    if isinstance(cost, (list, tuple)):
        cap = len(cost) - 1
        at = cost.__getitem__
    else:
        cap = cost.max_size
        at = cost.pricer(seqs, context)
    room = max(0, cap - base_n)
    merged = [(c.probs[i], r) for r, c in enumerate(cands) for i in c.order[:room]]
    if not merged:
        return [0] * len(cands)
    merged.sort(key=lambda pr: -pr[0])
    merged = merged[:room]
    value = fixed_value + len(cands)
    shift = 0.0  # the prompt chunks' share of the step
    if prefill_tokens and not isinstance(cost, (list, tuple)):
        alone = decoding_cost(cost, seqs, base_n, context, prefill_tokens, prefill_sequences)
        shift = max(0.0, at(max(base_n, 1)) - alone)
    best_m, best_rate = 0, value / (at(max(base_n, 1)) - shift)
    for m, (p, _) in enumerate(merged, start=1):
        value += p
        rate = value / (at(base_n + m) - shift)
        if rate > best_rate:
            best_m, best_rate = m, rate
    counts = [0] * len(cands)
    for _, r in merged[:best_m]:
        counts[r] += 1
    return counts
