"""Tenants of the prefix cache: a request reuses (and `cached_tokens` counts) only blocks stored by requests of
its own tenant (API key, `user`, `cache_salt`); another tenant sending the same prompt prefills it itself and
gets the same tokens; all tenants share one byte budget."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import TINY_EOS, TINY_VOCAB, filled_cache, greedy_memo, hf_greedy, make_tiny_llama
from goose import Engine
from goose.backends import cpukernel
from goose.backends.lean import LeanForward
from goose.engine.prefix import BLOCK, NODE_BYTES, PrefixCache

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")


@pytest.fixture(scope="module")
def model32():
    return make_tiny_llama(torch.float32, seed=7)


@needs_kernel
def test_the_store_finds_only_the_tenants_own_blocks(model32):
    fwd = LeanForward(model32)
    tokens = list(range(2, 2 + 3 * BLOCK))
    block_bytes = filled_cache(fwd, tokens).entries(0, BLOCK).numel() * 4 + NODE_BYTES
    store = PrefixCache(6 * block_bytes)
    store.store(tokens, filled_cache(fwd, tokens), tenant="a")
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="b") == 0
    assert store.attach(tokens + [1], fwd.new_cache()) == 0  # the anonymous tenant is a tenant of its own
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="a") == 3 * BLOCK
    assert store.hits == 3 * BLOCK
    store.store(tokens, filled_cache(fwd, tokens), tenant="b")  # the same tokens, stored again for b
    assert len(store) == 6 and store.attach(tokens + [1], fwd.new_cache(), tenant="b") == 3 * BLOCK
    other = list(range(40, 40 + 3 * BLOCK))
    store.store(other, filled_cache(fwd, other), tenant="c")  # one budget for all: the least recently used go
    assert store.bytes <= store.max_bytes and store.evicted == 3
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="a") < 3 * BLOCK  # a's were the oldest


@needs_kernel
def test_another_tenant_gets_no_cached_tokens_and_the_same_output(model32):
    rng = random.Random(11)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(4 * BLOCK + 3)]
    want = greedy_memo(model32, prompt, 10)
    with Engine(model32, None, "goose", max_batch=2) as eng:
        first = eng.generate(prompt, 10, tenant="alice")
        again = eng.generate(prompt, 10, tenant="alice")
        other = eng.generate(prompt, 10, tenant="bob")
        anon = eng.generate(prompt, 10)
    assert first.stats.cached_tokens == 0 and again.stats.cached_tokens == 4 * BLOCK
    assert other.stats.cached_tokens == 0 and anon.stats.cached_tokens == 0
    assert first.token_ids == again.token_ids == other.token_ids == anon.token_ids == want


@needs_kernel
def test_tenants_admitted_together_do_not_wait_for_each_other(model32):
    """Requests admitted in one step with the same prompt: only those of the same tenant wait for the first's
    prefill and copy it."""
    import threading

    rng = random.Random(12)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(4 * BLOCK + 3)]
    eng = Engine(model32, None, "goose", max_batch=3, thread=False)
    reqs = [eng.submit(prompt, 8, tenant=t) for t in ("a", "b", "a")]
    closer = threading.Timer(0.2, eng.close)
    closer.start()
    eng.run()
    results = [r.result(timeout=60) for r in reqs]
    assert [r.stats.cached_tokens for r in results] == [0, 0, 4 * BLOCK]
    assert all(r.token_ids == greedy_memo(model32, prompt, 8) for r in results)


# ---- through the server: `user`, `cache_salt`, API key -------------------------------------------------

@needs_kernel
def test_tenants_through_the_api():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from transformers import AutoTokenizer

    from goose.decoding import encode_chat
    from goose.loading.model import model_dir
    from serving import live_server

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    model = make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=2)
    system = "You are the assistant of tenant A. Their secret plan: migrate the geese north in May. " * 2
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is the plan?"}]
    want = hf_greedy(model, encode_chat(tok, messages), 8, eos=TINY_EOS)
    eng = Engine(model, tok, "goose", max_batch=2)
    try:
        with live_server(eng) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)

            def ask(**kw):
                r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                   **kw)
                assert r.model_extra["goose"]["completion_token_ids"] == want
                return r.usage.prompt_tokens_details.cached_tokens

            assert ask(user="alice") == 0
            assert ask(user="alice") > 0  # the same tenant reuses its prefix
            assert ask(user="bob") == 0  # another tenant learns nothing of alice's prompt
            assert ask() == 0  # nor does the anonymous tenant
            # a request naming no tenant drafts from no memory and leaves its text in none
            assert "" not in eng.memories and len(eng.memories) == 2  # alice's and bob's
            assert ask(user="alice", extra_body={"cache_salt": "s1"}) == 0  # a salt is a tenant of its own
            assert ask(user="alice", extra_body={"cache_salt": "s1"}) > 0
        with live_server(eng, api_key="key-1") as base:  # with a key, the key is part of the tenant
            client = openai.OpenAI(base_url=base + "/v1", api_key="key-1", max_retries=0, timeout=60)
            assert ask(user="alice") == 0
            assert ask(user="alice") > 0
    finally:
        eng.close(timeout=10, cancel=True)


@needs_kernel
def test_prefix_tenants_are_capped_and_an_eviction_reads_no_other_block(model32, monkeypatch):
    fwd = LeanForward(model32)
    tokens = list(range(2, 2 + 2 * BLOCK))
    cache = filled_cache(fwd, tokens)
    store = PrefixCache(2**30, max_tenants=3)
    for t in "abc":
        store.store(tokens, cache, tenant=t)
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="a") == 2 * BLOCK  # b is the least recent now
    store.store(tokens, cache, tenant="d")
    assert store.tenants == 3 and len(store) == 6 and store.evicted == 2
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="b") == 0
    assert store.attach(tokens + [1], fwd.new_cache(), tenant="c") == 2 * BLOCK
    # a full cache of many tenants: a store evicts exactly what it needs, looking at no other block
    block = filled_cache(fwd, tokens).entries(0, BLOCK).numel() * 4 + NODE_BYTES
    full = PrefixCache(400 * block)
    for i in range(400):
        prompt = tokens[:BLOCK] + [2 + i % 7] * BLOCK
        full.store(prompt, filled_cache(fwd, prompt), tenant=f"t{i}")
    assert full.bytes <= full.max_bytes and full.tenants == 200
    seen = []
    monkeypatch.setattr(PrefixCache, "_remove", lambda self, node, real=PrefixCache._remove: (seen.append(node),
                                                                                          real(self, node)))
    full.store(tokens, cache, tenant="new")
    assert len(seen) == 2 and all(n.tenant == "t200" for n in seen)  # the least recently used tenant's blocks
    assert full.attach(tokens + [1], fwd.new_cache(), tenant="new") == 2 * BLOCK


def test_serve_passes_its_engine_settings_as_one_engine_config(monkeypatch):
    from goose.cli import main
    from goose.config import EngineConfig
    from goose.server import app

    seen = {}
    monkeypatch.setattr(app, "serve", lambda *a, **kw: seen.update(args=a, kw=kw) or 0)
    assert main(["serve", "--model", "smollm2-135m", "--max-tenants", "7", "--memory-mb", "3", "--max-batch", "2",
                 "--prefix-cache-mb", "5"]) == 0
    cfg = seen["args"][4]
    assert cfg == EngineConfig(max_batch=2, max_queue=64, prefix_cache_mb=5, memory_mb=3, max_tenants=7,
                               methods=("goose", "pld", "goose-nohead"))
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--max-tenants", "0"])
    assert exc.value.code == 2


def test_the_step_loop_hands_free_heap_memory_back(model32, monkeypatch):
    """Between steps, at most every TRIM_S seconds while busy, and whenever it runs out of work."""
    from goose.engine import scheduler
    from goose.machine import trim_heap

    assert trim_heap() is True  # glibc here: the call exists and runs
    calls = []
    monkeypatch.setattr(scheduler, "trim_heap", lambda: calls.append(1))
    eng = Engine(model32, None, "ar", max_batch=1, thread=False)
    req = eng.submit([5, 6, 7], 6, eos=[])
    monkeypatch.setattr(scheduler, "TRIM_S", 1e9)  # busy: not before TRIM_S has passed
    for _ in range(3):
        eng.step()
    assert calls == []
    monkeypatch.setattr(scheduler, "TRIM_S", 0.0)
    while eng.step():
        pass
    assert req.result(timeout=5).token_ids == greedy_memo(model32, [5, 6, 7], 6) and len(calls) >= 3
    eng.close()
