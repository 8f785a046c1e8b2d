"""`eagle2`: EAGLE-2 (Li et al., 2024), a dynamic draft tree grown by a trained draft head.

The head (`goose.backends.head`) reads the target's final hidden states, which the step loop asks the forward
for (`features`) and hands over for every position whose token enters the cache (`take_features`: the prompt's
positions, then each step's root and accepted nodes). A step drafts depth by depth (`EagleConfig`):

1. the head runs over the pairs (feature, next token) of the positions verified since the last step, on its own
   KV cache (these rows read the target's true features and stay in the head's cache); the last row's
   distribution gives the root's `top_k` children;
2. at each further depth, the `top_k` nodes of the last depth with the highest joint draft probability are
   expanded: one head row each, reading the feature the head predicted for it, attending to the head's cache
   and to its own ancestors' rows only; each gets its `top_k` most likely children;
3. every drafted node is a candidate: the device-aware selector verifies the subtree of highest path probability
   that pays for its rows under this device's cost curve (EAGLE-2's rerank to the node budget).

Nodes below the step's worth threshold (`min_prob`) are not expanded. The head's rows of a step's draft are
dropped afterwards; the verified positions come back with the target's own features next step. Only drafts
depend on the head: every committed token is the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...backends.head import DraftHead, load_head, packaged_head
from ...config import EagleConfig
from ...drafting.tree import HEAD, DraftTree
from ...errors import GooseError
from ...selection.costmodel import CostCurve
from ...selection.selector import Candidates
from ..measure import load_or_measure
from .base import Method


class _HeadState:
    """One request's head: its KV cache (rows of verified positions), the features not yet run through it."""

    __slots__ = ("k", "v", "start", "feats", "fpos", "tokens")

    def __init__(self) -> None:
        self.k = self.v = None  # [1, K, n, D]
        self.start = 0  # position of the head cache's first row
        self.feats: list[torch.Tensor] = []  # pending features, positions fpos..
        self.fpos = -1  # position of the first pending feature (-1: set by `begin`)
        self.tokens: list[int] = []  # committed tokens (prompt + generated)

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]


class Eagle2(Method):
    name = "eagle2"
    offers_candidates = True
    features = True

    def __init__(self, cfg: EagleConfig = EagleConfig(), cost: CostCurve | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.head: DraftHead | None = None
        self.st = _HeadState()

    def prepare(self, model, forward, tokenizer=None) -> None:
        path = self.cfg.head
        if path is None:
            found = packaged_head(model)
            if found is None:
                raise GooseError("no draft head is packaged for this model: train one with `goose train-head --out "
                                 "DIR` and pass it (--head DIR)")
            path = found
        self.head = load_head(Path(path), model)
        if self.cost is None:
            self.cost = load_or_measure(model, forward)

    # ---- per request -----------------------------------------------------------------------------------
    def start(self) -> None:
        self.st = _HeadState()

    def take_features(self, hidden: torch.Tensor) -> None:
        """The target's final hidden states ``[n, hidden]`` of the next n positions entering the cache."""
        self.st.feats.append(hidden.detach().float())

    def begin(self, tokens: list[int]) -> None:
        st = self.st
        st.tokens = list(tokens)
        have = sum(len(f) for f in st.feats)
        st.fpos = st.start = len(tokens) - 1 - have  # prompt positions reused from a prefix cache have none

    def commit(self, tokens: list[int]) -> None:
        self.st.tokens.extend(tokens)

    # ---- drafting --------------------------------------------------------------------------------------
    def _catch_up(self) -> torch.Tensor | None:
        """Run the head over the pending positions (their rows join its cache); the last row's output, or None
        when there is none to run."""
        st, head = self.st, self.head
        if not st.feats:
            return None
        feats = torch.cat(st.feats)
        st.feats = []
        n = len(feats)
        toks = torch.tensor(st.tokens[st.fpos + 1 : st.fpos + 1 + n])
        if len(toks) != n:
            raise GooseError(f"the head's features ({n}) and tokens ({len(toks)}) disagree")
        pos = torch.arange(st.fpos, st.fpos + n)
        past = None if st.k is None else (st.k, st.v)
        out, (k, v) = head.layer(toks[None], feats[None], pos[None], past)
        st.k = k if st.k is None else torch.cat([st.k, k], 2)
        st.v = v if st.v is None else torch.cat([st.v, v], 2)
        st.fpos += n
        return out[0, -1]

    def _children(self, outs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` draft tokens (target ids) and their probabilities."""
        probs = torch.softmax(self.head.logits(outs).float(), dim=-1)
        p, i = probs.topk(min(self.cfg.top_k, probs.shape[-1]), dim=-1)
        return self.head.d2t[i], p

    @torch.inference_mode()
    def candidates(self, anchor: int, prev: int | None, max_depth: int | None = None,
                   min_prob: float = 0.0) -> Candidates:
        st, head, cfg = self.st, self.head, self.cfg
        tree = DraftTree.root(anchor)
        q = [1.0]
        last = self._catch_up()
        if last is None:  # nothing new verified (cannot happen after `begin`): a plain step
            return Candidates(tree, q)
        r = st.fpos  # the root's position
        depth_cap = cfg.depth if max_depth is None else min(cfg.depth, max_depth)
        if depth_cap < 1:
            return Candidates(tree, q)
        toks, probs = self._children(last[None])
        # per node of the last depth: (tree index, joint probability, the feature predicted for it)
        level = []
        for t, p in zip(toks[0].tolist(), probs[0].tolist()):
            i = tree.add(0, t, HEAD)
            if i > 0:
                q.append(p)
                level.append((i, p, last))
        rows_k, rows_v = [], []  # this step's expansion rows' keys and values
        row_of: dict[int, int] = {}  # tree index -> its expansion row
        L = st.length
        for d in range(2, depth_cap + 1):
            level = sorted((x for x in level if x[1] >= min_prob), key=lambda x: -x[1])[: cfg.top_k]
            if not level:
                break
            n = len(level)
            m0 = sum(k.shape[2] for k in rows_k)  # earlier expansion rows of this step
            mask = torch.zeros(n, L + m0 + n, dtype=torch.bool)
            mask[:, :L] = True
            for j, (i, _, _) in enumerate(level):
                a = tree.parents[i]
                while a > 0:
                    mask[j, L + row_of[a]] = True
                    a = tree.parents[a]
                mask[j, L + m0 + j] = True
            toks_in = torch.tensor([tree.tokens[i] for i, _, _ in level])[None]
            feats_in = torch.stack([f for _, _, f in level])[None]
            pos = torch.full((1, n), r + d - 2, dtype=torch.long)
            past = (torch.cat([st.k] + rows_k, 2), torch.cat([st.v] + rows_v, 2))
            out, (k, v) = head.layer(toks_in, feats_in, pos, past, mask)
            rows_k.append(k)
            rows_v.append(v)
            for j, (i, _, _) in enumerate(level):
                row_of[i] = m0 + j
            toks, probs = self._children(out[0])
            nxt = []
            for j, (i, pv, _) in enumerate(level):
                for t, p in zip(toks[j].tolist(), probs[j].tolist()):
                    c = tree.add(i, t, HEAD)
                    if c > 0:
                        q.append(p)
                        nxt.append((c, pv * p, out[0, j]))
            level = nxt
        return Candidates(tree, q)
