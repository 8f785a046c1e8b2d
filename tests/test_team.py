"""The kernels' claim pool (team.h, `cpukernel.claim_threads`): projections of every kernel library give the same
bits on OpenMP's team of two, on one thread and on the claim pool (two or three threads), whatever the rows,
columns, format and fused input; the pool serves one caller at a time, and a second thread calling meanwhile
computes alone, with the same bits; the pool is inert while OpenMP runs the region on several threads."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goose.backends import cpukernel, int8, quant
from test_quant import bits, random_blocks, reference

needs_all = pytest.mark.skipif(cpukernel.kernel() is None or quant.kernels() is None or int8.kernels() is None,
                               reason=f"kernels: {cpukernel.unavailable_reason() or int8.unavailable_reason()}")


@contextlib.contextmanager
def mode(threads: int, claim: int):
    """This thread's projections on `threads` OpenMP threads, and on a claim pool of `claim` threads (0: none)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    cpukernel.claim_threads(claim)
    try:
        yield
    finally:
        cpukernel.claim_threads(0)
        torch.set_num_threads(before)


def _weights(fmt: str, n: int, k: int, seed: int):
    raw = random_blocks(fmt, n, k, np.random.default_rng(seed))
    ck, packed = cpukernel.kernel(), quant.kernels().pack(fmt, list(raw), k)  # (int8's weights are quant's)
    return {"float32": (ck, ck.pack(reference(fmt, raw))), "quant": (quant.kernels(), packed),
            "int8": (int8.kernels(), packed)}


def _project(kern, w, x, n, fused, bias, out):
    kw: dict = {}
    if fused == "norm":
        kw["norm"] = (torch.linspace(0.5, 1.5, x.shape[1]), 1e-6)
    elif fused == "gated":
        kw["gated"] = True
    if fused == "bias+out":
        return kern.linear(x, w, n, bias, out=out.clone())
    return kern.linear(x, w, n, **kw)


@needs_all
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(list(quant.FORMATS)), m=st.integers(1, 70), n=st.sampled_from([16, 40, 300, 1100]),
       fused=st.sampled_from(["plain", "norm", "gated", "bias+out"]), seed=st.integers(0, 2**16))
def test_projections_have_the_same_bits_on_the_claim_pool(fmt, m, n, fused, seed):
    k = 256
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if fused == "gated" else k, generator=g)
    bias = cpukernel.CpuKernels.pack_bias(torch.randn(n, generator=g), n)
    out = torch.randn(m, n, generator=g)
    for name, (kern, w) in _weights(fmt, n, k, seed).items():
        with mode(2, 0):
            want = _project(kern, w, x, n, fused, bias, out)
        for threads, claim in ((1, 0), (1, 2), (1, 3), (2, 2)):  # (2, 2): OpenMP's team, the pool inert
            with mode(threads, claim):
                got = _project(kern, w, x, n, fused, bias, out)
            assert torch.equal(bits(got), bits(want)), (name, threads, claim)


@needs_all
def test_two_callers_share_a_pool_and_keep_their_bits():
    """Three threads on the claim pool at once: one holds the pool, the others compute alone; all get every
    projection's bits."""
    k, n = 512, 3000
    weights = _weights("Q4_1", n, k, 5)
    xs = [torch.randn(m, k, generator=torch.Generator().manual_seed(m)) for m in (1, 3, 9, 17)]
    want = {name: [kern.linear(x, w, n) for x in xs] for name, (kern, w) in weights.items()}
    errors: list = []

    def caller(offset: int) -> None:
        try:
            with mode(1, 2):
                for r in range(40):
                    name = list(weights)[(r + offset) % 3]
                    kern, w = weights[name]
                    i = (r * 3 + offset) % len(xs)
                    if not torch.equal(bits(kern.linear(xs[i], w, n)), bits(want[name][i])):
                        errors.append((offset, r, name))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(o,)) for o in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads) and errors == []
