"""goose's own CPU kernels (`goose.backends.cpukernel`): build here; the linear kernel multiplies right with rows
independent of each other; the attention kernel matches a float64 reference (rotary, cache write, tree
masks, GQA); top-k matches a stable sort; they fall back clearly, and `LeanForward` on them matches
PyTorch's kernels and the HF model."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from goose.backends import cpukernel
from goose.backends.lean import LeanForward
from goose.errors import GooseError
from test_lean import assert_same, call_script, play, tiny_llama

KERNEL = cpukernel.kernel()
needs_kernel = pytest.mark.skipif(KERNEL is None, reason=f"goose's CPU kernel: {cpukernel.unavailable_reason()}")
# every variant this CPU runs (avx512 and avx2 on an AVX-512 machine), each tested against float64
VARIANTS = {v: cpukernel.kernel(v) for v in cpukernel.runnable_variants()} if KERNEL is not None else {}


def test_builds_on_an_avx2_machine_with_a_compiler():
    """Where it can run (x86-64 Linux, AVX2 + FMA, a C++ compiler, torch on libgomp), it must be available."""
    can = (platform.system() == "Linux" and platform.machine() == "x86_64"
           and {"avx2", "fma"} <= cpukernel._cpu_flags() and (shutil.which("c++") or shutil.which("g++"))
           and cpukernel._gnu_openmp_loaded())
    if not can:
        pytest.skip("not an x86-64 Linux machine with AVX2, FMA and a C++ compiler")
    assert cpukernel.unavailable_reason() is None
    assert KERNEL is not None and KERNEL.path.is_file()


def random_tree_mask(n: int, g: torch.Generator) -> torch.Tensor | None:
    """The ancestor mask [n, n] of a random tree of n nodes (None for a single node: nothing to mask)."""
    if n < 2:
        return None
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    allowed = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        allowed[i] |= allowed[parents[i]]
    return allowed


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 20), k=st.integers(1, 70), n=st.integers(1, 50), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_linear_matches_float64_reference(m, k, n, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    for kern in VARIANTS.values():
        y = kern.linear(x, kern.pack(w), n, kern.pack_bias(b, n))
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert torch.allclose(y.double(), ref, atol=1e-4 * (k ** 0.5), rtol=1e-5), kern.variant


@needs_kernel
def test_the_best_variant_this_cpu_runs_is_loaded():
    flags = cpukernel._cpu_flags()
    want = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2"
    assert KERNEL.variant == want and KERNEL.isa == (512 if want == "avx512" else 256)
    assert list(VARIANTS)[0] == want and "avx2" in VARIANTS and all(k is not None for k in VARIANTS.values())


def test_variant_can_be_capped_by_environment(monkeypatch):
    monkeypatch.delenv("GOOSE_KERNEL_VARIANT", raising=False)
    every = cpukernel.runnable_variants()
    monkeypatch.setenv("GOOSE_KERNEL_VARIANT", "avx2")
    assert cpukernel.runnable_variants() == (["avx2"] if "avx2" in every else every)
    monkeypatch.setenv("GOOSE_KERNEL_VARIANT", "no-such-isa")  # unknown: ignored
    assert cpukernel.runnable_variants() == every
    kern, reason = cpukernel._load("avx-9000")
    assert kern is None and "unknown variant" in reason


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 90), n=st.integers(1, 70),
       mode=st.sampled_from(["plain", "norm", "gated"]),
       bias=st.booleans(), accumulate=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_variants_are_bit_identical(m, k, n, mode, bias, accumulate, seed):
    """Every variant gives the same bits (same packed layout, same FMA chain per output), with the fused
    norm, the gated activation, bias and the residual add, for tiles of any size."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 2 * k if mode == "gated" else k, generator=g)
    w, b, res = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    norm = (torch.rand(k, generator=g) + 0.5, 1e-5) if mode == "norm" else None
    outs = []
    for kern in VARIANTS.values():
        out = res.clone() if accumulate else None
        outs.append(kern.linear(x, kern.pack(w), n, kern.pack_bias(b, n) if bias else None, norm=norm,
                                gated=mode == "gated", out=out))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@needs_kernel
