"""Oracles on a tiny random Llama (float64, so no floating-point near-ties):
per-node tree logits, KV compaction, and token identity of every method with greedy `model.generate`."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CPU_CURVE, TINY_EOS, TINY_VOCAB, configs, hf_greedy, make_tiny_llama, method_for, prompts
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.backends.tree_tensors import ancestor_mask, tree_depths
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.drafting.tree import BRANCH, DraftTree
from goose.engine.methods import METHODS
from goose.selection.costmodel import CostCurve


def random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree.root(rng.randrange(2, TINY_VOCAB))
    while len(tree) < n:
        tree.add(rng.randrange(len(tree)), rng.randrange(2, TINY_VOCAB), BRANCH)
    return tree


@pytest.mark.parametrize("seed", range(4))
def test_tree_logits_equal_plain_forward_over_each_path(tiny_model, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 30))]
    fwd = HFForward(tiny_model)
    with torch.inference_mode():
        fwd.reset()
        fwd(prompt)
        tree = random_tree(rng, rng.randrange(2, 25))
        logits = fwd(tree.tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology()))
        for i in range(len(tree)):
            path = [tree.tokens[j] for j in tree.path_to(i)]
            ref = tiny_model(torch.tensor([prompt + path])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_compacted_kv_equals_fresh_prefill(tiny_model, seed):
    rng = random.Random(100 + seed)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 30))]
    fwd = HFForward(tiny_model)
    with torch.inference_mode():
        fwd.reset()
        fwd(prompt)
        committed = list(prompt)
        for _ in range(3):  # several steps, so compaction happens on top of compaction
            tree = random_tree(rng, rng.randrange(2, 20))
            fwd(tree.tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology()))
            path = tree.path_to(rng.randrange(len(tree)))
            fwd.keep(path)
            committed += [tree.tokens[j] for j in path]
        fresh = HFForward(tiny_model)
        fresh.reset()
        fresh(committed)
        assert fwd.length == fresh.length == len(committed)
        for a, b in zip(fwd.cache.dc.layers, fresh.cache.dc.layers):
            torch.testing.assert_close(a.keys, b.keys, rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(a.values, b.values, rtol=1e-9, atol=1e-9)


# Cost curves for the device-aware method: CPU-like (small trees), flat (big trees), steep (mostly AR).
CURVES = {
    "cpu": CPU_CURVE,
    "flat": CostCurve((1, 128), (10, 10.5)),
    "steep": CostCurve((1, 2, 128), (10, 40, 1000)),
}

@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 48), cfg=configs, seed=st.integers(0, 2),
       curve=st.sampled_from(sorted(CURVES)), backend=st.sampled_from(["hf", "lean"]))
def test_every_method_equals_greedy_generate(prompt, max_new, cfg, seed, curve, backend):
    model = _model(seed)
    ref = hf_greedy(model, prompt, max_new)
    for method in METHODS:
        fwd = HFForward(model) if backend == "hf" else LeanForward(model)
        dec = Decoder(model, None, method_for(method, model, CURVES[curve]), cfg, forward=fwd, cost=CURVES[curve])
        out, stats = dec.generate_ids(prompt, _decode(max_new))
        assert out == ref, f"{method} diverged from greedy generate"
        assert stats.new_tokens == len(out)
        assert len(out) == max_new or out[-1] == TINY_EOS


_MODELS: dict = {}


def _model(seed):
    if seed not in _MODELS:
        _MODELS[seed] = make_tiny_llama(seed=seed)
    return _MODELS[seed]


def _decode(max_new):
    return DecodeConfig(max_new_tokens=max_new)


def test_decoder_is_reusable_across_requests(tiny_model):
    rng = random.Random(7)
    for method in METHODS:
        dec = Decoder(tiny_model, None, method_for(method, tiny_model, CURVES["cpu"]), cost=CURVES["cpu"])
        for _ in range(3):
            prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 20))]
            out, _ = dec.generate_ids(prompt, _decode(30))
            assert out == hf_greedy(tiny_model, prompt, 30), method


@pytest.mark.parametrize("method", ["goose-paper", "goose"])
def test_speculation_is_accepted_on_repetitive_text(tiny_model, method):
    prompt = [5, 6, 7, 8, 9, 10] * 6
    out, stats = Decoder(tiny_model, None, method, cost=CURVES["flat"]).generate_ids(prompt, _decode(40))
    assert out == hf_greedy(tiny_model, prompt, 40)
    assert stats.forward_calls < stats.new_tokens  # speculation accepted something
    assert stats.accepted["spine"] + stats.accepted["branch"] > 0


def test_device_aware_goose_falls_back_to_plain_steps_when_trees_do_not_pay(tiny_model):
    prompt = [5, 6, 7, 8, 9, 10] * 6
    never = CostCurve((1, 2, 128), (1.0, 1000.0, 100000.0))  # any tree costs 1000x a plain step
    out, stats = Decoder(tiny_model, None, "goose", cost=never).generate_ids(prompt, _decode(30))
    assert out == hf_greedy(tiny_model, prompt, 30)
    assert set(stats.tree_sizes) == {1} and stats.routes["ar"] == len(stats.tree_sizes)



@pytest.mark.parametrize("backend", ["hf", "lean"])
@pytest.mark.parametrize("keep", [1, 3])
def test_keep_last_gives_the_last_rows_and_the_same_cache(tiny_model, backend, keep):
    rng = random.Random(5)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(20)]
    make = HFForward if backend == "hf" else LeanForward
    full, last = make(tiny_model), make(tiny_model)
    with torch.inference_mode():
        full.reset()
        last.reset()
        ref = full(prompt)
        got = last(prompt, keep_last=keep)
        assert got.shape == (keep, TINY_VOCAB)
        torch.testing.assert_close(got, ref[-keep:], rtol=1e-12, atol=1e-12)
        nxt = [3, 4, 5]  # the cache is the same: the next call agrees
        torch.testing.assert_close(last(nxt), full(nxt), rtol=1e-12, atol=1e-12)
