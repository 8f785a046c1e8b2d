"""`GPUForward` (goose.backends.cuda) and the exact mode's kernels (goose.backends.fixed_kernels), on CPU: cache
indexing and `keep`, bucket choice, tree masks, the graph-replay bookkeeping with a stand-in for CUDA graphs, logits
against `HFForward`, every method's tokens equal to `ar`'s through the exact mode, the Triton kernels under Triton's
interpreter, and clear errors. The tests marked `cuda` need a GPU (they run in benchmarks/gpu_check.py)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # Triton's kernels run under its interpreter here: read when triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_VOCAB, configs, make_tiny_llama, method_for, prompts
from goose.backends import fixed_kernels
from goose.backends.cuda import BUCKETS, GPUForward, GraphRunner, ancestor_table, bucket_for, graph_mask
from goose.backends.forward import HFForward
from goose.backends.tree_tensors import ancestor_mask, tree_depths
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.drafting.tree import BRANCH, DraftTree
from goose.errors import GooseError
from goose.protocols import Segment
from goose.selection.costmodel import CostCurve

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run in benchmarks/gpu_check.py)")
has_triton = pytest.mark.skipif(fixed_kernels.triton is None, reason="triton is not installed")
FLAT = CostCurve((1, 128), (10, 10.5))  # trees are nearly free: the selector verifies big ones


class StandInGraph:
    """A CUDA graph's stand-in: `capture` runs the step once and keeps its outputs; `replay` runs it again and
    writes the new results into those same tensors (what a replayed graph does)."""

    made = 0

    def __init__(self) -> None:
        StandInGraph.made += 1
        self.fn, self.out, self.replays = None, None, 0

    def capture(self, fn):
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        self.replays += 1
        for old, new in zip(self.out, self.fn()):
            old.copy_(new)


def random_tree(rng: random.Random, n: int) -> DraftTree:
    tree = DraftTree.root(rng.randrange(2, TINY_VOCAB))
    while len(tree) < n:
        tree.add(rng.randrange(len(tree)), rng.randrange(2, TINY_VOCAB), BRANCH)
    return tree


def tree_args(tree: DraftTree):
    return tree.tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology())


_MODELS: dict = {}


def model32(seed: int = 0):
    if seed not in _MODELS:
        _MODELS[seed] = make_tiny_llama(dtype=torch.float32, seed=seed)
    return _MODELS[seed]


# ---- small pieces ------------------------------------------------------------------------------------------------
def test_bucket_is_the_smallest_power_of_two_holding_the_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 17, 64, 65, 128)] == [1, 2, 4, 4, 8, 32, 64, 128, 128]
    assert bucket_for(129) is None
    assert bucket_for(3, (1, 8)) == 8
    with pytest.raises(GooseError, match="at least one row"):
        bucket_for(0)


@pytest.mark.parametrize("seed", range(5))
def test_ancestor_table_lists_each_rows_path_by_depth(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randrange(1, 30))
    _, depths, allowed = tree_args(tree)
    anc = ancestor_table(allowed, depths)
    for i in range(len(tree)):
        assert anc[i, : depths[i] + 1].tolist() == tree.path_to(i)


def test_ancestor_table_refuses_a_mask_that_is_no_tree():
    allowed = torch.ones(3, 3, dtype=torch.bool).tril_()
    with pytest.raises(GooseError, match="ancestor mask"):
        ancestor_table(allowed, torch.tensor([0, 1, 1]))  # row 2 sees two rows at depth 1
    with pytest.raises(GooseError, match="ancestor mask"):
        ancestor_table(torch.zeros(2, 2, dtype=torch.bool), torch.tensor([0, 1]))  # no row sees itself
    with pytest.raises(GooseError, match="allowed"):
        ancestor_table(allowed, torch.tensor([0, 1]))


@pytest.mark.parametrize("seed", range(4))
def test_graph_mask_is_the_prefix_and_the_tree_over_the_whole_slot(seed):
    rng = random.Random(seed)
    tree = random_tree(rng, rng.randrange(1, 12))
    _, _, allowed = tree_args(tree)
    p, cap = rng.randrange(0, 20), 40
    mask = graph_mask(allowed, torch.tensor(p), cap)
    n = len(tree)
    assert mask.shape == (n, cap)
    assert mask[:, :p].all() and torch.equal(mask[:, p : p + n], allowed) and not mask[:, p + n :].any()


# ---- the cache ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["fp32", "fixed"])
def test_compacted_cache_equals_a_fresh_prefill(mode):
    """After trees and `keep`, a slot holds what a prefill of the committed tokens writes (bit for bit in the exact
    mode, whose rows do not depend on the call around them)."""
    model = model32()
    fwd = GPUForward(model, device="cpu", mode=mode, max_len=128, slots=3)
    rng = random.Random(3)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(9)]
    with torch.inference_mode():
        fwd.reset()
        fwd(prompt)
        committed = list(prompt)
        for _ in range(3):
            tree = random_tree(rng, rng.randrange(2, 14))
            fwd(*tree_args(tree))
            path = tree.path_to(rng.randrange(len(tree)))
            fwd.keep(path)
            committed += [tree.tokens[j] for j in path]
        fresh = fwd.new_cache()
        fresh.reset()
        fwd.run([Segment(fresh, committed)])
    n = len(committed)
    assert fwd.length == fresh.length == n
    mine, theirs = fwd.kv[:, :, fwd.cache.slot, :n], fwd.kv[:, :, fresh.slot, :n]
    if mode == "fixed":
        assert torch.equal(mine, theirs)
    else:
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_slots_are_given_back_when_a_cache_goes():
    fwd = GPUForward(model32(), device="cpu", max_len=32, slots=2)  # the forward's own cache holds one
    c = fwd.new_cache()
    with pytest.raises(GooseError, match="slots"):
        fwd.new_cache()
    slot = c.slot
    del c
    assert fwd.new_cache().slot == slot


def test_sequences_longer_than_the_cache_are_refused():
    fwd = GPUForward(model32(), device="cpu", max_len=16, slots=2)
    fwd.reset()
    fwd(list(range(2, 12)))
    with pytest.raises(GooseError, match="max_len"):
        fwd(list(range(2, 10)))
    with pytest.raises(GooseError, match="max_len"):
        fwd.cache.expect(17)


# ---- logits ------------------------------------------------------------------------------------------------------
def _matches_hf(model, mode: str, prompt_len: int, trees: int, seed: int, max_len: int) -> None:
    """GPUForward's logits equal HFForward's (float32 tolerance) on a prompt, then on `trees` random trees, each
    followed by the same `keep` of a random path."""
    hf, fwd = HFForward(model, kernel=False), GPUForward(model, device="cpu", mode=mode, max_len=max_len, slots=2)
    rng = random.Random(seed)
    with torch.inference_mode():
        hf.reset()
        fwd.reset()
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(prompt_len)]
        torch.testing.assert_close(fwd(prompt), hf(prompt), rtol=1e-5, atol=1e-5)
        for _ in range(trees):
            tree = random_tree(rng, rng.randrange(2, 20))
            torch.testing.assert_close(fwd(*tree_args(tree)), hf(*tree_args(tree)), rtol=1e-5, atol=1e-5)
            path = tree.path_to(rng.randrange(len(tree)))
            fwd.keep(path)
            hf.keep(path)
        last = fwd([3, 4, 5], keep_last=2)
        assert last.shape == (2, TINY_VOCAB)
        torch.testing.assert_close(last, hf([3, 4, 5])[-2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["fp32", "fixed"])
def test_logits_match_hf_forward_on_prompts_and_trees(mode):
    _matches_hf(model32(1), mode, prompt_len=15, trees=3, seed=11, max_len=128)


def _family(kind: str):
    """A tiny random model of each supported family: llama with attention and MLP biases, qwen2 (q/k/v bias), qwen3
    (per-head q/k norms)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(7)
    if kind == "llama-bias":
        model = LlamaForCausalLM(LlamaConfig(attention_bias=True, mlp_bias=True, **shape))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=8, **shape))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # (biases and norms away from their zeros and ones)
    return model.eval()


