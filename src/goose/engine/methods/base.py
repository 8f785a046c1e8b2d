"""`Method`, what every decoding method is: drafting state that answers the step loop's calls."""

from __future__ import annotations

import copy

from ...drafting.memory import SuffixMemory
from ...drafting.tree import DraftTree
from ...selection.costmodel import CostCurve
from ...selection.selector import Candidates
from ..verify import WalkResult


class Method:
    name = "base"
    prefill_harvest: int | None = 0  # prompt positions (the last k) whose logits `harvest` reads; None: all
    cost: CostCurve | None = None  # the device's cost curve, for a method that sizes its trees by it
    offers_candidates = False  # True: the step loop asks `candidates` and selects the subtree itself
    # True: the step loop hands over the target's final hidden states (`take_features`); a tuple of layer indices:
    # with those layers' streams before them (a fused head's input, `goose.protocols.Segment`)
    features: bool | tuple[int, ...] = False
    # earlier requests' prompts and outputs, set by the request's owner (Decoder, Engine per tenant); read
    # by the methods that draft from it (`goose`), None: no memory
    memory: SuffixMemory | None = None

    def candidates(self, anchor: int, prev: int | None, max_depth: int | None = None,
                   min_prob: float = 0.0, token_ms: float = 0.0, batch: int = 1) -> Candidates:
        """A candidate tree and its nodes' path probabilities (only when `offers_candidates`). `min_prob`: about
        the acceptance probability a node must reach to pay for its row in this step; `token_ms`: the tokens a
        millisecond of this step is worth (both 0 without a cost curve; see `step._worth`); `batch`: the
        requests decoding in this step (a millisecond spent drafting holds up each of them)."""
        raise NotImplementedError(f"method '{self.name}' drafts its own tree (see `draft`)")

    def start(self) -> None:
        """A new request begins: called before its prefill (whose logits `harvest` may read)."""

    def begin(self, tokens: list[int]) -> None:
        """After the prefill: the request's committed tokens (prompt + first generated token) are `tokens`."""

    def prepare(self, model, forward, tokenizer=None) -> None:
        """Called once by the Engine (a Decoder is one) with the model, its forward and tokenizer (or None), before
        the method is forked for its first request."""

    def draft(self, anchor: int, prev: int | None) -> DraftTree:
        return DraftTree.root(anchor, route="ar")

    def harvest(self, tokens: list[int], prevs: list[int], logits) -> None:
        """Logits ``[n, vocab]`` at positions holding `tokens`, whose predecessors are `prevs`."""

    def take_features(self, hidden) -> None:
        """(Only when `features`.) The target's final hidden states ``[n, hidden]`` (or a fused head's features,
        ``[n, (taps + 1) * hidden]``) of the next n positions whose
        keys and values entered the cache: each prompt chunk's, then each step's root and accepted nodes."""

    def observe(self, tree: DraftTree, walk: WalkResult) -> None:
        pass

    def commit(self, tokens: list[int]) -> None:
        pass

    def fork(self) -> "Method":
        """This method for one more concurrent request: the configuration and what is learned across requests
        by design are shared, the per-request state (set by `begin`) is the new request's own."""
        return copy.copy(self)
