"""Forward cost curve of a model on its device: milliseconds per forward as a function of query size.

Measured once per (model, dtype, device, threads, forward backend) on a realistic cache length, stored
as JSON under ``$XDG_CACHE_HOME/goose/cost/`` and linearly interpolated between grid points. The
device-aware decoder divides expected tokens by this cost to choose each step's tree size.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .model import cache_root
from .tree import BRANCH, DraftTree
from .tree_tensors import ancestor_mask, tree_depths

GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
REPEATS = 5  # timed passes over the grid (after one warm-up pass); the median of each size is kept
PROTOCOL = 2  # bumped when the measurement changes, so cached curves are measured again


@dataclass(frozen=True)
class CostCurve:
    sizes: tuple[int, ...]  # query tokens per forward, ascending
    ms: tuple[float, ...]  # median milliseconds per forward at each size

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.ms) or not self.sizes or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError("cost curve needs matching, strictly increasing sizes and timings")

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def __call__(self, n: float) -> float:
        """Interpolated cost of an n-token forward (linear extrapolation past the last point)."""
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
        return {"sizes": list(self.sizes), "ms": list(self.ms)}

    @classmethod
    def from_json(cls, d: dict) -> "CostCurve":
        return cls(tuple(int(x) for x in d["sizes"]), tuple(float(x) for x in d["ms"]))


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


def curve_key(model, forward) -> str:
    """Identifies what the curve depends on: model shape, dtype, device, threads and forward backend."""
    cfg = model.config
    parts = [getattr(cfg, "model_type", "?"), getattr(cfg, "_name_or_path", ""),
             str(sum(p.numel() for p in model.parameters())), str(next(model.parameters()).dtype),
             str(next(model.parameters()).device), f"threads={torch.get_num_threads()}", type(forward).__name__,
             getattr(forward, "backend", ""), f"protocol={PROTOCOL}"]
    digest = hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]
    return f"{parts[0]}-{digest}"


def _bushy_tree(n: int, vocab: int) -> DraftTree:
    """A tree of n nodes with a realistic mix of depth and width (a chain with side branches)."""
    tree = DraftTree.root(1 % vocab)
    tok = 2
    while len(tree) < n:
        parent = len(tree) - 1 if len(tree) % 3 else max(0, len(tree) - 3)
        if tree.add(parent, tok % vocab, BRANCH) < 0:
            tree.add(0, tok % vocab, BRANCH)
        tok += 1
    return tree


@torch.inference_mode()
def measure(forward, vocab: int, sizes=GRID, cache_len: int = 256, repeats: int = REPEATS) -> CostCurve:
    """Median ms per forward of a tree of each size on top of a cache of `cache_len` tokens, made
    non-decreasing in the size (`monotone`)."""
    forward.reset()
    forward([(i * 7919) % vocab for i in range(cache_len)])
    trees = {n: _bushy_tree(n, vocab) for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first pass warms up and is discarded
        for n in sizes:
            tree = trees[n]
            t0 = time.perf_counter()
            if n == 1:
                forward(tree.tokens)
            else:
                forward(tree.tokens, tree_depths(tree), ancestor_mask(tree))
            dt = (time.perf_counter() - t0) * 1e3
            forward.keep([])  # back to the prefix
            if rep:
                samples[n].append(dt)
    forward.reset()
    return CostCurve(tuple(sizes), tuple(monotone([statistics.median(samples[n]) for n in sizes])))


def load_or_measure(model, forward, remeasure: bool = False, path: Path | None = None) -> CostCurve:
    """The cached curve for this (model, device, backend), measuring it first if needed."""
    vocab = model.get_output_embeddings().weight.shape[0]
    path = path or cache_root() / "cost" / f"{curve_key(model, forward)}.json"
    if path.is_file() and not remeasure:
        try:
            return CostCurve.from_json(json.loads(path.read_text()))
        except (ValueError, KeyError, json.JSONDecodeError):
            pass  # unreadable: measure again
    curve = measure(forward, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(curve.to_json()))
    tmp.replace(path)
    return curve
