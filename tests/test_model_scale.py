"""benchmarks/model_scale.py: random-weight models built straight into GGUF blocks (nothing left on the meta
device, packed sizes as the block formats give them, finite logits from goose's forward) and the speed-up
projection (no gain on a steep cost curve, a gain on a flat one)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from goose.backends import packed, quant
from goose.backends.lean import LeanForward
from goose.selection.costmodel import CostCurve

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "model_scale.py"
needs_quant = pytest.mark.skipif(quant.kernels_or_none() is None,
                                 reason=f"quantized kernels: {quant.unavailable_reason()}")


@pytest.fixture(scope="module")
def scale():
    spec = importlib.util.spec_from_file_location("model_scale", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@needs_quant
@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_0"])
def test_tiny_model_is_built_in_blocks_and_runs(scale, fmt):
    shape = scale.SHAPES["tiny"]
    net = scale.build(shape, fmt)
    assert not [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    _, block, bbytes = quant.FORMATS[fmt]
    weights = [m.weight for m in net.modules() if isinstance(m, (packed.PackedLinear, packed.PackedEmbedding))]
    assert len(weights) == 7 * shape.layers + 2  # every projection, the embedding and a separate head
    for w in weights:  # whole 16-row panels of the GGUF blocks
        assert w.fmt == fmt and w.nbytes == -(-w.n // quant.PANEL) * quant.PANEL * (w.k // block) * bbytes
    params, nbytes = scale.weight_stats(net)
    h, i, v = shape.hidden, shape.intermediate, shape.vocab
    kv = shape.kv_heads * h // shape.heads
    assert params == shape.layers * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * v * h + h
    assert nbytes == sum(w.nbytes for w in weights) + 4 * (2 * shape.layers + 1) * h
    logits = LeanForward(net)([5, 17, 999])
    assert logits.shape == (3, v) and torch.isfinite(logits).all()


@needs_quant
def test_each_arithmetic_is_measured_on_the_same_model(scale):
    from goose.backends import int8

    ariths = ("exact", "int8") if int8.kernels() is not None else ("exact",)
    accepted = scale.default_acceptance(4)
    rows = scale.measure_size("tiny", "Q8_0", (1, 2, 4), 16, 1, accepted, ariths)
    assert [r["arith"] for r in rows] == list(ariths)
    assert len({r["build_s"] for r in rows}) == 1  # one build serves every arithmetic
    for r in rows:
        assert r["sizes"] == [1, 2, 4] and all(m > 0 for m in r["ms"]) and 1 <= r["n_star"] <= 4
        assert ("+int8-" in r["backend"]) == (r["arith"] == "int8")


def test_projection_needs_a_flat_cost_curve(scale):
    sizes = (1, 2, 4, 8, 16, 32, 64)
    accepted = scale.default_acceptance(sizes[-1])
    assert accepted[1] == 0 and np.all(np.diff(accepted[1:]) >= 0)
    assert scale.project(CostCurve(sizes, tuple(float(n) for n in sizes)), accepted) == (1, 1.0)
    n_star, speedup = scale.project(CostCurve(sizes, (10.0,) * len(sizes)), accepted)
    assert n_star > 1 and speedup == pytest.approx(1 + accepted[n_star]) and speedup > 1


def test_acceptance_file_is_interpolated_and_checked(scale, tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"2": 0.5, "4": 1.0}))
    assert scale.load_acceptance(good, 6).tolist() == [0.0, 0.0, 0.5, 0.75, 1.0, 1.0, 1.0]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"2": 0.5, "4": 0.25}))
    with pytest.raises(ValueError, match="fewer"):
        scale.load_acceptance(bad, 6)
