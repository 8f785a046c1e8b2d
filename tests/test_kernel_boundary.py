"""The entry points of goose's CPU kernels check what they are given (dtype, device, shapes, contiguity)
before any pointer reaches the compiled code: a wrong tensor is a ValueError naming the argument, never
garbage or a read past a buffer."""

from __future__ import annotations

import pytest
import torch

from goose.backends import cpukernel

KERNEL = cpukernel.kernel()
pytestmark = pytest.mark.skipif(KERNEL is None, reason=f"goose's CPU kernel: {cpukernel.unavailable_reason()}")

BAD_DTYPES = [torch.float64, torch.bfloat16, torch.float16, torch.int32]


@pytest.fixture(scope="module")
def layer():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(20, 24, generator=g), torch.randn(20, generator=g), torch.randn(3, 24, generator=g)
    return w, b, x, KERNEL.pack(w), KERNEL.pack_bias(b, 20)


def test_valid_call_still_works(layer):
    w, b, x, packed, pb = layer
    assert torch.allclose(KERNEL.linear(x, packed, 20, pb), x @ w.T + b, atol=1e-5)
    assert torch.allclose(KERNEL.linear(x.T.contiguous().T, packed, 20, pb), x @ w.T + b, atol=1e-5)  # strided x


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_linear_refuses_other_dtypes(layer, dtype):
    _, _, x, packed, pb = layer
    with pytest.raises(ValueError, match=f"linear: x must be float32, not {dtype}"):
        KERNEL.linear(x.to(dtype), packed, 20, pb)
    with pytest.raises(ValueError, match="linear: packed weight must be float32"):
        KERNEL.linear(x, packed.to(dtype), 20, pb)
    with pytest.raises(ValueError, match="linear: bias must be float32"):
        KERNEL.linear(x, packed, 20, pb.to(dtype))
    with pytest.raises(ValueError, match="pack: weight must be float32"):
        KERNEL.pack(torch.zeros(4, 4, dtype=dtype))
    with pytest.raises(ValueError, match="topk: x must be float32"):
        KERNEL.topk(x.to(dtype), 2)
    with pytest.raises(ValueError, match="norm weight must be float32"):
        KERNEL.linear(x, packed, 20, pb, norm=(torch.ones(24, dtype=dtype), 1e-6))


def test_linear_refuses_bad_shapes_and_layouts(layer):
    w, _, x, packed, pb = layer
    cases = [
        (lambda: KERNEL.linear(x[0], packed, 20), "x must have 2 dimensions"),
        (lambda: KERNEL.linear(x, w, 20), "packed weight must have 4 dimensions"),
        (lambda: KERNEL.linear(x, packed.transpose(0, 1), 20), "contiguous"),
        (lambda: KERNEL.linear(x, packed, 40), "do not fit a packed weight of 2 panels"),
        (lambda: KERNEL.linear(x, packed, 0), "do not fit"),
        (lambda: KERNEL.linear(x, packed, 20, torch.zeros(20)), "not 32 \\(use pack_bias\\)"),
        (lambda: KERNEL.linear(x, packed, 20, pb[::2]), "bias has 16 entries|contiguous"),
        (lambda: KERNEL.linear(x[:, :10], packed, 20), "input has 10 features, the weight 24"),
        (lambda: KERNEL.linear(x, packed, 20, out=torch.zeros(3, 20, dtype=torch.float64)), "out must be"),
        (lambda: KERNEL.linear(x, packed, 20, out=torch.zeros(20, 3).T), "out must be"),
        (lambda: KERNEL.linear(x, packed, 20, norm=(torch.ones(23), 1e-6)), "\\[K\\] weight"),
        (lambda: KERNEL.linear(x, packed, 20, norm=torch.ones(24)), "pair"),
        (lambda: KERNEL.pack(torch.zeros(0, 4)), "rows and columns"),
        (lambda: KERNEL.pack(torch.zeros(4)), "2 dimensions"),
        (lambda: KERNEL.pack_bias(torch.zeros(5), 6), "5 entries, the layer 6"),
        (lambda: KERNEL.topk(torch.zeros(4), 1), "2 dimensions"),
        (lambda: KERNEL.topk(torch.zeros(4, 8).T, 1), "unit stride"),
        (lambda: KERNEL.topk(torch.zeros(4, 8), 9), "must be in 1..8"),
        (lambda: KERNEL.topk(torch.zeros(4, 8), True), "must be in 1..8"),
        (lambda: KERNEL.linear(x.numpy(), packed, 20), "torch.Tensor, not ndarray"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_linear_refuses_gpu_tensors(layer):
    _, _, x, packed, pb = layer
    with pytest.raises(ValueError, match="on the CPU"):
        KERNEL.linear(x.cuda(), packed, 20, pb)


def test_linear_refuses_a_meta_tensor(layer):
    """Another device than the CPU (the meta device exists everywhere)."""
    _, _, x, packed, pb = layer
    with pytest.raises(ValueError, match="must be on the CPU, not meta"):
        KERNEL.linear(x.to("meta"), packed, 20, pb)


@pytest.mark.parametrize("dtype", BAD_DTYPES)
def test_attention_refuses_other_dtypes(dtype):
    cos = sin = torch.ones(2, 8)
    cache = torch.zeros(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="attention: cos must be float32"):
        KERNEL.attention_step(2, cos.to(dtype), sin, cache, 0, None, 1.0)
    if dtype == torch.bfloat16:  # a bfloat16 cache is taken (arith="int8" keeps one)
        assert KERNEL.attention_step(2, cos, sin, cache.to(dtype), 0, None, 1.0).kv16 == 1
    else:
        with pytest.raises(ValueError, match="attention: cache must be float32 or bfloat16"):
            KERNEL.attention_step(2, cos, sin, cache.to(dtype), 0, None, 1.0)
    step = KERNEL.attention_step(2, cos, sin, cache, 0, None, 1.0)
    with pytest.raises(ValueError, match="qkv must be a contiguous float32"):
        step(0, torch.zeros(2, 32, dtype=dtype))


def test_attention_refuses_bad_arguments():
    cos = sin = torch.ones(2, 8)
    cache = torch.zeros(1, 2, 1, 4, 8)
    cases = [
        (lambda: KERNEL.attention_step(2, cos, sin, cache[:, :, :, :, :4], 0, None, 1.0), "contiguous"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache.transpose(3, 4), 0, None, 1.0), "contiguous|shapes"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache[0], 0, None, 1.0), "cache must have 5 dimensions"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache, 0, torch.ones(2, 2), 1.0), "allowed must be a bool"),
        (lambda: KERNEL.attention_step(0, cos, sin, cache, 0, None, 1.0), "n_heads = 0"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache, 0.5, None, 1.0), "integers"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache, -1, None, 1.0), "shapes"),
        (lambda: KERNEL.attention_step(2, cos, sin, cache, 0, None, float("nan")), "finite"),
        (lambda: KERNEL.attention_step(2, torch.ones(2, 4), torch.ones(2, 4), torch.zeros(1, 2, 1, 4, 4), 0, None, 1.0),
         "head dim 4 must be a multiple of 8"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle):
            call()
    step = KERNEL.attention_step(2, cos, sin, cache, 0, None, 1.0)
    with pytest.raises(ValueError, match="qkv"):
        step(0, torch.zeros(4, 16).T)  # right element count, wrong layout
