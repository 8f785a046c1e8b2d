"""Tests for goose.theory: the two-source model, the best-first optimiser and the reference trees."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from goose.theory import (
    BRANCH,
    CPU_COST_MS,
    ROOT,
    SPINE,
    Tree,
    TwoSourceModel,
    best_isotropic,
    best_size,
    best_subtree,
    branch_only,
    expected_accepted,
    goose_tree,
    interp_cost,
    isotropic_tree,
    optimal_tree,
    optimal_values,
    spine_only,
)

# ---------------------------------------------------------------- brute force (independent of theory.py)

def subtree_value(parents: list[int], probs: list[float], keep: set[int]) -> float:
    """E[accepted] of the rooted subtree `keep` (computed from scratch, path by path)."""
    total = 0.0
    for v in keep - {0}:
        p, u = 1.0, v
        while u > 0:
            p *= probs[u]
            u = parents[u]
        total += p
    return total


def rooted_subtrees(parents: list[int], max_size: int):
    """Every rooted subtree with at most max_size nodes, each once (include/exclude on the frontier)."""
    kids: dict[int, list[int]] = {}
    for v in range(1, len(parents)):
        kids.setdefault(parents[v], []).append(v)

    def rec(chosen: frozenset[int], frontier: tuple[int, ...]):
        yield chosen
        for i, f in enumerate(frontier):  # f is the first frontier node we include; earlier ones excluded
            if len(chosen) < max_size:
                yield from rec(chosen | {f}, frontier[i + 1:] + tuple(kids.get(f, ())))

    yield from rec(frozenset({0}), tuple(kids.get(0, ())))


def brute_force(parents: list[int], probs: list[float], budget: int) -> float:
    return max(subtree_value(parents, probs, set(s)) for s in rooted_subtrees(parents, budget))


def explicit_candidates(model: TwoSourceModel, depth: int, width: int) -> Tree:
    """The model's candidate tree cut to `depth` levels and `width` children per node."""
    tree = Tree()
    frontier = [0]
    for _ in range(depth):
        nxt = []
        for u in frontier:
            for prob, kind, rank in model.children(tree.kinds[u], tree.depths[u])[:width]:
                nxt.append(tree.add(u, prob, kind, rank))
        frontier = nxt
    return tree


@st.composite
def candidate_trees(draw):
    """A random tree of <= 12 nodes; each node's children have probabilities summing to <= 1."""
    n = draw(st.integers(2, 12))
    parents = [-1] + [draw(st.integers(0, v - 1)) for v in range(1, n)]
    mass = [1.0] * n  # probability mass still free among each node's children
    probs = [1.0]
    for v in range(1, n):
        p = draw(st.floats(0.0, 1.0)) * mass[parents[v]]
        mass[parents[v]] -= p
        probs.append(p)
    return parents, probs


def _tree(parents, probs) -> Tree:
    t = Tree()
    for v in range(1, len(parents)):
        t.add(parents[v], probs[v])
    return t


# ---------------------------------------------------------------- optimiser vs brute force

def test_rooted_subtree_enumeration_counts():
    # a root with two leaf children has 4 rooted subtrees; a 3-chain has 3
    assert len(list(rooted_subtrees([-1, 0, 0], 9))) == 4
    assert len(list(rooted_subtrees([-1, 0, 1], 9))) == 3


@settings(max_examples=150, deadline=None)
@given(candidate_trees(), st.integers(1, 7))
def test_best_subtree_matches_brute_force(cand, budget):
    parents, probs = cand
    order = best_subtree(_tree(parents, probs), budget)
    assert len(order) == min(budget, len(parents))
    assert all(parents[v] in order[:i] for i, v in enumerate(order) if v)  # a rooted subtree
    assert subtree_value(parents, probs, set(order)) == pytest.approx(brute_force(parents, probs, budget))


@settings(max_examples=40, deadline=None)
@given(st.floats(0.01, 0.99), st.sampled_from([0.05, 0.1, 0.3, (0.4, 0.2, 0.1), (0.3, 0.3, 0.05)]),
       st.sampled_from([None, 1, 2]), st.integers(1, 5))
def test_lazy_optimal_tree_matches_brute_force(p_s, p_t, spine_len, budget):
    model = TwoSourceModel(p_s, p_t, k=4, spine_len=spine_len)
    tree = optimal_tree(budget, model, "both")
    assert len(tree) == budget
    # any subtree of `budget` nodes lies within depth budget-1 and uses at most budget-1 children per node
    cand = explicit_candidates(model, budget - 1, budget - 1)
    best = brute_force(cand.parents, cand.probs, budget)
    assert expected_accepted(tree) == pytest.approx(best)
    assert optimal_values(budget, model, "both")[budget] == pytest.approx(best)
    assert optimal_values(budget, model)[budget] >= best - 1e-12  # "best" also tries adjacency only


# ---------------------------------------------------------------- expected_accepted by hand

def test_expected_accepted_hand_cases():
    assert expected_accepted(([-1], [1.0])) == 0.0
    # chain 0.5, 0.5: 0.5 + 0.25
    assert expected_accepted(([-1, 0, 1], [1, 0.5, 0.5])) == pytest.approx(0.75)
    # root with children 0.6 and 0.3, the 0.6 child has a child 0.5: 0.6 + 0.3 + 0.3
    assert expected_accepted(([-1, 0, 0, 1], [1, 0.6, 0.3, 0.5])) == pytest.approx(1.2)


