"""The interfaces the engine decodes through, and the plain data that crosses them.

A forward (`goose.backends`: `LeanForward`, `HFForward`), the KV caches it makes, and a batched cost model
(`goose.selection.costmodel.BatchCostCurve`) are used only through these protocols. Optional behaviour is a
protocol member with a default: a class that subclasses the protocol inherits it, so callers never probe
for it.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from .errors import GooseError


class KVCache(Protocol):
    """One sequence's keys and values (one per request: nothing is shared between caches)."""

    @property
    def length(self) -> int:
        """Cached entries."""
        ...

    def reset(self) -> None:
        """Empty the cache (allocating it where it is allocated up front)."""
        ...

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last forward (in that order); drop the rest."""
        ...

    def expect(self, total: int) -> None:
        """The sequence will need about `total` entries; called before `reset`. Default: nothing (the cache
        grows as it needs)."""
        return None


class Segment:
    """One sequence's part of a forward: `tokens` appended to `cache` as a causal run, or as a tree
    (``allowed [n, n]`` ancestor mask and ``depths [n]``); only the last `keep_last` rows' logits when given.
    `features`: the forward also sets `hidden` to every row's final hidden state ``[n, hidden]`` (after the
    model's last norm: what its output head reads; a draft head's input), whatever `keep_last` is. A tuple of
    layer indices (`feature_taps`) asks for a fused draft head's input too: the residual stream after each of
    those decoder layers, RMS-normalized without a weight, before the final state: ``[n, (len + 1) * hidden]``."""

    __slots__ = ("cache", "tokens", "depths", "allowed", "keep_last", "features", "hidden")

    def __init__(self, cache: KVCache, tokens: list[int], depths: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, keep_last: int | None = None,
                 features: bool | tuple[int, ...] = False) -> None:
        self.cache, self.tokens, self.depths, self.allowed, self.keep_last = cache, tokens, depths, allowed, keep_last
        self.features = features
        self.hidden: torch.Tensor | None = None


class Forward(Protocol):
    """The target model's forward over KV caches of its own making.

    `run` serves the engine (several sequences per call); `reset` / `__call__` / `keep` / `length` are the
    single-sequence API on the forward's own cache."""

    backend: str  # which kernels run it (part of a cost curve's cache key)
    # the arithmetic it computes in ("exact": float32 products of the weights' values; "int8": see LeanForward);
    # an Engine's prefix cache only ever holds one arithmetic's keys and values
    arith: str = "exact"
    # goose's whole-model kernel plan, when every layer runs on goose's kernels: each cache entry is then
    # computed the same however the sequence was split into calls (what the prefix cache needs)
    plan: object | None = None

    def new_cache(self) -> KVCache:
        ...

    def run(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Logits per segment, ``[n, vocab]`` (the last `keep_last` rows where given)."""
        ...

    cache: KVCache  # the forward's own cache: the single-sequence API's (reset / __call__ / keep / length)

    def reset(self) -> None:
        self.cache.reset()

    @property
    def length(self) -> int:
        return self.cache.length

    def __call__(self, tokens: list[int], depths: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, keep_last: int | None = None) -> torch.Tensor:
        """Logits ``[n, vocab]`` for `tokens` appended after the forward's own cache (a causal run, or a tree
        with `allowed` ``[n, n]`` and `depths` ``[n]``); only the last `keep_last` rows (>= 1) when given."""
        return self.run([Segment(self.cache, tokens, depths, allowed, keep_last)])[0]

    def keep(self, path: list[int]) -> None:
        """Keep the prefix and the nodes `path` of the last call (in that order); drop the rest."""
        self.cache.keep(path)

    def stale(self) -> bool:
        """True when the model's weights changed since this forward copied or packed them. Default: False (a
        forward that reads the model's own weights is never stale)."""
        return False

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of weights one forward reads (None: not known; the cost measurement's starvation check then
        does not apply)."""
        return None

    @property
    def free_caches(self) -> int | None:
        """How many more caches `new_cache` can make now (None: no bound; a forward with a static cache of a
        fixed number of slots says how many are free). The engine admits no more requests than that."""
        return None

    @property
    def max_entries(self) -> int | None:
        """Entries one cache can hold (None: no bound but the model's): the engine's context limit is at most
        this, less a step's tree room."""
        return None


class CostModel(Protocol):
    """Milliseconds of one forward over `sequences` sequences with `n` query tokens in all, whose cached
    contexts hold `context` tokens on average."""

    @property
    def max_size(self) -> int:
        """The largest measured query size."""
        ...

    def __call__(self, sequences: int, n: float, context: float = 0.0) -> float:
        ...

    def pricer(self, sequences: int, context: float = 0.0) -> Callable[[float], float]:
        """``n -> ms`` for a fixed sequence count and context (what a step prices many sizes with)."""
        ...

    def observe(self, sequences: int, rows: int, context: float, seconds: float) -> None:
        """A decoding forward it priced took `seconds` (a curve that tracks the machine learns from it)."""
        ...


def feature_taps(features: bool | tuple[int, ...]) -> tuple[int, ...]:
    """The decoder layers a `Segment.features` value taps (none for True or False)."""
    return tuple(features) if isinstance(features, tuple) else ()


def check_taps(taps, layers: int) -> None:
    """GooseError when a forward of `layers` decoder layers cannot tap `taps` (`feature_taps`)."""
    if taps and not 0 <= min(taps) <= max(taps) < layers:
        raise GooseError(f"feature taps {list(taps)} outside the model's {layers} decoder layers")


def tap_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """A tapped residual stream as a fused head reads it: RMS-normalized rows, no weight (float32)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def with_taps(final: torch.Tensor, streams: list[torch.Tensor]) -> torch.Tensor:
    """A segment's `hidden`: the tapped `streams` (each `tap_norm`ed), then the `final` states; `final` alone
    without taps."""
    return torch.cat([tap_norm(t).to(final.dtype) for t in streams] + [final], -1) if streams else final

