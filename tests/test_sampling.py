"""Lossless sampling: every method samples exactly the distribution of plain sampling.

Two oracles on tiny random models:
* distribution: continuations of 3 tokens over an 8-token vocabulary, sampled through each method, against
  the exact probabilities computed from plain forwards (chi-square goodness of fit, significance 0.001,
  cells with expected count < 5 pooled; fixed seeds, so the outcome is deterministic). The same test rejects
  a sampler at the wrong temperature, so it has the power to fail.
* coupling: the sampler draws the same randomness per emitted token in every method, so with one seed every
  method must give exactly `ar`'s tokens (float64 model: no near-ties).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, make_tiny_llama, method_for
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.engine.methods import METHODS
from goose.engine.sampling import argmax_rows, warpers
from goose.errors import GooseError
from goose.selection.costmodel import CostCurve

BIG_TREES = CostCurve((1, 128), (10, 10.5))  # trees almost free: goose verifies large trees
SMALL_V = 8
LENGTH = 3
SAMPLES = 1000
ALPHA = 1e-3
PROMPT = [2, 3, 4, 5, 2, 3, 4, 5, 2, 3]


@pytest.fixture(scope="module")
def small_model():
    model = make_tiny_llama(seed=3, vocab=SMALL_V)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(0.3)  # spread the distribution over the small vocabulary
    model.config.eos_token_id = None
    model.generation_config.eos_token_id = None
    return model


def exact_distribution(model, prompt: list[int], cfg: DecodeConfig) -> dict[tuple, float]:
    """P(continuation) under plain sampling, from one plain forward per prefix."""
    procs = warpers(cfg)
    probs: dict[tuple, float] = {(): 1.0}
    for _ in range(LENGTH):
        nxt = {}
        for prefix, p in probs.items():
            ids = torch.tensor([prompt + list(prefix)])
            with torch.inference_mode():
                row = model(ids).logits[:, -1].float()
            dist = torch.softmax(procs(ids, row), -1)[0].tolist()
            for tok, q in enumerate(dist):
                if q > 0:
                    nxt[prefix + (tok,)] = p * q
        probs = nxt
    return probs


def chi_square_pvalue(counts: Counter, probs: dict[tuple, float], n: int) -> float:
    """Goodness of fit of `counts` to `probs` (cells with expected < 5 pooled into one)."""
    stat, cells, pool_obs, pool_exp = 0.0, 0, 0, 0.0
    for seq, p in probs.items():
        exp = n * p
        if exp < 5:
            pool_obs, pool_exp = pool_obs + counts.get(seq, 0), pool_exp + exp
            continue
        stat += (counts.get(seq, 0) - exp) ** 2 / exp
        cells += 1
    outside = n - sum(counts.get(seq, 0) for seq in probs)  # samples the distribution forbids
    if outside:
        return 0.0
    if pool_exp > 0:
        stat += (pool_obs - pool_exp) ** 2 / pool_exp
        cells += 1
    dof = cells - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


_COUNTS: dict = {}


def sample_counts(model, method: str, setting: str) -> Counter:
    """SAMPLES continuations of PROMPT through `method` (seeds 0..SAMPLES-1), counted; cached per case."""
    if (method, setting) in _COUNTS:
        return _COUNTS[method, setting]
    cfg = SETTINGS[setting]
    dec = Decoder(model, None, method, cost=BIG_TREES)
    counts: Counter = Counter()
    for i in range(SAMPLES):
        out, _ = dec.generate_ids(PROMPT, DecodeConfig(max_new_tokens=LENGTH, do_sample=True, seed=i,
                                                       temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p))
        counts[tuple(out)] += 1
    _COUNTS[method, setting] = counts
    return counts


SETTINGS = {
    "t1": DecodeConfig(do_sample=True),
    "t0.7-p0.8": DecodeConfig(do_sample=True, temperature=0.7, top_p=0.8),
    "t1.3-k4": DecodeConfig(do_sample=True, temperature=1.3, top_k=4),
}


@pytest.mark.parametrize("method, setting", [("ar", "t1"), ("goose", "t1"), ("goose", "t0.7-p0.8"),
                                             ("goose", "t1.3-k4"), ("tr", "t0.7-p0.8"), ("pld", "t1.3-k4")])
def test_sampled_continuations_follow_the_exact_distribution(small_model, method, setting):
    counts = sample_counts(small_model, method, setting)
    p = chi_square_pvalue(counts, exact_distribution(small_model, PROMPT, SETTINGS[setting]), SAMPLES)
    assert p > ALPHA, f"{method} {setting}: chi-square p = {p:.2e}"


def test_the_chi_square_check_rejects_a_wrong_temperature(small_model):
    counts = sample_counts(small_model, "goose", "t1")
    wrong = exact_distribution(small_model, PROMPT, DecodeConfig(do_sample=True, temperature=0.6))
    assert chi_square_pvalue(counts, wrong, SAMPLES) < ALPHA


def test_trees_are_verified_and_accepted_while_sampling(small_model):
    dec = Decoder(small_model, None, "goose", cost=BIG_TREES)
    _, stats = dec.generate_ids(PROMPT * 3, DecodeConfig(max_new_tokens=40, do_sample=True, seed=1))
    assert max(stats.tree_sizes) > 1 and stats.forward_calls < stats.new_tokens


_MODEL = {}


def _tiny():
    if "m" not in _MODEL:
        _MODEL["m"] = make_tiny_llama()
    return _MODEL["m"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=24).map(lambda p: p + p),
       seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.5, 1.0, 1.5]),
       top_p=st.sampled_from([None, 0.9]), top_k=st.sampled_from([None, 10]))
def test_one_seed_gives_every_method_the_same_tokens_as_ar(prompt, seed, temperature, top_p, top_k):
    model = _tiny()
    cfg = DecodeConfig(max_new_tokens=30, do_sample=True, seed=seed, temperature=temperature, top_p=top_p,
                       top_k=top_k)
    ref, _ = Decoder(model, None, "ar").generate_ids(prompt, cfg)
    for method in METHODS:
        out, _ = Decoder(model, None, method_for(method, model, BIG_TREES), cost=BIG_TREES).generate_ids(prompt, cfg)
        assert out == ref, method


def test_same_seed_same_output_across_requests_of_one_decoder():
    dec = Decoder(_tiny(), None, "goose", cost=BIG_TREES)
    cfg = DecodeConfig(max_new_tokens=30, do_sample=True, seed=11, temperature=1.2)
    rng = random.Random(0)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(12)] * 2
    first, _ = dec.generate_ids(prompt, cfg)
    again, _ = dec.generate_ids(prompt, cfg)  # the decoder has learned in between: different drafts
    assert first == again
    other, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=30, do_sample=True, seed=12, temperature=1.2))
    assert other != first


def test_top_k_one_is_greedy():
    model = _tiny()
    prompt = [5, 6, 7, 8] * 3
    greedy, _ = Decoder(model, None, "goose", cost=BIG_TREES).generate_ids(prompt, DecodeConfig(max_new_tokens=25))
    sampled, _ = Decoder(model, None, "goose", cost=BIG_TREES).generate_ids(
        prompt, DecodeConfig(max_new_tokens=25, do_sample=True, top_k=1, seed=3))
    assert sampled == greedy


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": 0}, "temperature must be > 0"),
    ({"top_p": 0}, "top_p must be in"),
    ({"top_k": -1}, "top_k must be >= 0"),
])
def test_bad_sampling_values_are_refused(kwargs, needle):
    with pytest.raises(GooseError, match=needle):
        DecodeConfig(do_sample=True, **kwargs)


def test_the_exact_distribution_is_a_distribution_and_top_p_prunes_it(small_model):
    full = exact_distribution(small_model, PROMPT, SETTINGS["t1"])
    nucleus = exact_distribution(small_model, PROMPT, SETTINGS["t0.7-p0.8"])
    assert abs(sum(full.values()) - 1) < 1e-5 and abs(sum(nucleus.values()) - 1) < 1e-5
    assert len(full) == SMALL_V ** LENGTH and len(nucleus) < len(full)


def test_unknown_options_are_named():
    with pytest.raises(GooseError, match="unknown option.*temprature"):
        Decoder(_tiny(), None, "ar").generate([3, 4, 5], 5, temprature=0.5)


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 6), vocab=st.integers(1, 300), levels=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_argmax_rows_is_torch_argmax_ties_included(n, vocab, levels, seed, dtype):
    """The greedy choice (numpy's argmax on CPU float32) picks the first maximum, exactly as torch.argmax."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (n, vocab), generator=g).to(dtype)  # few distinct values: many ties
    assert argmax_rows(logits) == logits.argmax(-1).tolist()
    assert argmax_rows(logits[:, ::2]) == logits[:, ::2].argmax(-1).tolist()  # a strided view


@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, 1.5, "3", True])
def test_seed_outside_the_generator_range_is_refused(seed):
    from goose.config import DecodeConfig
    from goose.errors import GooseError

    with pytest.raises(GooseError, match="seed must be an integer"):
        DecodeConfig(seed=seed)
    DecodeConfig(seed=2**64 - 1)
