"""Forward cost curve of a model on its device: milliseconds per forward as a function of query size.

Measured once per (model, dtype, device, threads, forward backend) on a realistic cache length, stored
as JSON under ``$XDG_CACHE_HOME/goose/cost/`` and linearly interpolated between grid points. The
device-aware decoder divides expected tokens by this cost to choose each step's tree size.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import cachefs
from ..backends.tree_tensors import ancestor_mask, tree_depths
from ..drafting.tree import BRANCH, DraftTree
from ..paths import cache_root
from ..progress import note

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REPEATS = 5  # timed passes over the grid (after one warm-up pass); the median of each size is kept
MAX_SPREAD = 1.5  # a measurement whose passes differ more (median over sizes) was disturbed: not cached
MEASURE_TRIES = 2  # measurements tried before a disturbed one is used uncached
CONTEXT_ROWS = 8  # rows of the tree timed on a short and a long cache to price a row's cached context
CONTEXT_FACTOR = 2  # the long cache holds this many times `cache_len` tokens (4x measured the same beta here)
PROTOCOL = 3  # bumped when the measurement changes, so cached curves are measured again


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # query tokens per forward, ascending
    ms: tuple[float, ...]  # median milliseconds per forward at each size
    context_ms: float = 0.0  # ms more per query row and cached token past `cache_len` (attention reads the prefix)
    cache_len: int = 256  # cached tokens per sequence that `ms` was measured on
    spread: float = field(default=1.0, compare=False)  # median over sizes of 2nd slowest / 2nd fastest timed pass (1.0 when read from a file)

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


_KERNEL_SOURCES = ("cpu_kernels.cpp", "quant_kernels.cpp", "int8_kernels.cpp")
_kernels_digest: list[str] = []


def kernels_digest() -> str:
    """A hash of goose's kernel sources: a new kernel measures its own curves."""
    if not _kernels_digest:
        h = hashlib.sha1()
        for name in _KERNEL_SOURCES:
            path = Path(__file__).parents[1] / "backends" / name
            h.update(path.read_bytes() if path.exists() else b"")
        _kernels_digest.append(h.hexdigest()[:12])
    return _kernels_digest[0]


def curve_key(model, forward) -> str:
    """Identifies what the curve depends on: model shape, dtype, device, threads, forward backend and goose's
    kernel sources."""
    cfg = model.config
    parts = [getattr(cfg, "model_type", "?"), getattr(cfg, "_name_or_path", ""),
             str(sum(p.numel() for p in model.parameters())), str(next(model.parameters()).dtype),
             str(next(model.parameters()).device), f"threads={torch.get_num_threads()}", type(forward).__name__,
             getattr(forward, "backend", ""), f"protocol={PROTOCOL}", f"kernels={kernels_digest()}"]
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    return f"{parts[0]}-{digest}"


def bushy_tree(n: int, vocab: int) -> DraftTree:
    """A tree of n nodes with a realistic mix of depth and width (a chain with side branches)."""
    tree = DraftTree.root(1 % vocab)
    tok = 2
    while len(tree) < n:
        parent = len(tree) - 1 if len(tree) % 3 else max(0, len(tree) - 3)
        if tree.add(parent, tok % vocab, BRANCH) < 0:
            tree.add(0, tok % vocab, BRANCH)
        tok += 1
    return tree


def prefilled_caches(forward, vocab: int, count: int, cache_len: int) -> list:
    """`count` caches of the forward's own (`forward.new_cache()`), each prefilled with `cache_len` tokens of
    its own: the prefixes a cost measurement times trees on."""
    from ..backends.lean import Segment

    caches = [forward.new_cache() for _ in range(count)]
    for i, c in enumerate(caches):
        c.reset()
        forward.run([Segment(c, [(j * 7919 + i) % vocab for j in range(cache_len)], keep_last=1)])
    return caches


def tree_segment(cache, tree: DraftTree):
    """The forward's segment verifying `tree` on `cache` (no mask for a single node)."""
    from ..backends.lean import Segment

    return Segment(cache, tree.tokens, *((tree_depths(tree), ancestor_mask(tree)) if len(tree) > 1 else ()))


