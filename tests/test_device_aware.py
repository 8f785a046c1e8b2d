"""Cost curve, acceptance estimator and subtree selector of the device-aware `goose` method."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import hf_greedy, make_tiny_llama
from goose.backends.forward import HFForward
from goose.config import AcceptanceConfig, EngineConfig
from goose.drafting.tree import BRANCH, SPINE, DraftTree
from goose.engine import measure as costmodel
from goose.engine.measure import load_or_measure, measure
from goose.engine.verify import WalkResult
from goose.errors import GooseError
from goose.selection.acceptance import CONSENSUS, SHORT, AcceptanceModel
from goose.selection.costmodel import BatchCostCurve, CostCurve, TrackedCost, monotone
from goose.selection.selector import Candidates, allocate_counts, path_probs, select


def test_cost_curve_interpolates_and_extrapolates():
    c = CostCurve((1, 2, 8), (10.0, 16.0, 22.0))
    assert c(1) == 10.0 and c(2) == 16.0 and c(8) == 22.0
    assert c(5) == pytest.approx(19.0)
    assert c(14) == pytest.approx(28.0)  # slope of the last segment
    assert c.table(3) == [0.0, 10.0, 16.0, pytest.approx(17.0)]
    assert c.break_even(2) == pytest.approx(0.6)
    assert CostCurve.from_json(json.loads(json.dumps(c.to_json()))) == c
    priced = CostCurve((1, 2), (10.0, 16.0), context_ms=0.003, cache_len=300)
    assert CostCurve.from_json(json.loads(json.dumps(priced.to_json()))) == priced
    assert CostCurve.from_json({"sizes": [1], "ms": [5.0]}) == CostCurve((1,), (5.0,), 0.0, 256)
    with pytest.raises(ValueError):
        CostCurve((2, 1), (1.0, 2.0))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 1000.0), min_size=1, max_size=20))
def test_monotone_is_the_least_squares_non_decreasing_fit(ms):
    fit = monotone(ms)
    assert len(fit) == len(ms)
    assert all(a <= b + 1e-9 for a, b in zip(fit, fit[1:]))
    assert sum(fit) == pytest.approx(sum(ms))  # pooling keeps each block's mean
    if ms == sorted(ms):
        assert fit == pytest.approx(ms)
    # no other non-decreasing sequence is closer: compare with a few simple ones
    err = sum((a - b) ** 2 for a, b in zip(fit, ms))
    for other in (sorted(ms), [sum(ms) / len(ms)] * len(ms), [max(ms[: i + 1]) for i in range(len(ms))]):
        assert err <= sum((a - b) ** 2 for a, b in zip(other, ms)) + 1e-6


def test_a_tracked_curve_prices_rows_as_the_step_loop_measures_them():
    base = BatchCostCurve.single(CostCurve((1, 2, 4, 8), (10.0, 11.0, 13.0, 17.0)))
    t = TrackedCost(base, rate=0.2)
    assert [t(1, n) for n in (1, 2, 4, 8)] == [base(1, n) for n in (1, 2, 4, 8)]  # nothing observed: the curve

    def ms(n, u, k):  # a forward of n rows on one sequence when the plain step costs u and extra rows k times the curve
        return (u * 10.0 + k * (base(1, n) - 10.0)) / 1e3

    for _ in range(60):
        t.observe(1, 1, 0.0, ms(1, 1.2, 1.0))  # plain steps at 1.2x their price
    u, k = t.factors(1)
    assert u == pytest.approx(1.2, rel=0.02) and k == pytest.approx(1.0, rel=1e-6)  # no extra rows: k the curve's
    for i in range(60):
        n = (1, 2, 4, 8)[i % 4]
        t.observe(1, n, 0.0, ms(n, 1.2, 2.0))  # trees of several sizes, their extra rows at twice the curve's
    u, k = t.factors(1)
    assert u == pytest.approx(1.2, rel=0.02) and k == pytest.approx(2.0, rel=0.02)
    assert t(1, 4) == pytest.approx(u * 10.0 + k * 3.0) and t.pricer(1)(3) == t(1, 3) and t(1, 1) == u * 10.0
    t.observe(1, 4, 0.0, 60.0)  # a forward preempted for a minute counts as TRACK_CLAMP times its price
    for _ in range(5):
        t.observe(1, 8, 0.0, ms(8, 1.2, 2.0))
    assert t.factors(1)[1] < 2.5  # (unclamped, 60,000 ms would hold it far off for long)
    for _ in range(200):
        t.observe(1, 1, 0.0, ms(1, 1.2, 1.0))  # only plain steps: the extra rows' price goes back to the curve's
    assert t.factors(1)[1] == pytest.approx(1.0, rel=0.01) and t.factors(2) == (1.0, 1.0)  # (per sequence count)
    rare = TrackedCost(base, rate=0.2)  # no plain step at all (`eagle2`): a machine 10% faster than the curve
    for i in range(100):
        n = (2, 3, 4, 8)[i % 4]
        rare.observe(1, n, 0.0, ms(n, 0.9, 1.0))
    u, k = rare.factors(1)
    assert u == pytest.approx(0.9, rel=0.02) and k == pytest.approx(1.0, rel=0.05)  # not charged to the extra rows
    with pytest.raises(ValueError):
        TrackedCost(base, rate=0.0)


def test_the_step_loop_tracks_its_curve_and_trees_follow_it(tiny_model):
    from goose import Engine

    prompt = [5, 9, 17, 33, 60, 5, 9, 17, 33, 60, 5, 9, 17]
    with Engine(tiny_model, None, "goose", engine_config=EngineConfig(max_batch=1), thread=False) as eng:
        out = [t for block in eng.drive(eng.submit(prompt, 24)) for t in block]
        tracked = eng._cost
        assert isinstance(tracked, TrackedCost) and tracked._sums[1][0] > 0  # its plain steps were observed
    assert out == hf_greedy(tiny_model, prompt, 24)
    tree = DraftTree.root(7)
    tree.add_chain(0, [8, 9, 10, 11], SPINE)
    cands = [Candidates(tree, [1.0, 0.9, 0.9, 0.9, 0.9])]
    slow = TrackedCost(BatchCostCurve.single(CostCurve((1, 8), (10.0, 24.0))), rate=0.5)  # a row: 2 ms
    assert allocate_counts(cands, cost=slow) == [4]  # the whole chain pays at the curve's price
    for _ in range(30):
        slow.observe(1, 1, 0.0, 0.010)
        slow.observe(1, 5, 0.0, (10.0 + 4 * 4 * 2.0) / 1e3)  # the forwards' extra rows at 4x the curve's price
    assert slow.factors(1)[1] == pytest.approx(4.0, rel=0.02) and allocate_counts(cands, cost=slow)[0] < 4


def test_monotone_pools_a_noisy_flat_start():
    assert monotone([49.0, 49.5, 47.0, 47.2, 53.0]) == pytest.approx([48.175] * 4 + [53.0])
    assert monotone([3.0, 1.0]) == [2.0, 2.0]


def test_measure_and_cache(tmp_path, monkeypatch):
    model = make_tiny_llama()
    fwd = HFForward(model)
    curve = measure(fwd, 96, sizes=(1, 2, 4), cache_len=16, repeats=1)
    assert curve.sizes == (1, 2, 4) and all(ms > 0 for ms in curve.ms)
    assert list(curve.ms) == sorted(curve.ms)  # made non-decreasing
    assert curve.cache_len == 16 and curve.context_ms >= 0.0  # the cached context is priced too
    assert measure(fwd, 96, sizes=(2, 4), cache_len=16, repeats=1, sequences=2).context_ms == 0.0  # once, at 1
    assert fwd.length == 0  # measuring leaves no state behind
    path = tmp_path / "curve.json"
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: curve)
    first = load_or_measure(model, fwd, path=path)
    assert first == curve and path.is_file()

    def boom(*a, **k):
        raise AssertionError("a cached curve must not be measured again")

    monkeypatch.setattr(costmodel, "measure", boom)
    assert load_or_measure(model, fwd, path=path) == curve
    path.write_text("{broken")
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: curve)
    assert load_or_measure(model, fwd, path=path) == curve  # unreadable cache: measured again


def small_tree():
    """0 -> 1(s) -> 2(s) -> 3(s); 0 -> 4(b, rank 0); 1 -> 5(b, rank 1)"""
    t = DraftTree.root(9)
    a = t.add(0, 10, SPINE)
    b = t.add(a, 11, SPINE)
    t.add(b, 12, SPINE)
    t.add(0, 20, BRANCH, 0)
    t.add(a, 21, BRANCH, 1)
    return t


def test_acceptance_model_starts_at_priors_and_learns():
    cfg = AcceptanceConfig()
    acc = AcceptanceModel(cfg)
    tree = small_tree()
    q, keys = acc.node_probs(tree, CONSENSUS)
    assert q[0] == 1.0 and q[1] == q[2] == q[3] == cfg.spine_prior[CONSENSUS]
    assert q[4] == cfg.branch_prior[0] and q[5] == cfg.branch_prior[1]
    assert keys[1] != keys[2]  # spine depth matters
    # the spine is always rejected at the first node: its probability drops, deeper ones are untouched
    for _ in range(20):
        acc.update(tree, keys, WalkResult([0, 4], 0))
    q2, _ = acc.node_probs(tree, CONSENSUS)
    assert q2[1] < 0.2 and q2[2] == q[2]
    assert q2[4] > 0.85  # the rank-0 root branch was always accepted
    q_short, _ = acc.node_probs(tree, SHORT)
    assert q_short[1] == cfg.spine_prior[SHORT]  # match kinds are separate groups
    acc.reset()
    assert acc.node_probs(tree, CONSENSUS)[0] == q


def rooted_subtrees(tree: DraftTree):
    nodes = range(1, len(tree))
    for r in range(len(tree)):
        for combo in itertools.combinations(nodes, r):
            keep = set(combo) | {0}
            if all(tree.parents[i] in keep for i in combo):
                yield sorted(keep)


@st.composite
def trees_and_probs(draw):
    n = draw(st.integers(1, 8))
    tree = DraftTree.root(0)
    for i in range(1, n):
        tree.add(draw(st.integers(0, i - 1)), i, BRANCH)
    q = [1.0] + [draw(st.floats(0.0, 0.98)) for _ in range(1, n)]
    base = draw(st.floats(1.0, 50.0))
    incs = draw(st.lists(st.floats(0.0, 40.0), min_size=n, max_size=n))
    cost = [0.0, base]
    for inc in incs:
        cost.append(cost[-1] + inc)
    return tree, q, cost


@settings(max_examples=200, deadline=None)
@given(trees_and_probs())
def test_selector_matches_brute_force(data):
    tree, q, cost = data
    probs = path_probs(tree, q)
    best = max((sum(probs[i] for i in keep[1:]) + 1.0) / cost[len(keep)] for keep in rooted_subtrees(tree))
    chosen, expected = select(tree, q, cost)
    got = (expected + 1.0) / cost[len(chosen)]
    assert got == pytest.approx(best, rel=1e-9)
    # the chosen tree is a real rooted subtree of the candidate, with the same tokens on each path
    for i in range(1, len(chosen)):
        assert chosen.parents[i] < i
    assert expected == pytest.approx(sum(path_probs(chosen, [1.0] + [q[t] for t in chosen.tokens[1:]])[1:]))


def test_selector_returns_plain_step_when_trees_do_not_pay():
    tree = small_tree()
    chosen, e = select(tree, [1.0] + [0.5] * 5, [0.0, 1.0] + [100.0] * 10)
    assert len(chosen) == 1 and chosen.route == "ar" and e == 0.0


@pytest.mark.parametrize("tail, chunk", [(5, 8), (12, 8), (None, 8), (0, 7), (64, 512)])
def test_prefill_harvest_reads_only_the_last_prompt_positions(tiny_model, tail, chunk):
    from dataclasses import replace

    from goose.config import DecodeConfig, DeviceAwareConfig, GooseConfig
    from goose.decoding import Decoder

    prompt = list(range(2, 32))  # 30 distinct tokens: each row of the table belongs to one position
    cfg = GooseConfig(device_aware=replace(DeviceAwareConfig(), prefill_harvest=tail))
    dec = Decoder(tiny_model, None, "goose", cfg, cost=CostCurve((1, 128), (10.0, 10.5)))
    forks, fork = [], dec.method.fork
    dec.method.fork = lambda: forks.append(fork()) or forks[-1]  # the request's own instance (its own table)
    out, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=1, prefill_chunk=chunk))
    harvested = {t for t in prompt if forks[-1].adj.observed[t]}
    k = len(prompt) if tail is None else min(tail, len(prompt))
    assert harvested == set(prompt[len(prompt) - k:])
    assert out == hf_greedy(tiny_model, prompt, 1)


def test_a_disturbed_measurement_is_used_but_not_cached(tmp_path, monkeypatch, capsys):
    """Passes whose timings differ more than MAX_SPREAD (a busy machine) give a curve for this process only:
    measured again next time instead of being cached for good."""
    model = make_tiny_llama()
    fwd = HFForward(model)
    calls = []

    def disturbed(*a, **k):
        calls.append(1)
        return CostCurve((1, 2), (10.0, 12.0), spread=3.0)

    monkeypatch.setattr(costmodel, "measure", disturbed)
    path = tmp_path / "curve.json"
    curve = load_or_measure(model, fwd, path=path)
    assert curve.ms == (10.0, 12.0) and not path.exists() and len(calls) == costmodel.MEASURE_TRIES
    assert "not cached" in capsys.readouterr().err
    steady = iter([CostCurve((1, 2), (10.0, 12.0), spread=3.0), CostCurve((1, 2), (9.0, 11.0), spread=1.1)])
    monkeypatch.setattr(costmodel, "measure", lambda *a, **k: next(steady))
    assert load_or_measure(model, fwd, path=path).ms == (9.0, 11.0) and path.is_file()


@settings(max_examples=100, deadline=None)
@given(st.data())
def test_best_child_bounds_every_path_probability(data):
    """`best_child` is an upper bound on the path probability of every node of any tree (what lets the step
    loop skip building a tree whose root children are all too unlikely), learned counts included."""
    acc = AcceptanceModel(AcceptanceConfig())
    kind = data.draw(st.sampled_from([CONSENSUS, SHORT]))
    n = data.draw(st.integers(2, 12))
    tree = DraftTree.root(0)
    for i in range(1, n):
        parent = data.draw(st.integers(0, i - 1))
        spine_ok = parent == 0 or tree.sources[parent] == SPINE
        tree.add(parent, i, SPINE if spine_ok and data.draw(st.booleans()) else BRANCH, data.draw(st.integers(0, 12)))
    keys = acc.keys(tree, kind)
    has_spine = any(tree.sources[i] == SPINE for i in range(1, n))
    for _ in range(data.draw(st.integers(0, 30))):  # learn from random walks down the tree, asking after each
        path = [0]
        while True:
            kids = [i for i in range(1, n) if tree.parents[i] == path[-1]]
            if not kids or not data.draw(st.booleans()):
                break
            path.append(data.draw(st.sampled_from(kids)))
        acc.update(tree, keys, WalkResult(path, 0))
        probs = path_probs(tree, acc.node_probs(tree, kind)[0])
        assert max(probs[1:]) <= acc.best_child(kind, has_spine) + 1e-12  # the kept branch bound follows the counts
    probs = path_probs(tree, acc.node_probs(tree, kind)[0])
    assert max(probs[1:]) <= acc.best_child(kind, has_spine) + 1e-12


def test_candidates_skip_the_tree_below_min_prob(tiny_model):
    from goose.engine.methods import make_method
    from goose.engine.step import _worth


    m = make_method("goose", tiny_model.config.vocab_size, None)
    m._set_cost(CostCurve((1, 4, 16), (10.0, 12.0, 20.0)))
    m.begin([5, 6, 7, 5, 6, 7, 5, 6])
    full = m.candidates(7, 6)
    assert len(full.tree) > 1  # the repeated context gives a spine
    skipped = m.candidates(7, 6, None, min_prob=1.0)  # no node can reach probability 1 (max_prob < 1)
    assert len(skipped.tree) == 1 and skipped.tree.route == "ar"
    assert len(m.candidates(7, 6, None, min_prob=1e-6).tree) == len(full.tree)
    # a step whose tree was skipped is not harvested (it costs what an `ar` step costs); the next one is
    logits = torch.zeros(1, tiny_model.config.vocab_size)
    logits[0, 3] = 5.0
    before = m.adj.successors(7, 6)
    m.candidates(7, 6, None, min_prob=1.0)
    m.harvest([7], [6], logits)
    assert m.adj.successors(7, 6) == before
    m.candidates(7, 6, None, min_prob=1e-6)
    m.harvest([7], [6], logits)
    assert m.adj.successors(7, 6)[0][0] == 3
    # a threshold between the best branch and the spine's first node: the spine alone, and no harvest
    m.begin([5, 6, 7, 5, 6, 7, 5, 6] * 4)
    full = m.candidates(7, 6)
    assert BRANCH in full.tree.sources and SPINE in full.tree.sources
    spine_p, branch_p = m.acc.best_child(m._kind, True), m.acc.branch_best()
    assert branch_p < spine_p
    mid = (branch_p + spine_p) / 2
    spine_only = m.candidates(7, 6, None, min_prob=mid)
    assert 1 < len(spine_only.tree) and set(spine_only.tree.sources[1:]) == {SPINE}
    assert spine_only.tree.tokens == full.tree.tokens[:len(spine_only.tree)]  # the same spine first
    logits[0, 3], logits[0, 4] = 0.0, 5.0
    m.harvest([7], [6], logits)
    assert m.adj.successors(7, 6)[0][0] == 3  # not learned
    assert BRANCH in m.candidates(7, 6, None, min_prob=branch_p / 2).tree.sources
    m.harvest([7], [6], logits)
    assert m.adj.successors(7, 6)[0][0] == 4
    # the threshold: tokens per ms of a plain step times a row's marginal cost, 0 without a curve
    cost = BatchCostCurve.single(CostCurve((1, 4, 16), (10.0, 12.0, 20.0)))
    assert _worth(None, 1, 1, 1.0) == 0.0
    assert _worth(cost, 1, 1, 1.0) == pytest.approx(EngineConfig().worth_margin * 1.0 * (cost(1, 5) - 10.0) / 4 / 10.0)
    margin = EngineConfig().worth_margin
    near_end = margin * (cost(1, 16) - cost(1, 14)) / 2 / cost(1, 14)  # the 2 rows left below the curve's end
    assert _worth(cost, 1, 14, 1.0) == pytest.approx(near_end)
    assert _worth(cost, 1, 16, 1.0) == math.inf  # the step fills the curve: no draft node can be verified
    # a prompt chunk in the step: a token is priced by the decoding rows' forward alone, a row in the whole step
    two = BatchCostCurve(((1, CostCurve((1, 4, 16), (10.0, 12.0, 20.0))), (2, CostCurve((2, 16), (12.0, 24.0)))))
    with_chunk = _worth(two, 2, 9, 1.0, prefill_rows=8, prefill_sequences=1)
    assert with_chunk == pytest.approx(margin * 1.0 * (two(2, 13) - two(2, 9)) / 4 / two(1, 1))
    assert with_chunk > _worth(two, 2, 9, 1.0)  # (as plain rows, the chunk made every row look cheap)


@given(depth=st.integers(-2, 80), edges=st.lists(st.integers(1, 64), min_size=1, max_size=12, unique=True))
def test_depth_bucket_is_the_first_edge_at_or_above(depth, edges):
    from goose.selection.acceptance import depth_bucket

    edges = tuple(sorted(edges))
    want = next((i for i, e in enumerate(edges) if depth <= e), len(edges))
    assert depth_bucket(depth, edges) == want


def test_candidate_budget_shrinks_with_the_probability_a_node_must_reach(tiny_model):
    """Under load (a high `min_prob`) the candidate tree is cut to the nodes that could pay: at most
    1 / min_prob per depth for LOAD_DEPTHS depths; with no threshold it is the full tree."""
    from goose.config import DeviceAwareConfig
    from goose.engine.methods import load_budget, make_method

    LOAD_DEPTHS, LOAD_MIN_BUDGET = DeviceAwareConfig().load_depths, DeviceAwareConfig().load_min_budget

    assert load_budget(0.0) is None
    assert load_budget(0.25) == max(LOAD_MIN_BUDGET, 1 + LOAD_DEPTHS * 4) and load_budget(0.9) == LOAD_MIN_BUDGET
    assert load_budget(0.25, spine=30) == 31 + LOAD_DEPTHS * 4  # spine nodes that can pay are always built
    m = make_method("goose", tiny_model.config.vocab_size, None)
    m._set_cost(CostCurve((1, 4, 64), (10.0, 12.0, 40.0)))
    m.begin([5, 6, 7, 5, 6, 7, 5, 6] * 4)  # a confident spine: its tree may use up to 100 nodes
    full = m.candidates(7, 6)
    assert len(full.tree) > 2 * LOAD_MIN_BUDGET
    assert len(m.candidates(7, 6, None, min_prob=1e-4).tree) == len(full.tree)
    cut = m.candidates(7, 6, None, min_prob=0.5)
    assert 1 < len(cut.tree) <= load_budget(0.5, m.acc.spine_reach(m._kind, 100, 0.5))
    assert cut.tree.tokens[:4] == full.tree.tokens[:4]  # the same spine first


@given(min_prob=st.floats(0.01, 0.99), length=st.integers(0, 40), kind=st.integers(0, 2))
def test_spine_reach_counts_the_spine_nodes_whose_path_probability_stays_above(min_prob, length, kind):
    acc = AcceptanceModel(AcceptanceConfig())
    tree = DraftTree.root(0)
    tree.add_chain(0, list(range(1, length + 1)), SPINE)
    probs = path_probs(tree, acc.node_probs(tree, kind)[0])
    want = next((d for d in range(1, length + 1) if probs[d] < min_prob), length + 1) - 1
    assert acc.spine_reach(kind, length, min_prob) == want


def test_root_branches_that_were_not_verified_still_count_as_trials(tiny_model):
    """A step's adjacency successors of the anchor are trials of their branch groups whether or not the step
    verified them (accepted exactly when the target's next token is theirs), so a group that early rejections
    put below `min_prob` keeps learning; a verified branch counts once. The n-gram chain's head counts too
    (`AcceptanceModel.explore_chain`)."""
    from goose.engine.methods import make_method

    vocab = tiny_model.config.vocab_size
    m = make_method("goose", vocab, None)
    m._set_cost(CostCurve((1, 4, 16), (10.0, 12.0, 20.0)))
    m.begin([5, 6, 7, 5, 6, 7, 5, 6])
    for _ in range(400):  # a memory group that could pay at any price (this request has no memory to draft from)
        m.acc.count(("m", 0, 0), True)
    assert m.acc.child_best() == m.acc.cfg.max_prob
    logits = torch.full((1, vocab), -30.0)
    logits[0, 3], logits[0, 4] = 5.0, 4.0  # the anchor 7 (after 6): successors 3, then 4
    m.candidates(7, 6)
    m.harvest([7], [6], logits)
    trials = lambda key: tuple(m.acc.counts.get(key, (0.0, 0.0)))  # noqa: E731
    rank0, rank1, spine = ("b", 0, 1), ("b", 1, 1), ("s", m._kind, 0)
    before = {k: trials(k) for k in (rank0, rank1, spine)}
    low = m.acc.branch_best()
    gate = m.acc.cfg.max_prob  # above every root child's probability this step can draft, not above what a
    # child of some group can have (`child_best`, the memory group's)
    plain = m.candidates(7, 6, None, min_prob=gate).tree  # a plain step: nothing below the root is verified
    assert len(plain) == 1
    m.observe(plain, WalkResult([0], 3))  # the target's next token is the rank-0 successor
    assert trials(rank0) == (before[rank0][0] + 1, before[rank0][1] + 1)
    assert trials(rank1) == (before[rank1][0], before[rank1][1] + 1)
    assert m._chain[0] != 3 and trials(spine) == (before[spine][0], before[spine][1] + 1)  # its head: rejected
    assert m.acc.branch_best() > low  # the bound follows the new counts
    m.candidates(7, 6, None, min_prob=gate)
    m.observe(plain, WalkResult([0], 9))  # neither
    assert trials(rank0) == (before[rank0][0] + 1, before[rank0][1] + 2)
    # above what any node can have (a loaded batch): nothing is looked up, so nothing is counted either
    counts = {k: list(v) for k, v in m.acc.counts.items()}
    assert len(m.candidates(7, 6, None, min_prob=1.0).tree) == 1 and m._chain is None and m._root_succ is None
    m.observe(plain, WalkResult([0], 3))
    assert m.acc.counts == counts
    # a tree that verified the rank-0 branch under the root: counted once (by `update`), accepted here
    tree = m.candidates(7, 6).tree
    node = tree.children[0].get(3)
    assert node is not None and tree.sources[node] == BRANCH and tree.ranks[node] == 0
    counted = trials(rank0)
    m.observe(tree, WalkResult([0, node], 1))
    assert trials(rank0) == (counted[0] + 1, counted[1] + 1)


def test_chain_nodes_that_were_not_verified_count_as_spine_trials_while_the_group_is_young():
    """`explore_chain`: along the target's known tokens, each chain node the tree did not verify is a trial of its
    spine group (accepted when its token is the known one) until the first rejection; verified nodes are left to
    `update`; a group stops being counted so once it has `explore_trials` trials, or once a verified node of it
    was a trial. A memory spine's nodes count in their memory groups."""
    acc = AcceptanceModel(AcceptanceConfig(explore_trials=3))
    tree = DraftTree.root(0)
    tree.add_chain(0, [1], SPINE)  # the chain's head was verified
    trials = lambda d: tuple(acc.counts.get(("s", SHORT, d - 1), (0.0, 0.0)))  # noqa: E731 (depths 1-4: buckets 0-3)
    acc.explore_chain(SHORT, [1, 2, 3, 4], [1, 2, 9], tree)
    assert [trials(d) for d in (1, 2, 3, 4)] == [(0, 0), (1, 1), (0, 1), (0, 0)]
    root_only = DraftTree.root(0)
    acc.explore_chain(SHORT, [1, 2, 3, 4], [1, 2, 3, 4, 5], root_only)  # all four known and accepted
    assert [trials(d) for d in (1, 2, 3, 4)] == [(1, 1), (2, 2), (1, 2), (1, 1)]
    acc.explore_chain(SHORT, [7, 2], [1, 2], root_only)  # the head is rejected: nothing below it is a trial
    assert [trials(d) for d in (1, 2)] == [(1, 2), (2, 2)]
    for _ in range(3):
        acc.explore_chain(SHORT, [1, 2, 3], [1, 2, 3], root_only)
    assert [trials(d) for d in (1, 2, 3)] == [(2, 3), (3, 3), (2, 3)]  # each group stops at 3 trials
    off = AcceptanceModel(AcceptanceConfig(explore_trials=0))
    off.explore_chain(SHORT, [1, 2], [1, 2], root_only)
    assert off.counts == {}
    mem = AcceptanceModel(AcceptanceConfig())  # a memory spine: its nodes' groups are their memory ranks
    mem.explore_chain(SHORT, [1, 2, 3], [1, 2, 3], root_only, memory_ranks=[0, 9, 2])
    assert mem.counts == {("m", 0, 0): [1.0, 1.0], ("m", 7, 1): [1.0, 1.0], ("m", 2, 2): [1.0, 1.0]}
    fresh = AcceptanceModel(AcceptanceConfig())
    fresh.update(tree, fresh.keys(tree, SHORT), WalkResult([0, 1], 5))  # the head was verified (and accepted)
    assert fresh.counts == {("s", SHORT, 0): [1.0, 1.0]}
    fresh.explore_chain(SHORT, [1, 2], [1, 2], root_only)  # depth 1: verified before, not explored any more
    assert fresh.counts == {("s", SHORT, 0): [1.0, 1.0], ("s", SHORT, 1): [1.0, 1.0]}


def test_two_token_matches_draft_a_spine_priced_as_their_own_group(tiny_model):
    """`goose` matches the context down to 2 tokens (`DeviceAwareConfig.ngram_sizes`); a chain after such a match
    is priced by the weak group (its prior, then its own counts), not with the longer matches; with the spec's
    sizes (5, 4, 3) the same context has no chain at all."""
    import dataclasses

    from goose.config import DeviceAwareConfig, GooseConfig
    from goose.engine.methods import make_method
    from goose.selection.acceptance import WEAK, match_kind

    assert match_kind(True, 20, weak=True) == WEAK and match_kind(True, 20) == CONSENSUS
    vocab = tiny_model.config.vocab_size
    context = [9, 4, 5, 11, 12, 13, 14, 4, 5]  # only (4, 5) recurs: followed by 11 12 13 14 4 5
    cfg = GooseConfig()
    m = make_method("goose", vocab, cfg)
    m._set_cost(CostCurve((1, 4, 16), (10.0, 10.5, 12.0)))
    m.begin(context)
    cands = m.candidates(5, 4)
    assert m._kind == WEAK
    spine = [i for i in range(1, len(cands.tree)) if cands.tree.sources[i] == SPINE]
    assert [cands.tree.tokens[i] for i in spine] == [11, 12, 13, 14, 4, 5]
    prior = cfg.device_aware.acceptance.spine_prior[WEAK]
    assert cands.probs[spine[0]] == pytest.approx(prior)
    # counts of the weak group move its price, and no other group's
    tree = cands.tree
    m.acc.update(tree, m.acc.keys(tree, WEAK), WalkResult([0, spine[0]], 12))
    assert m.candidates(5, 4).probs[spine[0]] > prior
    assert m.acc.prob(("s", SHORT, 0)) == pytest.approx(cfg.device_aware.acceptance.spine_prior[SHORT])
    spec = dataclasses.replace(cfg, device_aware=dataclasses.replace(cfg.device_aware, ngram_sizes=(5, 4, 3)))
    plain = make_method("goose", vocab, spec)
    plain._set_cost(CostCurve((1, 4, 16), (10.0, 10.5, 12.0)))
    plain.begin(context)
    assert SPINE not in plain.candidates(5, 4).tree.sources
    with pytest.raises(GooseError):
        DeviceAwareConfig(ngram_sizes=(3, 0))
    with pytest.raises(GooseError):
        AcceptanceConfig(spine_prior=(0.7, 0.5, 0.3))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("smb"), st.integers(0, 12), st.integers(1, 8), st.booleans()), max_size=60),
       st.integers(0, 60))
