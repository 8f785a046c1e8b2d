"""LeanForward equals HFForward, a plain forward over each node's path, and greedy `model.generate`.

All on tiny random models built from configs (no download): float64 for exactness, float32 for the
oneDNN-prepacked path.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import hf_greedy
from goose.backends import cpukernel
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward, _mkldnn_available, supports
from goose.backends.tree_tensors import parent_tensors
from goose.config import DecodeConfig
from goose.decoding import Decoder
from goose.errors import GooseError

VOCAB = 128
EOS = 2


def _finish(model, dtype, scale: float):
    model = model.to(dtype).eval()
    with torch.no_grad():  # larger weights than the init default: peaked logits, repetitive greedy text
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(scale)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)  # HF initializes biases to zero: make them matter
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = 0
    return model


def tiny_llama(dtype=torch.float64, seed=0, layers=3, scale=6.0, heads=4, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), max_position_embeddings=1024,
                      eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
                      attn_implementation="sdpa", **extra)
    return _finish(LlamaForCausalLM(cfg), dtype, scale)


def tiny_qwen2(dtype=torch.float64, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    return _finish(Qwen2ForCausalLM(cfg), dtype, 6.0)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls gain nothing from threads, and OpenMP spin-waits are ruinous when the 2 cores are
    shared with other processes (a 2-thread run was ~80x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama64():
    return tiny_llama(torch.float64)


@pytest.fixture(scope="module")
def llama32():
    return tiny_llama(torch.float32)


# ---- helpers --------------------------------------------------------------------------------------------
def random_tree(rng: random.Random, n: int) -> list[int]:
    """Parent indices in topological order (node 0 = root, parent -1)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def tree_tensors(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return parent_tensors(parents)


def root_path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def call_script(seed: int, steps: int = 12, prompt_len: int = 40):
    """A random sequence of calls: ("run", tokens) / ("tree", tokens, parents, keep_path)."""
    rng = random.Random(seed)
    script = [("run", [rng.randrange(VOCAB) for _ in range(prompt_len)], None, None)]
    for _ in range(steps):
        n = rng.choice([1, 1, 2, 3, 5, 8, 13])
        tokens = [rng.randrange(VOCAB) for _ in range(n)]
        if rng.random() < 0.3:  # causal run (chain): keep a prefix of it
            script.append(("run", tokens, None, list(range(rng.randint(1, n)))))
        else:  # tree: keep the root path of a random node, maybe truncated
            parents = random_tree(rng, n)
            path = root_path(parents, rng.randrange(n))
            script.append(("tree", tokens, parents, path[: rng.randint(1, len(path))]))
    return script


def play(fwd, script) -> list[torch.Tensor]:
    """Run the script through a forward; returns the logits of every call."""
    fwd.reset()
    outs = []
    with torch.inference_mode():
        for kind, tokens, parents, keep in script:
            if kind == "run":
                outs.append(fwd(tokens).clone())
            else:
                allowed, depths = tree_tensors(parents)
                outs.append(fwd(tokens, depths, allowed).clone())
            if keep is not None:
                fwd.keep(keep)
    return outs


def assert_same(outs_a, outs_b, atol):
    for i, (a, b) in enumerate(zip(outs_a, outs_b)):
        assert a.shape == b.shape, i
        err = (a - b).abs().max().item()
        assert err <= atol, f"call {i}: max |diff| {err:.3g} > {atol}"


# ---- (1) same logits as HFForward over call sequences with keep() -----------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_hf_forward_float64(llama64, seed):
    script = call_script(seed)
    assert_same(play(LeanForward(llama64), script), play(HFForward(llama64), script), atol=1e-9)


def test_matches_hf_forward_float32(llama32):
    script = call_script(7)
    lean = LeanForward(llama32)
    assert lean.prepacked == (_mkldnn_available() and cpukernel.kernel() is None)
    assert_same(play(lean, script), play(HFForward(llama32), script), atol=2e-4)


def test_cache_grows_and_length_tracks(llama64):
    """Past the initial capacity (512) the cache doubles and keeps its contents."""
    rng = random.Random(3)
    script = [("run", [rng.randrange(VOCAB) for _ in range(300)], None, None),
              ("run", [rng.randrange(VOCAB) for _ in range(250)], None, None)]
    parents = random_tree(rng, 9)
    script.append(("tree", [rng.randrange(VOCAB) for _ in range(9)], parents, root_path(parents, 8)))
    script.append(("run", [rng.randrange(VOCAB)], None, [0]))
    lean, hf = LeanForward(llama64), HFForward(llama64)
    assert_same(play(lean, script), play(hf, script), atol=1e-9)
    assert lean.length == hf.length == 550 + len(root_path(parents, 8)) + 1


def test_keep_identity_path_is_truncation(llama64):
    lean = LeanForward(llama64)
    lean.reset()
    lean(list(range(10)))
    before = lean.cache.kv[:, :, :, :10].clone()
    lean(list(range(20, 25)))
    lean.keep([0, 1, 2])
    assert lean.length == 13
    assert torch.equal(lean.cache.kv[:, :, :, :10], before)


# ---- (2) every tree node equals a plain forward over its root path ---------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_nodes_equal_plain_forward(llama64, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(17)]
    n = 12
    parents = random_tree(rng, n)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    allowed, depths = tree_tensors(parents)
    lean = LeanForward(llama64)
    lean.reset()
    with torch.inference_mode():
        lean(prefix)
        logits = lean(tokens, depths, allowed)  # [n, vocab]
        for i in range(n):
            seq = prefix + [tokens[j] for j in root_path(parents, i)]
            ref = llama64(torch.tensor([seq])).logits[0, -1]
            assert (logits[i] - ref).abs().max().item() <= 1e-9, i


@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(2, 20), prefix_len=st.integers(1, 30))
def test_tree_node_logits_are_the_plain_steps_bits_float32(llama32, seed, n, prefix_len):
    """On goose's float32 kernels a tree node's logits are bit-identical to `ar`'s one-token steps along its
    path (not just close): accepting the path can never change a token, however near a tie."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    parents = random_tree(rng, n)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    allowed, depths = tree_tensors(parents)
    lean = LeanForward(llama32)
    with torch.inference_mode():
        lean.reset()
        lean(prefix)
        tree = lean(tokens, depths, allowed)
        for i in range(n):
            lean.reset()
            lean(prefix)
            for j in root_path(parents, i):  # one token per call, as ar decodes
                last = lean([tokens[j]])[-1]
            assert torch.equal(tree[i], last), (i, root_path(parents, i))


def play_segments(fwd, seed: int, steps: int = 6) -> list[torch.Tensor]:
    """Random multi-sequence forwards (`LeanForward.run`): 1-4 sequences per call, each a causal run or a tree on
    its own cache, a random path kept after each call; returns every call's logits."""
    from goose.protocols import Segment

    rng = random.Random(seed)
    caches = [fwd.new_cache() for _ in range(4)]
    outs = []
    with torch.inference_mode():
        fwd.run([Segment(c, [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]) for c in caches])
        for _ in range(steps):
            segs, keeps = [], []
            for c in rng.sample(caches, rng.randint(1, 4)):
                n = rng.choice([1, 1, 2, 3, 5, 9])
                tokens = [rng.randrange(VOCAB) for _ in range(n)]
                if rng.random() < 0.4:
                    segs.append(Segment(c, tokens))
                    keeps.append(list(range(rng.randint(1, n))))
                else:
                    parents = random_tree(rng, n)
                    allowed, depths = tree_tensors(parents)
                    segs.append(Segment(c, tokens, depths, allowed))
                    keeps.append(root_path(parents, rng.randrange(n)))
            outs.extend(t.clone() for t in fwd.run(segs))
            for seg, keep in zip(segs, keeps):
                seg.cache.keep(keep)
    return outs