def test_model_children_sum_at_most_one_and_sorted():
    for p_s in (0.05, 0.3, 0.9):
        for p_t in (0.05, 0.1, 0.3, (0.5, 0.3, 0.1)):
            for kind in (ROOT, SPINE, BRANCH):
                ps = [p for p, _, _ in TwoSourceModel(p_s, p_t).children(kind, 1)]
                assert sum(ps) <= 1 + 1e-9
                assert ps == sorted(ps, reverse=True)
    # strong spine first, branches discounted by (1 - p_s)
    assert TwoSourceModel(0.8, 0.1).children(ROOT, 0)[:2] == [(0.8, SPINE, 0), (pytest.approx(0.02), BRANCH, 0)]
    with pytest.raises(ValueError):
        TwoSourceModel(0.5, (0.1, 0.2)).branch_probs()


def test_small_optimal_tree_by_hand():
    # p_s = 0.8, p_t = 0.1: with 3 nodes the chain (0.8 + 0.64) beats any branch (0.02)
    tree = optimal_tree(3, TwoSourceModel(0.8, 0.1), "both")
    assert tree.parents == [-1, 0, 1] and expected_accepted(tree) == pytest.approx(1.44)


# ---------------------------------------------------------------- anisotropy

@pytest.mark.parametrize("p_s,p_t,budget", [(0.6, 0.1, 16), (0.6, 0.05, 32), (0.8, 0.1, 60), (0.4, 0.05, 60)])
def test_optimum_is_anisotropic_when_spine_is_better(p_s, p_t, budget):
    model = TwoSourceModel(p_s, p_t)
    tree = optimal_tree(budget, model)
    iso_val, _, _ = best_isotropic(budget, model)
    iso_b, _, _ = best_isotropic(budget, model, "branch")
    assert expected_accepted(tree) > max(iso_val, iso_b) + 1e-6  # strictly better than every k-ary tree
    assert max(tree.depths) >= 5 and tree.width() >= 3  # a long chain *and* a wide node
    # deeper than the k-ary tree of its own width: one long chain, not a balanced tree
    assert max(tree.depths) > max(isotropic_tree(budget, model, tree.width()).depths)


def test_isotropic_trees_are_k_ary_bfs():
    model = TwoSourceModel(0.5, 0.1)
    for k in (1, 2, 3):
        t = isotropic_tree(15, model, k)
        assert len(t) == 15 and t.width() <= k
        assert t.depths == sorted(t.depths)  # filled level by level
    assert max(isotropic_tree(7, model, 2).depths) == 2


# ---------------------------------------------------------------- single sources and the GOOSE tree

@pytest.mark.parametrize("budget", [1, 2, 7, 60])
def test_single_source_trees_are_feasible(budget):
    model = TwoSourceModel(0.6, 0.1)
    s = spine_only(budget, model)
    assert len(s) == budget and set(s.kinds[1:]) <= {SPINE} and s.parents == list(range(-1, budget - 1))
    assert expected_accepted(s) == pytest.approx(sum(0.6 ** i for i in range(1, budget)))
    b = branch_only(budget, model)
    assert len(b) == budget and set(b.kinds[1:]) <= {BRANCH}
    assert all(p == pytest.approx(0.1) for p in b.probs[1:])
    # a bounded spine: the chain stops at the end of the match
    assert len(spine_only(budget, TwoSourceModel(0.6, 0.1, spine_len=3))) == min(budget, 4)


@pytest.mark.parametrize("budget", [2, 5, 20, 60, 100])
@pytest.mark.parametrize("confidence", [0.0, 0.7, 1.0])
def test_goose_tree_is_feasible_and_dominated_by_optimum(budget, confidence):
    model = TwoSourceModel(0.6, 0.1)
    g = goose_tree(budget, model, confidence)
    assert len(g) == budget
    assert all(g.parents[v] < v for v in range(1, budget))
    spine = [v for v in range(budget) if g.kinds[v] == SPINE]
    assert all(g.parents[v] == v - 1 for v in spine)  # one chain under the root
    assert expected_accepted(g) <= optimal_values(budget, model)[budget] + 1e-9
    if confidence == 1.0:
        assert len(spine) == budget - 1  # bypass: the whole budget goes to the spine


def test_goose_tree_spec_split():
    # B = 20, ema = 0.5 -> ratio 0.5: 10 spine nodes, 9 branch nodes: spine share 4, root share 5
    g = goose_tree(20, TwoSourceModel(0.6, 0.05), ema=0.5)
    assert g.kinds.count(SPINE) == 10
    assert sum(1 for v in range(1, 20) if g.parents[v] == 0 and g.kinds[v] == BRANCH) == 5
    assert g.probs[11] == pytest.approx(0.05 * 0.4)  # root branch: a sibling of the spine


# ---------------------------------------------------------------- device-aware sizing

def test_cost_interpolation_and_best_size():
    assert interp_cost(CPU_COST_MS, 1) == 58.0
    assert interp_cost(CPU_COST_MS, 3) == pytest.approx(94.0)
    assert interp_cost(CPU_COST_MS, 100) == pytest.approx(232 + (407 - 232) * 36 / 64)
    n, rate = best_size([0.0, 0.0, 0.0], CPU_COST_MS)  # nothing to gain: one plain token
    assert n == 1 and rate[1] == pytest.approx(1 / 58)
    vals = optimal_values(128, TwoSourceModel(0.8, 0.05))
    n, rate = best_size(vals, CPU_COST_MS)
    assert 2 <= n < 60 and rate[n] >= rate[60] and math.isclose(rate[n], (vals[n] + 1) / interp_cost(CPU_COST_MS, n))
