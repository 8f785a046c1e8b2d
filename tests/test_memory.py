"""The cross-request suffix memory (`goose.drafting.memory`) and `goose` drafting from it.

* Exact small cases: match lengths, continuation counts, alternatives, LRU eviction order, the byte budget.
* Lossless: random sessions with random memory contents and evictions in the middle give every request
  exactly the tokens of greedy decoding alone (float64 against Hugging Face; float32 through goose's kernels
  against `ar` on the same forward).
* Ownership: a tenant never gets memory drafts from another tenant's text; a repeated request is drafted from
  memory and takes fewer forwards than the cold one.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, greedy_memo, make_tiny_llama
from goose import Engine
from goose.config import EngineConfig, MemoryConfig
from goose.decoding import Decoder
from goose.drafting.memory import ENTRY_BYTES, SEQUENCE_BYTES, TENANT_BYTES, TOKEN_BYTES, MemoryPool, SuffixMemory
from goose.drafting.tree import MEMORY, DraftTree
from goose.errors import GooseError
from goose.selection.acceptance import AcceptanceModel, memory_rank
from goose.selection.costmodel import CostCurve

FLAT = CostCurve((1, 128), (10.0, 10.5))  # every candidate node pays: memory drafts are verified
BIG = 1 << 20


# ---- the structure -----------------------------------------------------------------------------------
def test_longest_match_counts_and_alternatives():
    mem = SuffixMemory(BIG)
    mem.insert([1, 2, 3, 4, 5, 6, 7, 8])
    mem.insert([9, 2, 3, 4, 5, 6, 0, 1])
    d = mem.lookup([7, 3, 4, 5])  # both sequences hold 3 4 5 (after 2, so the match is 3 long)
    assert (d.match, d.occurrences) == (3, 2)
    assert d.spine == [6, 0, 1]  # 6 followed both; 0 and 7 tie: the newest occurrence wins
    assert d.counts == [2, 1, 1] and d.totals == [2, 2, 1]
    assert d.branches == [(0, [7, 8], 1, 2)]  # 7 followed once, after spine node 0 (the 6)
    d = mem.lookup([1, 2, 3, 4, 5])  # only the first sequence matches 5 tokens: its continuation alone
    assert (d.match, d.occurrences, d.spine, d.counts, d.totals, d.branches) == (5, 1, [6, 7, 8], [1] * 3, [1] * 3, [])
    assert mem.lookup([4, 5, 6]).branches == [(-1, [7, 8], 1, 2)]  # alternatives at depth 1 hang off the root
    assert mem.lookup([8, 8, 8]).spine == [] and mem.lookup([5, 6]).match == 0  # unknown / shorter than k


def test_counts_follow_frequency_and_match_length_is_capped():
    mem = SuffixMemory(BIG, MemoryConfig(max_match=4))
    for tail in ([10, 11], [10, 11], [12, 13]):
        mem.insert([1, 2, 3, 4, 5] + tail)
    d = mem.lookup([0, 1, 2, 3, 4, 5])
    assert d.match == 4 and d.occurrences == 3  # capped at max_match
    assert d.spine == [10, 11] and d.counts == [2, 2] and d.totals == [3, 2]
    assert d.branches == [(-1, [12, 13], 1, 3)]
    assert [memory_rank(c, t) for c, t in zip(d.counts, d.totals)] == [2, 0]
    assert [memory_rank(c, t, d.match) for c, t in zip(d.counts, d.totals)] == [6, 4]  # a short match


def test_lru_eviction_of_whole_sequences_and_the_budget():
    a, b, c = [1, 2, 3, 4, 5, 6], [21, 22, 23, 24, 25, 26], [31, 32, 33, 34, 35, 36]
    one = TOKEN_BYTES * 6 + ENTRY_BYTES * 3 + SEQUENCE_BYTES  # 3 k-grams with a follower each
    mem = SuffixMemory(2 * one)
    mem.insert(a)
    mem.insert(b)
    assert mem.nbytes == 2 * one and len(mem) == 2
    assert mem.lookup([1, 2, 3]).spine == [4, 5, 6]  # a is now the most recently used
    mem.insert(c)  # over budget: b, the least recently used, goes
    assert len(mem) == 2 and mem.evicted == 1 and mem.nbytes <= mem.max_bytes
    assert mem.lookup([21, 22, 23]).spine == [] and mem.lookup([1, 2, 3]).spine == [4, 5, 6]
    mem.insert(b)  # c is the oldest use now (a was drafted from after c was inserted)
    assert mem.lookup([31, 32, 33]).spine == [] and mem.lookup([1, 2, 3]).spine == [4, 5, 6]
    assert mem.lookup([21, 22, 23]).spine == [24, 25, 26]
    assert len(mem._head) == 6  # the evicted sequences' k-grams are gone from the index
    mem.insert(list(range(40, 90)))  # alone over the budget: not kept, and nothing else either
    assert len(mem) == 0 and mem.nbytes == 0 and mem._head == {}
    mem.insert(a)
    mem.clear()
    assert len(mem) == 0 and mem.lookup([1, 2, 3]).spine == []


def test_an_evicted_sequence_between_two_others_keeps_the_newest_reachable():
    mem = SuffixMemory(BIG)
    mem.insert([1, 2, 3, 7])
    mem.insert([1, 2, 3, 8])
    mem.insert([1, 2, 3, 9])
    mem.lookup([5, 1, 2, 3])  # uses the newest (9)
    mem.evict_one()  # the 7 (the least recently used)
    mem.evict_one()  # the 8
    d = mem.lookup([1, 2, 3])
    assert d.spine == [9] and d.occurrences == 1


def test_pool_scopes_tenants_under_one_budget():
    pool = MemoryPool(4000)
    pool.insert("a", [1, 2, 3, 4, 5, 6])
    pool.insert("b", [7, 8, 9, 10, 11])
    assert pool.get("b").lookup([1, 2, 3]).spine == [] and pool.get("a").lookup([1, 2, 3]).spine == [4, 5, 6]
    for i in range(20):  # b fills the budget: a (least recently used tenant) loses its sequence first
        pool.insert("b", [100 + i] * 3 + [50 + i, 60 + i, 70 + i])
    assert pool.nbytes <= pool.max_bytes and "a" not in pool._tenants
    assert MemoryPool(0).get("a") is None


def test_bad_sizes_are_refused():
    with pytest.raises(GooseError):
        EngineConfig(memory_mb=-1)
    with pytest.raises(GooseError):
        EngineConfig(memory_mb=float("inf"))
    with pytest.raises(GooseError):
        MemoryConfig(min_match=0)
    with pytest.raises(GooseError):
        Decoder(make_tiny_llama(), method="ar", memory_mb=-2)


def test_memory_nodes_have_their_own_acceptance_groups():
    tree = DraftTree.root(5)
    n = tree.add(0, 6, MEMORY, 0)
    n = tree.add(n, 7, MEMORY, 3)
    tree.add(n, 8, MEMORY, 5)
    acc = AcceptanceModel()
    keys = acc.keys(tree, 0)
    assert keys[1:] == [("m", 0, 0), ("m", 3, 1), ("m", 5, 2)]
    q, _ = acc.node_probs(tree, 0)
    assert q[1:] == pytest.approx([acc.cfg.memory_prior[0], acc.cfg.memory_prior[3], acc.cfg.memory_short_prior[1]])


# ---- decoding with memory ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


PROMPT_POOL = [[5, 17, 33, 8, 9, 41], [7, 7, 7, 12], [40, 41, 42, 43, 44, 45, 46], [60, 3, 60, 3, 60, 9]]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_sessions_with_memory_equal_greedy_alone(model, data):
    """Random memory contents (greedy outputs, their corruptions, noise), a small budget that evicts, explicit
    evictions in the middle: every output equals greedy decoding alone."""
    budget_mb = data.draw(st.sampled_from([0.001, 0.004, 1.0]))
    dec = Decoder(model, method="goose", cost=FLAT, memory_mb=budget_mb)
    rng = random.Random(data.draw(st.integers(0, 1000)))
    for _ in range(data.draw(st.integers(0, 4))):  # random contents
        p = rng.choice(PROMPT_POOL)
        seq = p + greedy_memo(model, p, 24)
        if rng.random() < 0.5:
            for _ in range(3):
                seq[rng.randrange(len(seq))] = rng.randrange(2, TINY_VOCAB)
        dec.engine.memories.insert("", seq if rng.random() < 0.8 else [rng.randrange(2, TINY_VOCAB) for _ in range(30)])
    for _ in range(data.draw(st.integers(2, 5))):
        p = data.draw(st.sampled_from(PROMPT_POOL + [[rng.randrange(2, TINY_VOCAB) for _ in range(5)]]))
        n = data.draw(st.integers(1, 32))
        assert dec.generate(p, n).token_ids == greedy_memo(model, p, n)
        if dec.memory is not None and len(dec.memory) and data.draw(st.booleans()):
            dec.memory.evict_one()


@pytest.fixture(scope="module")
def model32():
    return make_tiny_llama(torch.float32, seed=5)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow])
@given(data=st.data())
def test_float32_kernel_path_with_memory_equals_ar(model32, data):
    """Through `LeanForward` (goose's kernels where available), as users run it."""
    ar = Decoder(model32, method="ar", memory_mb=0)
    dec = Decoder(model32, method="goose", cost=FLAT, memory_mb=data.draw(st.sampled_from([0.002, 1.0])))
    assert type(dec.forward).__name__ == "LeanForward"
    for _ in range(data.draw(st.integers(2, 5))):
        p = data.draw(st.sampled_from(PROMPT_POOL))
        n = data.draw(st.integers(1, 32))
        assert dec.generate(p, n).token_ids == ar.generate(p, n).token_ids
        if dec.memory is not None and len(dec.memory) and data.draw(st.booleans()):
            dec.memory.evict_one()


def test_a_repeated_request_is_drafted_from_memory(model):
    p = [23, 51, 9, 77, 3, 14, 30]
    want = greedy_memo(model, p, 48)
    on = Decoder(model, method="goose", cost=FLAT)
    off = Decoder(model, method="goose", cost=FLAT, memory_mb=0)
    cold = on.generate(p, 48)
    warm = on.generate(p, 48)
    again_off = (off.generate(p, 48), off.generate(p, 48))[1]
    assert cold.token_ids == warm.token_ids == again_off.token_ids == want
    assert cold.stats.drafted["memory"] == 0 and again_off.stats.drafted["memory"] == 0
    assert warm.stats.accepted["memory"] > 0
    assert warm.stats.tau > cold.stats.tau and warm.stats.tau > again_off.stats.tau


def test_changed_weights_clear_the_decoders_memory():
    m = make_tiny_llama(seed=3)
    dec = Decoder(m, method="goose", cost=FLAT)
    dec.generate([4, 5, 6, 7], 8)
    assert len(dec.memory) == 1
    with torch.no_grad():
        m.lm_head.weight.mul_(1.5)
    out = dec.generate([4, 5, 6, 7], 8)
    assert len(dec.memory) == 1 and out.token_ids == greedy_memo(m, [4, 5, 6, 7], 8)


def test_tenants_never_draft_from_each_others_text(model):
    p = [23, 51, 9, 77, 3, 14, 30]
    want = greedy_memo(model, p, 40)
    with Engine(model, None, "goose", max_batch=2, prefix_cache_mb=0) as eng:
        alice = [eng.generate(p, 40, tenant="alice") for _ in range(2)]
        bob = eng.generate(p, 40, tenant="bob")
        bob_again = eng.generate(p, 40, tenant="bob")
        anon = eng.generate(p, 40)
        assert len(eng.memories) == 3
    for r in alice + [bob, bob_again, anon]:
        assert r.token_ids == want
    assert alice[0].stats.drafted["memory"] == 0 and alice[1].stats.accepted["memory"] > 0
    assert bob.stats.drafted["memory"] == 0 and anon.stats.drafted["memory"] == 0  # alice's text is hers
    assert bob_again.stats.accepted["memory"] > 0


def test_a_private_memory_request_neither_reads_nor_leaves_text(model):
    """(`goose serve` submits requests that name no tenant so.)"""
    p = [23, 51, 9, 77, 3, 14, 30]
    want = greedy_memo(model, p, 40)
    with Engine(model, None, "goose", max_batch=2, prefix_cache_mb=0) as eng:
        shared = eng.generate(p, 40)
        private = [eng.generate(p, 40, private_memory=True) for _ in range(2)]
        assert len(eng.memories) == 1 and len(eng.memories.get("")) == 1  # the shared request's text only
        shared_again = eng.generate(p, 40)
    for r in [shared, *private, shared_again]:
        assert r.token_ids == want
    assert all(r.stats.drafted["memory"] == 0 for r in private)  # the anonymous memory held p's answer
    assert shared_again.stats.accepted["memory"] > 0


def test_engine_memory_off():
    m = make_tiny_llama(seed=4)
    with Engine(m, None, "goose", memory_mb=0, prefix_cache_mb=0) as eng:
        rs = [eng.generate([8, 9, 10, 11], 20) for _ in range(2)]
        assert eng.memories.get("") is None
    assert rs[1].stats.drafted["memory"] == 0 and rs[0].token_ids == rs[1].token_ids


def test_concurrent_tenants_with_evictions_mid_request_equal_greedy(model):
    """Requests of three tenants decoded together while finished ones insert and evict (a budget of a few
    sequences): every output equals greedy decoding alone."""
    prompts = PROMPT_POOL + [[23, 51, 9, 77, 3, 14, 30]]
    with Engine(model, None, "goose", max_batch=3, prefix_cache_mb=0, memory_mb=0.003) as eng:
        for _ in range(2):
            reqs = [(p, n, eng.submit(p, n, tenant=f"t{i % 3}"))
                    for i, (p, n) in enumerate((p, 12 + 7 * (i % 4)) for i, p in enumerate(prompts * 2))]
            for p, n, r in reqs:
                assert r.result(timeout=300).token_ids == greedy_memo(model, p, n)
        assert eng.memories.nbytes <= eng.memories.max_bytes
        assert eng.memories.evicted > 0  # the budget held a few sequences of the three tenants' twelve


# ---- bounded tenants -----------------------------------------------------------------------------------
def test_a_tenant_holds_bytes_only_once_it_has_text_and_none_once_emptied():
    pool = MemoryPool(50_000)
    assert pool.get("reader") is None and len(pool) == 0  # reading makes no memory
    pool.insert("short", [1, 2])  # too short to store: no memory either
    assert len(pool) == 0 and pool.nbytes == 0
    for i in range(200):  # every insert by a new tenant: the oldest ones are emptied and dropped
        pool.insert(f"t{i}", [i, i + 1, i + 2, i + 3, i + 4, i + 5])
    sizes = pool.tenant_bytes()
    assert pool.nbytes == sum(sizes.values()) <= pool.max_bytes
    assert all(b > TENANT_BYTES for b in sizes.values())  # no empty tenant is kept
    assert pool.dropped == 200 - len(pool) and "t199" in pool and "t0" not in pool


def test_tenants_are_capped_least_recently_used_first():
    pool = MemoryPool(10**9, max_tenants=3)
    for name in "abc":
        pool.insert(name, [1, 2, 3, 4, 5])
    held = pool.get("a")  # a is used again: b is now the least recently used
    pool.insert("d", [6, 7, 8, 9, 10])
    assert sorted(pool.tenant_bytes()) == ["a", "c", "d"] and held is pool.get("a")
    dropped_c = pool.get("c")  # a running request's memory
    pool.get("a"), pool.get("d")
    pool.insert("e", [6, 7, 8, 9, 10])  # c goes; a request still holding its memory sees it emptied
    assert "c" not in pool and len(dropped_c) == 0 and dropped_c.lookup([1, 2, 3]).spine == []
    assert pool.nbytes == sum(pool.tenant_bytes().values())
    with pytest.raises(ValueError):
        MemoryPool(100, max_tenants=0)
    with pytest.raises(GooseError):
        EngineConfig(max_tenants=0)


def test_an_insert_reads_a_bounded_number_of_tenants(monkeypatch):
    """A finished request's bookkeeping does not grow with the number of tenants (it used to sum them all)."""
    pool = MemoryPool(2**30)
    for i in range(3000):
        pool.insert(f"t{i}", [i, 1, 2, 3, 4, 5])
    reads = []
    real = SuffixMemory.nbytes
    monkeypatch.setattr(SuffixMemory, "nbytes", property(lambda self: reads.append(1) or real.fget(self)))
    pool.insert("t5", [9, 9, 9, 9, 9, 9])
    pool.insert("new", [8, 8, 8, 8, 8, 8])
    assert len(reads) <= 8


def test_tenant_bytes_bound_what_a_tenant_really_holds():
    """TENANT_BYTES covers the Python objects a tenant adds besides its sequences (measured with tracemalloc)."""
    import tracemalloc

    pool = MemoryPool(2**30)
    names = [f"{i:064x}" for i in range(2000)]  # tenants are digests as the server makes them
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for name in names:
        pool.insert(name, [7, 1, 2, 3])
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_tenant = grown / len(names)
    sequences = pool.nbytes - len(names) * TENANT_BYTES
    assert per_tenant <= TENANT_BYTES + sequences / len(names)


def test_many_tenants_through_admission_stay_within_the_budget():
    """200,000 distinct tenants, each with one finished request: the pool holds at most max_tenants of them
    within its byte budget (benchmarks/tenants_rss.py measures a million and the process's resident memory)."""
    pool = MemoryPool(4 * 2**20)
    for i in range(200_000):
        pool.get(f"u{i}")  # admission reads
        pool.insert(f"u{i}", [i % 1000, 5, 6, 7, 8])
    assert pool.nbytes == sum(pool.tenant_bytes().values()) <= pool.max_bytes
    assert len(pool) <= pool.max_tenants and pool.dropped == 200_000 - len(pool)
