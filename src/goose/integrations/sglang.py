"""GOOSE spine trees inside SGLang: a plugin registering the speculative algorithm ``GOOSE``.

SGLang verifies *trees* for its NGRAM algorithm: per request, exactly ``N = speculative_num_draft_tokens``
node tokens (node 0 is the request's last token, the root) and an ``N x N`` boolean ancestor mask
(``mask[i, j]``: node j is node i or an ancestor of it), flattened over the batch. Its NGRAM drafter
matches a trie fed with short output tails only. The ``GOOSE`` worker subclasses SGLang's
``NGRAMWorker`` and replaces what it verifies with GOOSE's anisotropic tree: a deep spine
copied from the request's *whole* context (prompt included; incremental n-gram index per request) with
adjacency branches hanging off the root and the spine, the adjacency table fed from the verify logits
of every drafted node (Token Recycling style, kept across requests: "hot start").

Install goose into SGLang's environment (its entry point, group ``sglang.srt.plugins``, registers the
algorithm when SGLang loads its plugins), then::

    python -m sglang.launch_server --model-path M --speculative-algorithm GOOSE \\
        --speculative-num-draft-tokens 16 --disable-overlap-schedule

The worker runs only where SGLang runs (CUDA/ROCm GPUs, or a build of its kernel package for the
device): SGLang's kernel package has no CPU build on the package registries. What runs anywhere and is
tested on CPU (tests/test_integrations_sglang.py): the tree -> (tokens, mask) adapter, checked against
SGLang's own mask utilities, and the drafter (`GooseTreeDrafter`). The worker is registered with
``supports_overlap=False`` (SGLang then runs it synchronously), so each request's ``output_ids`` is
complete when its tree is drafted.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

import numpy as np

from ..backends.cpukernel import table_harvester, topk_rows
from ..config import AdjacencyConfig, GooseConfig
from ..drafting.adjacency import AdjacencyTable
from ..drafting.ngram import NgramIndex
from ..drafting.spine import build_spine_tree
from ..drafting.tree import SPINE, DraftTree

ALGORITHM = "GOOSE"


# -- the tokens / mask format -----------------------------------------------------------------------------
def tree_to_sglang(tree: DraftTree, num_draft_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """One request's draft in SGLang's NGRAM format: ``tokens`` [N] int64 and ``mask`` [N * N] bool.

    Nodes keep the tree's (topological) order, so a parent precedes its children and is its child's
    largest-index ancestor, which is how SGLang recovers parents. A tree larger than N keeps its first
    N nodes (closed under parents); a smaller one is padded, as SGLang's own drafter pads, with token 0
    hung under the root."""
    n = num_draft_tokens
    keep = min(len(tree), n)
    tokens = np.zeros(n, dtype=np.int64)
    tokens[:keep] = tree.tokens[:keep]
    parents = list(tree.parents[:keep]) + [0] * (n - keep)
    mask = np.zeros((n, n), dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i, : p + 1] = mask[p, : p + 1]
        mask[i, i] = True
    return tokens, mask.reshape(-1)


def batch_to_sglang(trees: Sequence[DraftTree], num_draft_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch's drafts, concatenated as ``NGRAMWorker._prepare_draft_tokens`` returns them:
    tokens [bs * N] int64, mask [bs * N * N] bool."""
    if not trees:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=bool)
    parts = [tree_to_sglang(t, num_draft_tokens) for t in trees]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def parents_from_mask(mask: np.ndarray, n: int) -> list[int]:
    """Each node's parent (its largest-index strict ancestor; -1 for the root) from an N x N mask."""
    m = np.asarray(mask, dtype=bool).reshape(n, n)
    out = []
    for i in range(n):
        anc = np.flatnonzero(m[i, :i])
        out.append(int(anc[-1]) if anc.size else -1)
    return out


def accepted_path(tree: DraftTree, accepted: Sequence[int]) -> list[int]:
    """Node indices (root first) of the tree path spelled by the accepted draft tokens."""
    path, node = [0], 0
    for tok in accepted:
        node = tree.children[node].get(int(tok), -1)
        if node < 0:
            break
        path.append(node)
    return path


# -- the drafter (pure: runs anywhere) ---------------------------------------------------------------------
class _Request:
    __slots__ = ("index", "ema")

    def __init__(self, cfg: GooseConfig, tokens: list[int]) -> None:
        self.index = NgramIndex.from_config(cfg.ngram)
        self.index.extend(tokens)
        self.ema = cfg.tree.ema_init


