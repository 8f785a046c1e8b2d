from goose.config import NgramConfig
from goose.drafting.ngram import NgramIndex, chain_confidence


def index_of(tokens, sizes=(3, 2, 1), max_chain=20):
    idx = NgramIndex(sizes, max_chain)
    idx.extend(tokens)
    return idx


def test_no_match_gives_empty_chain():
    p = index_of([1, 2, 3, 4]).propose()
    assert p.chain == [] and p.ngram == 0 and p.confidence == 0.0


def test_longest_ngram_wins_over_earlier_shorter_match():
    # suffix (7, 8, 9): the 1-gram 9 occurs first at 0, but the 3-gram match at 4 must win
    toks = [9, 5, 5, 5, 7, 8, 9, 6, 6, 7, 8, 9]
    p = index_of(toks).propose()
    assert p.ngram == 3 and p.chain[0] == 6


def test_earliest_occurrence_is_copied():
    toks = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    p = index_of(toks, sizes=(2,)).propose()
    assert p.chain[:2] == [10, 11]
    assert p.occurrences == 2 and not p.consensus


def test_consensus_needs_two_occurrences_with_same_follower():
    toks = [1, 2, 3, 1, 2, 3, 4, 1, 2]
    p = index_of(toks, sizes=(2,)).propose()
    assert p.occurrences == 2 and p.consensus and p.confidence == 1.0
    single = index_of([1, 2, 3, 9, 1, 2], sizes=(2,)).propose()
    assert single.occurrences == 1 and not single.consensus


def test_chain_length_capped_by_max_chain():
    toks = list(range(50)) + [0, 1, 2]
    p = index_of(toks, sizes=(3,), max_chain=7).propose()
    assert p.chain == list(range(3, 10))


def test_confidence_values():
    assert chain_confidence(0, True) == 0.0
    assert chain_confidence(5, True) == 1.0
    assert chain_confidence(4, False) == 0.6 * 4 / 8
    assert chain_confidence(8, False) == 0.7
    assert abs(chain_confidence(14, False) - 0.8) < 1e-12
    assert chain_confidence(20, False) == 0.9
    assert chain_confidence(40, False) == 0.9


def test_incremental_extension_equals_full_build():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    whole = index_of(toks)
    inc = NgramIndex((3, 2, 1), 20)
    for i in range(0, len(toks), 3):
        inc.extend(toks[i : i + 3])
        assert inc.propose() == index_of(toks[: i + 3]).propose()
    whole.propose()
    assert inc._maps == whole._maps


def test_appended_tokens_are_indexed_at_the_next_lookup_only():
    toks = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    lazy = NgramIndex((3, 2, 1), 20)
    for i in range(0, len(toks), 5):  # many appends between lookups
        lazy.extend(toks[i : i + 5])
    assert all(m == {} for m in lazy._maps.values()) and lazy.tokens == toks  # appended, not indexed yet
    assert lazy.lookup(toks[-2:]) == index_of(toks).lookup(toks[-2:])
    whole = index_of(toks)
    whole.propose()
    assert lazy._maps == whole._maps


def test_last_ngram_without_follower_is_not_indexed():
    idx = index_of([5, 6, 7], sizes=(3,))
    idx.propose()
    assert idx._maps[3] == {}


def test_chain_extension_with_consensus_goes_past_max_chain():
    cycle = [10, 11, 12, 13, 14]
    toks = cycle * 8
    idx = NgramIndex((5, 4, 3), 20)
    idx.extend(toks)
    first = idx.propose()
    assert first.consensus and len(first.chain) == 20
    ext = idx.propose_extended(NgramConfig())
    assert len(ext.chain) == 100
    assert ext.chain == (cycle * 30)[: len(ext.chain)]


def test_low_confidence_chain_is_not_extended():
    toks = [1, 2, 3, 4, 50, 51, 52, 1, 2, 3, 4]
    idx = NgramIndex((5, 4, 3), 20)
    idx.extend(toks)
    p = idx.propose()
    assert p.confidence <= 0.6
    assert idx.propose_extended(NgramConfig()) == p
