import pytest
import torch

from goose.config import AdjacencyConfig
from goose.drafting.adjacency import AdjacencyTable


def logits_preferring(order_rows, vocab=20):
    """One logits row per list: tokens in the list get descending logits, the rest far below."""
    rows = torch.full((len(order_rows), vocab), -100.0)
    for r, order in enumerate(order_rows):
        for rank, tok in enumerate(order):
            rows[r, tok] = 10.0 - rank
    return rows


def test_unobserved_token_has_no_successors():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=3))
    assert adj.successors(5) is None


def test_harvest_sets_unigram_row_with_softmax_scores():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=3))
    adj.harvest([5], [-1], logits_preferring([[7, 8, 9]]))
    ids, scores = adj.successors(5)
    assert ids == [7, 8, 9]
    expected = torch.softmax(torch.tensor([10.0, 9.0, 8.0]), 0).tolist()
    assert all(abs(a - b) < 1e-6 for a, b in zip(scores, expected))


def test_duplicate_tokens_last_position_wins():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=2))
    adj.harvest([5, 6, 5], [-1, 5, 6], logits_preferring([[1, 2], [3, 4], [10, 11]]))
    assert adj.successors(5)[0] == [10, 11]
    assert adj.successors(6)[0] == [3, 4]


def test_bigram_preferred_over_unigram():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=2))
    adj.harvest([4, 5, 3, 5], [-1, 4, -1, 3], logits_preferring([[1, 2], [7, 8], [1, 2], [12, 13]]))
    assert adj.successors(5, prev=4)[0] == [7, 8]  # bigram (4, 5)
    assert adj.successors(5, prev=3)[0] == [12, 13]  # bigram (3, 5)
    assert adj.successors(5, prev=9)[0] == [12, 13]  # unknown bigram: unigram row (last write)
    assert adj.successors(5)[0] == [12, 13]


def test_bigram_tier_can_be_disabled_and_ids_only_scores():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=2, use_bigram=False, with_scores=False))
    adj.harvest([4, 5], [-1, 4], logits_preferring([[1, 2], [7, 8]]))
    assert adj.bigram == {}
    assert adj.successors(5, prev=4) == ([7, 8], [0.5, 0.5])


def test_reset_forgets_everything():
    adj = AdjacencyTable(20, AdjacencyConfig(top_k=2))
    adj.harvest([4, 5], [-1, 4], logits_preferring([[1, 2], [7, 8]]))
    adj.reset()
    assert adj.successors(5, prev=4) is None and adj.successors(4) is None


def test_harvest_is_the_same_with_and_without_goose_kernel(monkeypatch):
    """The top-k behind a harvest runs on goose's CPU kernel where it is available, else torch.topk: same table."""
    from goose.backends import cpukernel

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g)  # distinct values: the top 10 is unambiguous
    tokens, prevs = [3, 9, 3, 40, 7, 11], [-1, 3, 9, 3, 40, 7]
    tables = []
    for kernel in (cpukernel.kernel(), None):
        monkeypatch.setattr(cpukernel, "kernel", lambda kernel=kernel: kernel)
        adj = AdjacencyTable(500, AdjacencyConfig(top_k=10))
        adj.harvest(tokens, prevs, logits)
        adj.harvest(tokens[:2], prevs[:2], logits.double()[:2])  # not float32: torch.topk either way
        tables.append(adj)
    a, b = tables
    assert (a.ids == b.ids).all() and (a.scores == b.scores).all() and (a.observed == b.observed).all()
    assert a.bigram == b.bigram


@pytest.mark.parametrize("with_scores", [True, False])
@pytest.mark.parametrize("bigram", [True, False])
def test_one_call_harvest_fills_the_table_as_the_numpy_path(monkeypatch, with_scores, bigram):
    """`fill` (the engine's `cpukernel.table_harvester`) harvests in one kernel call: the same successor ids,
    bigrams and observed rows as the top-k + NumPy path, the scores to float32 rounding, the last of duplicate
    tokens winning; logits it cannot read (not float32) and a machine without the kernel take the NumPy path,
    and a token outside the table is an error."""
    from goose.backends import cpukernel

    if cpukernel.kernel() is None:
        pytest.skip("goose's CPU kernel is not available here")
    cfg = AdjacencyConfig(top_k=6, use_bigram=bigram, with_scores=with_scores)
    g = torch.Generator().manual_seed(1)
    fused = AdjacencyTable(300, cfg, cpukernel.topk_rows, cpukernel.table_harvester)
    plain = AdjacencyTable(300, cfg, cpukernel.topk_rows)
    assert fused._harvester is not None
    for n in (1, 4, 7, 2, 9):
        logits = torch.randn(n, 300, generator=g)
        tokens = torch.randint(0, 12, (n,), generator=g).tolist()  # duplicates within and across harvests
        prevs = torch.randint(-1, 12, (n,), generator=g).tolist()
        for adj in (fused, plain):
            adj.harvest(tokens, prevs, logits)
            adj.harvest(tokens[:1], prevs[:1], logits[:1].double())  # not float32: the NumPy path
    assert (fused.ids == plain.ids).all() and (fused.observed == plain.observed).all()
    assert fused.scores == pytest.approx(plain.scores, abs=1e-6)
    assert fused.bigram.keys() == plain.bigram.keys()
    for key, (ids, scores) in plain.bigram.items():
        assert fused.bigram[key][0] == ids and fused.bigram[key][1] == pytest.approx(scores, abs=1e-6)
    with pytest.raises(ValueError, match="outside the table"):
        fused.harvest([300], [-1], torch.randn(1, 300))
    monkeypatch.setattr(cpukernel, "kernel", lambda variant=None: None)
    assert AdjacencyTable(300, cfg, cpukernel.topk_rows, cpukernel.table_harvester)._harvester is None