@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
@pytest.mark.parametrize("bias", [False, True])
def test_layer_plan_is_bit_identical_to_per_layer_calls(bias):
    """All decoder layers in one kernel call (`CpuKernels.layer_plan`) give the bits of calling each layer's
    projections and attention from Python, for single and multi-sequence forwards, chains and trees."""
    extra = {"attention_bias": True, "mlp_bias": True} if bias else {}
    model = tiny_llama(torch.float32, seed=3, scale=1.0, **extra)
    planned, stepped = LeanForward(model), LeanForward(model)
    assert planned.plan is not None
    stepped.plan = None
    for seed in range(3):
        for a, b in zip(play_segments(planned, seed), play_segments(stepped, seed), strict=True):
            assert torch.equal(a, b)
    script = call_script(7, steps=8, prompt_len=25)
    for a, b in zip(play(planned, script), play(stepped, script), strict=True):
        assert torch.equal(a, b)


@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
def test_layer_plan_refuses_mismatched_input(llama32):
    fwd = LeanForward(llama32)
    steps = [fwd.attn_kernel.attention_step(fwd.n_heads, torch.zeros(2, fwd.head_dim), torch.zeros(2, fwd.head_dim),
                                             _cache(fwd), 0, None, fwd.scale)]
    batch = fwd.attn_kernel.attention_batch(steps)
    with pytest.raises(ValueError, match="x must be"):
        fwd.plan(torch.zeros(2, 3), batch)
    with pytest.raises(ValueError, match="x must be"):
        fwd.plan(torch.zeros(2, 64, dtype=torch.float64), batch)
    with pytest.raises(ValueError, match="attention batch"):
        fwd.plan(torch.zeros(3, 64), batch)  # 3 rows, the batch has 2
    first = fwd.layers[0]
    with pytest.raises(ValueError, match="chain"):
        fwd.attn_kernel.layer_plan([(first.ln1, first.eps1, first.ln2, first.eps2,
                                     first.qkv.op(), first.o.op(), first.down.op(), first.gate_up.op())])


@pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
def test_head_layer_is_bit_identical_to_its_projection_and_a_layer_plan(llama32):
    """A draft head's step in one call (`CpuKernels.head_layer`) gives the bits of its input projection followed
    by the one-layer plan over an attention step, on a cache prefix, a causal block and a tree block."""
    from goose.backends.packed import PanelWeight

    fwd = LeanForward(llama32)
    ck, L = fwd.attn_kernel, fwd.layers[0]
    entry = (L.ln1.contiguous(), L.eps1, L.ln2.contiguous(), L.eps2, *[x.op() for x in (L.qkv, L.o, L.gate_up, L.down)])
    hid, kh, d = entry[4].k, fwd.n_kv, fwd.head_dim
    g = torch.Generator().manual_seed(0)
    fcw = PanelWeight.pack(ck, torch.randn(hid, 2 * hid, generator=g) * 0.05)
    step = ck.head_layer(ck.op(fcw.data, hid, None), entry, fwd.n_heads)
    plan = ck.layer_plan([entry])
    mine, ref = torch.zeros(1, 2, kh, 32, d), torch.zeros(1, 2, kh, 32, d)
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    for p, m, allowed in ((0, 5, None), (5, 3, None), (8, 3, tree)):
        inp, cos, sin = torch.randn(m, 2 * hid, generator=g), torch.randn(m, d, generator=g), torch.randn(m, d,
                                                                                                           generator=g)
        got = step(inp, cos, sin, mine[0, 0], mine[0, 1], p, allowed)
        x = fcw.linear(inp)
        plan(x, ck.attention_batch([ck.attention_step(fwd.n_heads, cos, sin, ref, p, allowed, d ** -0.5)]))
        assert torch.equal(got, x) and torch.equal(mine, ref)
    with pytest.raises(ValueError, match="allowed"):
        step(inp, cos, sin, mine[0, 0], mine[0, 1], 11, tree, back=1)  # allowed is [3, 3], back 1 needs [3, 4]
    with pytest.raises(ValueError, match="shapes"):
        step(inp, cos, sin, mine[0, 0], mine[0, 1], 30)  # rows 30..32 past the cache's 32


def _cache(fwd) -> torch.Tensor:
    cache = fwd.new_cache()
    cache.reset()
    return cache.kv