@settings(max_examples=30, deadline=None)
@given(m=st.integers(2, 30), k=st.integers(1, 200), n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_rows_do_not_depend_on_the_batch(m, k, n, seed):
    """Each row's result is bit-identical whether it is computed alone or with other rows (any tile)."""
    g = torch.Generator().manual_seed(seed)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    for kern in VARIANTS.values():
        packed, pb = kern.pack(w), kern.pack_bias(b, n)
        together = kern.linear(x, packed, n, pb)
        for i in range(m):
            assert torch.equal(kern.linear(x[i:i + 1], packed, n, pb)[0], together[i]), (kern.variant, i)
        assert torch.equal(kern.linear(x[1:], packed, n, pb), together[1:]), kern.variant


def reference_attention(qkv, n_heads, cos, sin, cache, layer, prefix, allowed, scale):
    """float64 attention of the new tokens (rotary, then softmax over the prefix and the allowed new tokens)
    and the cache the kernel should leave."""
    n, d = cos.shape
    kh = cache.shape[2]
    q, k, v = qkv.double().view(n, n_heads + 2 * kh, d).split([n_heads, kh, kh], 1)  # [n, heads, D]
    c, s_ = cos.double()[:, None], sin.double()[:, None]

    def rope(x):
        return x * c + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * s_

    q, k = rope(q), rope(k)
    keys = torch.cat([cache[layer, 0, :, :prefix].double(), k.transpose(0, 1)], 1)  # [Kh, P + n, D]
    vals = torch.cat([cache[layer, 1, :, :prefix].double(), v.transpose(0, 1)], 1)
    seen = torch.ones(n, prefix + n, dtype=torch.bool)
    seen[:, prefix:] = allowed if allowed is not None else torch.ones(n, n, dtype=torch.bool).tril()
    group = n_heads // kh
    out = torch.empty(n, n_heads, d, dtype=torch.float64)
    for h in range(n_heads):
        sc = (q[:, h] @ keys[h // group].T) * scale  # [n, P + n]
        out[:, h] = torch.softmax(sc.masked_fill(~seen, float("-inf")), -1) @ vals[h // group]
    return out.reshape(n, n_heads * d), keys, vals


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), kh=st.integers(1, 3), group=st.integers(1, 7), d=st.sampled_from([8, 16, 24, 64, 72, 128]),
       prefix=st.integers(0, 40), tree=st.booleans(), kv16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_attention_matches_float64_reference(n, kh, group, d, prefix, tree, kv16, seed):
    """Rotary embedding, cache write, scores, softmax and weighted sum of every layer against float64, for
    causal runs and random trees, 1..7 query heads per kv head; the cache outside the new slots is untouched.
    A bfloat16 cache holds each new value rounded to nearest (ties to even, as torch rounds) and each new key
    within a rounding of the float64 one; the outputs are then those of the rounded entries."""
    g = torch.Generator().manual_seed(seed)
    heads, layers, cap = kh * group, 2, prefix + n + 3
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 6.3
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    cache = torch.randn(layers, 2, kh, cap, d, generator=g).to(torch.bfloat16 if kv16 else torch.float32)
    allowed = random_tree_mask(n, g) if tree else None
    before = cache.clone()
    step = KERNEL.attention_step(heads, cos, sin, cache, prefix, allowed, d ** -0.5)
    for layer in range(layers):
        out = step(layer, qkv)
        ref, keys, vals = reference_attention(qkv, heads, cos, sin, before, layer, prefix, allowed, d ** -0.5)
        assert out.shape == (n, heads * d)
        if kv16:  # the reference on the entries the kernel stored (the prefix's are unchanged)
            written = cache.clone()
            written[layer, :, :, prefix + n:] = before[layer, :, :, prefix + n:]
            assert torch.equal(written[layer, 1, :, : prefix + n], vals.to(torch.bfloat16))
            assert torch.allclose(written[layer, 0, :, : prefix + n].double(), keys, rtol=2 ** -8, atol=1e-6)
            ref = _reference_on_stored(qkv, heads, cos, sin, written, layer, prefix, allowed, d ** -0.5)
        assert torch.allclose(out.double(), ref, atol=1e-5, rtol=1e-4), (out.double() - ref).abs().max()
        if not kv16:
            assert torch.allclose(cache[layer, 0, :, : prefix + n].double(), keys, atol=1e-6)
            assert torch.equal(cache[layer, 1, :, : prefix + n].double(), vals)
    assert torch.equal(cache[:, :, :, prefix + n:], before[:, :, :, prefix + n:])


def _reference_on_stored(qkv, n_heads, cos, sin, cache, layer, prefix, allowed, scale):
    """float64 attention of the new tokens' queries over the keys and values the cache holds (its first
    prefix + n entries of `layer`, new tokens' included)."""
    n, d = cos.shape
    kh = cache.shape[2]
    q = qkv.double().view(n, n_heads + 2 * kh, d)[:, :n_heads]
    q = q * cos.double()[:, None] + torch.cat([-q[..., d // 2:], q[..., : d // 2]], -1) * sin.double()[:, None]
    keys, vals = cache[layer, 0, :, : prefix + n].double(), cache[layer, 1, :, : prefix + n].double()
    seen = torch.ones(n, prefix + n, dtype=torch.bool)
    seen[:, prefix:] = allowed if allowed is not None else torch.ones(n, n, dtype=torch.bool).tril()
    group = n_heads // kh
    out = torch.empty(n, n_heads, d, dtype=torch.float64)
    for h in range(n_heads):
        sc = (q[:, h] @ keys[h // group].T) * scale
        out[:, h] = torch.softmax(sc.masked_fill(~seen, float("-inf")), -1) @ vals[h // group]
    return out.reshape(n, n_heads * d)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(segs=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 30), st.booleans()), min_size=1, max_size=5),
       seed=st.integers(0, 2**31 - 1))
def test_attention_batch_equals_each_sequence_alone(segs, seed):
    """Several sequences' attention in one call: every row and every cache bit-identical to the sequence's
    own step (causal runs and trees, different prefixes and capacities)."""
    g = torch.Generator().manual_seed(seed)
    heads, kh, d, layers = 6, 2, 16, 2
    qkvs, steps_alone, steps_batch, caches = [], [], [], []
    for n, prefix, tree in segs:
        cap = prefix + n + int(torch.randint(0, 5, (1,), generator=g))
        qkvs.append(torch.randn(n, (heads + 2 * kh) * d, generator=g))
        ang = torch.rand(n, d // 2, generator=g) * 6.3
        cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
        allowed = random_tree_mask(n, g) if tree else None
        kv16 = bool(torch.randint(0, 2, (1,), generator=g))  # float32 and bfloat16 caches in one batch
        cache = torch.randn(layers, 2, kh, cap, d, generator=g).to(torch.bfloat16 if kv16 else torch.float32)
        twin = cache.clone()
        caches.append((cache, twin))
        steps_alone.append(KERNEL.attention_step(heads, cos, sin, cache, prefix, allowed, d ** -0.5))
        steps_batch.append(KERNEL.attention_step(heads, cos, sin, twin, prefix, allowed, d ** -0.5))
    batch = KERNEL.attention_batch(steps_batch)
    qkv = torch.cat(qkvs)
    for layer in range(layers):
        together = batch(layer, qkv)
        alone = torch.cat([s(layer, q) for s, q in zip(steps_alone, qkvs)])
        assert torch.equal(together, alone)
    for cache, twin in caches:
        assert torch.equal(cache, twin)
    with pytest.raises(ValueError):
        batch(0, qkv[:-1].contiguous())
    with pytest.raises(IndexError):
        batch(layers, qkv)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 24), kh=st.integers(1, 3), group=st.integers(1, 4), d=st.sampled_from([8, 16, 64]),
       prefix=st.integers(0, 40), kv16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_a_tree_node_equals_its_path_run_as_a_chain(n, kh, group, d, prefix, kv16, seed):
    """The output of every tree node is bit-identical to the last row of its path (its ancestors and itself, in
    order) run as a causal chain on the same cache: verifying a tree gives exactly the logits a plain step
    gives once the path is accepted, so no near-tie can make a speculative method differ from `ar`."""
    g = torch.Generator().manual_seed(seed)
    heads = kh * group
    allowed = random_tree_mask(n, g)
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 6.3
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    for kern in VARIANTS.values():
        cache = torch.randn(1, 2, kh, prefix + n, d, generator=torch.Generator().manual_seed(seed))
        cache = cache.to(torch.bfloat16 if kv16 else torch.float32)
        tree = kern.attention_step(heads, cos, sin, cache.clone(), prefix, allowed, d ** -0.5)(0, qkv)
        for i in range(n):
            path = [j for j in range(n) if allowed[i, j]]
            chain = kern.attention_step(heads, cos[path].contiguous(), sin[path].contiguous(), cache.clone(), prefix,
                                        None, d ** -0.5)(0, qkv[path].contiguous())
            assert torch.equal(tree[i], chain[-1]), (kern.variant, i, path)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 20), kh=st.integers(1, 3), group=st.integers(1, 7), d=st.sampled_from([8, 16, 24, 64, 72, 128]),
       prefix=st.integers(0, 60), tree=st.booleans(), kv16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_attention_variants_are_bit_identical(n, kh, group, d, prefix, tree, kv16, seed):
    """Every variant's grouped attention (the query rows of a sequence that read one kv head share each block of
    keys and values; two rows per register with AVX-512) gives the bits of the plain AVX2 arrangement (one
    token's query heads per work item), outputs and cache alike."""
    g = torch.Generator().manual_seed(seed)
    heads = kh * group
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 6.3
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    cache = torch.randn(2, 2, kh, prefix + n + 2, d, generator=g).to(torch.bfloat16 if kv16 else torch.float32)
    allowed = random_tree_mask(n, g) if tree else None
    got = {}
    for name, plain in [("plain", True)] + [(name, False) for name in VARIANTS]:
        c = cache.clone()
        step = VARIANTS["avx2" if plain else name].attention_step(heads, cos, sin, c, prefix, allowed, d ** -0.5,
                                                                  plain=plain)
        got[name] = (torch.cat([step(layer, qkv) for layer in range(2)]), c)
    ref, ref_cache = got.pop("plain")
    for name, (out, c) in got.items():
        assert torch.equal(out, ref) and torch.equal(c, ref_cache), name


def _attention_with_threads(kern, threads, heads, kh, d, n, prefix, allowed, seed, plain=False, kv16=False):
    """One layer's attention output and cache with `threads` OpenMP threads (restored afterwards); `plain`:
    the plain arrangement, the bit reference of the grouped kernels."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g) * 6.3
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    cache = torch.randn(1, 2, kh, prefix + n, d, generator=g).to(torch.bfloat16 if kv16 else torch.float32)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kern.attention_step(heads, cos, sin, cache, prefix, allowed, d ** -0.5, plain=plain)(0, qkv)
    finally:
        torch.set_num_threads(before)
    return out, cache


@needs_kernel
def test_bfloat16_cache_entries_round_special_values_as_the_plain_arrangement():
    """The grouped kernels store a new token's value in a bfloat16 cache as the plain arrangement does, bit for
    bit, for ties (to even), denormals, signed zeros, infinities, overflow to infinity and NaNs (kept NaN); and
    as torch rounds every value but NaN."""
    heads, kh, d, n = 3, 1, 64, 3
    special = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 2 ** -130, -(2 ** -140), 0.0, -0.0,
                            float("inf"), -float("inf"), 3.4e38, float("nan"), -float("nan"), 1e-45, 65504.0,
                            1.00390625, 0.1], dtype=torch.float32)
    special[-1] = torch.tensor([0x7F800001], dtype=torch.int32).view(torch.float32)  # a NaN that truncates to inf
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    qkv[:, (heads + kh) * d:] = special.repeat(n * d // len(special)).view(n, d)
    qkv[1, (heads + kh) * d:] = qkv[1, (heads + kh) * d:].flip(0)
    ang = torch.rand(n, d // 2, generator=g)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    caches = []
    for kern, plain in [(k, False) for k in VARIANTS.values()] + [(VARIANTS["avx2"], True)]:
        for threads in (1, 2):
            cache = torch.zeros(1, 2, kh, 5 + n, d, dtype=torch.bfloat16)
            old = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                kern.attention_step(heads, cos, sin, cache, 5, None, d ** -0.5, plain=plain)(0, qkv)
            finally:
                torch.set_num_threads(old)
            caches.append(cache)
    for c in caches[1:]:
        assert torch.equal(c.view(torch.int16), caches[0].view(torch.int16))
    stored, want = caches[0][0, 1, 0, 5:].float(), qkv[:, (heads + kh) * d:].to(torch.bfloat16).float()
    nan = want.isnan()
    assert torch.equal(stored.isnan(), nan) and torch.equal(stored[~nan], want[~nan])
    assert torch.equal(stored[~nan].sign(), want[~nan].sign()) and nan.any() and stored.isinf().any()


@needs_kernel
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 40), kh=st.integers(1, 3), group=st.integers(1, 9), d=st.sampled_from([16, 64, 72, 128]),
       prefix=st.integers(0, 400), tree=st.booleans(), kv16=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_attention_bits_do_not_depend_on_threads_or_variant(n, kh, group, d, prefix, tree, kv16, seed):
    """Every row's bits are the same whatever the number of threads (which changes how the grouped kernels
    split keys, rows and columns into work items) and in every variant, and are the plain AVX2 arrangement's;
    up to 360 rows per kv head (several row groups) and hundreds of keys (several key blocks); float32 and
    bfloat16 caches."""
    _same_bits_for_threads_and_variants(n, kh, group, d, prefix, tree, seed, kv16)


def _same_bits_for_threads_and_variants(n, kh, group, d, prefix, tree, seed, kv16=False):
    g = torch.Generator().manual_seed(seed)
    allowed = random_tree_mask(n, g) if tree else None
    ref, ref_cache = _attention_with_threads(VARIANTS["avx2"], 1, kh * group, kh, d, n, prefix, allowed, seed,
                                             plain=True, kv16=kv16)
    for kern in VARIANTS.values():
        for threads in (1, 2, 3, 5):
            out, cache = _attention_with_threads(kern, threads, kh * group, kh, d, n, prefix, allowed, seed,
                                                 kv16=kv16)
            assert torch.equal(out, ref) and torch.equal(cache, ref_cache), (kern.variant, threads)


@needs_kernel
@pytest.mark.parametrize("n, kh, group, d, prefix, tree", [
    (1, 3, 3, 64, 1000, False),   # one token, 3 kv heads: keys split by range, values by columns
    (16, 3, 3, 64, 300, True),    # a 16-node tree: 48 rows per kv head, values split by rows
    (4, 3, 3, 64, 256, True),     # a 4-node tree: 12 rows per kv head, split by rows below the keys' threshold
    (2, 1, 2, 72, 2000, False),   # 4 rows, head dim 72 (AVX-512: a partial last vector): values split by columns
    (3, 2, 4, 128, 700, True),
])
def test_attention_split_over_threads_keeps_the_bits(n, kh, group, d, prefix, tree):
    """Steps with few kv heads and long caches, whose groups the grouped kernels split over the threads (by key
    range, rows or columns): the plain arrangement's bits with 1, 2, 3 and 5 threads and in every variant, with
    float32 and bfloat16 caches."""
    for kv16 in (False, True):
        _same_bits_for_threads_and_variants(n, kh, group, d, prefix, tree, 11, kv16)


@needs_kernel
def test_attention_in_several_waves_equals_each_row_alone():
    """A step whose score rows exceed one wave of the grouped kernels (many rows on a long cache) gives each
    token exactly what it gets computed alone on the same cache (its prefix plus itself), with 1 and 2 threads."""
    heads, kh, d, prefix, n = 12, 3, 64, 2600, 24  # 96 rows per kv head, ~2600 keys: 6 groups of 0.5 MB rows
    for threads in (1, 2):
        out, cache = _attention_with_threads(KERNEL, threads, heads, kh, d, n, prefix, None, 7)
        for i in (0, 13, n - 1):  # token i alone: the cache holding the tokens before it, then itself
            g = torch.Generator().manual_seed(7)
            qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
            ang = torch.rand(n, d // 2, generator=g) * 6.3
            cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
            alone_cache = cache[:, :, :, : prefix + i + 1].clone()
            step = KERNEL.attention_step(heads, cos[i:i + 1].contiguous(), sin[i:i + 1].contiguous(), alone_cache,
                                         prefix + i, None, d ** -0.5)
            assert torch.equal(step(0, qkv[i:i + 1].contiguous())[0], out[i]), (threads, i)


@needs_kernel
def test_attention_rows_do_not_depend_on_the_other_rows():
    """A token's output is bit-identical whether it is computed alone or with the tokens after it."""
    g = torch.Generator().manual_seed(0)
    heads, kh, d, prefix, n = 9, 3, 64, 37, 6
    qkv = torch.randn(n, (heads + 2 * kh) * d, generator=g)
    ang = torch.rand(n, d // 2, generator=g)
    cos, sin = ang.cos().repeat(1, 2), ang.sin().repeat(1, 2)
    cache = torch.randn(1, 2, kh, prefix + n, d, generator=g)
    together = KERNEL.attention_step(heads, cos, sin, cache, prefix, None, 0.125)(0, qkv)
    for m in range(1, n):  # the first m tokens of the same causal run
        alone = KERNEL.attention_step(heads, cos[:m], sin[:m], cache, prefix, None, 0.125)(0, qkv[:m].contiguous())
        assert torch.equal(alone, together[:m]), m


@needs_kernel
def test_attention_refuses_bad_input():
    cos = sin = torch.ones(2, 8)
    cache = torch.zeros(1, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="shapes"):
        KERNEL.attention_step(2, cos, sin, cache, 3, None, 1.0)  # 3 + 2 tokens past a capacity of 4
    with pytest.raises(ValueError, match="float32"):
        KERNEL.attention_step(2, cos, sin, cache.double(), 0, None, 1.0)
    with pytest.raises(ValueError, match="see itself"):
        KERNEL.attention_step(2, cos, sin, cache, 0, torch.tensor([[True, False], [True, False]]), 1.0)
    step = KERNEL.attention_step(2, cos, sin, cache, 0, None, 1.0)
    with pytest.raises(ValueError, match="qkv"):
        step(0, torch.zeros(2, 31))
    with pytest.raises(IndexError):
        step(1, torch.zeros(2, 32))
    assert cpukernel.attention_reason(12, torch.float32) is not None
    assert cpukernel.attention_reason(64, torch.float64) is not None
    assert cpukernel.attention_reason(64, torch.float32) is None


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 6), v=st.integers(1, 200), k=st.integers(1, 12), levels=st.sampled_from([3, 50, 0]),
       pad=st.integers(0, 3), seed=st.integers(0, 2**31 - 1))
def test_topk_matches_a_stable_sort(n, v, k, levels, pad, seed):
    """Values in descending order, ties to the lower index (a stable sort of -x), rows with a stride."""
    k = min(k, v)
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, v + pad, generator=g) if levels == 0 else \
        torch.randint(0, levels, (n, v + pad), generator=g).float()
    x = wide[:, :v]  # rows of stride v + pad
    vals, ids = KERNEL.topk(x, k)
    order = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ids, order) and torch.equal(vals, torch.gather(x, 1, order))
    if levels == 0 and n:
        assert torch.equal(vals, torch.topk(x, k).values)


@needs_kernel
def test_topk_skips_nans_and_refuses_bad_input():
    x = torch.tensor([[1.0, float("nan"), 3.0, -float("inf"), 2.0]])
    vals, ids = KERNEL.topk(x, 4)
    assert ids.tolist() == [[2, 4, 0, 3]] and vals[0, :3].tolist() == [3.0, 2.0, 1.0]
    vals, ids = KERNEL.topk(torch.tensor([[float("nan"), 1.0]]), 2)
    assert ids[0, 0] == 1 and torch.isnan(vals[0, 1])
    with pytest.raises(ValueError, match="k = 6"):
        KERNEL.topk(x, 6)
    with pytest.raises(ValueError, match="float32"):
        KERNEL.topk(x.double(), 2)
    with pytest.raises(ValueError, match="unit stride"):
        KERNEL.topk(torch.randn(4, 6).T, 2)


@needs_kernel
def test_non_contiguous_input_and_shape_errors():
    x, w = torch.randn(16, 8)[::2], torch.randn(24, 8)  # rows with a stride
    assert not x.is_contiguous()
    assert torch.allclose(KERNEL.linear(x, KERNEL.pack(w), 24), x @ w.T, atol=1e-5)
    with pytest.raises(ValueError, match="features"):
        KERNEL.linear(torch.randn(2, 7), KERNEL.pack(w), 24)


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv("GOOSE_CPU_KERNEL", "0")
    kern, reason = cpukernel._load()
    assert kern is None and "GOOSE_CPU_KERNEL" in reason


def test_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    if platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpukernel._cpu_flags():
        pytest.skip("the build is only attempted on AVX2 machines")
    broken = tmp_path / "cxx"
    broken.write_text("#!/bin/sh\necho 'no such compiler' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    kern, reason = cpukernel._load()
    assert kern is None and "failed" in reason and "no such compiler" in reason
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-built is left to be loaded later



def test_a_library_name_hashes_the_headers_its_source_includes(tmp_path):
    """An edit of a header rebuilds every library that includes it (their cache names hash it), and the real
    kernel sources all take `prepare` from one header."""
    (tmp_path / "k.cpp").write_text('#include <math.h>\n#include "a.h"\nint f() { return A + B; }\n')
    (tmp_path / "a.h").write_text('#pragma once\n#include "b.h"\nconst int A = 1;\n')
    (tmp_path / "b.h").write_text('#pragma once\n#include "a.h"\nconst int B = 2;\n')  # a cycle: read once each
    text = cpukernel.source_text(tmp_path / "k.cpp")
    assert text.count("const int A = 1;") == 1 and text.count("const int B = 2;") == 1 and "int f()" in text
    (tmp_path / "b.h").write_text('#pragma once\n#include "a.h"\nconst int B = 3;\n')
    assert cpukernel.source_text(tmp_path / "k.cpp") != text
    prepare = (cpukernel.SOURCE.with_name("prepare.h")).read_text()
    for name in ("cpu_kernels.cpp", "quant_kernels.cpp", "int8_kernels.cpp"):
        source = cpukernel.SOURCE.with_name(name)
        assert prepare in cpukernel.source_text(source) and "void prepare(" not in source.read_text()

# ---- LeanForward on the kernel ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama32_biased():
    return tiny_llama(torch.float32, seed=5, attention_bias=True, mlp_bias=True)


@needs_kernel
def test_lean_forward_on_the_kernel_matches_torch_kernels_and_hf(llama32_biased):
    from goose.backends.forward import HFForward

    script = call_script(13)
    ours, torchs = LeanForward(llama32_biased), LeanForward(llama32_biased, kernel=False)
    linear_only = LeanForward(llama32_biased, attention_kernel=False)
    assert ours.backend == f"goose-{KERNEL.variant}+attention" and ours.attn_kernel is not None and not ours.prepacked
    assert linear_only.backend == f"goose-{KERNEL.variant}" and linear_only.attn_kernel is None
    assert not torchs.backend.startswith("goose") and torchs.attn_kernel is None
    ref = play(HFForward(llama32_biased), script)
    for fwd in (ours, linear_only, torchs):
        assert_same(play(fwd, script), ref, atol=2e-4)


def test_kernel_refused_where_it_cannot_run():
    with pytest.raises(GooseError, match="float32"):
        LeanForward(tiny_llama(torch.float64), kernel=True)
    with pytest.raises(GooseError, match="prepack"):
        LeanForward(tiny_llama(torch.float32), kernel=True, prepack=True)


# ---- HFForward: the model's linear layers on the kernel -----------------------------------------------------------
def _fp32(arch: str, **overrides):
    import copy

    from test_architectures import tiny

    model = copy.deepcopy(tiny(arch)).float()
    for k, v in overrides.items():
        setattr(model.config, k, v)
    return model


@needs_kernel
@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("gemma3", {"final_logit_softcapping": 5.0}),
                                            ("gpt2", {}), ("qwen2", {})])
