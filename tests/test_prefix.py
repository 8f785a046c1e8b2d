"""The engine's prefix cache: requests that start with tokens the engine has already computed (a shared system
prompt, a conversation's earlier turns) copy their keys and values and still decode exactly their own greedy
tokens; the cache keeps to its byte budget, forgets old weights and stays off where reuse could change bits."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, filled_cache, greedy_memo, hf_greedy, make_tiny_llama
from goose import Engine, GooseError
from goose.backends import cpukernel
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.engine.prefix import BLOCK, NODE_BYTES, PrefixCache

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")


@pytest.fixture(scope="module")
def model32():
    return make_tiny_llama(torch.float32, seed=5)


# ---- the store on its own ---------------------------------------------------------------------------------
@needs_kernel
def test_attach_copies_the_longest_stored_prefix_and_leaves_a_token(model32):
    fwd = LeanForward(model32)
    assert PrefixCache.supports(fwd)
    tokens = [random.Random(1).randrange(2, TINY_VOCAB) for _ in range(3 * BLOCK + 3)]
    store = PrefixCache(2**30)
    store.store(tokens, filled_cache(fwd, tokens))
    assert len(store) == 3
    for prompt, want in ((tokens, 3 * BLOCK), (tokens[: 3 * BLOCK], 2 * BLOCK), (tokens[:BLOCK], 0),
                         (tokens[: 2 * BLOCK + 1], 2 * BLOCK), (tokens[:BLOCK] + [0] * 20, BLOCK), ([0] + tokens, 0)):
        cache = fwd.new_cache()
        cache.reset()
        assert store.attach(prompt, cache) == want
        assert cache.length == want
        if want:  # the copied entries are the bits a prefill of those tokens computes
            assert torch.equal(cache.entries(0, want), filled_cache(fwd, prompt[:want]).entries(0, want))


@needs_kernel
def test_the_byte_budget_drops_least_recently_used_leaves_first(model32):
    fwd = LeanForward(model32)
    rng = random.Random(2)
    a = [rng.randrange(2, TINY_VOCAB) for _ in range(2 * BLOCK)]
    b = [rng.randrange(2, TINY_VOCAB) for _ in range(2 * BLOCK)]
    block_bytes = filled_cache(fwd, a).entries(0, BLOCK).numel() * 4 + NODE_BYTES
    store = PrefixCache(3 * block_bytes)
    store.store(a, filled_cache(fwd, a))
    store.store(a[:BLOCK] + b[:BLOCK], filled_cache(fwd, a[:BLOCK] + b[:BLOCK]))  # shares a's first block
    assert len(store) == 3 and store.bytes == 3 * block_bytes
    cache = fwd.new_cache()
    cache.reset()
    assert store.attach(a + [0], cache) == 2 * BLOCK  # a's blocks are now the most recently used
    store.store(b, filled_cache(fwd, b))  # 2 more blocks: the two oldest leaves go, never a block with children
    assert store.bytes <= 3 * block_bytes and store.evicted == 2
    cache = fwd.new_cache()
    cache.reset()
    assert store.attach(b + [0], cache) == 2 * BLOCK
    store.clear()
    assert len(store) == 0 and store.bytes == 0
    tiny = PrefixCache(block_bytes - 1)  # not even one block fits: nothing is kept
    tiny.store(a, filled_cache(fwd, a))
    assert len(tiny) == 0


# ---- through the engine ---------------------------------------------------------------------------------
@needs_kernel
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_requests_sharing_prefixes_equal_greedy_alone(model32, data):
    """Prompts built from a few shared prefixes (and earlier requests' whole outputs: the next turn of a
    conversation) arriving in random order, on the float32 kernel path: every request equals its greedy
    decoding alone, and later ones really took their prefixes from the cache."""
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    heads = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(BLOCK, 5 * BLOCK))] for _ in range(2)]
    methods = ["ar", "goose", "pld", "tr", "goose-paper", "lookahead"]
    with Engine(model32, None, "goose", max_batch=data.draw(st.integers(1, 3))) as eng:
        openers = [h + [rng.randrange(2, TINY_VOCAB)] for h in heads]
        done = [r.result(timeout=120) for r in [eng.submit(p, 12) for p in openers]]
        reqs, prompts = [], []
        for i in range(data.draw(st.integers(2, 6))):
            h = rng.randrange(2)
            if rng.random() < 0.3:  # the next turn: the earlier prompt, its output and more
                prompt = openers[h] + done[h].token_ids + [5, 6]
            else:
                prompt = heads[h][: rng.randrange(1, len(heads[h]) + 1)] + \
                    [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(0, 12))]
            new = rng.randrange(1, 16)
            prompts.append((prompt, new))
            reqs.append(eng.submit(prompt, new, method=methods[i % len(methods)]))
            time.sleep(rng.random() * 0.005)
        results = [r.result(timeout=120) for r in reqs]
    # what the openers left stored: their prompt and output, but for the last token (never fed to the model)
    stored = [(p + res.token_ids)[: len(p) + len(res.token_ids) - 1] for p, res in zip(openers, done)]
    for (prompt, new), res in zip(prompts, results):
        assert res.token_ids == greedy_memo(model32, prompt, new), prompt
        assert res.stats.cached_tokens % BLOCK == 0 and res.stats.cached_tokens < len(prompt)
        common = max(len(os.path.commonprefix([prompt, s])) for s in stored)
        assert res.stats.cached_tokens >= min(common, len(prompt) - 1) // BLOCK * BLOCK, prompt
    for p, res in zip(openers, done):
        assert res.token_ids == greedy_memo(model32, p, 12)


@needs_kernel
def test_the_next_turn_reuses_the_previous_output(model32):
    prompt = [random.Random(3).randrange(2, TINY_VOCAB) for _ in range(20)]
    with Engine(model32, None, "ar", max_batch=2) as eng:
        one = eng.generate(prompt, 30)
        turn = prompt + one.token_ids + [7, 8, 9]
        two = eng.generate(turn, 10)
    assert one.stats.cached_tokens == 0
    assert two.stats.cached_tokens >= (len(prompt) + len(one.token_ids) - 1) // BLOCK * BLOCK > len(prompt)
    assert two.token_ids == greedy_memo(model32, turn, 10)


@needs_kernel
def test_changed_weights_empty_the_cache(model32):
    model = make_tiny_llama(torch.float32, seed=6)
    prompt = list(range(2, 2 + 3 * BLOCK))
    with Engine(model, None, "ar", max_batch=1) as eng:
        eng.generate(prompt, 5)
        assert len(eng.prefixes) > 0
        again = eng.generate(prompt, 5)
        assert again.stats.cached_tokens > 0
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
        after = eng.generate(prompt, 5)
    assert after.stats.cached_tokens == 0
    assert after.token_ids == hf_greedy(model, prompt, 5)


def test_off_where_reuse_could_change_bits_or_when_asked(model32):
    prompt = list(range(2, 2 + 3 * BLOCK))
    model64 = make_tiny_llama(torch.float64, seed=5)
    for eng in (Engine(model32, None, "ar", forward=HFForward(model32)), Engine(model64, None, "ar"),
                Engine(model32, None, "ar", prefix_cache_mb=0)):
        with eng:
            eng.generate(prompt, 4)
            assert eng.generate(prompt, 4).stats.cached_tokens == 0
            assert len(eng.prefixes) == 0
    with pytest.raises(GooseError, match="prefix_cache_mb"):
        Engine(model32, None, "ar", prefix_cache_mb=-1)


@needs_kernel
@pytest.mark.parametrize("chunk", [None, 5])
def test_requests_admitted_together_wait_for_the_shared_prefix(model32, chunk):
    """Requests admitted in one step whose prompts share their first blocks: the first prefills them (in
    chunks of `chunk` prompt tokens per step), the others wait, then copy them; all equal greedy alone."""
    rng = random.Random(4)
    shared = [rng.randrange(2, TINY_VOCAB) for _ in range(4 * BLOCK + 3)]
    prompts = [shared + [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    prompts.append([rng.randrange(2, TINY_VOCAB) for _ in range(3 * BLOCK)])  # shares nothing: never waits
    eng = Engine(model32, None, "goose", max_batch=5, thread=False, prefill_chunk=chunk)
    reqs = [eng.submit(p, 10) for p in prompts]  # all queued before the loop starts: admitted in one step
    closer = threading.Timer(0.2, eng.close)
    closer.start()
    eng.run()
    results = [r.result(timeout=60) for r in reqs]
    for p, res in zip(prompts, results):
        assert res.token_ids == greedy_memo(model32, p, 10)
    assert [res.stats.cached_tokens for res in results] == [0] + [4 * BLOCK] * 3 + [0]
