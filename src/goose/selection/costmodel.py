"""Forward cost curve of a model on its device: milliseconds per forward as a function of query size.

Measured once per (model, dtype, device, threads, forward backend) on a realistic cache length
(`goose.engine.measure`) and linearly interpolated between grid points. The device-aware decoder divides
expected tokens by this cost to choose each step's tree size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # query tokens per forward, ascending
    ms: tuple[float, ...]  # median milliseconds per forward at each size
    context_ms: float = 0.0  # ms more per query row and cached token past `cache_len` (attention reads the prefix)
    cache_len: int = 256  # cached tokens per sequence that `ms` was measured on
    # median over sizes of 2nd slowest / 2nd fastest timed pass (1.0 when read from a file)
    spread: float = field(default=1.0, compare=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.ms) or not self.sizes or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("cost curve needs matching, strictly increasing sizes and timings")

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def __call__(self, n: float) -> float:
        """Interpolated cost of an n-token forward on caches of `cache_len` (linear extrapolation past the
        last point)."""
        s, m = self.sizes, self.ms
        if n >= s[-1] and len(s) > 1:
            slope = (m[-1] - m[-2]) / (s[-1] - s[-2])
            return m[-1] + slope * (n - s[-1])
        return float(np.interp(n, s, m))

    def table(self, upto: int | None = None) -> list[float]:
        """cost(n) for n = 0..upto (index 0 unused), for fast lookups in the step loop."""
        upto = upto or self.max_size
        return [0.0] + [self(n) for n in range(1, upto + 1)]

    def break_even(self, n: int) -> float:
        """Accepted draft tokens per step a size-n tree needs to match plain decoding's tokens/s."""
        return self(n) / self(1) - 1.0

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "ms": list(self.ms), "context_ms": self.context_ms,
                "cache_len": self.cache_len}

    @classmethod
    def from_json(cls, d: dict) -> "CostCurve":
        return cls(tuple(int(x) for x in d["sizes"]), tuple(float(x) for x in d["ms"]),
                   float(d.get("context_ms", 0.0)), int(d.get("cache_len", 256)))


def monotone(ms: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators, equal weights).

    A forward never gets cheaper with more query tokens; measured medians sometimes do (timing noise of a
    few percent, where the true curve is nearly flat), and a curve that dips would make larger trees look
    free. Pooling replaces each dip with the mean of the points involved."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in ms:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]


@dataclass(frozen=True)
class BatchCostCurve:
    """Cost of one forward over several sequences: ms as a function of the number of sequences and of their
    query tokens in all, plus, past the cache length the curves were measured on, the cost of each query row's
    cached context (the one-sequence curve's `context_ms` per row and token of the sequences' mean context).
    One `CostCurve` (over total tokens) per measured sequence count; between counts the cost is interpolated
    linearly, past the last one extrapolated from the last two."""

    curves: tuple[tuple[int, CostCurve], ...]  # (sequences, curve), ascending
    _tables: dict = field(default_factory=dict, compare=False, repr=False)  # sequences -> cost per size

    @property
    def max_size(self) -> int:
        return self.curves[-1][1].max_size

    def table(self, sequences: int) -> list[float]:
        """``cost(sequences, n)`` on caches of the measured length, for n = 0..max_size (index 0: 0.0),
        computed once per sequence count (`pricer` adds each row's context)."""
        t = self._tables.get(sequences)
        if t is None:
            t = self._tables[sequences] = [0.0] + [self._base(sequences, n) for n in range(1, self.max_size + 1)]
        return t

    def row_context_ms(self, context: float) -> float:
        """ms more per query row when the sequences hold `context` cached tokens on average."""
        curve = self.curves[0][1]
        return curve.context_ms * max(0.0, context - curve.cache_len)

    def __call__(self, sequences: int, n: float, context: float = 0.0) -> float:
        return self._base(sequences, n) + n * self.row_context_ms(context)

    def pricer(self, sequences: int, context: float = 0.0):
        """``n -> cost(sequences, n, context)`` for the step loop: table lookups up to `max_size`."""
        table, per_row = self.table(sequences), self.row_context_ms(context)
        cap = len(table) - 1
        return lambda n: (table[n] if n <= cap else self._base(sequences, n)) + n * per_row

    def _base(self, sequences: int, n: float) -> float:
        pts = self.curves
        if len(pts) == 1 or sequences <= pts[0][0]:
            return pts[0][1](n)
        for (b0, c0), (b1, c1) in zip(pts, pts[1:]):
            if sequences <= b1 or (b1, c1) == pts[-1]:
                w = (sequences - b0) / (b1 - b0)
                return (1 - w) * c0(n) + w * c1(n)
        raise AssertionError("unreachable")

    @classmethod
    def single(cls, curve: CostCurve) -> "BatchCostCurve":
        return cls(((1, curve),))

    def observe(self, sequences: int, rows: int, context: float, seconds: float) -> None:
        """A measured curve learns nothing from a forward (`TrackedCost` does)."""