class GooseTreeDrafter:
    """Per-request GOOSE spine trees of exactly the node budget SGLang verifies.

    ``draft(rid, tokens)`` with the request's whole committed context (prompt + output), then after the
    verify ``harvest(tree, logits)`` (the logits of the tree's nodes) and ``observe(rid, tree,
    accepted_tokens)``; ``retain(rids)`` drops every other request's state."""

    def __init__(self, vocab_size: int, num_draft_tokens: int, cfg: GooseConfig | None = None) -> None:
        base = cfg or GooseConfig()
        if num_draft_tokens < 2:
            raise ValueError("GOOSE needs speculative_num_draft_tokens >= 2 (the root and one draft node)")
        # SGLang verifies exactly N nodes per request: the budget is N whatever the confidence (the paper's
        # budget + c * (max_extended_chain - budget) stays N), and no chain is longer than N - 1
        spine = max(1, num_draft_tokens - 1)
        ngram = replace(base.ngram, max_chain=min(base.ngram.max_chain, spine), max_extended_chain=num_draft_tokens)
        self.cfg = replace(base.with_budget(num_draft_tokens), ngram=ngram)
        self.num_draft_tokens = num_draft_tokens
        adj_cfg = AdjacencyConfig(top_k=base.adjacency.top_k, use_bigram=base.adjacency.use_bigram,
                                  with_scores=base.adjacency.with_scores, hot_start=True)
        self.adj = AdjacencyTable(vocab_size, adj_cfg, topk_rows, table_harvester)
        self.requests: dict[str, _Request] = {}

    def _state(self, rid: str, tokens: list[int]) -> _Request:
        st = self.requests.get(rid)
        have = None if st is None else st.index.tokens
        if have is None or len(have) > len(tokens) or (have and tokens[len(have) - 1] != have[-1]):
            st = self.requests[rid] = _Request(self.cfg, tokens)
        elif len(have) < len(tokens):
            st.index.extend(tokens[len(have):])
        return st

    def draft(self, rid: str, tokens: Sequence[int]) -> DraftTree:
        tokens = [int(t) for t in tokens]
        st = self._state(rid, tokens)
        anchor = tokens[-1]
        prev = tokens[-2] if len(tokens) > 1 else None
        first = st.index.propose()
        prop = st.index.propose_extended(self.cfg.ngram, first)
        return build_spine_tree(anchor, prev, prop.chain, first.confidence, st.ema, self.adj, self.cfg)

    def harvest(self, tree: DraftTree, logits) -> None:
        """Adjacency from the verify logits ``[len(tree), vocab]`` of every drafted node."""
        prevs = [-1 if p < 0 else tree.tokens[p] for p in tree.parents]
        self.adj.harvest(tree.tokens, prevs, logits[: len(tree)])

    def observe(self, rid: str, tree: DraftTree, accepted_tokens: Sequence[int]) -> None:
        """The spine acceptance EMA (accepted / drafted spine nodes) from the accepted draft tokens (bonus excluded)."""
        st = self.requests.get(rid)
        n_spine = tree.count(SPINE)
        if st is None or not n_spine:
            return
        path = accepted_path(tree, accepted_tokens)
        rate = sum(1 for i in path if tree.sources[i] == SPINE) / n_spine
        r = self.cfg.tree.ema_rate
        st.ema = r * rate + (1 - r) * st.ema

    def retain(self, rids: Iterable[str]) -> None:
        keep = set(rids)
        for rid in [r for r in self.requests if r not in keep]:
            del self.requests[rid]


# -- SGLang's side (imports SGLang; runs where SGLang runs) ------------------------------------------------
def worker_class():
    """``GooseWorker``: SGLang's NGRAMWorker drafting GOOSE trees instead of its trie's."""
    import torch  # noqa: PLC0415
    from sglang.srt.speculative.ngram_worker import NGRAMWorker  # noqa: PLC0415

    class GooseWorker(NGRAMWorker):
        def __init__(self, server_args, gpu_id, nccl_port, target_worker) -> None:
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            vocab = target_worker.model_runner.model_config.vocab_size
            self.goose = GooseTreeDrafter(vocab, self.draft_token_num)
            self._drafted: list[tuple[str, DraftTree]] = []

        def _prepare_draft_tokens(self, batch):
            drafted = []
            for req in batch.reqs:
                ctx = list(req.origin_input_ids_unpadded) + list(req.output_ids)
                drafted.append((req.rid, self.goose.draft(req.rid, ctx)))
            self._drafted = drafted
            return batch_to_sglang([t for _, t in drafted], self.draft_token_num)

        def _update_ngram_corpus(self, batch) -> None:
            """goose indexes each request's whole context itself; SGLang's trie is not used."""

        def forward_batch_generation(self, batch, on_publish=None, pp_proxy_tensors=None):
            res = super().forward_batch_generation(batch, on_publish=on_publish, pp_proxy_tensors=pp_proxy_tensors)
            drafted, self._drafted = self._drafted, []
            n = self.draft_token_num
            logits = getattr(res.logits_output, "next_token_logits", None)
            if drafted and logits is not None and logits.shape[0] == len(drafted) * n:
                with torch.no_grad():
                    per_req = logits.view(len(drafted), n, -1)
                    accept_lens = res.accept_lens.tolist()
                    accepted = res.next_token_ids.view(len(drafted), -1).tolist() \
                        if res.next_token_ids.numel() == len(drafted) * n else None
                    for b, (rid, tree) in enumerate(drafted):
                        self.goose.harvest(tree, per_req[b])
                        if accepted is not None:
                            self.goose.observe(rid, tree, accepted[b][: max(0, accept_lens[b] - 1)])
                self.goose.retain(rid for rid, _ in drafted)
            return res

    return GooseWorker


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): registers the ``GOOSE`` speculative algorithm."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: PLC0415
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec  # noqa: PLC0415

    class GooseSpecAlgo(CustomSpecAlgo):
        """Runs on NGRAM's paths: a tree verify of N draft tokens, no draft model, no draft KV."""

        def is_ngram(self) -> bool:
            return True

        def has_draft_kv(self) -> bool:
            return False

    if get_spec(ALGORITHM) is None:
        SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=False, spec_class=GooseSpecAlgo)(
            lambda server_args: worker_class())