def test_hf_forward_on_the_kernel(arch, overrides):
    from conftest import TINY_EOS, TINY_VOCAB, hf_greedy
    from goose.backends.forward import HFForward
    from goose.config import DecodeConfig
    from goose.decoding import Decoder

    model = _fp32(arch, **overrides)
    ours, plain = HFForward(model), HFForward(model, kernel=False)
    assert ours.backend == "hf+goose-kernel" and plain.backend == "hf" and plain.linears is None
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(ours.linears.items) == len(linears) > 0
    script = [(kind, [t % TINY_VOCAB for t in toks], parents, keep)
              for kind, toks, parents, keep in call_script(17, prompt_len=20)]
    assert_same(play(ours, script), play(plain, script), atol=1e-4)
    assert all("forward" not in m.__dict__ for m in linears)  # the model is itself again between calls
    for prompt in ([5, 6, 7, 5, 6, 7, 5, 6], [9, 3, 11, 4, 9, 3]):
        ref = hf_greedy(model, prompt, 24, TINY_EOS)
        for method in ("ar", "goose"):
            out, _ = Decoder(model, None, method, forward=HFForward(model)).generate_ids(prompt, DecodeConfig(24))
            assert out == ref, (arch, method)


@needs_kernel
def test_kernel_linears_are_switched_out_after_an_error():
    from goose.backends.forward import HFForward

    model = _fp32("llama")
    fwd = HFForward(model)
    linear = next(m for m in model.modules() if type(m) is torch.nn.Linear)
    linear.forward = hooked = lambda x: torch.nn.Linear.forward(linear, x)  # e.g. a hook's own override
    with pytest.raises(RuntimeError):
        with fwd.linears.active():
            assert linear.forward is not hooked
            raise RuntimeError("inside a forward")
    assert linear.forward is hooked
    del linear.forward
    assert all("forward" not in m.__dict__ for m, _ in fwd.linears.items)


