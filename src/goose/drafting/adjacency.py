"""Adjacency table: the model's own remembered top-k successors (GOOSE's branch source).

Two tiers. The unigram tier is a pair of arrays ``[vocab, K]`` (successor ids, scores) plus an
"observed" flag per token; the bigram tier maps ``(prev, token)`` to its own top-k. Both are refreshed
from every forward pass ("harvest"): for each processed position with token t and predecessor p, the
top-k of its logits overwrite row t (the last position wins on duplicates) and set bigram (p, t).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..config import AdjacencyConfig

Successors = tuple[list[int], list[float]]
TopK = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]  # (logits [n, V], k) -> (values, ids) [n, k]
# (table ids [V, K], table scores [V, K], observed [V], with_scores) -> a harvester (or None: none here); a
# harvester: (logits [n, V], tokens) -> (ids, scores) [n, K] after writing the table's rows as
# `AdjacencyTable.harvest` does, or None for logits it cannot read (the table then harvests them itself)
Fill = Callable[[np.ndarray, np.ndarray, np.ndarray, bool], "Callable | None"]


def torch_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(logits.float(), k, dim=-1)


class AdjacencyTable:
    def __init__(self, vocab_size: int, cfg: AdjacencyConfig = AdjacencyConfig(), topk: TopK = torch_topk,
                 fill: Fill | None = None) -> None:
        """`topk`: the row-wise top-k of a harvest's logits (the engine passes its kernel's,
        `goose.backends.cpukernel.topk_rows`); `fill`: makes the table's harvester, the unigram harvest in one
        call where it can (the engine passes `goose.backends.cpukernel.table_harvester`)."""
        self.cfg = cfg
        self.topk = topk
        self.fill = fill
        self.vocab_size = vocab_size
        self.k = k = min(cfg.top_k, vocab_size)  # a vocabulary smaller than top_k keeps every token
        self.ids = np.zeros((vocab_size, k), dtype=np.int64)  # [V, K]
        self.scores = np.zeros((vocab_size, k), dtype=np.float32)  # [V, K]
        self.observed = np.zeros(vocab_size, dtype=bool)  # [V]
        self.bigram: dict[tuple[int, int], Successors] = {}
        self._harvester = None if fill is None else fill(self.ids, self.scores, self.observed, cfg.with_scores)

    def reset(self) -> None:
        self.observed[:] = False
        self.bigram.clear()

    def successors(self, token: int, prev: int | None = None) -> Successors | None:
        """Bigram entry if present, else the unigram row if observed, else None."""
        if prev is not None and self.cfg.use_bigram:
            hit = self.bigram.get((prev, token))
            if hit is not None:
                return hit
        if 0 <= token < self.vocab_size and self.observed[token]:
            return self.ids[token].tolist(), self.scores[token].tolist()
        return None

    def harvest(self, tokens: Sequence[int], prevs: Sequence[int], logits: torch.Tensor) -> None:
        """Remember the top-k successors of every processed position.

        tokens[i] is the token at position i, prevs[i] its predecessor (-1 if unknown) and
        logits[i] (shape ``[n, vocab]``) the model's next-token logits there.
        """
        n = len(tokens)
        if n == 0:
            return
        k = self.k
        done = None if self._harvester is None else self._harvester(logits, tokens)
        if done is not None:
            if self.cfg.use_bigram:
                self._bigrams(tokens, prevs, *done)
            return
        values, idx = self.topk(logits, k)  # [n, K] each
        values, ids = values.cpu(), idx.cpu().numpy()
        if self.cfg.with_scores:
            scores = torch.softmax(values, dim=-1).numpy()  # [n, K], over the K kept logits only
        else:
            scores = np.full((n, k), 1.0 / k, dtype=np.float32)
        last = {t: i for i, t in enumerate(tokens)}  # last position wins on duplicate tokens
        rows = np.fromiter(last.keys(), dtype=np.int64, count=len(last))
        src = np.fromiter(last.values(), dtype=np.int64, count=len(last))
        self.ids[rows] = ids[src]
        self.scores[rows] = scores[src]
        self.observed[rows] = True
        if self.cfg.use_bigram:
            self._bigrams(tokens, prevs, ids, scores)

    def _bigrams(self, tokens: Sequence[int], prevs: Sequence[int], ids: np.ndarray, scores: np.ndarray) -> None:
        id_rows, score_rows = ids.tolist(), scores.tolist()
        for i, (p, t) in enumerate(zip(prevs, tokens)):
            if p >= 0:
                self.bigram[(p, t)] = (id_rows[i], score_rows[i])