# ---- (3) lossless: every method equals greedy generate ------------------------------------------------------
prompts = st.one_of(
    st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=40),  # random
    st.tuples(st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=6), st.integers(2, 8))
    .map(lambda t: (t[0] * t[1])[:48]),  # repetitive: a short pattern repeated
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(prompt=prompts, n_new=st.integers(1, 40))
def test_decoder_with_lean_equals_generate(llama64, prompt, n_new):
    ref = hf_greedy(llama64, prompt, n_new, EOS)
    lean = LeanForward(llama64)  # one forward shared by all methods (reset per request)
    for method in ("ar", "pld", "tr", "goose-paper"):
        out, _ = Decoder(llama64, None, method, forward=lean).generate_ids(prompt, DecodeConfig(n_new))
        assert out == ref, method


# ---- (4) oneDNN prepacked weights and the F.linear fallback agree ----------------------------------------
@pytest.mark.skipif(not _mkldnn_available(), reason="torch built without mkldnn ops")
def test_prepacked_equals_fallback(llama32):
    script = call_script(11)
    packed, plain = LeanForward(llama32, kernel=False), LeanForward(llama32, kernel=False, prepack=False)
    packed_only = LeanForward(llama32, kernel=False, gemv=False)  # oneDNN for single rows too
    assert packed.prepacked and packed.gemv and not plain.prepacked and not packed_only.gemv
    ref = play(plain, script)
    assert_same(play(packed, script), ref, atol=1e-4)
    assert_same(play(packed_only, script), ref, atol=1e-4)


def test_prepack_refused_for_float64(llama64):
    with pytest.raises(GooseError):
        LeanForward(llama64, prepack=True)


# ---- (5) unsupported models are refused clearly ------------------------------------------------------------
def test_unsupported_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert not supports(model)
    with pytest.raises(GooseError, match="gpt2"):
        LeanForward(model)


def test_unsupported_sliding_window_and_activation():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    assert not supports(MistralForCausalLM(MistralConfig(sliding_window=256, **cfg)))
    assert supports(MistralForCausalLM(MistralConfig(sliding_window=None, **cfg)))
    assert not supports(tiny_llama(layers=1, hidden_act="gelu"))


# ---- other supported structures ----------------------------------------------------------------------------
def test_llama_with_biases_matches_hf():
    model = tiny_llama(layers=2, attention_bias=True, mlp_bias=True)
    script = call_script(5, steps=8)
    assert_same(play(LeanForward(model), script), play(HFForward(model), script), atol=1e-9)


def test_qwen2_matches_hf_and_generate():
    model = tiny_qwen2()
    assert supports(model)
    script = call_script(4, steps=8)
    assert_same(play(LeanForward(model), script), play(HFForward(model), script), atol=1e-9)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    out, _ = Decoder(model, None, "goose-paper", forward=LeanForward(model)).generate_ids(prompt, DecodeConfig(30))
    ref = hf_greedy(model, prompt, 30, EOS)
    assert out == ref


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-9), (torch.float32, 2e-4)])  # fp32: goose's kernels
def test_qwen3_q_k_norms_match_hf_and_generate(dtype, atol):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    model = _finish(Qwen3ForCausalLM(cfg), dtype, 6.0)
    with torch.no_grad():  # HF initializes the q/k norm weights to one: make them matter
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    assert supports(model)
    lean = LeanForward(model)
    assert (lean.attn_kernel is not None) == (dtype == torch.float32 and cpukernel.kernel() is not None)
    script = call_script(4, steps=8)
    assert_same(play(lean, script), play(HFForward(model, kernel=False), script), atol=atol)
    prompt = [5, 9, 14, 5, 9, 14, 5, 9]
    out, _ = Decoder(model, None, "goose-paper", forward=LeanForward(model)).generate_ids(prompt, DecodeConfig(30))
    assert out == hf_greedy(model, prompt, 30, EOS)


