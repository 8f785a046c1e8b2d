"""GOOSE drafting inside vLLM: an out-of-tree proposer for vLLM's ``custom_class`` speculative method.

vLLM (v1) verifies one draft *chain* per request. In a chain, GOOSE's contribution is its spine: the
context n-gram match over the request's whole context (earliest occurrence, longest n first), the chain
extension of confident matches, and a chain length chosen per request from what it is worth::

    LLM(model, speculative_config={"method": "custom_class", "num_speculative_tokens": 16,
                                   "model": "goose.integrations.vllm.GooseProposer"})

Per engine step vLLM calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``: for every
row of its batch, the tokens sampled this step (accepted draft tokens + the bonus token) and the row's
whole context. For each row the proposer

1. finds the request's state (an incremental `NgramIndex` over its context) and extends it by the new
   tokens only (O(new tokens) per step; the context is never rescanned);
2. scores last step's draft: ``len(sampled) - 1`` of its tokens were accepted, which updates the online
   acceptance model (Beta-smoothed counts per (match kind, n, depth));
3. proposes GOOSE's spine (`NgramIndex.propose` + `propose_extended`) — or, when the contexts of
   requests that already left the batch (kept in one shared n-gram index, ``memory_tokens`` at most)
   match a longer suffix n-gram than the request's own context, the continuation found there — and gives
   each token its path probability (product of the acceptance probabilities along the chain).

Then one allocation over the whole batch cuts every chain: tokens are taken in decreasing path
probability p while ``p > slope * N / C`` — adding a token of marginal verify cost ``slope`` raises the
step's expected tokens per second N / C. The cost model ``C(T) = 1 + slope * T`` (in units of a
one-token step) is fitted online from the wall time between consecutive ``propose`` calls (one engine
step: schedule, forward over T verified tokens, sample) against T, so the same code picks short chains
where verifying is expensive (a busy CPU batch) and long ones where it is nearly free (a GPU at batch 1).

vLLM hands the proposer no request ids. A request's state is found by its content: the row it had last
step if its context still starts with the indexed tokens (first and last tokens compared), else any
unclaimed state whose tokens the row's context extends (requests move rows when others finish), else a
new one. States no row claimed for ``state_ttl`` steps are dropped (finished or long-preempted
requests). A mismatch can only cost acceptance, never correctness: vLLM verifies every drafted token.

This module does not import vLLM; its logic is tested without vLLM
(tests/test_integrations_vllm.py) and, from ``.venv-vllm`` (``make vllm``), inside vLLM on CPU
(tests_vllm/test_vllm_real.py). Token Recycling successors are not drafted here: they are rarely accepted
in a chain (4-8% against 50-63% for spine tokens, measured) and vLLM gives a proposer no logits to
harvest them from.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from ..config import NgramConfig, ProposerConfig
from ..drafting.ngram import NgramIndex, Proposal
from ..selection.acceptance import SHORT
from ..selection.chains import ChainAcceptance, StepCost, allocate

__all__ = ["ChainAcceptance", "GooseProposer", "ProposerConfig", "StepCost", "allocate"]

_SEP = -1  # separates requests in the memory: no n-gram across it matches a real context


class _Request:
    """One request's drafting state: its n-gram index and the draft awaiting verification."""

    __slots__ = ("index", "head", "idle", "draft_len", "kind", "ngram", "archived")

    def __init__(self, cfg: NgramConfig, context: list[int], head: int) -> None:
        self.index = NgramIndex.from_config(cfg)
        self.index.extend(context)
        self.head = tuple(context[:head])
        self.idle = 0
        self.draft_len = 0
        self.kind = SHORT
        self.ngram = 0
        self.archived = False

    def continues(self, row_tokens, n: int) -> bool:
        """Whether a context of `n` tokens (a row of vLLM's token array) extends the indexed tokens."""
        toks = self.index.tokens
        m = len(toks)
        if n < m or tuple(row_tokens[: len(self.head)].tolist()) != self.head:
            return False
        tail = min(m, 8)
        return tail == 0 or row_tokens[m - tail : m].tolist() == toks[m - tail :]


