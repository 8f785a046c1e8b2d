"""goose's integer-dot kernels (`goose.backends.int8`): every variant this CPU runs equals a NumPy reference
with exact integer sums bit for bit (the same float32 operations in the same order), gives a row the same
bits whatever rows, tiles and threads it is computed with, and a CPU without VNNI falls back."""

from __future__ import annotations

import functools
import subprocess

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goose.backends import cpukernel, int8, quant
from goose.backends.lean import LeanForward
from goose.errors import GooseError
from test_quant import bits, random_blocks, reference

VARIANTS = int8.runnable_variants()
needs_int8 = pytest.mark.skipif(not VARIANTS or int8.kernels() is None or quant.kernels() is None,
                                reason=f"integer kernels: {int8.unavailable_reason()}")
FMTS = list(quant.FORMATS)
F32 = np.float32


# ---- the NumPy reference ---------------------------------------------------------------------------------

def _halves(raw: np.ndarray, off: int) -> np.ndarray:
    return raw[..., off:off + 2].copy().view(np.float16)[..., 0].astype(F32)


def _scale_min_k4(s: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
    s = s.astype(np.int64)
    if j < 4:
        return s[..., j] & 63, s[..., j + 4] & 63
    return (s[..., j + 4] & 0xF) | ((s[..., j - 4] >> 6) << 4), (s[..., j + 4] >> 4) | ((s[..., j] >> 6) << 4)


def decode(fmt: str, raw: np.ndarray) -> tuple[int, np.ndarray, np.ndarray, np.ndarray | None]:
    """GGUF rows ``[n, bytes]`` -> (group G, integer weights ``[n, K]`` with the format's constant taken off,
    scales ``[n, K / G]`` float32, offsets ``[n, K / G]`` float32 or None): w = s * q (+ o)."""
    _, block, bbytes = quant.FORMATS[fmt]
    n = raw.shape[0]
    b = raw.reshape(n, -1, bbytes)
    if fmt == "Q8_0":
        return 32, b[..., 2:].view(np.int8).astype(np.int64).reshape(n, -1), _halves(b, 0), None
    if fmt in ("Q4_0", "Q4_1"):
        qs = b[..., 2:18] if fmt == "Q4_0" else b[..., 4:20]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64).reshape(n, -1)
        if fmt == "Q4_0":
            return 32, q - 8, _halves(b, 0), None
        return 32, q, _halves(b, 0), _halves(b, 2)
    if fmt == "Q4_K":
        d, dmin = _halves(b, 0), _halves(b, 2)
        qs = b[..., 16:144].reshape(n, -1, 4, 32)
        q = np.stack([qs[:, :, j // 2] & 15 if j % 2 == 0 else qs[:, :, j // 2] >> 4 for j in range(8)], 2)
        sc = np.stack([_scale_min_k4(b[..., 4:16], j)[0] for j in range(8)], -1).astype(F32)
        mn = np.stack([_scale_min_k4(b[..., 4:16], j)[1] for j in range(8)], -1).astype(F32)
        s, o = d[..., None] * sc, -(dmin[..., None] * mn)
        return 32, q.astype(np.int64).reshape(n, -1), s.reshape(n, -1), o.reshape(n, -1)
    # Q6_K
    ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
    i = np.arange(256)
    half, lane, quarter = i // 128, i % 32, (i % 128) // 32
    lb = ql[..., 64 * half + 32 * (quarter & 1) + lane]
    low = np.where(quarter < 2, lb & 15, lb >> 4)
    high = (qh[..., 32 * half + lane] >> (2 * quarter)) & 3
    q = (low | (high << 4)) - 32
    s = _halves(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(F32)
    return 16, q.reshape(n, -1), s.reshape(n, -1), None


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c with one rounding (IEEE fma), exactly: a * b is exact in float64, the float64 sum's
    error e is recovered exactly (TwoSum), and a sum that lies exactly halfway between two float32 values
    goes to the side of e, so the double rounding never differs from one rounding."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    e = (p - (s - bb)) + (c64 - bb)
    r = s.astype(F32)
    r64 = r.astype(np.float64)
    up = np.where(r64 >= s, r, np.nextafter(r, F32(np.inf)))
    lo = np.where(r64 <= s, r, np.nextafter(r, F32(-np.inf)))
    half = (up.astype(np.float64) - s) == (s - lo.astype(np.float64))
    return np.where(half & (e > 0), up, np.where(half & (e < 0), lo, r)).astype(F32)


def test_fma32_is_one_rounding():
    """The reference's fma against rational arithmetic, including sums whose float64 rounding lands exactly
    halfway between two float32 values (where rounding twice would go the wrong way)."""
    from fractions import Fraction

    rng = np.random.default_rng(5)
    a, b, c = (rng.standard_normal(300).astype(F32) for _ in range(3))
    u = F32(2.0 ** -23)
    cases = [(F32(1) + u, F32(2.0 ** -24) - F32(2.0 ** -47), F32(1) + u),  # 1+u + (2^-24 - 2^-70): halfway - tiny
             (F32(1) + u, F32(2.0 ** -24) + F32(2.0 ** -47), F32(1)),  # 1 + 2^-24 + 2^-46 + 2^-70
             (F32(1), F32(2.0 ** -24), F32(1)), (F32(1), F32(2.0 ** -24), F32(1) + u)]  # exact ties: to even
    cases += list(zip(a, b, c))
    for x, y, z in cases:
        got = fma32(np.array([x]), np.array([y]), np.array([z]))[0]
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        near = [np.float32(float(exact))]  # candidates: the float32 values around the exact sum
        near += [np.nextafter(near[0], F32(np.inf)), np.nextafter(near[0], F32(-np.inf))]
        dist = [abs(Fraction(float(v)) - exact) for v in near]
        best = min(dist)
        ties = [v for v, dd in zip(near, dist) if dd == best]
        want = ties[0] if len(ties) == 1 else next(v for v in ties if not (v.view(np.int32) & 1))
        assert got.view(np.int32) == want.view(np.int32), (x, y, z)


def quantize_ref(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of x in blocks of 32: (q int64 [M, K], d float32 [M, K / 32]), as the module doc states."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    d = np.abs(xb).max(-1) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.rint(xb * inv[..., None]).astype(np.int64)
    return q.reshape(m, k), d


def linear_ref(fmt: str, raw: np.ndarray, x: np.ndarray, bias: np.ndarray | None = None,
               y0: np.ndarray | None = None) -> np.ndarray:
    """The kernel's arithmetic in NumPy: exact integer dot products per group, float32 fma chain over groups."""
    g, qw, s, o = decode(fmt, raw)
    qx, d = quantize_ref(x)
    m, k = x.shape
    acc = np.zeros((m, raw.shape[0]), dtype=F32)
    for j in range(k // g):
        cols = slice(j * g, (j + 1) * g)
        i = qx[:, cols] @ qw[:, cols].T  # exact (int64)
        dx = d[:, j * g // 32]
        t = s[None, :, j] * dx[:, None]
        acc = fma32(i.astype(F32), t, acc)
        if o is not None:
            ds = dx * qx[:, j * 32:(j + 1) * 32].sum(1).astype(F32)
            acc = fma32(np.broadcast_to(o[None, :, j], acc.shape), np.broadcast_to(ds[:, None], acc.shape), acc)
    if bias is not None:
        acc = acc + bias[None, :raw.shape[0]]
    return acc if y0 is None else y0 + acc


@functools.lru_cache(maxsize=None)
def weight(fmt: str, n: int, k: int, seed: int = 0):
    raw = random_blocks(fmt, n, k, np.random.default_rng(seed))
    return raw, quant.kernels().pack(fmt, list(raw), k)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, :32] *= 30  # blocks of different scales
    if m > 1:
        x[1, 32:64] = 0  # an all-zero block (d = 0)
    return x


# ---- tests -----------------------------------------------------------------------------------------------

def test_decode_reference_is_ggufs_dequantization():
    for fmt in FMTS:
        raw = random_blocks(fmt, 5, 512, np.random.default_rng(3))
        g, q, s, o = decode(fmt, raw)
        w = (np.repeat(s, g, 1) * q.astype(F32)).astype(F32)
        if o is not None:  # the kernel never forms w; this only checks that q, s, o are read right
            w = np.repeat(s, g, 1) * q.astype(F32) + np.repeat(o, g, 1)
        assert np.allclose(w, reference(fmt, raw).numpy(), rtol=0, atol=1e-6), fmt


@needs_int8
def test_variants_in_order_and_fall_back_without_vnni(monkeypatch):
    assert VARIANTS[-1] == "avx2" and VARIANTS == [v for v in int8.ORDER if v in VARIANTS]
    for v in VARIANTS:
        k = int8.kernels(v)
        assert k is not None and k.variant == v and k.isa == int8.ISA[v]
    flags = cpukernel._cpu_flags()
    monkeypatch.setattr(cpukernel, "_cpu_flags", lambda: flags - {"avx512_vnni", "avx_vnni"})
    assert int8.runnable_variants() == ["avx2"] and int8.kernels().variant == "avx2"
    monkeypatch.setattr(cpukernel, "_cpu_flags", lambda: flags - {"avx512vbmi"})  # VNNI-512 without VBMI
    assert int8.runnable_variants()[0] == ("avxvnni" if "avx_vnni" in flags else "avx2")
    monkeypatch.setattr(cpukernel, "_cpu_flags", lambda: flags - {"f16c"})
    assert int8.runnable_variants() == [] and int8.kernels() is None and "AVX2" in int8.unavailable_reason()
    assert "cannot run" in int8._load("vnni512")[1]  # (uncached)


@needs_int8
def test_a_variant_that_cannot_load_falls_back_to_the_next(monkeypatch):
    """(amx needs Linux to grant the tile state: refused, the next variant serves.)"""
    monkeypatch.setitem(int8._state, VARIANTS[0], (None, "refused here"))
    if len(VARIANTS) > 1:
        assert int8.kernels().variant == VARIANTS[1] and int8.unavailable_reason() is None
    for v in VARIANTS[1:]:
        monkeypatch.setitem(int8._state, v, (None, f"{v} refused"))
    assert int8.kernels() is None and int8.unavailable_reason() == "refused here"
    assert int8.kernels(VARIANTS[0]) is None


@needs_int8
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_forced_by_environment(monkeypatch, variant):
    monkeypatch.setenv(int8.ENV_VARIANT, variant)
    assert int8.runnable_variants()[0] == variant and int8.kernels().variant == variant
    monkeypatch.delenv(int8.ENV_VARIANT)
    monkeypatch.setenv(cpukernel.ENV_VARIANT, "avx2")
    assert int8.kernels().variant == "avx2"


@needs_int8
@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_quantization_matches_numpy(variant):
    x = _x(7, 256, 1)
    x[2, 5] = 0.5 * x[2].abs().max() / 127 * 3  # a value at an exact half step rounds to even
    q, d = int8.kernels(variant).quantize(x)
    qr, dr = quantize_ref(x.numpy())
    assert torch.equal(q.to(torch.int64), torch.from_numpy(qr))
    assert torch.equal(bits(d), bits(torch.from_numpy(dr)))
    assert int(q.abs().max()) == 127 and bool((d[1, 1] == 0).item())


@needs_int8
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_linear_equals_numpy_reference_bit_for_bit(variant, fmt):
    kern = int8.kernels(variant)
    odd = 288 if quant.FORMATS[fmt][1] == 32 else 768  # 288: 9 groups, an odd count (the AMX loop runs pairs)
    for n, k, m in ((37, 512, 1), (48, 256, 9), (16, 768, 3), (40, odd, 7), (40, odd, 13), (33, 512, 16),
                    (40, odd, 21), (24, odd, 37)):
        raw, w = weight(fmt, n, k)
        x = _x(m, k, n + m)
        y = kern.linear(x, w, n)
        assert torch.equal(bits(y), bits(torch.from_numpy(linear_ref(fmt, raw, x.numpy()))))
        bias = torch.randn(-(-n // 16) * 16)
        y0 = torch.randn(m, n)
        y1 = kern.linear(x, w, n, bias, out=y0.clone())
        ref = linear_ref(fmt, raw, x.numpy(), bias.numpy(), y0.numpy())
        assert torch.equal(bits(y1), bits(torch.from_numpy(ref)))
    # close to the float32 product (8-bit activations: a relative error of a few parts per thousand)
    exact = x @ torch.from_numpy(quant.kernels().rows(w, torch.arange(n)).numpy()).T
    assert (y - exact).abs().max() <= 0.02 * exact.abs().max()


# the quant bytes of each format's GGUF block set to the largest integer weights (Q8_0: -128, the largest |w|)
EXTREME = {"Q8_0": [(2, 34, 0x80)], "Q4_0": [(2, 18, 0xFF)], "Q4_1": [(4, 20, 0xFF)], "Q4_K": [(16, 144, 0xFF)],
           "Q6_K": [(0, 192, 0xFF)]}


@needs_int8
@pytest.mark.parametrize("fmt", FMTS)
def test_largest_integer_sums_are_exact(fmt):
    """Every weight and activation at its largest magnitude: the largest integer sums a kernel forms (int16 sums
    inside a group on AVX2 included) stay exact, with the rows on every path (few rows, many rows)."""
    _, block, bbytes = quant.FORMATS[fmt]
    n, k = 40, 2 * block if block == 256 else 256
    raw = random_blocks(fmt, n, k, np.random.default_rng(5)).reshape(n, -1, bbytes)
    for lo, hi, byte in EXTREME[fmt]:
        raw[:, :, lo:hi] = byte
    raw = raw.reshape(n, -1)
    w = quant.kernels().pack(fmt, list(raw), k)
    x = torch.ones(40, k)
    x[1::2] = -1  # q = 127 and q = -127 in every block
    x[2, :] = torch.linspace(-1, 1, k)
    for v in VARIANTS:
        for m in (1, 7, 8, 40):  # (AVX2, nibble formats: 1 and 7 rows as pairs, 4 + 3; 8 and 40 as panels)
            y = int8.kernels(v).linear(x[:m], w, n)
            assert torch.equal(bits(y), bits(torch.from_numpy(linear_ref(fmt, raw, x[:m].numpy())))), (v, m)


@needs_int8
def test_fused_norm_equals_reference_on_the_normed_input():
    fmt = "Q4_1"
    raw, w = weight(fmt, 40, 256)
    x, nw, eps = _x(5, 256, 2), torch.rand(256) + 0.5, 1e-5
    xs = x.numpy().astype(np.float64)
    normed = np.empty_like(x.numpy())
    for r in range(len(xs)):  # the kernel's RMSNorm: a sequential float64 sum of squares, float32 after
        ss = 0.0
        for v in xs[r]:
            ss += v * v
        scale = F32(1) / np.sqrt(F32(ss / 256) + F32(eps))
        normed[r] = nw.numpy() * (x.numpy()[r] * scale)
    for v in VARIANTS:
        y = int8.kernels(v).linear(x, w, 40, norm=(nw, eps))
        assert torch.equal(bits(y), bits(torch.from_numpy(linear_ref(fmt, raw, normed))))


def activate_ref(x: np.ndarray) -> np.ndarray:
    """The integer path's gated activation silu(g) * u of x [M, 2K] with goose's exp, as the source states it
    (float32 NumPy operations, one rounding each)."""
    k = x.shape[1] // 2
    g, u = x[:, :k].astype(F32), x[:, k:].astype(F32)
    h = float.fromhex
    t = np.minimum(np.maximum(F32(0) - g, F32(-104)), F32(89))
    n = np.rint(t * F32(h("0x1.715476p+0")))
    r = (t - n * F32(h("0x1.62e4p-1"))) - n * F32(h("0x1.7f7d1cp-20"))
    coef = [1.0, 1.0, h("0x1p-1"), h("0x1.555556p-3"), h("0x1.555556p-5"), h("0x1.111112p-7"), h("0x1.6c16c2p-10"),
            h("0x1.a01a02p-13")]
    p = np.full_like(r, F32(coef[7]))
    for c in reversed(coef[:7]):
        p = p * r + F32(c)
    j = np.clip(n.astype(np.int32), -126, 128)
    scale = ((j + 126) << 23).astype(np.int32).view(F32)
    with np.errstate(over="ignore"):
        e = (p * scale) * F32(2)
    return (g / (F32(1) + e) * u).astype(F32)


@needs_int8
def test_gated_activation_equals_reference_and_is_close_to_silu():
    """The fused silu(g) * u of the integer path: every variant equals the NumPy statement of goose's exp bit for
    bit, over the whole range (overflow to inf above ~88.7, underflow to 0, signed zeros, huge values), and
    stays within a few float32 ulps of silu computed in float64 where that is above 1e-30."""
    fmt, k = "Q4_1", 256
    raw, w = weight(fmt, 40, k)
    edges = torch.tensor([0.0, -0.0, 88.5, -88.5, 88.8, -88.8, 89.5, -89.5, 103.9, -104.5, 1e30, -1e30,
                          0.5 * np.log(2), -0.5 * np.log(2), 1e-30, -1e-30] * 4, dtype=torch.float32)
    g = torch.cat([edges, torch.linspace(-120, 120, 4 * k), torch.randn(4 * k) * 4])[: 8 * k].reshape(8, k)
    x = torch.cat([g, torch.randn(8, k)], 1)
    want = activate_ref(x.numpy())
    for v in VARIANTS:
        assert torch.equal(bits(int8.kernels(v).linear(x, w, 40, gated=True)),
                           bits(torch.from_numpy(linear_ref(fmt, raw, want)))), v
    g64, u64 = x[:, :k].double().numpy(), x[:, k:].double().numpy()
    with np.errstate(over="ignore"):
        silu = g64 / (1 + np.exp(-g64)) * u64
    big = np.abs(silu) > 1e-30  # (below: exp(-g) overflows first, and the product is a signed zero)
    assert np.all(np.abs(want - silu)[big] <= 4 * np.spacing(np.abs(silu[big]).astype(F32)))
    assert np.all(np.abs(want[~big]) <= 1e-30) and big.mean() > 0.5


@needs_int8
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FMTS), m=st.integers(1, 65), row=st.integers(0, 64), threads=st.sampled_from([1, 2]),
       fused=st.sampled_from(["plain", "norm", "gated", "bias+out"]), seed=st.integers(0, 2**16))
def test_a_row_alone_equals_the_row_among_others(fmt, m, row, threads, fused, seed):
    row %= m
    k = 256
    raw, w = weight(fmt, 40, k)
    x = _x(m, 2 * k if fused == "gated" else k, seed)
    kw: dict = {}
    if fused == "norm":
        kw["norm"] = (torch.rand(k) + 0.5, 1e-6)
    elif fused == "gated":
        kw["gated"] = True
    bias = torch.randn(48) if fused == "bias+out" else None
    y0 = torch.randn(m, 40)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = []
        for v in VARIANTS:
            kern = int8.kernels(v)
            if bias is not None:
                many = kern.linear(x, w, 40, bias, out=y0.clone(), **kw)
                alone = kern.linear(x[row:row + 1], w, 40, bias, out=y0[row:row + 1].clone(), **kw)
            else:
                many, alone = kern.linear(x, w, 40, **kw), kern.linear(x[row:row + 1], w, 40, **kw)
            assert torch.equal(bits(many[row:row + 1]), bits(alone)), v
            outs.append(many)
    finally:
        torch.set_num_threads(old)
    for o in outs[1:]:  # every variant gives the same bits
        assert torch.equal(bits(o), bits(outs[0]))


@needs_int8
def test_bad_input_is_refused_before_the_kernel():
    kern = int8.kernels()
    _, w = weight("Q8_0", 16, 64)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 63), w, 16)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64, dtype=torch.float64), w, 16)
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 16, torch.randn(8))  # bias not padded
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 16, out=torch.empty(2, 15))
    with pytest.raises(ValueError):
        kern.linear(torch.randn(2, 64), w, 15)
    with pytest.raises(TypeError):
        kern.linear(torch.randn(2, 64), torch.randn(16, 64), 16)
    with pytest.raises(ValueError):
        kern.quantize(torch.randn(2, 40))
    assert kern.linear(torch.randn(0, 64), w, 16).shape == (0, 16)