@pytest.mark.parametrize("kind", ["llama-bias", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode", ["fp32", "fixed"])
def test_each_supported_family_matches_hf_forward(kind, mode):
    _matches_hf(_family(kind), mode, prompt_len=9, trees=2, seed=2, max_len=64)


def test_goose_panels_are_read_back_as_plain_weights():
    """A model held as goose's float32 panels (`load_model`'s default on CPU) gives the same logits."""
    from goose.backends import cpukernel
    from goose.backends.packed import pack_float32

    if cpukernel.kernel() is None:
        pytest.skip("goose's CPU kernel does not run here")
    plain = make_tiny_llama(dtype=torch.float32, seed=3)
    packed = make_tiny_llama(dtype=torch.float32, seed=3)
    pack_float32(packed, cpukernel.kernel())
    a, b = (GPUForward(m, device="cpu", max_len=32, slots=2) for m in (plain, packed))
    for f in (a, b):
        f.reset()
    assert torch.equal(a([4, 5, 6, 7]), b([4, 5, 6, 7]))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 200), p=st.integers(0, 300), cap=st.integers(1, 400))
def test_bucket_choice_property(n, p, cap):
    runner = GraphRunner(lambda s: (), StandInGraph, torch.device("cpu"))
    runner.graphs = {b: None for b in BUCKETS}
    b = runner.bucket(n, p, cap)
    if n > 128 or p + bucket_for(n) > cap:
        assert b is None
    else:
        assert b >= n and b in BUCKETS and (b == 1 or b // 2 < n)


def test_features_are_the_final_norms_output():
    model = model32()
    fwd = GPUForward(model, device="cpu", max_len=64, slots=2)
    seg = Segment(fwd.cache, [4, 5, 6], keep_last=1, features=True)
    fwd.cache.reset()
    logits = fwd.run([seg])[0]
    assert seg.hidden.shape == (3, model.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(logits, model.lm_head(seg.hidden[-1:]), rtol=1e-5, atol=1e-5)


# ---- graphs ------------------------------------------------------------------------------------------------------
def test_graphs_are_captured_once_per_bucket_and_replayed():
    fwd = GPUForward(model32(), device="cpu", mode="fixed", max_len=160, slots=2, graphs=True,
                     make_graph=StandInGraph)
    r = fwd.runner
    assert r.captures == len(BUCKETS) and sorted(r.graphs) == list(BUCKETS) and fwd.backend.endswith("-graphs")
    with pytest.raises(GooseError, match="once"):
        r.capture_all(fwd._stage_scratch)
    assert r.bucket(3, 0, 160) == 4 and r.bucket(1, 159, 160) == 1
    assert r.bucket(3, 157, 160) is None  # the padded rows would pass the slot's end: eager
    assert r.bucket(129, 0, 160) is None
    fwd.reset()
    fwd([5, 6, 7])  # 3 rows: bucket 4
    assert r.replays == 1 and r.graphs[4][0].replays == 1
    fwd([2 + i % 90 for i in range(138)])  # 138 rows: more than any bucket, eager
    assert r.replays == 1 and r.captures == len(BUCKETS)


@pytest.mark.parametrize("mode", ["fp32", "fixed"])
def test_a_replayed_bucket_gives_the_eager_logits(mode):
    """Padding rows change nothing: the exact mode's rows equal the eager call's bit for bit."""
    model = model32(2)
    eager = GPUForward(model, device="cpu", mode=mode, max_len=96, slots=2)
    graphed = GPUForward(model, device="cpu", mode=mode, max_len=96, slots=2, graphs=True,
                         make_graph=StandInGraph)
    rng = random.Random(5)
    with torch.inference_mode():
        eager.reset()
        graphed.reset()
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(7)]
        pairs = [(eager(prompt), graphed(prompt))]
        for _ in range(3):
            tree = random_tree(rng, rng.randrange(1, 20))
            pairs.append((eager(*tree_args(tree)), graphed(*tree_args(tree))))
            path = tree.path_to(rng.randrange(len(tree)))
            eager.keep(path)
            graphed.keep(path)
    assert graphed.runner.replays == 4  # the prompt and the trees
    for a, b in pairs:
        if mode == "fixed":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_bucket_that_does_not_fit_in_memory_leaves_the_larger_sizes_eager(capsys):
    class Tight(StandInGraph):
        def capture(self, fn):
            if fn.__defaults__[0].rows >= 16:
                raise torch.OutOfMemoryError("stand-in: out of memory")
            return super().capture(fn)

    model = model32()
    fwd = GPUForward(model, device="cpu", mode="fixed", max_len=64, slots=2, graphs=True, make_graph=Tight)
    assert sorted(fwd.runner.graphs) == [1, 2, 4, 8] and fwd.runner.failed == 16
    assert "graphs<=8" in fwd.backend and "16 rows" in capsys.readouterr().err
    ref = GPUForward(model, device="cpu", mode="fixed", max_len=64, slots=2)
    for f in (fwd, ref):
        f.reset()
    assert torch.equal(fwd(list(range(2, 22))), ref(list(range(2, 22))))  # 20 rows: eager, same logits


def test_graph_runner_stages_padding_rows_that_see_only_themselves():
    seen = {}

    def step(static):
        seen["static"] = static
        return (static.ids.clone(),)

    runner = GraphRunner(step, StandInGraph, torch.device("cpu"), buckets=(4,))
    allowed = torch.ones(4, 4, dtype=torch.bool).tril_()
    runner.capture_all(lambda s: s.fill(0, 0, [0] * 4, torch.arange(4), allowed, torch.zeros(4, 4, dtype=torch.long)))
    tree = ancestor_mask([-1, 0])
    out = runner.run(4, 100, 7, [11, 12], torch.tensor([0, 1]), tree, ancestor_table(tree, torch.tensor([0, 1])))
    s = seen["static"]
    assert out[0].tolist() == [11, 12, 0, 0] and s.meta.tolist() == [100, 7] and s.depths.tolist() == [0, 1, 0, 0]
    assert s.allowed.tolist() == [[True, False, False, False], [True, True, False, False],
                                  [False, False, True, False], [False, False, False, True]]
    assert s.anc[:, 0].tolist() == [0, 0, 2, 3] and s.anc[1, :2].tolist() == [0, 1]


# ---- lossless through the exact mode -----------------------------------------------------------------------------
_FORWARDS: dict = {}


def exact_forward(seed: int):
    """A fixed-mode forward (PyTorch's row loop) with stand-in graphs, per tiny model."""
    if seed not in _FORWARDS:
        _FORWARDS[seed] = GPUForward(model32(seed), device="cpu", mode="fixed", max_len=384, slots=4, graphs=True,
                                     make_graph=StandInGraph, use_triton=False)
    return _FORWARDS[seed]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 40), cfg=configs, seed=st.integers(0, 1))