class GooseProposer:
    """vLLM's custom proposer: built as ``GooseProposer(vllm_config)``, then ``load_model(model)``;
    ``propose`` returns one chain (possibly empty) per row of the batch."""

    config = ProposerConfig()

    def __init__(self, vllm_config: Any = None, *, num_speculative_tokens: int | None = None,
                 max_model_len: int | None = None, config: ProposerConfig | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        spec = getattr(vllm_config, "speculative_config", None)
        model_cfg = getattr(vllm_config, "model_config", None)
        self.k = int(num_speculative_tokens or getattr(spec, "num_speculative_tokens", None) or 16)
        self.max_model_len = int(max_model_len or getattr(model_cfg, "max_model_len", None) or 1 << 30)
        self.cfg = config or self.config
        self.acceptance = ChainAcceptance(self.cfg)
        self.cost = StepCost(self.cfg)
        self.clock = clock
        self._states: list[_Request] = []  # every live request state
        self._rows: dict[int, _Request] = {}  # batch row -> state, as of the last call
        self._last_return: float | None = None
        self._last_tokens = 0  # tokens verified by the step that follows the last call
        self.memory = NgramIndex(self.cfg.ngram.ngram_sizes, self.k)  # contexts of requests that left
        self.stats = {"steps": 0, "drafted": 0, "accepted": 0}

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load: drafting reads only the context."""

    # -- request state ------------------------------------------------------------------------------
    def _claim(self, row: int, row_tokens, n: int, claimed: set[int]) -> tuple[_Request, bool]:
        """The state of the request in `row` (found by content), and whether it already existed."""
        st = self._rows.get(row)
        if st is not None and id(st) not in claimed and st.continues(row_tokens, n):
            return st, True
        best = None
        for cand in self._states:  # moved rows: the longest unclaimed state this context extends
            if id(cand) not in claimed and (best is None or len(cand.index.tokens) > len(best.index.tokens)) \
                    and cand.continues(row_tokens, n):
                best = cand
        if best is not None:
            return best, True
        st = _Request(self.cfg.ngram, row_tokens[:n].tolist(), self.cfg.head)
        self._states.append(st)
        return st, False

    def _expire(self, claimed: set[int]) -> None:
        keep = []
        for st in self._states:
            st.idle = 0 if id(st) in claimed else st.idle + 1
            if st.idle and not st.archived:  # left the batch (finished, or not scheduled this step)
                self._remember(st.index.tokens)
                st.archived = True
            if st.idle <= self.cfg.state_ttl:
                keep.append(st)
        self._states = keep

    def _remember(self, tokens: list[int]) -> None:
        cap = self.cfg.memory_tokens
        if cap <= 0:
            return
        if len(self.memory.tokens) + len(tokens) + 1 > cap:  # keep the newer half
            old = self.memory.tokens[len(self.memory.tokens) // 2:]
            self.memory = NgramIndex(self.cfg.ngram.ngram_sizes, self.k)
            self.memory.extend(old)
        self.memory.extend([_SEP] + list(tokens[-cap // 2:]))

    def _spine(self, st: _Request) -> tuple[Proposal, bool]:
        """The request's chain: GOOSE's spine over its own context, or a copy from an earlier request's
        context when that matches a longer suffix n-gram (then True)."""
        own = st.index.propose()
        if self.memory.tokens:
            mem = self.memory.lookup(st.index.tokens[-max(self.cfg.ngram.ngram_sizes):])
            if mem.ngram > own.ngram:
                chain = mem.chain
                if _SEP in chain:
                    chain = chain[: chain.index(_SEP)]
                if chain:
                    return Proposal(chain, mem.ngram, mem.occurrences, mem.consensus), True
        if own.chain:
            own = st.index.propose_extended(self.cfg.ngram, own)
        return own, False

    @property
    def num_requests(self) -> int:
        return len(self._states)

    # -- the vLLM contract --------------------------------------------------------------------------
    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec, token_ids_cpu,
                *args, **kwargs) -> list[list[int]]:
        now = self.clock()
        rows = len(sampled_token_ids)
        claimed: set[int] = set()
        new_rows: dict[int, _Request] = {}
        clean = self._last_return is not None  # this step's time is a cost sample unless a prefill ran
        proposals: list[tuple[int, _Request, Proposal]] = []
        live: list[tuple[int, _Request, int]] = []
        for r in range(rows):
            sampled = sampled_token_ids[r]
            if len(sampled) == 0:  # partial prefill or discarded: no draft
                clean = False
                continue
            n = int(num_tokens_no_spec[r])
            row_tokens = token_ids_cpu[r]
            st, known = self._claim(r, row_tokens, n, claimed)
            claimed.add(id(st))
            new_rows[r] = st
            if not known:
                clean = False
            else:
                grown = n - len(st.index.tokens)
                if grown != len(sampled):
                    clean = False  # not a plain decode step for this row
                elif st.draft_len:
                    accepted = min(st.draft_len, grown - 1)
                    self.acceptance.update(st.kind, st.ngram, st.draft_len, accepted)
                    self.stats["accepted"] += accepted
                if grown:
                    st.index.extend(row_tokens[n - grown : n].tolist())
            st.draft_len = 0
            if n + 1 < self.max_model_len:
                live.append((r, st, n))
        self._expire(claimed)  # first, so requests that just left are already in the memory
        for r, st, n in live:
            prop, from_memory = self._spine(st)
            if prop.chain:
                limit = min(self.k, self.max_model_len - n - 1)
                st.kind, st.ngram = self.acceptance.kind(prop, from_memory), prop.ngram
                proposals.append((r, st, Proposal(prop.chain[:limit], prop.ngram, prop.occurrences,
                                                  prop.consensus)))
        if clean and self._last_tokens:
            self.cost.observe(self._last_tokens, now - self._last_return)

        chains = []
        for _, st, prop in proposals:
            chains.append(self.acceptance.path_probs(st.kind, st.ngram, len(prop.chain)))
        take = allocate(chains, self.cost.slope, self.cfg.min_prob)
        out: list[list[int]] = [[] for _ in range(rows)]
        for (r, st, prop), t in zip(proposals, take):
            out[r] = list(prop.chain[:t])
            st.draft_len = t
        self._rows = new_rows
        self._last_tokens = len(new_rows) + sum(take)
        self.stats["steps"] += 1
        self.stats["drafted"] += sum(take)
        self._last_return = self.clock()
        return out
