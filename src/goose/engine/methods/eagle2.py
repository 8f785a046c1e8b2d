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

Nodes below the step's worth threshold (`min_prob`) are not expanded, and a further depth is drafted only while
the nodes it expands could add the tokens its measured drafting time is worth (`HeadDrafter.grow`). The head's
rows of a step's draft are dropped afterwards; the verified positions come back with the target's own features
next step. Only drafts depend on the head: every committed token is the target's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ...backends.head import DraftHead, FastHead, HeadCache, load_head, packaged_head
from ...config import EagleConfig
from ...drafting.tree import HEAD, DraftTree
from ...errors import GooseError
from ...selection.acceptance import head_rank
from ...selection.costmodel import CostCurve
from ...selection.selector import Candidates
from ..measure import load_or_measure
from .base import Method

DEPTH_MS_RATE = 0.25  # weight of each drafted depth's time in `HeadDrafter.depth_ms`


class HeadState:
    """One request's head: its KV cache (rows of verified positions), the features not yet run through it."""

    __slots__ = ("cache", "length", "feats", "fpos", "tokens")

    def __init__(self) -> None:
        self.cache = HeadCache()
        self.length = 0  # rows of verified positions in the cache (beyond them: a step's draft rows)
        self.feats: list[torch.Tensor] = []  # pending features, positions fpos..
        self.fpos = -1  # position of the first pending feature (set by `HeadDrafter.begin`)
        self.tokens: list[int] = []  # committed tokens (prompt + generated)

    def take_features(self, hidden: torch.Tensor) -> None:
        """The target's features of the next positions entering its cache (`Method.take_features`): final
        hidden states, a fused head's with the tapped layers' streams before them."""
        self.feats.append(hidden.detach().float())

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def skip(self, keep: int = 0) -> None:
        """Leave the pending positions but the last `keep` out of the head's cache (0: a step the head does not
        draft in `goose`; `EagleConfig.catch_up`: before a catch-up)."""
        drop = sum(len(f) for f in self.feats) - keep
        if drop > 0:
            self.fpos += drop
            self.feats = [torch.cat(self.feats)[drop:]] if keep else []


def find_head(model, cfg: EagleConfig, required: bool) -> DraftHead | None:
    """The head `cfg.head` names, loaded and checked: a folder, "packaged" (the one packaged for `model`) or
    "none". None means "packaged" when the head is `required` (`eagle2`) and "none" otherwise (`goose`, which
    stays training-free unless a head is named). A missing packaged head is an error when `required`."""
    name = cfg.head if cfg.head is not None else ("packaged" if required else "none")
    if name == "none":
        if required:
            raise GooseError("eagle2 needs a draft head; head='none' turns it off")
        return None
    path = name
    if name == "packaged":
        path = packaged_head(model)
        if path is None:
            if required:
                raise GooseError("no draft head is packaged for this model: train one with `goose train-head --out "
                                 "DIR` and pass it (--head DIR)")
            return None
    return load_head(Path(path), model)