def test_hf_forward_kernel_refused_for_float64():
    from goose.backends.forward import HFForward

    with pytest.raises(GooseError, match="float32"):
        HFForward(_fp32("llama").double(), kernel=True)


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info() or (os.cpu_count() or 1) < 2
                    or not os.path.isdir("/proc/self/task"), reason="torch runs without an OpenMP team here")
def test_release_thread_team_frees_the_callers_workers_of_torchs_libgomp():
    import threading
    import time

    pytest.importorskip("sentencepiece")  # bundles a second libgomp: the release must find torch's
    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    path = cpukernel._libgomp_path()
    assert path is not None and os.path.realpath(path).startswith(os.path.dirname(os.path.realpath(torch.__file__)))
    box = {}

    def worker():  # a fresh thread: its team is created by the op and freed by the release
        before = _tasks()
        torch.ones(1 << 22).sum()  # a parallel region: this thread's team appears
        box["with_team"] = _tasks() - before
        box["released"] = cpukernel.release_thread_team()
        deadline = time.monotonic() + 5
        while (_tasks() - before) and time.monotonic() < deadline:
            time.sleep(0.01)
        box["after"] = _tasks() - before

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    torch.set_num_threads(before_threads)
    assert box["with_team"], "the parallel op started no worker thread"
    assert box["released"] is True
    assert not box["after"], "the workers of the released team are still alive"
