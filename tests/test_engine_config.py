"""`EngineConfig`: the engine's settings, checked once; the protocols' defaults; settings change speed only."""

from __future__ import annotations

import gc
import math
import random
import weakref

import pytest
import torch

from conftest import TINY_VOCAB, greedy_memo, make_tiny_llama
from goose import Engine, GooseError
from goose.backends.forward import HFCache, HFForward
from goose.backends.lean import LeanForward
from goose.cliargs import prefix_cache_mb
from goose.config import EngineConfig
from goose.engine.methods import make_method
from goose.protocols import Forward, KVCache


@pytest.fixture(scope="module")
def model32():
    return make_tiny_llama(torch.float32, seed=5)


@pytest.mark.parametrize("field, value", [
    ("max_batch", 0), ("max_batch", 2.5), ("max_batch", True), ("max_queue", -1), ("prefill_chunk", 0),
    ("prefix_cache_mb", -1), ("prefix_cache_mb", math.nan), ("prefix_cache_mb", math.inf), ("prefix_cache_mb", "8"),
    ("worth_margin", -0.5), ("worth_margin", math.nan), ("worth_rows", 0), ("tree_room", -1),
    ("weights_check_steps", 0), ("freeze_gc", 1), ("freeze_gc", None), ("adapt_threads", "yes"),
])
def test_bad_settings_raise_one_clear_error_naming_the_setting(field, value):
    with pytest.raises(GooseError, match=field):
        EngineConfig(**{field: value})


def test_valid_edges_are_accepted():
    cfg = EngineConfig(max_batch=1, max_queue=0, prefill_chunk=1, prefix_cache_mb=0, worth_margin=0.0, tree_room=0)
    assert cfg.prefix_cache_bytes == 0
    assert EngineConfig(prefix_cache_mb=1.5).prefix_cache_bytes == 3 * 2**19


def test_prefix_cache_mb_argument_is_checked_by_the_config():
    import argparse

    assert prefix_cache_mb("0") == 0.0 and prefix_cache_mb("12.5") == 12.5
    for bad in ("-1", "nan", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            prefix_cache_mb(bad)


def test_engine_takes_a_config_or_keywords_not_both(model32):
    cfg = EngineConfig(max_batch=3, max_queue=5, prefix_cache_mb=0)
    with Engine(model32, None, "ar", engine_config=cfg) as eng:
        assert eng.settings is cfg and eng.max_batch == 3 and eng.max_queue == 5 and eng.prefixes.max_bytes == 0
    with Engine(model32, None, "ar", 2, max_queue=4) as eng:
        assert eng.settings == EngineConfig(max_batch=2, max_queue=4)
    with pytest.raises(GooseError, match="max_batch"):
        Engine(model32, None, "ar", max_batch=2, engine_config=cfg)
    with pytest.raises(GooseError, match="engine_config"):
        Engine(model32, None, "ar", engine_config={"max_batch": 2})


@pytest.mark.parametrize("settings", [
    EngineConfig(max_batch=3, worth_margin=0.0, worth_rows=1, tree_room=0, weights_check_steps=1),
    EngineConfig(max_batch=3, worth_margin=50.0, worth_rows=8, prefill_chunk=3, prefix_cache_mb=0, freeze_gc=False),
])
def test_speed_settings_never_change_a_token(model32, settings):
    """Every setting shapes only which trees are built and how the work is cut: each request's tokens are
    still its greedy tokens."""
    rng = random.Random(11)
    prompts = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randint(3, 20))] for _ in range(5)]
    with Engine(model32, None, "goose", engine_config=settings) as eng:
        reqs = [eng.submit(p, 16) for p in prompts]
        outs = [r.result(timeout=300).token_ids for r in reqs]
    assert outs == [greedy_memo(model32, p, 16) for p in prompts]


class _Node:
    other = None


def test_freeze_gc_freezes_what_the_caller_holds_and_the_weights_still_go_with_their_last_reference():
    """`freeze_gc` (default) moves the objects alive at construction out of later collections (gc.freeze), after
    collecting the garbage; False leaves the collector as it is. A model and its engine hold no reference cycle,
    so dropping them frees the weights although they were frozen."""
    gc.unfreeze()
    try:
        model = make_tiny_llama(torch.float32, seed=6)
        with Engine(model, None, "goose", engine_config=EngineConfig(max_batch=2, freeze_gc=False)) as eng:
            assert eng.generate([3, 4, 5], 4).token_ids == greedy_memo(model, [3, 4, 5], 4)
        assert gc.get_freeze_count() == 0
        garbage = _Node()
        garbage.other = _Node()
        garbage.other.other = garbage  # a cycle no one holds: collected, not frozen
        probe = weakref.ref(garbage)
        del garbage
        eng = Engine(model, None, "goose", engine_config=EngineConfig(max_batch=2))
        assert probe() is None and gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        assert eng.generate([3, 4, 5], 4).token_ids == greedy_memo(model, [3, 4, 5], 4)
        weight = weakref.ref(next(model.parameters()))
        eng.close()
        del eng, model
        assert weight() is None and gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_protocol_defaults_are_inherited(model32):
    """Optional behaviour comes from the protocol: a cache without its own `expect` ignores it, a forward
    without packed copies is never stale and has no kernel plan; a method without candidates says so."""
    cache = HFCache()
    assert KVCache in HFCache.__mro__ and cache.expect(1000) is None
    hf = HFForward(model32, kernel=False)
    assert Forward in HFForward.__mro__ and hf.plan is None and hf.stale() is False
    assert Forward in LeanForward.__mro__
    ar = make_method("ar", TINY_VOCAB, None)
    assert ar.cost is None and not ar.offers_candidates
    with pytest.raises(NotImplementedError):
        ar.candidates(1, 0)
    assert make_method("goose", TINY_VOCAB, None).offers_candidates


def test_offered_methods_are_prepared_at_start_and_others_refused(model32):
    """`EngineConfig.methods`: every offered method is prepared when the engine starts (no request waits for a
    preparation or a cost measurement), "ar" is always offered, another method is refused before anything is
    queued, and ``speculative=False`` decodes plainly whatever `method` says; tokens equal greedy decoding."""
    from goose.errors import MethodNotAllowed

    settings = EngineConfig(max_batch=2, methods=("pld", "pld"))
    assert settings.methods == ("ar", "pld")
    with Engine(model32, None, "goose", engine_config=settings, thread=False) as eng:
        assert set(eng._templates) == {"goose", "ar", "pld"}  # prepared by the constructor
        with pytest.raises(MethodNotAllowed, match="'tr' is not offered here; choose one of: goose, ar, pld"):
            eng.submit([5, 6, 7], 4, method="tr")
        assert eng.load() == (0, 0)
        prompt = [5, 9, 17, 33, 60, 5, 9, 17]
        reqs = {name: eng.submit(prompt, 12, method=name, speculative=spec)
                for name, spec in (("goose", True), ("pld", True), ("tr", False))}
        for r in reqs.values():
            list(eng.drive(r))
        assert {name: r.method for name, r in reqs.items()} == {"goose": "goose", "pld": "pld", "tr": "ar"}
        assert all(r.token_ids == greedy_memo(model32, prompt, 12) for r in reqs.values())
    with pytest.raises(GooseError, match="unknown method"):
        EngineConfig(methods=("warp",))
    with pytest.raises(GooseError, match="tuple of method names"):
        EngineConfig(methods="pld")
