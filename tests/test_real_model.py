"""The packaged SmolLM2-135M: every method is token-identical to `ar` (and `ar` to `model.generate`)."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_CURVE
from goose.cli import first_mismatch
from goose.config import EngineConfig
from goose.decoding import Decoder
from goose.drafting import datastore
from goose.engine.methods import METHODS, DeviceAwareGoose
from goose.engine.scheduler import Engine
from goose.loading.model import load_model
from goose.selection.costmodel import CostCurve

PROMPTS = {
    "code-edit": "Rename the variable `x` to `count` everywhere in this function and show the full result:\n"
                 "def bump(x):\n    x = x + 1\n    if x > 10:\n        x = x * 2\n    print(x)\n    return x\n",
    "story": "Write a short story about a goose who learns to fly.",
    "math": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?",
    "code": "Write a Python function that checks whether a string is a palindrome.",
    "facts": "List three facts about the Moon.",
}
MAX_NEW = 40

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_model()


@pytest.fixture(scope="module")
def references(smollm):
    model, tok = smollm
    ar = Decoder(model, tok, "ar")
    out = {}
    for name, text in PROMPTS.items():
        ids = ar.encode(text, chat=True)
        out[name] = (ids, ar.generate(ids, MAX_NEW).token_ids)
    return out


def describe(model, ids, ref, got):
    return f"first mismatch (tie if the two logits are within ~1e-4): {first_mismatch(model, ids, ref, got)}"


def test_ar_equals_hf_generate(smollm, references):
    model, _ = smollm
    for name in ("code-edit", "story"):
        ids, ref = references[name]
        with torch.inference_mode():
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=MAX_NEW)
        got = g[0, len(ids):].tolist()
        assert got == ref, describe(model, ids, ref, got)


@pytest.fixture(scope="module")
def sharegpt_store(smollm, tmp_path_factory):
    """REST's default store, built from a slice of ShareGPT in a temporary user cache dir."""
    _, tok = smollm
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        datastore.build(tok, ["sharegpt"], max_docs=50)
        yield


# `goose` prices rows with this machine's cost curve, so how much it drafts depends on the machine (a curve where
# a second row costs a whole step rightly drafts nothing). The drafting check therefore also runs under a fixed
# curve where each row adds 40% of a one-row forward: dearer than on the CPUs measured in docs/performance.md; priced
# by it alone (no thread governor, whose one-thread curve is this machine's, and no tracking of the measured
# forwards), so what it drafts does not depend on this machine's speed or its neighbours'.
DEAR_ROWS = CostCurve(tuple(range(1, 97)), tuple(5.0 * (1 + 0.4 * (n - 1)) for n in range(1, 97)))


@pytest.mark.parametrize("method", [m for m in METHODS if m != "ar"] + ["goose-dear-rows"])
def test_method_is_lossless_on_real_prompts(smollm, references, method, request):
    model, tok = smollm
    if method == "rest":
        request.getfixturevalue("sharegpt_store")
    if method == "goose-dear-rows":
        fixed = EngineConfig(max_batch=1, adapt_threads=False, track_cost=False)
        eng = Engine(model, tok, DeviceAwareGoose(model.get_output_embeddings().weight.shape[0], cost=DEAR_ROWS),
                     engine_config=fixed)
        generate = lambda ids: eng.submit(ids, MAX_NEW).result()  # noqa: E731
    else:
        eng, dec = None, Decoder(model, tok, method)
        generate = lambda ids: dec.generate(ids, MAX_NEW)  # noqa: E731
    try:
        for name, (ids, ref) in references.items():
            res = generate(ids)
            assert res.token_ids == ref, f"{method} on {name}: " + describe(model, ids, ref, res.token_ids)
            if method in ("goose-dear-rows", "goose-paper") and name == "code-edit":
                assert res.stats.tau > 1.5, f"tau {res.stats.tau:.2f} on the repetitive prompt"
    finally:
        if eng is not None:
            eng.close()


@pytest.mark.parametrize("method", ["pld", "goose"])
def test_sampling_with_a_seed_gives_ar_tokens_and_streams_the_same_text(smollm, method):
    model, tok = smollm
    ar, dec = Decoder(model, tok, "ar"), Decoder(model, tok, method)
    options = {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "seed": 5}
    for name in ("code-edit", "story"):
        ids = dec.encode(PROMPTS[name], chat=True)
        ref = ar.generate(ids, MAX_NEW, **options).token_ids
        got = dec.generate(ids, MAX_NEW, **options)
        assert got.token_ids == ref, f"{method} {name}: {first_mismatch(model, ids, ref, got.token_ids)}"
        assert "".join(dec.stream(ids, MAX_NEW, **options)) == got.text


MORE = ["Explain photosynthesis in two sentences.", "Write a haiku about rain.", "What is 17 times 23?",
        "Translate 'good morning' into French and Spanish."]


@pytest.mark.parametrize("method", ["goose", "ar"])
def test_engine_serves_eight_concurrent_prompts_token_identical(smollm, references, method, monkeypatch):
    """Nine requests (eight in flight at once) through one Engine on the float32 kernel path: each equals
    `ar` decoding its prompt alone. The batched cost curve is a fixed CPU-like one (measuring eight curves of the
    real model, twice with the one-thread ones, took most of this test's 90 s; measuring is tested on its own, and
    no curve can change a token)."""
    from goose import Engine
    from goose.engine import scheduler
    from goose.selection.costmodel import BatchCostCurve

    sizes, ms = CPU_CURVE.sizes, CPU_CURVE.ms
    fixed = BatchCostCurve(tuple((b, CostCurve(sizes, tuple(m * (1 + 0.05 * (b - 1)) for m in ms)))
                                 for b in (1, 2, 4, 8)))
    monkeypatch.setattr(scheduler, "load_or_measure_batch", lambda *a, **k: fixed)
    model, tok = smollm
    ar = Decoder(model, tok, "ar")
    jobs = [ids for ids, _ in references.values()] + [ar.encode(t, chat=True) for t in MORE]
    refs = [ref for _, ref in references.values()] + [ar.generate(ids, MAX_NEW).token_ids for ids in jobs[5:]]
    with Engine(model, tok, method, max_batch=8) as eng:
        reqs = [eng.submit(ids, MAX_NEW) for ids in jobs]
        got = [r.result(timeout=600).token_ids for r in reqs]
        assert max(eng.batch_sizes) == 8
    for ids, ref, out in zip(jobs, refs, got):
        assert out == ref, describe(model, ids, ref, out)
