import torch

from goose.backends.tree_tensors import additive_mask, ancestor_mask, is_chain, tree_depths
from goose.config import AdjacencyConfig, GooseConfig, IsotropicConfig, TRConfig
from goose.drafting.adjacency import AdjacencyTable
from goose.drafting.baselines import build_chain, build_isotropic_tree, build_tr_tree
from goose.drafting.spine import build_spine_tree, spine_ratio, tree_budget
from goose.drafting.tree import BRANCH, ROOT, SPINE, DraftTree
from goose.engine.verify import greedy_walk

V = 200


def full_table(k=10, seed=0, vocab=V, peaked=True):
    """An adjacency table where every token is observed, with random distinct successors."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, vocab, generator=g) * (4.0 if peaked else 0.5)
    adj = AdjacencyTable(vocab, AdjacencyConfig(top_k=k))
    adj.harvest(list(range(vocab)), [-1] * vocab, logits)
    return adj


def check_invariants(tree: DraftTree, budget: int | None = None):
    assert tree.parents[0] == -1 and tree.sources[0] == ROOT
    for i in range(1, len(tree)):
        assert 0 <= tree.parents[i] < i  # topological order
        assert tree.depths[i] == tree.depths[tree.parents[i]] + 1
    for kids in tree.children:  # distinct siblings
        assert len(kids) == len(set(kids))
    for u in range(len(tree)):
        toks = [tree.tokens[c] for c in range(len(tree)) if tree.parents[c] == u]
        assert len(toks) == len(set(toks))
    if budget is not None:
        assert len(tree) <= budget


def test_pure_branch_tree_when_no_chain():
    adj = full_table()
    cfg = GooseConfig()
    tree = build_spine_tree(5, 4, [], 0.0, 0.5, adj, cfg)
    check_invariants(tree, cfg.tree.budget)
    assert tree.count(SPINE) == 0 and tree.count(BRANCH) == len(tree) - 1
    assert len(tree) == cfg.tree.budget  # a well-observed table fills the budget


def test_budget_accounting_and_spine_length():
    adj = full_table()
    cfg = GooseConfig()
    chain = list(range(100, 130))
    for c, ema in [(0.3, 0.5), (0.7, 0.1), (0.85, 0.3), (0.5, 0.9)]:
        tree = build_spine_tree(5, 4, chain, c, ema, adj, cfg)
        budget = tree_budget(c, cfg)
        check_invariants(tree, budget)
        expect_spine = min(len(chain), int(budget * spine_ratio(c, ema, cfg.tree)))
        assert tree.count(SPINE) == expect_spine
        spine_nodes = [i for i, s in enumerate(tree.sources) if s == SPINE]
        assert [tree.tokens[i] for i in spine_nodes] == chain[:expect_spine]
        assert all(tree.parents[i] == (spine_nodes[j - 1] if j else 0) for j, i in enumerate(spine_nodes))


def test_branch_cap_limits_branch_nodes_and_keeps_the_spine():
    """`branch_cap` (DeviceAwareConfig.candidate_branches): at most that many branch nodes, the spine the tree
    has without it, and the branches it keeps hang where the uncapped tree hangs its first ones (root first)."""
    adj = full_table()
    cfg = GooseConfig().with_budget(96)
    chain = list(range(100, 130))
    for c, ema, cap in [(0.3, 0.5, 16), (0.9, 0.3, 8), (0.0, 0.5, 4), (0.7, 0.1, 1000)]:
        full = build_spine_tree(5, 4, chain if c else [], c, ema, adj, cfg)
        capped = build_spine_tree(5, 4, chain if c else [], c, ema, adj, cfg, branch_cap=cap)
        check_invariants(capped, len(full))
        assert capped.count(BRANCH) == min(cap, full.count(BRANCH)) and full.count(BRANCH) > 4
        n = capped.count(SPINE) + 1
        assert capped.tokens[:n] == full.tokens[:n] and capped.count(SPINE) == full.count(SPINE)
        root_kids, full_kids = _root_branches(capped), _root_branches(full)
        assert root_kids and root_kids == full_kids[:len(root_kids)]


def _root_branches(tree: DraftTree) -> list[int]:
    return [tree.tokens[i] for i in range(len(tree)) if tree.parents[i] == 0 and tree.sources[i] == BRANCH]


def test_budget_formula_and_ema_tiers():
    cfg = GooseConfig()
    assert tree_budget(0.0, cfg) == 60 and tree_budget(1.0, cfg) == 100 and tree_budget(0.5, cfg) == 80
    assert spine_ratio(0.0, 0.1, cfg.tree) == 0.15
    assert spine_ratio(0.0, 0.3, cfg.tree) == 0.30
    assert spine_ratio(0.0, 0.5, cfg.tree) == 0.50
    assert spine_ratio(1.0, 0.1, cfg.tree) == 1.0


def test_bypass_chain_at_full_confidence():
    adj = full_table()
    chain = list(range(100, 199))
    tree = build_spine_tree(5, 4, chain, 1.0, 0.5, adj, GooseConfig())
    assert tree.count(SPINE) == 99 and tree.count(BRANCH) == 0 and len(tree) == 100
    assert is_chain(tree.topology())


def test_branches_skip_next_spine_token_and_respect_depth_cap():
    adj = full_table()
    cfg = GooseConfig()
    top_after_5 = adj.successors(5, 4)[0][0]
    chain = [top_after_5] + list(range(100, 110))
    tree = build_spine_tree(5, 4, chain, 0.5, 0.5, adj, cfg)
    check_invariants(tree)
    root_kids = [i for i in range(1, len(tree)) if tree.parents[i] == 0]
    assert sum(1 for i in root_kids if tree.tokens[i] == top_after_5) == 1  # only the spine node
    # branch depth (branch nodes on the path) never exceeds max_branch_depth
    for i in range(len(tree)):
        n_branch = sum(1 for j in tree.path_to(i) if tree.sources[j] == BRANCH)
        assert n_branch <= cfg.tree.max_branch_depth


def test_min_score_drops_flat_successors():
    adj = full_table(peaked=False)
    cfg = GooseConfig()
    tree = build_spine_tree(5, 4, [], 0.0, 0.5, adj, cfg)
    for i in range(1, len(tree)):
        p = tree.parents[i]
        succ = adj.successors(tree.tokens[p], tree.tokens[tree.parents[p]] if p else 4)
        score = succ[1][succ[0].index(tree.tokens[i])]
        assert score >= cfg.tree.min_score


def test_tr_template_level_sizes():
    cfg = TRConfig()
    assert len(cfg.template) == 80
    levels = [sum(1 for p in cfg.template if len(p) == d) for d in range(1, 7)]
    assert levels == [8, 21, 25, 15, 8, 3]
    adj = AdjacencyTable(V, AdjacencyConfig(top_k=8, use_bigram=False, with_scores=False))
    g = torch.Generator().manual_seed(1)
    adj.harvest(list(range(V)), [-1] * V, torch.randn(V, V, generator=g))
    tree = build_tr_tree(3, adj, cfg)
    check_invariants(tree)
    depth_counts = [sum(1 for d in tree.depths if d == k) for k in range(1, 7)]
    assert len(tree) <= 81 and depth_counts[0] == 8
    assert all(a <= b for a, b in zip(depth_counts, levels))


def test_tr_tree_on_unobserved_anchor_is_an_ar_step():
    adj = AdjacencyTable(V, AdjacencyConfig(top_k=8))
    tree = build_tr_tree(3, adj, TRConfig())
    assert len(tree) == 1 and tree.route == "ar"


def test_isotropic_tree_width_and_depth():
    adj = full_table()
    for k in (3, 5):
        cfg = IsotropicConfig(width=k)
        tree = build_isotropic_tree(5, 4, list(range(100, 120)), 60, adj, cfg)
        check_invariants(tree, 60)
        assert max(len(c) for c in tree.children) <= k
        assert max(tree.depths) <= cfg.max_depth
        # the first chain token is the root's first child
        assert tree.tokens[1] == 100 and tree.sources[1] == SPINE


def test_chain_builder():
    assert build_chain(7, []).route == "ar"
    t = build_chain(7, [1, 2, 3])
    assert t.tokens == [7, 1, 2, 3] and t.parents == [-1, 0, 1, 2] and is_chain(t.topology())


def drawn_tree():
    """0 -> 1 -> 2 ;  0 -> 3 ; 1 -> 4"""
    t = DraftTree.root(10)
    a = t.add(0, 11, SPINE)
    t.add(a, 12, SPINE)
    t.add(0, 13, BRANCH)
    t.add(a, 14, BRANCH)
    return t


def test_mask_and_positions_on_drawn_tree():
    t = drawn_tree()
    allowed = ancestor_mask(t.topology())
    expect = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 1, 0], [1, 1, 0, 0, 1]],
                          dtype=torch.bool)
    assert torch.equal(allowed, expect)
    assert tree_depths(t.topology()).tolist() == [0, 1, 2, 1, 2]
    m = additive_mask(allowed, 3, torch.float32)
    assert m.shape == (1, 1, 5, 8)
    assert torch.all(m[0, 0, :, :3] == 0)
    low = torch.finfo(torch.float32).min
    assert torch.equal(m[0, 0, :, 3:] == 0, expect) and torch.all(m[0, 0, :, 3:][~expect] == low)
    assert not is_chain(t.topology())


def test_sliding_window_mask_hides_what_lies_beyond_the_window_from_each_node():
    t = drawn_tree()  # depths [0, 1, 2, 1, 2]; after 3 prefix tokens the nodes sit at positions 3 4 5 4 5
    allowed, depths = ancestor_mask(t.topology()), tree_depths(t.topology())
    m = additive_mask(allowed, 3, torch.float64, depths=depths, window=2) == 0  # [1, 1, 5, 8] -> seen
    # window 2: a node at position q sees positions q - 1 and q, among the prefix and its ancestors
    expect = torch.tensor([[0, 0, 1, 1, 0, 0, 0, 0],   # node 0 (pos 3): prefix 2, itself
                           [0, 0, 0, 1, 1, 0, 0, 0],   # node 1 (pos 4): node 0, itself
                           [0, 0, 0, 0, 1, 1, 0, 0],   # node 2 (pos 5): node 1, itself
                           [0, 0, 0, 1, 0, 0, 1, 0],   # node 3 (pos 4): node 0, itself
                           [0, 0, 0, 0, 1, 0, 0, 1]],  # node 4 (pos 5): node 1, itself
                          dtype=torch.bool)
    assert torch.equal(m[0, 0], expect)
    wide = additive_mask(allowed, 3, torch.float64, depths=depths, window=64)
    assert torch.equal(wide, additive_mask(allowed, 3, torch.float64))


def test_walk_spine_continuation_and_all_reject():
    t = drawn_tree()
    # root predicts 11 (spine), node 1 predicts 14 (branch), node 4 predicts 99 (no child)
    pred = [11, 14, 0, 0, 99]
    w = greedy_walk(t, pred)
    assert w.path == [0, 1, 4] and w.bonus == 99 and w.accepted == 2
    w = greedy_walk(t, [42, 0, 0, 0, 0])
    assert w.path == [0] and w.bonus == 42 and w.accepted == 0


def test_subtree_and_within_depth():
    t = drawn_tree()
    s = t.within_depth(1)
    assert s.tokens == [10, 11, 13] and s.parents == [-1, 0, 0]
    assert t.within_depth(5) is t
    sub = t.subtree([0, 1, 4])
    assert sub.tokens == [10, 11, 14] and sub.sources == [ROOT, SPINE, BRANCH]
