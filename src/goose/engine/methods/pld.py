"""`pld`: prompt lookup decoding."""

from __future__ import annotations

from ...config import PLDConfig
from ...drafting.baselines import build_chain
from ...drafting.ngram import NgramIndex
from ...drafting.tree import DraftTree
from .base import Method


class PLD(Method):
    """Prompt lookup: a chain copied after the earliest match of the last n tokens (n = 3..1)."""

    name = "pld"

    def __init__(self, cfg: PLDConfig = PLDConfig()) -> None:
        self.cfg = cfg
        self.sizes = tuple(range(cfg.max_matching_ngram_size, cfg.min_matching_ngram_size - 1, -1))

    def begin(self, tokens: list[int]) -> None:
        self.index = NgramIndex(self.sizes, self.cfg.prompt_lookup_num_tokens)
        self.index.extend(tokens)

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        return build_chain(anchor, self.index.propose().chain)

    def commit(self, tokens: list[int]) -> None:
        self.index.extend(tokens)
