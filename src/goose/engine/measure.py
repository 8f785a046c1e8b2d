"""Measure a forward's cost curves on this device, and keep them.

A curve is measured once per (model, dtype, device, threads, forward backend, goose's kernel sources) on a
realistic cache length, stored as JSON under ``$XDG_CACHE_HOME/goose/cost/`` and read from there afterwards
(`load_or_measure`; `load_or_measure_batch` for a batch of sequences per forward).
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from .. import cachefs
from ..backends.cpukernel import claimed, source_text
from ..backends.tree_tensors import ancestor_mask, tree_depths
from ..drafting.tree import BRANCH, DraftTree
from ..machine import cpu_identity
from ..paths import cache_root
from ..progress import note
from ..protocols import Segment
from ..selection.costmodel import BatchCostCurve, CostCurve, monotone

# Every size up to 24 rows: the kernels take rows in tiles (8 in the AVX-512 int8 kernel, 6 and 4 elsewhere), and a
# forward of one row past a tile costs a step (int8, AMD EPYC Zen 5, 2 threads: 8 -> 9 rows +13% with 8 sequences,
# +18% with one, where 9 -> 12 add 4-5% each), which interpolating between 8 and 12 priced at half its cost.
GRID = tuple(range(1, 25)) + (32, 33, 48, 64, 96, 128)
REPEATS = 5  # timed passes over the grid (after one warm-up pass); the median of each size is kept
MIN_REPEATS = 2  # timed passes kept even when the time budget is spent (two give a spread)
MAX_SPREAD = 1.5  # a measurement whose passes differ more (median over sizes) was disturbed: not cached
MEASURE_TRIES = 2  # measurements tried before a disturbed one is used uncached
MEASURE_BUDGET_S = 10.0  # wall seconds for all tries of one curve: past it, passes and tries stop at their minimum
# A forward of the curve's smallest size reads every weight once. Reading them slower than this means the forward's
# threads were starved, e.g. by another process's OpenMP team spinning on the same cores: each forward then waits
# for the scheduler, whatever its size, and the curve comes out flat (every size costing the same), which would
# make the selector verify large trees for good. Real memory reads run 50-100x faster on any machine goose targets;
# STARVED_MS more allow for a forward's fixed work (the interpreter, kernel launches), all of a tiny model's time.
STARVED_GBPS = 0.2
STARVED_MS = 50.0
CONTEXT_ROWS = 8  # rows of the tree timed on a short and a long cache to price a row's cached context
CONTEXT_FACTOR = 2  # the long cache holds this many times `cache_len` tokens (4x measured the same beta here)
PROTOCOL = 5  # bumped when the measurement changes, so cached curves are measured again


_KERNEL_SOURCES = ("cpu_kernels.cpp", "quant_kernels.cpp", "int8_kernels.cpp")
_kernels_digest: list[str] = []


def kernels_digest() -> str:
    """A hash of goose's kernel sources and their headers: a new kernel measures its own curves."""
    if not _kernels_digest:
        h = hashlib.sha1()
        for name in _KERNEL_SOURCES:
            path = Path(__file__).parents[1] / "backends" / name
            h.update(source_text(path).encode() if path.exists() else b"")
        _kernels_digest.append(h.hexdigest()[:12])
    return _kernels_digest[0]


def curve_key(model, forward) -> str:
    """Identifies what the curve depends on: model shape, dtype, device, the CPU (`cpu_identity`), threads (and
    the kernels' claim pool), forward backend and goose's kernel sources."""
    cfg = model.config
    parts = [getattr(cfg, "model_type", "?"), getattr(cfg, "_name_or_path", ""),
             str(sum(p.numel() for p in model.parameters())), str(next(model.parameters()).dtype),
             str(next(model.parameters()).device), cpu_identity(), f"threads={torch.get_num_threads()}",
             f"claim={claimed()}",
             type(forward).__name__, forward.backend, f"protocol={PROTOCOL}", f"kernels={kernels_digest()}"]
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
    caches = [forward.new_cache() for _ in range(count)]
    for i, c in enumerate(caches):
        c.reset()
        forward.run([Segment(c, [(j * 7919 + i) % vocab for j in range(cache_len)], keep_last=1)])
    return caches


def tree_segment(cache, tree: DraftTree):
    """The forward's segment verifying `tree` on `cache` (no mask for a single node)."""
    if len(tree) == 1:
        return Segment(cache, tree.tokens)
    return Segment(cache, tree.tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology()))