def test_every_method_equals_ar_through_the_exact_mode(prompt, max_new, cfg, seed):
    fwd = exact_forward(seed)
    model = model32(seed)
    ref, _ = Decoder(model, None, "ar", cfg, forward=fwd, cost=FLAT).generate_ids(prompt, DecodeConfig(
        max_new_tokens=max_new))
    for method in ("goose", "goose-paper", "pld", "tr"):
        dec = Decoder(model, None, method_for(method, model, FLAT), cfg, forward=fwd, cost=FLAT)
        out, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=max_new))
        assert out == ref, f"{method} diverged from ar through {fwd.backend}"


def test_goose_measures_the_forwards_own_cost_curve():
    """Without a given curve, `goose` measures this forward's (engine/measure.py) and decodes losslessly."""
    fwd = GPUForward(model32(), device="cpu", mode="fixed", max_len=1024, slots=6, graphs=True,
                     make_graph=StandInGraph, use_triton=False)
    model = model32()
    prompt = [5, 6, 7, 8, 9, 10] * 4
    ref, _ = Decoder(model, None, "ar", forward=fwd).generate_ids(prompt, DecodeConfig(max_new_tokens=24))
    dec = Decoder(model, None, "goose", forward=fwd)
    assert dec.method.cost is not None and dec.method.cost.max_size >= 64
    out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=24))
    assert out == ref and dec.arith == "gpu-fixed-fp32"


