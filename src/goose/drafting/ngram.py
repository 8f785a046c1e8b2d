"""Context n-gram index: GOOSE's spine source and prompt lookup's matcher.

For each n, a hash map from an n-gram to what we need about its occurrences: the earliest start, how
many there are, and whether all of them are followed by the same token. Only occurrences with at least
one following token are indexed, and the index grows with the committed tokens in O(new tokens) per
step, so a lookup never rescans the context. Tokens are indexed at the next lookup, not when they are
appended: a request that stops looking up (a loaded batch, where no draft row can pay) pays for appends only.

Example (n = 2) over tokens ``a b c a b d``: ``(a, b)`` occurs at 0 and 3 with followers ``c`` and
``d`` (no consensus); proposing after ``... a b`` copies from the earliest occurrence: ``c a b d``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..config import NgramConfig


@dataclass(frozen=True)
class Proposal:
    """A context-matched chain and what the match looked like."""

    chain: list[int]
    ngram: int = 0  # n of the matching n-gram, 0 if none matched
    occurrences: int = 0
    consensus: bool = False

    @property
    def confidence(self) -> float:
        return chain_confidence(len(self.chain), self.consensus)


def chain_confidence(length: int, consensus: bool) -> float:
    """Spec §3: 0 for no chain, 1 on consensus, else a ramp in the chain length."""
    if length == 0:
        return 0.0
    if consensus:
        return 1.0
    if length >= 8:
        return min(0.9, 0.7 + 0.2 * (length - 8) / 12)
    return 0.6 * length / 8


class NgramIndex:
    """Incremental n-gram -> occurrences index over one request's committed tokens."""

    def __init__(self, ngram_sizes: Sequence[int] = (5, 4, 3), max_chain: int = 20) -> None:
        self.ngram_sizes = tuple(sorted(set(ngram_sizes), reverse=True))
        self.max_chain = max_chain
        self.tokens: list[int] = []
        # per n: key -> [earliest start, count, follower of earliest, all followers equal]
        self._maps: dict[int, dict[tuple[int, ...], list]] = {n: {} for n in self.ngram_sizes}
        self._next_start: dict[int, int] = {n: 0 for n in self.ngram_sizes}
        self._indexed = 0  # len(tokens) at the last `_index`

    @classmethod
    def from_config(cls, cfg: NgramConfig) -> "NgramIndex":
        return cls(cfg.ngram_sizes, cfg.max_chain)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append committed tokens; every n-gram that now has a following token is indexed at the next lookup."""
        self.tokens.extend(new_tokens)

    def _index(self) -> None:
        """Index the n-grams that gained a following token since the last call."""
        toks = self.tokens
        end = len(toks)
        if self._indexed == end:
            return
        self._indexed = end
        for n, m in self._maps.items():
            s = self._next_start[n]
            while s + n < end:  # occurrence at s is followed by toks[s + n]
                key = tuple(toks[s : s + n])
                follower = toks[s + n]
                entry = m.get(key)
                if entry is None:
                    m[key] = [s, 1, follower, True]
                else:
                    entry[1] += 1
                    if entry[3] and entry[2] != follower:
                        entry[3] = False
                s += 1
            self._next_start[n] = s

    def lookup(self, suffix: Sequence[int]) -> Proposal:
        """Chain copied after the earliest occurrence of the longest indexed suffix n-gram."""
        self._index()
        toks = self.tokens
        for n in self.ngram_sizes:
            if len(suffix) < n:
                continue
            entry = self._maps[n].get(tuple(suffix[-n:]))
            if entry is None:
                continue
            start, count, _, same = entry
            chain = toks[start + n : start + n + self.max_chain]
            return Proposal(chain, n, count, consensus=count >= 2 and same)
        return Proposal([])

    def propose(self) -> Proposal:
        """Lookup on the committed tokens themselves (the paper's ``propose(tokens)``)."""
        return self.lookup(self.tokens)

    def propose_extended(self, cfg: NgramConfig, first: Proposal | None = None) -> Proposal:
        """Propose, then grow the chain by repeated lookups while confidence allows (GOOSE's chain extension).

        With confidence c > ``extend_threshold`` the chain is extended up to ``int(max_extended_chain * c)``
        tokens; on consensus (c = 1) only while each further lookup also has consensus (the first
        lookup without consensus is still appended). `first` is this step's `propose()`, if known.
        """
        first = first if first is not None else self.propose()
        c = first.confidence
        if c <= cfg.extend_threshold:
            return first
        limit = int(cfg.max_extended_chain * c)
        chain = list(first.chain[:limit])
        while len(chain) < limit:
            nxt = self.lookup(self.tokens[-max(self.ngram_sizes) :] + chain)
            if not nxt.chain:
                break
            chain.extend(nxt.chain[: limit - len(chain)])
            if first.consensus and not nxt.consensus:
                break
        return Proposal(chain, first.ngram, first.occurrences, first.consensus)