@torch.inference_mode()
def measure(forward, vocab: int, sizes=GRID, cache_len: int = 256, repeats: int = REPEATS,
            sequences: int = 1, deadline: float | None = None, clock=time.perf_counter) -> CostCurve:
    """Median ms per forward of `sequences` trees of `n` nodes in all (split as evenly as possible), each on
    top of its own cache of `cache_len` tokens, for each size n >= sequences of `sizes`; made non-decreasing
    in the size (`monotone`). The caches are the measurement's own (`forward.new_cache()`). For one sequence
    it also prices the cached context (`context_cost`). Past `deadline` (a `clock` time) no pass starts
    beyond the warm-up and MIN_REPEATS timed ones, so a slow or busy machine measures in bounded time."""
    sizes = tuple(n for n in sizes if n >= sequences)
    caches = prefilled_caches(forward, vocab, sequences, cache_len)
    trees = {(n, i): bushy_tree(n // sequences + (i < n % sequences), vocab) for n in sizes for i in range(sequences)}
    segments = {n: [tree_segment(c, trees[n, i]) for i, c in enumerate(caches)] for n in sizes}
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(repeats + 1):  # the first pass warms up and is discarded
        if rep > min(MIN_REPEATS, repeats) and deadline is not None and clock() > deadline:
            break
        for n in sizes:
            t0 = clock()
            forward.run(segments[n])
            dt = (clock() - t0) * 1e3
            for c in caches:
                c.keep([])  # back to the prefix
            if rep:
                samples[n].append(dt)
    spread = statistics.median(_spread(v) for v in samples.values())
    context = context_cost(forward, vocab, cache_len, repeats, deadline, clock) if sequences == 1 else 0.0
    return CostCurve(sizes, tuple(monotone([statistics.median(samples[n]) for n in sizes])), context, cache_len,
                     spread)


def context_cost(forward, vocab: int, cache_len: int, repeats: int = REPEATS, deadline: float | None = None,
                 clock=time.perf_counter) -> float:
    """ms per query row and cached token: a tree of CONTEXT_ROWS nodes timed on a cache of `cache_len` tokens
    and on one of CONTEXT_FACTOR times as many (interleaved, after a warm-up call each), the difference of the
    medians per row and extra token; never negative. `deadline` as in `measure`."""
    caches = [prefilled_caches(forward, vocab, 1, n)[0] for n in (cache_len, CONTEXT_FACTOR * cache_len)]
    tree = bushy_tree(CONTEXT_ROWS, vocab)
    segments = [[tree_segment(c, tree)] for c in caches]
    samples: list[list[float]] = [[], []]
    for rep in range(repeats + 1):
        if rep > min(MIN_REPEATS, repeats) and deadline is not None and clock() > deadline:
            break
        for i, c in enumerate(caches):
            t0 = clock()
            forward.run(segments[i])
            dt = (clock() - t0) * 1e3
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


def starved(forward, curve: CostCurve) -> float | None:
    """The GB/s at which the curve's smallest forward read the forward's weights (``forward.weight_bytes``), when
    it took longer than STARVED_MS plus reading them at STARVED_GBPS (its threads were starved: see there); None
    otherwise, or when the forward does not say how many bytes its weights hold."""
    nbytes = forward.weight_bytes
    if not nbytes or not curve.ms or curve.ms[0] <= STARVED_MS + nbytes / (STARVED_GBPS * 1e6):
        return None
    return nbytes / (curve.ms[0] * 1e6)


def _read_curve(path: Path) -> CostCurve | None:
    """The curve stored at `path`, or None when it is missing, fails its digest (`cachefs.read_entry`) or is
    not a valid curve (then it is measured again and replaced)."""
    data = cachefs.read_entry(path)
    if data is None:
        return None
    try:
        curve = CostCurve.from_json(json.loads(data.decode("utf-8")))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(math.isfinite(m) and m > 0 for m in curve.ms) or curve.sizes[0] < 1:
        return None
    return curve


def load_or_measure(model, forward, remeasure: bool = False, path: Path | None = None,
                    sequences: int = 1, budget_s: float = MEASURE_BUDGET_S, clock=time.perf_counter) -> CostCurve:
    """The cached curve for this (model, device, backend), measuring it first if needed.

    Measuring holds a lock on the curve's file (`cachefs.lock`), so concurrent processes measure once, not
    at the same time on the same cores, and the file is replaced atomically (a killed measurement leaves
    the old curve or none, never a torn one). A measurement whose passes varied more than MAX_SPREAD, or whose
    forward's threads were starved (`starved`), is tried again (at most MEASURE_TRIES in
    all, none started after `budget_s` seconds) and, if it stays disturbed, used for this run without being
    cached."""
    vocab = model.get_output_embeddings().weight.shape[0]
    suffix = "" if sequences == 1 else f"-x{sequences}"
    path = path or cache_root() / "cost" / f"{curve_key(model, forward)}{suffix}.json"
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
        deadline = clock() + budget_s
        for attempt in range(MEASURE_TRIES):
            if attempt and clock() > deadline:
                break
            curve = measure(forward, vocab, sequences=sequences, deadline=deadline, clock=clock)
            slow = starved(forward, curve)
            if curve.spread <= MAX_SPREAD and slow is None:
                cachefs.write_entry(path, json.dumps(curve.to_json()).encode("utf-8"))
                return curve
    if slow is not None:
        why = (f"a forward read its {forward.weight_bytes / 1e6:.0f} MB of weights at {slow:.3f} GB/s (are other "
               f"processes' threads on these cores?)")
    else:
        why = f"the forward's timings varied {curve.spread:.1f}x between passes (is the machine busy?)"
    print(f"goose: {why}; this cost curve is used now but not cached", file=sys.stderr)
    return curve


BATCH_SEQUENCES = (1, 2, 4, 8)  # sequence counts whose cost curves are measured for a batch of that size


def batch_counts(max_batch: int) -> list[int]:
    """The sequence counts whose curves make the batched cost curve for up to `max_batch` sequences per forward:
    those of `BATCH_SEQUENCES` below it, then the first one >= max_batch (or max_batch itself)."""
    return [b for b in BATCH_SEQUENCES if b < max_batch] + [next((b for b in BATCH_SEQUENCES if b >= max_batch),
                                                                 max_batch)]


def load_or_measure_batch(model, forward, max_batch: int, remeasure: bool = False) -> BatchCostCurve:
    """The batched cost curve for up to `max_batch` sequences per forward (one cached curve per count of
    `batch_counts`)."""
    return BatchCostCurve(tuple((b, load_or_measure(model, forward, remeasure, sequences=b))
                                for b in batch_counts(max_batch)))
