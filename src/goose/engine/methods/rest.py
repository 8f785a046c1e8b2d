"""`rest`: retrieval-based speculative decoding (REST) from a datastore."""

from __future__ import annotations

from ...config import RestConfig
from ...drafting.baselines import build_trie
from ...drafting.datastore import Datastore, check_tokenizer
from ...drafting.datastore import load as load_datastore
from ...drafting.tree import DraftTree
from .base import Method


class Rest(Method):
    """REST: continuations of the longest context suffix found in a datastore, merged into a frequency
    trie of at most `node_budget` nodes (`drafting/datastore.py`)."""

    name = "rest"

    def __init__(self, cfg: RestConfig = RestConfig(), store: Datastore | None = None) -> None:
        self.cfg = cfg
        self.store = store

    def prepare(self, model, forward, tokenizer=None) -> None:
        if self.store is None:
            self.store = load_datastore(self.cfg.datastore)
        check_tokenizer(self.store, tokenizer, model.get_output_embeddings().weight.shape[0])

    def begin(self, tokens: list[int]) -> None:
        self.context = list(tokens)

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        c = self.cfg
        conts = self.store.continuations(self.context, c.continuation_length, c.max_continuations,
                                         c.max_suffix, c.min_suffix)
        return build_trie(anchor, conts, c.node_budget)

    def commit(self, tokens: list[int]) -> None:
        self.context.extend(tokens)
