"""Batching never changes a bit: on goose's kernels (float32 and GGUF blocks, every variant this CPU runs) a
sequence's logits and cache entries are the same bits whether it is computed alone or in one forward with
up to 7 others, as a chain, a tree or a prompt split into prefill chunks; and the prefix blocks an Engine
stores (computed through trees, chunks and shared batches) are the bits of a fresh prefill of their tokens.

The tiny model's weights keep their initial scale (nothing peaks the logits), so near-ties are common and a
last-bit difference could flip a token: everything here compares bits, not tokens.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goose import Engine
from goose.backends import cpukernel, quant
from goose.backends.lean import LeanForward, Segment
from goose.engine.prefix import BLOCK, PrefixCache
from test_lean import VOCAB, root_path, tiny_llama, tree_tensors

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw float32 bits (torch.equal alone would call -0.0 and 0.0 equal)."""
    return t.contiguous().view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32, seed=11, layers=2, scale=1.0)  # initial weight scale: flat logits


def _every_variant() -> list[str]:
    import os

    saved = os.environ.pop(cpukernel.ENV_VARIANT, None)
    try:
        return cpukernel.runnable_variants()
    finally:
        if saved is not None:
            os.environ[cpukernel.ENV_VARIANT] = saved


VARIANTS = _every_variant() if cpukernel.kernel() is not None else []
QUANT = VARIANTS if VARIANTS and quant.unavailable_reason() is None else []
FLAVOURS = ([f"f32-{v}" for v in VARIANTS] + [f"f32-{v}-per-layer" for v in VARIANTS]
            + [f"{fmt}-{v}" for v in QUANT for fmt in ("Q4_0", "Q8_0")])


@pytest.fixture(scope="module")
def forwards(model):
    """Every flavour of goose's kernels, each built under ``GOOSE_KERNEL_VARIANT`` so that variant runs."""
    from test_quant import _quantize_tiny

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in FLAVOURS:
            fmt, variant = name.split("-")[:2] if not name.startswith("f32") else ("f32", name.split("-")[1])
            mp.setenv(cpukernel.ENV_VARIANT, variant)
            fwd = LeanForward(model if fmt == "f32" else _quantize_tiny(model, fmt, seed=3))
            assert f"goose-{variant}" in fwd.backend and fwd.attn_kernel is not None, fwd.backend
            if fmt != "f32":
                assert f"gguf-{fmt}-{variant}" in fwd.backend, fwd.backend
            if name.endswith("per-layer"):
                fwd.plan = None  # one kernel call per projection and attention instead of one per forward
            else:
                assert fwd.plan is not None
            out[name] = fwd
    return out


# ---- scripts of calls -------------------------------------------------------------------------------------
@st.composite
def sequence_script(draw):
    """One sequence: a prompt (prefilled in one call alone, in the drawn chunks when batched) and then decode
    calls, each a chain or a tree of drafted tokens with the path kept afterwards."""
    tok = st.integers(0, VOCAB - 1)
    prompt = draw(st.lists(tok, min_size=1, max_size=48))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, len(prompt) - 1)), max_size=4)))
    cuts = [c for c in cuts if 0 < c < len(prompt)]
    chunks = [prompt[a:b] for a, b in zip([0, *cuts], [*cuts, len(prompt)])]
    steps = []
    for _ in range(draw(st.integers(0, 3))):
        n = draw(st.integers(1, 9))
        tokens = draw(st.lists(tok, min_size=n, max_size=n))
        if draw(st.booleans()):  # a chain: keep a prefix of it
            steps.append((tokens, None, list(range(draw(st.integers(1, n))))))
        else:  # a tree: keep the root path of one node, maybe cut short
            parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
            path = root_path(parents, draw(st.integers(0, n - 1)))
            steps.append((tokens, parents, path[: draw(st.integers(1, len(path)))]))
    return prompt, chunks, steps


def _segment(cache, tokens, parents):
    if parents is None:
        return Segment(cache, tokens)
    allowed, depths = tree_tensors(parents)
    return Segment(cache, tokens, depths, allowed)


def run_alone(fwd, prompt, steps):
    """(logits of the prompt, of every step; the cache's entries at the end), the sequence on its own."""
    cache = fwd.new_cache()
    with torch.inference_mode():
        outs = [fwd.run([Segment(cache, prompt)])[0].clone()]
        for tokens, parents, keep in steps:
            outs.append(fwd.run([_segment(cache, tokens, parents)])[0].clone())
            cache.keep(keep)
        return outs, cache.entries(0, cache.length).clone()


def run_batched(fwd, scripts, order_seed: int):
    """Every sequence's calls interleaved in shared forwards (prefill chunks beside other sequences' trees),
    each round taking the next call of a random subset of the unfinished sequences; returns per sequence
    (prompt logits joined over its chunks, then every step's; its cache's entries)."""
    rng = random.Random(order_seed)
    caches = [fwd.new_cache() for _ in scripts]
    todo = [[(c, None, None) for c in chunks] + list(steps) for _, chunks, steps in scripts]
    chunk_logits: list[list[torch.Tensor]] = [[] for _ in scripts]
    step_logits: list[list[torch.Tensor]] = [[] for _ in scripts]
    with torch.inference_mode():
        while any(todo):
            live = [i for i, t in enumerate(todo) if t]
            picked = sorted(rng.sample(live, rng.randint(1, len(live))), key=lambda i: rng.random())
            calls = [(i, todo[i].pop(0)) for i in picked]
            outs = fwd.run([_segment(caches[i], tokens, parents) for i, (tokens, parents, _) in calls])
            for (i, (_, _, keep)), out in zip(calls, outs):
                if keep is None:  # a prompt chunk: everything stays
                    chunk_logits[i].append(out.clone())
                else:
                    step_logits[i].append(out.clone())
                    caches[i].keep(keep)
    return [([torch.cat(chunk_logits[i])] + step_logits[i], caches[i].entries(0, caches[i].length).clone())
            for i in range(len(scripts))]