def test_rope_scaling_variant_matches_hf():
    """RoPE comes from the model's own rotary module, so scaled variants are exact too."""
    model = tiny_llama(layers=2, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    script = call_script(6, steps=6)
    assert_same(play(LeanForward(model), script), play(HFForward(model), script), atol=1e-9)


@pytest.mark.parametrize("heads, dtype", [(2, torch.float64), (1, torch.float32), (2, torch.float32)])
def test_rope_table_holds_the_rotary_modules_bits(heads, dtype):
    """Head sizes of 32 and 64 read cos/sin from a table filled by the model's own rotary module: every
    position's row equals a call of the module on that position alone or among others, the table grows in
    whole blocks on demand, and the forward still matches Hugging Face's (the float32 one: the same tokens)."""
    from goose.backends.lean import ROPE_BLOCK

    model = tiny_llama(dtype, heads=heads, layers=2)
    lean = LeanForward(model)
    assert lean.rope is not None and lean.rope.cos.shape[0] % ROPE_BLOCK == 0
    rng = random.Random(heads)
    lean.rope.grow(3 * ROPE_BLOCK + 1)
    assert lean.rope.cos.shape[0] >= 4 * ROPE_BLOCK
    for _ in range(5):
        pos = [rng.randrange(4 * ROPE_BLOCK) for _ in range(rng.randint(1, 9))]
        cos, sin = lean.rope.module(torch.tensor(pos))
        assert torch.equal(cos, lean.rope.cos[pos]) and torch.equal(sin, lean.rope.sin[pos])
    script = call_script(9, steps=6)
    assert_same(play(lean, script), play(HFForward(model), script), atol=1e-9 if dtype == torch.float64 else 2e-4)
    if dtype == torch.float32:
        prompt = [rng.randrange(2, VOCAB) for _ in range(12)]
        out = Decoder(model, None, "goose", forward=LeanForward(model)).generate(prompt, 24).token_ids
        assert out == hf_greedy(model, prompt, 24, EOS)


def test_rope_table_is_not_used_where_a_position_alone_does_not_fix_its_values():
    """A head size whose rows could fall in PyTorch's scalar loop tails (16 here), and rope types that
    rescale with the sequence (dynamic), call the rotary module every forward, and still match HF."""
    assert LeanForward(tiny_llama(layers=1)).rope is None
    dyn = tiny_llama(layers=2, heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert LeanForward(dyn).rope is None
    script = call_script(5, steps=6)
    assert_same(play(LeanForward(dyn), script), play(HFForward(dyn), script), atol=1e-9)


def test_cache_sized_once_for_the_expected_length():
    """`expect` sizes the first allocation (the power of two doubling would reach) so a long prompt is not
    copied on the way up; short ones keep the initial size; past it the cache still grows, keeping what it
    holds."""
    from goose.backends.lean import INITIAL_CAPACITY, LeanCache

    plain = LeanCache(2, 1, 8, torch.float32, torch.device("cpu"))
    plain.reset()
    assert plain.kv.shape[3] == INITIAL_CAPACITY
    short = LeanCache(2, 1, 8, torch.float32, torch.device("cpu"))
    short.expect(100)
    short.reset()
    assert short.kv.shape[3] == INITIAL_CAPACITY
    c = LeanCache(2, 1, 8, torch.float32, torch.device("cpu"))
    c.expect(1000)
    c.reset()
    assert c.kv.shape[3] == 1024
    c.reserve(900)
    assert c.kv.shape[3] == 1024
    with torch.inference_mode():
        c.kv[:, :, :, :900] = 1.0
        c.appended(0, 900)
        c.reserve(1100)  # beyond the expectation: doubles, keeping the entries
    assert c.kv.shape[3] == 2048 and bool((c.kv[:, :, :, :900] == 1.0).all())


def test_decoder_sizes_each_request_cache_for_prompt_and_max_new_tokens(monkeypatch):
    from goose.backends.lean import LeanCache
    from goose.engine import step as step_mod

    seen = []
    orig = LeanCache.expect
    monkeypatch.setattr(LeanCache, "expect", lambda self, total: (seen.append(total), orig(self, total))[1])
    model = tiny_llama(torch.float32, seed=3)
    prompt = [5, 6, 7, 8, 9]
    out = Decoder(model, method="ar", forward=LeanForward(model)).generate(prompt, max_new_tokens=7).token_ids
    assert seen == [len(prompt) + 7 + step_mod.DEFAULTS.tree_room]
    assert out == hf_greedy(model, prompt, 7)
