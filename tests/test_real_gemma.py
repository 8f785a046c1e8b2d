"""The packaged Gemma-3-270M (sliding window of 512 on 15 of its 18 layers): methods are token-identical to
greedy `model.generate` on a short prompt and on one longer than the window."""

from __future__ import annotations

import pytest
import torch

from conftest import CPU_CURVE
from goose.backends.forward import HFForward
from goose.bench.datasets import humaneval
from goose.cli import first_mismatch
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.loading.model import load_model

MAX_NEW = 24

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def references(gemma):
    model, tok = gemma
    window = model.config.sliding_window
    long = "\n\n".join(q.turns[0] for q in humaneval()[:5])  # 579 tokens
    out = {}
    for name, text in {"short": "The goose is a bird that", "past-the-window": long}.items():
        ids = tok(text)["input_ids"]
        with torch.inference_mode():
            g = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=MAX_NEW)
        out[name] = (ids, g[0, len(ids):].tolist())
    assert len(out["past-the-window"][0]) > window + 50
    return out


def test_gemma_takes_the_generic_forward_with_windowed_masks(gemma):
    model, _ = gemma
    fwd = Decoder(model, None, "ar").forward
    assert isinstance(fwd, HFForward) and fwd.window == 512
    assert set(fwd.kinds) == {"full_attention", "sliding_attention"}


@pytest.mark.parametrize("method", ["ar", "pld", "goose"])
def test_method_equals_generate_on_gemma(gemma, references, method):
    model, tok = gemma
    dec = Decoder(model, tok, method, cost=CPU_CURVE)
    for name, (ids, ref) in references.items():
        out, _ = dec.generate_ids(ids, DecodeConfig(max_new_tokens=MAX_NEW))
        assert out == ref, (f"{method} on {name}: first mismatch (tie if the two logits are within ~1e-4): "
                            f"{first_mismatch(model, ids, ref, out)}")