TRACK_RATE = 0.05  # weight of each forward in `TrackedCost`'s moving sums (about the last 20-40 forwards count)
TRACK_CLAMP = 4.0  # a forward's time counts as at most this many times (and at least 1 / this) its price; the
# factors stay within [1 / TRACK_CLAMP, TRACK_CLAMP]
TRACK_PRIOR = 0.05  # weight of the curve's own price (u = k = 1) in each fit, as one forward's


class TrackedCost:
    """A batched cost curve (`BatchCostCurve`, measured once and cached) corrected online by the forwards of the
    step loop that prices with it (`observe`). On a shared machine the price of extra rows moves while one row's
    does not: on a Zen 3 core pair (int8) the same 4-row forward took 1.5x one row's time in one minute and
    2.1-2.5x in another, one row 5.0-5.2 ms throughout (one row is bound by reading the weights from memory, more
    rows by computing, whose speed the machine's other tenants change), so a curve measured at one moment over- or
    under-verifies at the next.

    Per sequence count S, a step of n rows is modelled as ``u * cost(S, S) + k * (cost(S, n) - cost(S, S))`` (the
    plain step's price scaled by u, the extra rows' by k), and (u, k) are fitted by least squares to the measured
    forwards, each weighted `rate` in moving sums (each clamped to `TRACK_CLAMP` of its price), plus the curve
    itself (u = k = 1) weighted `TRACK_PRIOR`. Plain steps alone fix u and leave k at the curve's; trees of
    several sizes fix both (a ratio of extra time to extra price alone would charge the extra rows with any error of
    u where plain steps are rare, as with `eagle2`); and as steps without extra rows replace those with them in the
    moving sums, k returns to the curve's, so a price that stopped trees is tried again. Tokens never depend on
    it: it only sizes trees."""

    def __init__(self, base: BatchCostCurve, rate: float = TRACK_RATE) -> None:
        if not 0 < rate <= 1:
            raise ValueError(f"the tracking rate must be in (0, 1], got {rate}")
        self.base, self.rate = base, rate
        # sequences -> moving sums of [p0 * p0, p0 * e, e * e, ms * p0, ms * e] (p0: the plain step's price, e: the
        # extra rows' price, ms: the measured time) and the fitted (u, k)
        self._sums: dict[int, list[float]] = {}
        self._fit: dict[int, tuple[float, float]] = {}
        self._ref = max(base(1, 2) - base(1, 1), 1e-6) if base.max_size > 1 else 1.0  # an extra row's price

    @property
    def max_size(self) -> int:
        return self.base.max_size

    def factors(self, sequences: int) -> tuple[float, float]:
        """(u, k) for `sequences` sequences: the plain step's and the extra rows' price scales."""
        return self._fit.get(sequences, (1.0, 1.0))

    def __call__(self, sequences: int, n: float, context: float = 0.0) -> float:
        return self.pricer(sequences, context)(n)

    def pricer(self, sequences: int, context: float = 0.0):
        at = self.base.pricer(sequences, context)
        u, k = self.factors(sequences)
        if u == 1.0 and k == 1.0:
            return at
        p0 = at(sequences)
        return lambda n: u * at(n) if n <= sequences else u * p0 + k * (at(n) - p0)

    def observe(self, sequences: int, rows: int, context: float, seconds: float) -> None:
        """A decoding forward (no prompt chunk in it) of `rows` query rows over `sequences` sequences, whose
        cached contexts hold `context` tokens on average, took `seconds`."""
        at = self.base.pricer(sequences, context)
        p0 = at(sequences)
        if p0 <= 0:
            return
        e = max(0.0, at(rows) - p0) if rows > sequences else 0.0
        u, k = self.factors(sequences)
        priced = u * p0 + k * e
        ms = min(max(seconds * 1e3, priced / TRACK_CLAMP), priced * TRACK_CLAMP)
        sums = self._sums.setdefault(sequences, [0.0] * 5)
        for j, x in enumerate((p0 * p0, p0 * e, e * e, ms * p0, ms * e)):
            sums[j] += self.rate * (x - sums[j])
        pp, pe, ee, mp, me = sums
        wp, we = TRACK_PRIOR * p0 * p0, TRACK_PRIOR * self._ref * self._ref  # the curve's own weight
        a, b, c, d, f = pp + wp, pe, ee + we, mp + wp, me + we  # normal equations [a b; b c] (u, k) = (d, f)
        det = a * c - b * b
        u, k = (d * c - b * f) / det, (a * f - b * d) / det
        lo, hi = 1.0 / TRACK_CLAMP, TRACK_CLAMP
        self._fit[sequences] = (min(max(u, lo), hi), min(max(k, lo), hi))