def test_child_best_is_the_best_depth_one_probability_of_any_group(counts, ask_at):
    """`child_best` (kept between calls, updated by `count`) equals the maximum over every group a child of the root
    can belong to, whatever the order of counts and questions."""
    from goose.selection.acceptance import LONG, MEMORY_GROUPS, WEAK, memory_key, spine_key

    acc = AcceptanceModel()

    def brute() -> float:
        keys = ([spine_key(k, 1) for k in (CONSENSUS, LONG, SHORT, WEAK)]
                + [memory_key(r, 1) for r in range(MEMORY_GROUPS)]
                + [acc.branch_key(r, 1) for r in range(acc.cfg.max_rank + 1)])
        return max(acc.prob(k) for k in keys)

    for i, (kind, group, depth, accepted) in enumerate(counts):
        if i == ask_at:
            assert acc.child_best() == brute()
        if kind == "s":
            key = spine_key(group % 4, depth)
        elif kind == "m":
            key = memory_key(group, depth)
        else:
            key = acc.branch_key(group, depth)
        acc.count(key, accepted)
    assert acc.child_best() == brute()
    acc.reset()
    assert acc.child_best() == brute()


def test_a_step_no_child_can_pay_for_looks_nothing_up(tiny_model):
    """Under load (`min_prob` above `child_best`) `candidates` returns a plain step without reading the n-gram index,
    the memory or the adjacency table; just below it, it looks up as usual."""
    from goose.engine.methods import make_method

    m = make_method("goose", tiny_model.config.vocab_size, None)
    m._set_cost(CostCurve((1, 4, 16), (10.0, 12.0, 20.0)))
    m.begin([5, 6, 7, 5, 6, 7, 5, 6])
    best = m.acc.child_best()
    looked = []
    propose = m.index.propose
    m.index.propose = lambda: looked.append(1) or propose()
    plain = m.candidates(7, 6, None, min_prob=best * 1.001)
    assert len(plain.tree) == 1 and plain.tree.route == "ar" and not looked
    assert m._chain is None and m._root_succ is None
    m.candidates(7, 6, None, min_prob=best * 0.999)
    assert looked