# ---- the integer arithmetic in LeanForward ---------------------------------------------------------------

_QMODELS: dict = {}


def _qmodel(fmt: str):
    """A tiny Llama with random `fmt` blocks (the embedding and tied head too), and its float32 twin."""
    if fmt not in _QMODELS:
        from test_lean import tiny_llama
        from test_quant import _quantize_tiny

        model = tiny_llama(torch.float32, seed=1, scale=1.0)
        _QMODELS[fmt] = (_quantize_tiny(model, fmt), model)
    return _QMODELS[fmt]


@needs_int8
@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_lean_forward_int8_runs_the_integer_kernels_in_its_plan(fmt):
    from test_lean import call_script, play, play_segments

    qmodel, model = _qmodel(fmt)
    exact, fi = LeanForward(qmodel), LeanForward(qmodel, arith="int8")
    assert fi.arith == "int8" and "+int8-" in fi.backend and "+int8-" not in exact.backend
    assert fi.plan is not None and all(op.fn == fi.layers[0].qkv.op().fn for e in fi.plan._keep for op in e[2:])
    script = call_script(4, steps=8, prompt_len=20)
    a, b = play(fi, script), play(exact, script)
    for x, y in zip(a, b):  # another arithmetic: close to the exact logits, not equal
        assert (x - y).abs().max() <= 0.1 * y.abs().max()  # (a random tiny model, 3 layers)
    assert any(not torch.equal(x, y) for x, y in zip(a, b))
    stepped = LeanForward(qmodel, arith="int8")  # the plan gives the per-layer calls' bits
    stepped.plan = None
    for x, y in zip(play_segments(fi, 5), play_segments(stepped, 5), strict=True):
        assert torch.equal(bits(x), bits(y))
    with pytest.raises(GooseError, match="GGUF blocks"):
        LeanForward(model, arith="int8")  # float32 weights are never quantized behind the user's back
    with pytest.raises(GooseError, match="unknown arith"):
        LeanForward(qmodel, arith="int4")