# ---- forward level ---------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("flavour", FLAVOURS)
@settings(max_examples=40, **FAST)
@given(scripts=st.lists(sequence_script(), min_size=1, max_size=8), order_seed=st.integers(0, 2**16))
def test_batched_sequences_equal_each_alone_bit_for_bit(forwards, flavour, scripts, order_seed):
    fwd = forwards[flavour]
    together = run_batched(fwd, scripts, order_seed)
    for i, ((prompt, _, steps), (outs_b, kv_b)) in enumerate(zip(scripts, together)):
        outs_a, kv_a = run_alone(fwd, prompt, steps)
        assert len(outs_a) == len(outs_b)
        for j, (a, b) in enumerate(zip(outs_a, outs_b)):
            assert same_bits(a, b), (flavour, i, j)
        assert same_bits(kv_a, kv_b), (flavour, i)


@needs_kernel
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_prompt_in_chunks_of_every_size_gives_the_bits_of_one_call(forwards, flavour):
    """Every chunk size (1 to the whole prompt): the last row's logits and every cache entry are the bits of
    one prefill call, so where a scheduler cuts a prompt can never matter."""
    fwd = forwards[flavour]
    rng = random.Random(5)
    prompt = [rng.randrange(VOCAB) for _ in range(29)]
    whole, kv = run_alone(fwd, prompt, [])
    for size in range(1, len(prompt) + 1):
        chunks = [prompt[a:a + size] for a in range(0, len(prompt), size)]
        (outs, kv_c), = run_batched(fwd, [(prompt, chunks, [])], 0)
        assert same_bits(outs[0], whole[0]) and same_bits(kv_c, kv), (flavour, size)


@needs_kernel
def test_the_flavours_differ_from_each_other(forwards, model):
    """The comparison has teeth: the GGUF flavours compute other bits than float32 (different weights), and
    the unscaled model's top two logits come close (the scaled models of the engine tests keep them far apart)."""
    rng = random.Random(6)
    prompt = [rng.randrange(VOCAB) for _ in range(200)]
    f32 = run_alone(forwards[FLAVOURS[0]], prompt, [])[0][0]
    for name in FLAVOURS:
        if not name.startswith("f32"):
            assert not same_bits(run_alone(forwards[name], prompt, [])[0][0], f32), name
    top2 = f32.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min().item() < 1e-2


# ---- the Engine's stored prefix blocks -------------------------------------------------------------------
def stored_paths(store: PrefixCache):
    """(tokens from the root, node) of every stored block."""
    by_id = store._by_id
    for node in store._nodes.values():
        chain, n = [], node
        while True:
            chain.append(n)
            if not n.key[0]:
                break
            n = by_id[n.key[0]]
        yield [t for m in reversed(chain) for t in m.key[1]], node


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@settings(max_examples=12, **FAST)
@given(data=st.data())
def test_stored_prefix_blocks_equal_a_fresh_prefill(model, variant, data):
    """Requests sharing prompts (a common start, then their own tokens) decoded together with `goose` trees,
    prefill chunks and a small batch: every block the engine stored (prompts, and prompt + output of finished
    requests) holds the bits a fresh prefill of the block's tokens computes, on the same kernel variant."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(cpukernel.ENV_VARIANT, variant)
        fwd = LeanForward(model)
    assert f"goose-{variant}" in fwd.backend
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    shared = [rng.randrange(3, VOCAB) for _ in range(data.draw(st.integers(BLOCK, 4 * BLOCK)))]
    prompts = []
    for _ in range(data.draw(st.integers(2, 6))):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 2 * BLOCK))]
        prompts.append(shared[: rng.randint(BLOCK, len(shared))] + own)
    chunk = data.draw(st.sampled_from([3, 8, 13, 512]))
    with Engine(model, None, data.draw(st.sampled_from(["goose", "ar", "pld", "lookahead"])), forward=fwd,
                max_batch=data.draw(st.integers(1, 4)), prefill_chunk=chunk) as eng:
        reqs = [eng.submit(p, data.draw(st.integers(1, 24)), eos=[]) for p in prompts]
        for r in reqs:
            r.result(timeout=300)
        # a second round: these start with stored blocks (copied), and store their own on top
        again = [eng.submit(p + r.result().token_ids[:5] + [7], 6, eos=[]) for p, r in zip(prompts, reqs)]
        for r in again:
            r.result(timeout=300)
        store = eng.prefixes
    assert len(store) >= len(shared) // BLOCK and store.hits > 0
    for tokens, node in stored_paths(store):
        cache = fwd.new_cache()
        with torch.inference_mode():
            fwd.run([Segment(cache, tokens)])
        stored = store._pool[node.index]  # the block's entries in the cache's pool
        assert same_bits(stored, cache.entries(len(tokens) - BLOCK, len(tokens))), (variant, len(tokens))