# ---- the Triton kernels under the interpreter --------------------------------------------------------------------
@pytest.fixture
def interpreted():
    """The device the Triton kernels run on here: the GPU, else the CPU under the interpreter (set above)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    why = fixed_kernels.triton_reason(device)
    if why is not None:
        pytest.skip(why)
    return device


def _row_count_independent(kern, device, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 48, generator=gen).to(device, dtype)
    w = torch.randn(80, 48, generator=gen).to(device, dtype)
    b = torch.randn(80, generator=gen).to(device, dtype)
    full = kern.linear(x, w, b)
    for lo, hi in ((0, 1), (36, 37), (5, 21), (16, 32), (3, 37)):
        assert torch.equal(kern.linear(x[lo:hi], w, b), full[lo:hi]), (lo, hi)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T + b.float()), rtol=2e-2, atol=2e-2)
    g = torch.randn(48, generator=gen).to(device, dtype)
    r = kern.rms_norm(x, g, 1e-5)
    assert torch.equal(kern.rms_norm(x[7:9], g, 1e-5), r[7:9])
    gu = torch.randn(37, 64, generator=gen).to(device, dtype)
    assert torch.equal(kern.silu_mul(gu[30:]), kern.silu_mul(gu)[30:])
    # attention: a tree row equals the same token decoded as a plain step over its path
    K, H, D = 2, 4, 16
    kf, vf = (torch.randn(100, K, D, generator=gen).to(device, dtype) for _ in range(2))
    q = torch.randn(5, H, D, generator=gen).to(device, dtype)
    parents = [-1, 0, 1, 0, 3]
    allowed, depths = ancestor_mask(parents), tree_depths(parents)
    anc = ancestor_table(allowed, depths)
    at = lambda t: t.to(device)  # noqa: E731
    o = kern.attention(q, kf, vf, at(torch.tensor([10, 20])), at(depths), at(anc), 0.25)
    idx = list(range(10, 30)) + [30, 33, 34]  # row 4: the prefix, then rows 0, 3, 4
    kf2, vf2 = kf.clone(), vf.clone()
    kf2[50:73], vf2[50:73] = kf[idx], vf[idx]
    one = kern.attention(q[4:5], kf2, vf2, at(torch.tensor([50, 22])), at(torch.tensor([0])),
                         at(torch.zeros(1, 1, dtype=torch.long)), 0.25)
    assert torch.equal(one[0], o[4])
    ref = torch.softmax(q[4].float().view(K, 2, D) @ kf[idx].float().transpose(0, 1).transpose(1, 2) * 0.25, -1)
    ref = (ref @ vf[idx].float().transpose(0, 1)).reshape(H, D)
    torch.testing.assert_close(o[4].float(), ref, rtol=2e-2, atol=2e-2)


def test_torch_fixed_kernels_are_row_count_independent():
    _row_count_independent(fixed_kernels.TorchFixed(), torch.device("cpu"), torch.float32)


def test_triton_kernels_are_row_count_independent(interpreted):
    _row_count_independent(fixed_kernels.TritonFixed(), interpreted, torch.float32)


def test_goose_equals_ar_on_the_triton_kernels(interpreted):
    model = model32()
    fwd = GPUForward(model, device=interpreted, mode="fixed", fixed_dtype="fp32", max_len=256, slots=3,
                     use_triton=True, graphs=False)
    assert fwd.backend.endswith("fixed-fp32-triton")
    prompt = [5, 6, 7, 8, 9, 10] * 3
    ref, _ = Decoder(model, None, "ar", forward=fwd, cost=FLAT).generate_ids(prompt, DecodeConfig(max_new_tokens=10))
    out, stats = Decoder(model, None, "goose", forward=fwd, cost=FLAT).generate_ids(prompt, DecodeConfig(
        max_new_tokens=10))
    assert out == ref and stats.forward_calls < 10


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from goose.backends import fixed_kernels as fk
k = fk._kernels()
lin = dict(M="i32", N="i32", K="i32", sxm="i32", swn="i32", sym="i32", HAS_BIAS="constexpr", IEEE="constexpr",
           DOT="constexpr", BM="constexpr", BN="constexpr", BK="constexpr")
att = dict(meta="*i64", depth="*i64", anc="*i64", scale="fp32", G="i32", D="i32", sqb="i32", sqh="i32", skr="i32",
           skh="i32", sob="i32", soh="i32", sab="i32", BT="constexpr", BD="constexpr")
for dt in ("bf16", "fp32"):
    p = "*" + dt
    jobs = [(k.linear, dict(x=p, w=p, b=p, y=p, **lin), dict(HAS_BIAS=True, IEEE=dt == "fp32", DOT=dot, BM=16, BN=64,
                                                            BK=64)) for dot in (True, False)]
    jobs += [(k.rms, dict(x=p, w=p, y=p, N="i32", eps="fp32", sx="i32", sy="i32", BLOCK="constexpr"), dict(BLOCK=1024)),
             (k.silu_mul, dict(gu=p, y=p, inter="i32", sg="i32", sy="i32", BLOCK="constexpr"), dict(BLOCK=1024)),
             (k.attention, dict(q=p, kf=p, vf=p, o=p, **att), dict(BT=64, BD=64))]
    for fn, sig, const in jobs:
        triton.compile(ASTSource(fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


@has_triton
def test_triton_kernels_compile_for_hopper():
    """Without a GPU: Triton compiles every fixed-mode kernel for sm_90 (the H200), so the GPU check does not meet a
    compile error first (a fresh process: the interpreter is off there)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH")]
                                        if p)
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    if "ImportError" in proc.stderr or "cannot import name" in proc.stderr:
        pytest.skip(f"this Triton's compiler API differs: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-2000:]


# ---- bad input ---------------------------------------------------------------------------------------------------
def test_bad_input_gets_one_clear_error():
    model = model32()
    if not torch.cuda.is_available():
        with pytest.raises(GooseError, match="no CUDA device"):
            GPUForward(model, device="cuda")
    with pytest.raises(GooseError, match="unknown mode"):
        GPUForward(model, device="cpu", mode="fp8")
    with pytest.raises(GooseError, match="dtype"):
        GPUForward(model, device="cpu", mode="fixed", fixed_dtype="fp16")
    with pytest.raises(GooseError, match="fixed_dtype"):
        GPUForward(model, device="cpu", mode="bf16", fixed_dtype="bf16")
    with pytest.raises(GooseError, match="kernels"):
        GPUForward(model, device="cpu", mode="fp32", kernels=fixed_kernels.TorchFixed())
    with pytest.raises(GooseError, match="unknown device"):
        GPUForward(model, device="warp-drive")
    with pytest.raises(GooseError, match="graphs"):
        GPUForward(model, device="cpu", graphs=True)
    if fixed_kernels.triton is None:
        with pytest.raises(GooseError, match="Triton"):
            GPUForward(model, device="cpu", mode="fixed", use_triton=True)
    fwd = GPUForward(model, device="cpu", mode="fixed", max_len=32, slots=2)
    other = GPUForward(model, device="cpu", max_len=32, slots=2)
    with pytest.raises(GooseError, match="caches it made"):
        fwd.run([Segment(other.new_cache(), [3])])
    fwd.reset()
    with pytest.raises(GooseError, match="no tokens"):
        fwd([])
    with pytest.raises(GooseError, match="token ids"):
        fwd([3, TINY_VOCAB])
    with pytest.raises(GooseError, match="ancestor mask"):
        fwd([3, 4], torch.tensor([0, 0]), torch.ones(2, 2, dtype=torch.bool))


def test_unsupported_architectures_are_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(GooseError, match="does not support this model.*gpt2"):
        GPUForward(gpt2, device="cpu")


# ---- on a GPU (benchmarks/gpu_check.py runs these) ---------------------------------------------------------------
@cuda
@has_triton
@pytest.mark.parametrize("dot", [None, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_triton_kernels_are_row_count_independent(dtype, dot):
    _row_count_independent(fixed_kernels.TritonFixed(dot=dot), torch.device("cuda"), dtype)


@cuda
@pytest.mark.parametrize("mode", ["bf16", "fp32", "fixed"])
def test_cuda_graphs_capture_every_bucket_and_decode_like_ar(mode):
    model = make_tiny_llama(dtype=torch.float32, seed=4)
    fwd = GPUForward(model, device="cuda", mode=mode, max_len=512, slots=4)
    assert fwd.runner is not None and sorted(fwd.runner.graphs) == list(BUCKETS)
    prompt = [5, 6, 7, 8, 9, 10] * 5
    ref, _ = Decoder(model, None, "ar", forward=fwd, cost=FLAT).generate_ids(prompt, DecodeConfig(max_new_tokens=40))
    hf = HFForward(model, kernel=False)
    hf.reset()
    with torch.inference_mode():
        want = hf(prompt)[-1].argmax().item()
    assert ref[0] == want or mode == "bf16"
    out, _ = Decoder(model, None, "goose", forward=fwd, cost=FLAT).generate_ids(prompt, DecodeConfig(
        max_new_tokens=40))
    if mode == "fixed":
        assert out == ref


@cuda
def test_cuda_graph_replay_equals_eager_in_the_exact_mode():
    model = make_tiny_llama(dtype=torch.float32, seed=5)
    graphed = GPUForward(model, device="cuda", mode="fixed", max_len=256, slots=2)
    eager = GPUForward(model, device="cuda", mode="fixed", max_len=256, slots=2, graphs=False)
    rng = random.Random(1)
    for f in (graphed, eager):
        f.reset()
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(30)]
    assert torch.equal(graphed(prompt), eager(prompt))
    for _ in range(4):
        tree = random_tree(rng, rng.randrange(1, 100))
        assert torch.equal(graphed(*tree_args(tree)), eager(*tree_args(tree)))
        path = tree.path_to(rng.randrange(len(tree)))
        graphed.keep(path)
        eager.keep(path)
    assert graphed.runner.replays == 4



def test_a_cuda_models_default_forward_is_one_gpu_forward_per_model():
    """`default_forward` on a CUDA model goes through `_gpu_forward` (exercised here on the CPU, where
    GPUForward runs in fp32): one forward per model, rebuilt when the weights change; int8 refused; an
    architecture GPUForward does not run gets Hugging Face's forward."""
    from goose.engine import requests

    model = make_tiny_llama(torch.float32, seed=4)
    fwd = requests._gpu_forward(model, "exact")
    assert isinstance(fwd, GPUForward) and requests._gpu_forward(model, "exact") is fwd
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert fwd.stale() and requests._gpu_forward(model, "exact") is not fwd
    with pytest.raises(GooseError, match="CPU arithmetic"):
        requests._gpu_forward(model, "int8")
    model.config.model_type = "gemma3"
    try:
        assert isinstance(requests._gpu_forward(model, "exact"), HFForward)
    finally:
        model.config.model_type = "llama"


def test_a_fused_heads_taps_run_eagerly_and_are_the_normalized_streams():
    from goose.protocols import tap_norm

    model = model32()
    fwd = GPUForward(model, device="cpu", max_len=64, slots=2)
    ids = [4, 5, 6, 7]
    seg = Segment(fwd.cache, ids, features=(0,))
    fwd.cache.reset()
    fwd.run([seg])
    with torch.inference_mode():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    h = model.config.hidden_size
    assert seg.hidden.shape == (4, 2 * h)
    torch.testing.assert_close(seg.hidden[:, :h], tap_norm(states[1][0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(GooseError, match="feature taps"):
        fwd.run([Segment(fwd.new_cache(), ids, features=(9,))])
    # with graphs captured, a tapped call runs eagerly (the graphs return the final state only), the same rows
    fwd = GPUForward(model, device="cpu", mode="fixed", max_len=160, slots=3, graphs=True, make_graph=StandInGraph)
    plain, tapped = Segment(fwd.new_cache(), ids, features=True), Segment(fwd.new_cache(), ids, features=(0,))
    plain.cache.reset()
    tapped.cache.reset()
    a, b = fwd.run([plain])[0], fwd.run([tapped])[0]
    assert fwd.runner.replays == 1  # the plain call's bucket only
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(tapped.hidden[:, h:], plain.hidden)