@needs_int8
@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, 127), min_size=1, max_size=30), reps=st.integers(1, 4),
       n_new=st.integers(1, 32), fmt=st.sampled_from(["Q4_1", "Q8_0"]))
def test_every_method_equals_ar_in_int8(prompt, reps, n_new, fmt):
    from conftest import method_for
    from goose.config import DecodeConfig
    from goose.decoding import Decoder
    from goose.engine.methods import METHODS
    from goose.selection.costmodel import CostCurve

    qmodel, _ = _qmodel(fmt)
    prompt = (prompt * reps)[:60]  # repeated text makes the lookup methods draft long
    fwd = LeanForward(qmodel, arith="int8")
    cost = CostCurve((1, 2, 4, 8, 16, 32), (10, 10.5, 11, 12, 14, 20))  # cheap rows: big trees
    ref, _ = Decoder(qmodel, None, "ar", forward=fwd).generate_ids(prompt, DecodeConfig(n_new))
    for method in METHODS:
        out, _ = Decoder(qmodel, None, method_for(method, qmodel, cost), forward=fwd, cost=cost).generate_ids(
            prompt, DecodeConfig(n_new))
        assert out == ref, method


@pytest.mark.slow
@needs_int8
@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
def test_packaged_smollm2_int8_every_method_equals_ar_in_int8(monkeypatch):
    """The packaged SmolLM2 GGUF loaded with ``arith="int8"``: goose, goose-paper and pld give exactly the tokens
    of ar in int8, one request at a time (`Decoder`) and batched on an `Engine` with its prefix cache."""
    from goose.decoding import Decoder
    from goose.engine.scheduler import Engine
    from goose.loading.model import load_model, model_arith
    from goose.selection.costmodel import CostCurve
    from test_quant import REAL_PROMPTS

    q, tok = load_model("smollm2-135m", arith="int8")
    assert model_arith(q) == "int8"
    cost = CostCurve((1, 2, 4, 8, 16, 32), (10, 11, 12, 14, 18, 30))  # given: no curve measured here
    ref = Decoder(q, tok, "ar")  # the model's arith
    fwd = ref.forward
    assert ref.arith == "int8" and "+int8-" in fwd.backend and fwd.plan is not None
    others = [Decoder(q, tok, m, cost=cost) for m in ("goose", "goose-paper", "pld")]
    assert all(dec.forward is fwd for dec in others)  # one shared forward per (model, arith)
    prompts = [ref.encode(text, chat=True) for text in REAL_PROMPTS[2:4] + REAL_PROMPTS[9:10]]
    wants = [ref.generate(ids, 40).token_ids for ids in prompts]
    for ids, want in zip(prompts, wants):
        for dec in others:
            assert dec.generate(ids, 40).token_ids == want, (tok.decode(ids)[:40], dec.method.name)
    # batched: the chat template's system prompt is a prefix every request shares (taken from the cache); the
    # batch cost curve is given, not measured (it changes only which nodes are verified, never a token)
    from goose.engine import scheduler
    from goose.selection.costmodel import BatchCostCurve

    monkeypatch.setattr(scheduler, "load_or_measure_batch", lambda *a, **k: BatchCostCurve.single(cost))
    with Engine(q, tok, "goose", max_batch=4, prefill_chunk=64) as eng:
        assert eng.arith == "int8" and eng.forward is fwd
        reqs = [eng.submit(ids, 40, method=m) for ids in prompts for m in ("goose", "pld")]
        results = [r.result(timeout=600) for r in reqs]
        again = eng.generate(prompts[0], 40, method="goose")  # after the others stored their prefixes
    assert [r.token_ids for r in results] == [w for w in wants for _ in range(2)]
    assert again.token_ids == wants[0] and again.stats.cached_tokens > 0


_SOURCES = [(int8.SOURCE, int8.BASE_FLAGS, v, int8.VARIANTS[v][0]) for v in int8.ORDER] + [
    (src, cpukernel.BASE_FLAGS, v, cpukernel.VARIANTS[v][0]) for src in (cpukernel.SOURCE, quant.SOURCE)
    for v in cpukernel.ORDER]


@pytest.mark.skipif(cpukernel._compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize("source,base,variant,flags", _SOURCES, ids=[f"{s.stem}-{v}" for s, _, v, _ in _SOURCES])
def test_every_kernel_variant_compiles_on_any_machine(source, base, variant, flags):
    """Each variant's source is compiled where the CPU cannot run it too (syntax and types only): a change made and
    tested on one kind of CPU must not leave another kind's build broken (it would fall back to a slower one)."""
    out = subprocess.run([cpukernel._compiler(), *base, *flags, "-fsyntax-only", str(source)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{source.name} ({variant}) does not compile:\n{out.stderr[-3000:]}"