class HeadDrafter:
    """EAGLE-2's dynamic tree from a head (see the module docstring); the per-request state is a `HeadState`."""

    def __init__(self, head: DraftHead, cfg: EagleConfig) -> None:
        self.head, self.cfg = head, cfg
        self.depth_ms = 0.0  # one further depth's drafting (the head's layer and logits), ms: a moving average
        try:  # goose's kernels where they run (float32 CPU), else the head's PyTorch forward
            self.fast = FastHead(head, "Q4_0" if cfg.head_bits == 4 else "Q8_0") \
                if head.fc.weight.device.type == "cpu" else None
        except GooseError:
            self.fast = None

    def _layer(self, toks: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, cache: HeadCache, at: int,
               allowed: torch.Tensor | None = None, back: int = 0) -> torch.Tensor:
        """The head over rows ``[n]`` (keys and values into `cache` at `at`): ``out [n, hidden]``; the rows see
        the cache before ``at - back`` and rows ``at - back .. at + n - 1`` as ``allowed [n, back + n]`` says
        (None: causally)."""
        if self.fast is not None:
            return self.fast.layer(toks, feats, pos, cache, at, allowed, back)
        mask = None
        if allowed is not None:
            mask = torch.cat([torch.ones(len(toks), at - back, dtype=torch.bool), allowed], dim=1)
        return self.head.layer(toks[None], feats[None].to(self.head.fc.weight.dtype), pos[None], mask=mask,
                               cache=cache, at=at)[0][0]

    def begin(self, st: HeadState, tokens: list[int]) -> None:
        st.tokens = list(tokens)
        have = sum(len(f) for f in st.feats)
        st.fpos = len(tokens) - 1 - have  # prompt positions reused from a prefix cache have none

    def _catch_up(self, st: HeadState) -> torch.Tensor | None:
        """Run the head over the pending positions, the last `EagleConfig.catch_up` of them (their rows join its
        cache, each at its own position); the last row's output, or None when there is none to run."""
        st.skip(self.cfg.catch_up)  # the oldest pending positions stay out of the head's cache
        if not st.feats:
            return None
        feats = torch.cat(st.feats)
        st.feats = []
        n = len(feats)
        toks = torch.tensor(st.tokens[st.fpos + 1 : st.fpos + 1 + n])
        if len(toks) != n:
            raise GooseError(f"the head's features ({n}) and tokens ({len(toks)}) disagree")
        pos = torch.arange(st.fpos, st.fpos + n)
        out = self._layer(toks, feats, pos, st.cache, st.length)
        st.length += n
        st.fpos += n
        return out[-1]

    def _children(self, outs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` draft tokens (target ids) and their probabilities."""
        logits = self.fast.logits(outs) if self.fast is not None else self.head.logits(outs)
        probs = torch.softmax(logits.float(), dim=-1)
        p, i = probs.topk(min(self.cfg.top_k, probs.shape[-1]), dim=-1)
        return self.head.d2t[i], p

    @torch.inference_mode()
    def grow(self, st: HeadState, anchor: int, max_depth: int | None = None,
             min_prob: float = 0.0, token_ms: float = 0.0) -> tuple[DraftTree, list[float]]:
        """The step's tree under `anchor` (source HEAD, ranks by `head_rank`) and each node's probability under
        the head (the root's 1). Nodes whose joint probability is below `min_prob` are not expanded, and no
        further depth is drafted when the joint probabilities of the nodes it would expand sum to less than the
        tokens its drafting time is worth (`depth_ms` times `token_ms`, the step's tokens per millisecond): the
        most the next depth's nodes could add (0: no limit)."""
        cfg = self.cfg
        tree = DraftTree.root(anchor)
        q = [1.0]
        last = self._catch_up(st)
        depth_cap = cfg.depth if max_depth is None else min(cfg.depth, max_depth)
        if last is None or depth_cap < 1:
            return tree, q
        r = st.fpos  # the root's position
        toks, probs = self._children(last[None])
        level = []  # per node of the last depth: (tree index, joint probability, the feature predicted for it)
        for t, p in zip(toks[0].tolist(), probs[0].tolist()):
            i = tree.add(0, t, HEAD, head_rank(p))
            if i > 0:
                q.append(p)
                level.append((i, p, last))
        row_of: dict[int, int] = {}  # tree index -> its expansion row (after the cache's verified rows)
        L = st.length
        m0 = 0  # expansion rows of this step so far
        for d in range(2, depth_cap + 1):
            level = sorted((x for x in level if x[1] >= min_prob), key=lambda x: -x[1])[: cfg.top_k]
            if not level or sum(x[1] for x in level) < self.depth_ms * token_ms:
                break
            t0 = time.perf_counter()
            n = len(level)
            seen = torch.zeros(n, m0 + n, dtype=torch.bool)  # over this step's rows (the cache's: all seen)
            for j, (i, _, _) in enumerate(level):
                a = tree.parents[i]
                while a > 0:
                    seen[j, row_of[a]] = True
                    a = tree.parents[a]
                seen[j, m0 + j] = True
            toks_in = torch.tensor([tree.tokens[i] for i, _, _ in level])
            feats_in = torch.stack([f for _, _, f in level])
            pos = torch.full((n,), r + d - 2, dtype=torch.long)
            out = self._layer(toks_in, feats_in, pos, st.cache, L + m0, seen, m0)
            for j, (i, _, _) in enumerate(level):
                row_of[i] = m0 + j
            m0 += n
            toks, probs = self._children(out)
            ms = (time.perf_counter() - t0) * 1e3
            self.depth_ms = ms if self.depth_ms == 0.0 else self.depth_ms + DEPTH_MS_RATE * (ms - self.depth_ms)
            nxt = []
            for j, (i, pv, _) in enumerate(level):
                for t, p in zip(toks[j].tolist(), probs[j].tolist()):
                    c = tree.add(i, t, HEAD, head_rank(p))
                    if c > 0:
                        q.append(p)
                        nxt.append((c, pv * p, out[j]))
            level = nxt
        return tree, q


class Eagle2(Method):
    name = "eagle2"
    offers_candidates = True
    features = True

    def __init__(self, cfg: EagleConfig = EagleConfig(), cost: CostCurve | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.drafter: HeadDrafter | None = None
        self.st = HeadState()

    def prepare(self, model, forward, tokenizer=None) -> None:
        self.drafter = HeadDrafter(find_head(model, self.cfg, required=True), self.cfg)
        self.features = self.drafter.head.cfg.features  # (a fused head also reads some layers' streams)
        if self.cost is None:
            self.cost = load_or_measure(model, forward)

    def start(self) -> None:
        self.st = HeadState()

    def take_features(self, hidden: torch.Tensor) -> None:
        self.st.take_features(hidden)

    def begin(self, tokens: list[int]) -> None:
        self.drafter.begin(self.st, tokens)

    def commit(self, tokens: list[int]) -> None:
        self.st.commit(tokens)

    def candidates(self, anchor: int, prev: int | None, max_depth: int | None = None,
                   min_prob: float = 0.0, token_ms: float = 0.0, batch: int = 1) -> Candidates:
        """The head's tree (`HeadDrafter.grow`); none when `min_prob` is above any probability (a loaded batch,
        where no drafted row pays): then the head does not run, and its pending positions are left out of its
        cache but the last `catch_up`, as a resting head's in `goose`."""
        if min_prob > 1.0:
            self.st.skip(self.cfg.catch_up)
            return Candidates(DraftTree.root(anchor, route="ar"), [1.0])
        tree, q = self.drafter.grow(self.st, anchor, max_depth, min_prob, token_ms)
        return Candidates(tree, q)


def merge(base: DraftTree, qb: list[float], extra: DraftTree, qe: list[float]) -> tuple[DraftTree, list[float]]:
    """`base` with `extra`'s nodes merged in, trie-style, and each node's probability given its parent (a node
    both hold keeps `base`'s source and the larger probability)."""
    tree = base.subtree(list(range(len(base))))
    tree.route = "tree"
    q = list(qb)
    at = {0: 0}
    for i in range(1, len(extra)):
        p = at[extra.parents[i]]
        j = tree.children[p].get(extra.tokens[i])
        if j is None:
            j = tree.add(p, extra.tokens[i], extra.sources[i], extra.ranks[i])
            q.append(qe[i])
        else:
            q[j] = max(q[j], qe[i])
        at[i] = j
    return tree, q