@torch.inference_mode()
def measure(forward, vocab: int, sizes=GRID, cache_len: int = 256, repeats: int = REPEATS,
            sequences: int = 1) -> CostCurve:
    """Median ms per forward of `sequences` trees of `n` nodes in all (split as evenly as possible), each on
    top of its own cache of `cache_len` tokens, for each size n >= sequences of `sizes`; made non-decreasing
    in the size (`monotone`). The caches are the measurement's own (`forward.new_cache()`). For one sequence
    it also prices the cached context (`context_cost`)."""
    sizes = tuple(n for n in sizes if n >= sequences)
    caches = prefilled_caches(forward, vocab, sequences, cache_len)
    trees = {(n, i): bushy_tree(n // sequences + (i < n % sequences), vocab) for n in sizes for i in range(sequences)}
    segments = {n: [tree_segment(c, trees[n, i]) for i, c in enumerate(caches)] for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first pass warms up and is discarded
        for n in sizes:
            t0 = time.perf_counter()
            forward.run(segments[n])
            dt = (time.perf_counter() - t0) * 1e3
            for c in caches:
                c.keep([])  # back to the prefix
            if rep:
                samples[n].append(dt)
    spread = statistics.median(_spread(v) for v in samples.values())
    context = context_cost(forward, vocab, cache_len, repeats) if sequences == 1 else 0.0
    return CostCurve(sizes, tuple(monotone([statistics.median(samples[n]) for n in sizes])), context, cache_len,
                     spread)


def context_cost(forward, vocab: int, cache_len: int, repeats: int = REPEATS) -> float:
    """ms per query row and cached token: a tree of CONTEXT_ROWS nodes timed on a cache of `cache_len` tokens
    and on one of CONTEXT_FACTOR times as many (interleaved, after a warm-up call each), the difference of the
    medians per row and extra token; never negative."""
    caches = [prefilled_caches(forward, vocab, 1, n)[0] for n in (cache_len, CONTEXT_FACTOR * cache_len)]
    tree = bushy_tree(CONTEXT_ROWS, vocab)
    segments = [[tree_segment(c, tree)] for c in caches]
    samples: list[list[float]] = [[], []]
    for rep in range(repeats + 1):
        for i, c in enumerate(caches):
            t0 = time.perf_counter()
            forward.run(segments[i])
            dt = (time.perf_counter() - t0) * 1e3
            c.keep([])
            if rep:
                samples[i].append(dt)
    extra = statistics.median(samples[1]) - statistics.median(samples[0])
    return max(0.0, extra / (CONTEXT_ROWS * (CONTEXT_FACTOR - 1) * cache_len))


def _spread(samples: list[float]) -> float:
    """Slowest / fastest of one size's timed passes, ignoring one outlier each side when there are 4 or more."""
    s = sorted(samples)
    k = 1 if len(s) >= 4 else 0
    return s[-1 - k] / s[k]


def _read_curve(path: Path) -> CostCurve | None:
    """The curve stored at `path`, or None when it is missing or not a valid curve (then it is measured
    again and replaced)."""
    try:
        curve = CostCurve.from_json(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(math.isfinite(m) and m > 0 for m in curve.ms) or curve.sizes[0] < 1:
        return None
    return curve


def load_or_measure(model, forward, remeasure: bool = False, path: Path | None = None,
                    sequences: int = 1) -> CostCurve:
    """The cached curve for this (model, device, backend), measuring it first if needed.

    Measuring holds a lock on the curve's file (`cachefs.lock`), so concurrent processes measure once, not
    at the same time on the same cores, and the file is replaced atomically (a killed measurement leaves
    the old curve or none, never a torn one)."""
    vocab = model.get_output_embeddings().weight.shape[0]
    path = path or cache_root() / "cost" / f"{curve_key(model, forward)}{'' if sequences == 1 else f'-x{sequences}'}.json"
    if not remeasure:
        curve = _read_curve(path)
        if curve is not None:
            return curve
    with cachefs.lock(path):
        if not remeasure:
            curve = _read_curve(path)  # measured by another process while this one waited
            if curve is not None:
                return curve
        cachefs.clean_stale(path.parent)
        note(f"measuring this model's forward cost curve on this machine (once; cached in {path.parent})")
        for _ in range(MEASURE_TRIES):
            curve = measure(forward, vocab, sequences=sequences)
            if curve.spread <= MAX_SPREAD:
                cachefs.write_text(path, json.dumps(curve.to_json()))
                return curve
    print(f"goose: the forward's timings varied {curve.spread:.1f}x between passes (is the machine busy?); "
          f"this cost curve is used now but not cached", file=sys.stderr)
    return curve


BATCH_SEQUENCES = (1, 2, 4, 8)  # sequence counts whose cost curves are measured for a batch of that size


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


def load_or_measure_batch(model, forward, max_batch: int, remeasure: bool = False) -> BatchCostCurve:
    """The batched cost curve for up to `max_batch` sequences per forward (one cached curve per count in
    `BATCH_SEQUENCES` up to the first one >= max_batch)."""
    counts = [b for b in BATCH_SEQUENCES if b < max_batch] + [next((b for b in BATCH_SEQUENCES if b >= max_batch),
                                                                   max_batch)]
    return BatchCostCurve(tuple((b, load_or_measure(model, forward, remeasure, sequences=b)) for b in counts))
