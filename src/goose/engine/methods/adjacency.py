"""`AdjacencyMethod`: the base of the methods that keep an adjacency table (`tr` and the GOOSE family)."""

from __future__ import annotations

from ...backends.cpukernel import table_harvester, topk_rows
from ...config import AdjacencyConfig
from ...drafting.adjacency import AdjacencyTable
from .base import Method


class AdjacencyMethod(Method):
    """Shared harvest / reset logic for methods that keep an adjacency table."""

    prefill_harvest = None  # the adjacency table learns from every prompt position (the prefill seeds it)

    def __init__(self, vocab_size: int, adj_cfg: AdjacencyConfig) -> None:
        self.adj = AdjacencyTable(vocab_size, adj_cfg, topk_rows, table_harvester)

    def start(self) -> None:
        if not self.adj.cfg.hot_start:  # before the prefill, so its harvest is kept
            self.adj.reset()

    def fork(self) -> "Method":
        """Without ``hot_start`` every request learns its own table (a shared one would be reset by each
        arrival); with it, the table is shared by all requests, as across the requests of one decoder."""
        twin = super().fork()
        if not self.adj.cfg.hot_start:
            twin.adj = AdjacencyTable(self.adj.vocab_size, self.adj.cfg, self.adj.topk, self.adj.fill)
        return twin

    def harvest(self, tokens: list[int], prevs: list[int], logits) -> None:
        self.adj.harvest(tokens, prevs, logits)
