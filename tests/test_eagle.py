"""`eagle2` and draft heads: lossless whatever the head says (random heads, random prompts, both forwards, the
Engine), head files checked against the target, and the trainer (a tiny head on a tiny model)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CPU_CURVE, TINY_VOCAB, hf_greedy, make_tiny_llama, prompts, random_head
from goose.backends.forward import HFForward
from goose.backends.head import load_head, save_head
from goose.backends.lean import LeanForward
from goose.config import DecodeConfig, EagleConfig, GooseConfig
from goose.decoding import Decoder
from goose.engine.methods import Eagle2
from goose.errors import GooseError
from goose.selection.costmodel import CostCurve

FLAT = CostCurve((1, 128), (10, 10.5))  # rows nearly free: the selector verifies every candidate
CURVES = {"flat": FLAT, "cpu": CPU_CURVE}

_MODELS: dict = {}


def _model(seed):
    if seed not in _MODELS:
        _MODELS[seed] = make_tiny_llama(seed=seed)
    return _MODELS[seed]


def eagle(model, folder, depth=5, top_k=4, cost=FLAT, catch_up=64) -> Eagle2:
    return Eagle2(EagleConfig(head=str(folder), depth=depth, top_k=top_k, catch_up=catch_up), cost)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 40), seed=st.integers(0, 2), head_seed=st.integers(0, 1000),
       draft_vocab=st.integers(1, TINY_VOCAB), top_k=st.integers(1, 6), depth=st.integers(1, 6),
       eagle1=st.booleans(), curve=st.sampled_from(sorted(CURVES)), backend=st.sampled_from(["hf", "lean"]),
       catch_up=st.integers(1, 300), fused=st.booleans())
def test_eagle2_equals_greedy_whatever_the_head(tmp_path_factory, prompt, max_new, seed, head_seed, draft_vocab,
                                                top_k, depth, eagle1, curve, backend, catch_up, fused):
    model = _model(seed)
    folder = random_head(model, tmp_path_factory.mktemp("head"), head_seed, draft_vocab, eagle1, fused)
    fwd = HFForward(model) if backend == "hf" else LeanForward(model)
    dec = Decoder(model, None, eagle(model, folder, depth, top_k, CURVES[curve], catch_up), forward=fwd)
    out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=max_new))
    assert out == hf_greedy(model, prompt, max_new)
    assert stats.drafted["spine"] == stats.drafted["branch"] == 0
    assert stats.accepted["head"] <= stats.drafted["head"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 40), seed=st.integers(0, 2), head_seed=st.integers(0, 1000),
       draft_vocab=st.integers(1, TINY_VOCAB), top_k=st.integers(1, 6), depth=st.integers(1, 6),
       curve=st.sampled_from(sorted(CURVES)), backend=st.sampled_from(["hf", "lean"]), fused=st.booleans())
def test_goose_with_a_head_equals_greedy_whatever_the_head(tmp_path_factory, prompt, max_new, seed, head_seed,
                                                           draft_vocab, top_k, depth, curve, backend, fused):
    model = _model(seed)
    folder = random_head(model, tmp_path_factory.mktemp("head"), head_seed, draft_vocab, fused=fused)
    cfg = GooseConfig(eagle=EagleConfig(head=str(folder), depth=depth, top_k=top_k))
    fwd = HFForward(model) if backend == "hf" else LeanForward(model)
    dec = Decoder(model, None, "goose", cfg, forward=fwd, cost=CURVES[curve])
    assert dec.method.drafter is not None
    out, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=max_new))
    assert out == hf_greedy(model, prompt, max_new)


def test_goose_nohead_and_head_none_stay_training_free(tiny_model, tmp_path):
    folder = random_head(tiny_model, tmp_path / "h", 0, 30)
    cfg = GooseConfig(eagle=EagleConfig(head=str(folder)))
    assert Decoder(tiny_model, None, "goose-nohead", cfg, cost=FLAT).method.drafter is None
    off = GooseConfig(eagle=EagleConfig(head="none"))
    assert Decoder(tiny_model, None, "goose", off, cost=FLAT).method.drafter is None
    assert not Decoder(tiny_model, None, "goose", cost=FLAT).method.features  # goose names no head by default
    packaged = GooseConfig(eagle=EagleConfig(head="packaged"))
    assert Decoder(tiny_model, None, "goose", packaged, cost=FLAT).method.drafter is None  # none packaged for it
    with pytest.raises(GooseError, match="needs a draft head"):
        Decoder(tiny_model, None, "eagle2", off, cost=FLAT)


def _oracle_head(model, folder):
    """A head whose draft vocabulary is the few tokens the model's greedy text uses: accepted often."""
    rng = random.Random(3)
    text = []
    for _ in range(6):
        p = [rng.randrange(2, TINY_VOCAB) for _ in range(5)]
        text += hf_greedy(model, p, 30)
    common = sorted({t for t in text})[:6]
    folder = random_head(model, folder, 5, len(common))
    cfg = json.loads((folder / "config.json").read_text())
    head = load_head(folder, model)
    head.d2t = torch.tensor(common)
    return save_head(head, folder, cfg["goose"], dtype=torch.float32)


def _accepted_head_tokens(model, dec, rng) -> int:
    """Head tokens `dec` accepted over 6 random prompts, each decoded token-identical to greedy."""
    accepted = 0
    for _ in range(6):
        prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 12))]
        out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=30))
        assert out == hf_greedy(model, prompt, 30)
        assert len(stats.depth_drafted["head"]) >= 1
        accepted += stats.accepted["head"]
    return accepted


def test_eagle2_and_goose_accept_head_drafts_and_stay_lossless(tiny_model, tmp_path):
    folder = _oracle_head(tiny_model, tmp_path / "h")
    rng = random.Random(0)
    dec = Decoder(tiny_model, None, eagle(tiny_model, folder, depth=4, top_k=6))
    assert _accepted_head_tokens(tiny_model, dec, rng) > 0  # the accepted-path bookkeeping (features back) ran
    cfg = GooseConfig(eagle=EagleConfig(head=str(folder), depth=4, top_k=6))
    dec = Decoder(tiny_model, None, "goose", cfg, cost=FLAT)
    assert _accepted_head_tokens(tiny_model, dec, rng) > 0  # goose verified and accepted head nodes


def test_a_head_does_not_run_in_steps_where_none_of_its_rows_can_pay(tiny_model, tmp_path, monkeypatch):
    from goose.engine.methods.eagle2 import HeadDrafter
    from goose.selection.acceptance import HEAD_GROUPS, AcceptanceModel, head_key

    acc = AcceptanceModel()
    assert acc.head_best() == max(acc.prob(head_key(r, 1)) for r in range(HEAD_GROUPS))
    before = acc.head_best()
    for _ in range(20):
        acc.count(head_key(0, 1), False)
    assert acc.head_best() < before  # learned: the bound follows the groups' rates
    layers = []
    real = HeadDrafter._layer
    monkeypatch.setattr(HeadDrafter, "_layer", lambda self, *a: layers.append(len(a[0])) or real(self, *a))
    folder = _oracle_head(tiny_model, tmp_path / "h")
    steep = CostCurve((1, 128), (10.0, 10.0 * 128 * 2))  # a row costs twice a step's tokens: no draft pays
    rng = random.Random(2)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(9)]
    for curve, runs in ((steep, False), (FLAT, True)):
        for dec in (Decoder(tiny_model, None, eagle(tiny_model, folder, cost=curve)),
                    Decoder(tiny_model, None, "goose", GooseConfig(eagle=EagleConfig(head=str(folder))), cost=curve)):
            layers.clear()
            out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=30))
            assert out == hf_greedy(tiny_model, prompt, 30)
            assert bool(layers) == runs and (stats.drafted["head"] > 0) == runs
    m = Decoder(tiny_model, None, "goose", GooseConfig(eagle=EagleConfig(head=str(folder))), cost=FLAT).method
    m._head_ms = 0.5  # ms of drafting a step
    assert m._head_may_pay(0.0, 0.0) and not m._head_may_pay(m.acc.head_best(), 0.0)
    assert m._head_may_pay(0.2, 1 / 6)  # one request: a chain may add ~3 tokens for 0.08 tokens' worth of time
    assert not m._head_may_pay(0.9, 8 / 15)  # eight: at most ~0.05 tokens for 0.27 tokens' worth


@pytest.mark.parametrize("fused", [False, True])
def test_engine_eagle2_concurrent_requests_equal_greedy(tiny_model, tmp_path, fused):
    from goose.engine.scheduler import Engine

    folder = random_head(tiny_model, tmp_path / "h", 1, 40, fused=fused)
    rng = random.Random(1)
    prompts_ = [[rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 15))] for _ in range(6)]
    eng = Engine(tiny_model, None, config=GooseConfig(eagle=EagleConfig(head=str(folder))), max_batch=4)
    try:
        reqs = [eng.submit(p, 25, method="eagle2" if i % 3 else "ar") for i, p in enumerate(prompts_)]
        for p, r in zip(prompts_, reqs):
            assert r.result().token_ids == hf_greedy(tiny_model, p, 25)
    finally:
        eng.close()


def test_head_round_trip_gives_the_same_drafts(tiny_model, tmp_path):
    folder = random_head(tiny_model, tmp_path / "a", 2, 50)
    a = load_head(folder, tiny_model)
    b = load_head(save_head(a, tmp_path / "b", dtype=torch.float32), tiny_model)
    toks = torch.tensor([[3, 4, 5]])
    feats = torch.randn(1, 3, 32)
    pos = torch.arange(3)[None]
    with torch.no_grad():
        assert torch.equal(a.logits(a.layer(toks, feats, pos)[0]), b.logits(b.layer(toks, feats, pos)[0]))
    assert torch.equal(a.d2t, b.d2t)


def _expect(folder, model, *words):
    with pytest.raises(GooseError) as e:
        load_head(folder, model)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_bad_head_files_are_one_line_errors(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    _expect(tmp_path / "nothing", tiny_model, "config.json", "missing")
    good = random_head(tiny_model, tmp_path / "good", 0, 30)
    # a damaged weights file
    bad = random_head(tiny_model, tmp_path / "damaged", 0, 30)
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    _expect(bad, tiny_model, "model.safetensors", "not a readable safetensors")
    # a config that is not JSON
    bad = random_head(tiny_model, tmp_path / "badjson", 0, 30)
    (bad / "config.json").write_text("{oops")
    _expect(bad, tiny_model, "config.json", "JSON")
    # a head for another model of the same shape
    other = make_tiny_llama(seed=9)
    _expect(good, other, "trained for another model", "lm_head_digest")
    # another hidden size
    wide = make_tiny_llama(seed=0)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    wide = LlamaForCausalLM(cfg).double().eval()
    _expect(good, wide, "hidden size")
    # an EAGLE-3 head (three layers' features)
    bad = random_head(tiny_model, tmp_path / "e3", 0, 30)
    w = load_file(str(bad / "model.safetensors"))
    w["fc.weight"] = torch.zeros(32, 96)
    save_file(w, str(bad / "model.safetensors"))
    _expect(bad, tiny_model, "EAGLE-3")
    # a fused head naming layers the model does not have (or its last), or without its fuse weight
    for name, layers in (("taps-out", [5]), ("taps-last", [1]), ("taps-order", [0, 0]), ("taps-type", ["0"])):
        bad = random_head(tiny_model, tmp_path / name, 0, 30, fused=True)
        raw = json.loads((bad / "config.json").read_text())
        raw["goose"]["feature_layers"] = layers
        (bad / "config.json").write_text(json.dumps(raw))
        _expect(bad, tiny_model, "feature_layers")
    bad = random_head(tiny_model, tmp_path / "nofuse", 0, 30, fused=True)
    w = load_file(str(bad / "model.safetensors"))
    w.pop("fuse.weight")
    save_file(w, str(bad / "model.safetensors"))
    _expect(bad, tiny_model, "fuse.weight")
    # a d2t outside the vocabulary, a missing weight, an unknown weight
    for name, change in (("d2t", lambda w: w.__setitem__("d2t", w["d2t"] + 1000)),
                         ("missing", lambda w: w.pop("layers.0.mlp.up_proj.weight")),
                         ("extra", lambda w: w.__setitem__("layers.1.mlp.up_proj.weight", torch.zeros(2)))):
        bad = random_head(tiny_model, tmp_path / name, 0, 30)
        w = load_file(str(bad / "model.safetensors"))
        change(w)
        save_file(w, str(bad / "model.safetensors"))
        _expect(bad, tiny_model, str(bad))
    # decoding with a missing head fails at construction, naming it
    with pytest.raises(GooseError, match="missing"):
        Decoder(tiny_model, None, eagle(tiny_model, tmp_path / "nothing"))


def test_no_packaged_head_for_a_model_is_a_clear_error(tiny_model):
    with pytest.raises(GooseError, match="train-head"):
        Decoder(tiny_model, None, "eagle2", cost=FLAT)


def test_a_long_prompt_enters_the_heads_cache_by_its_last_catch_up_positions(tiny_model, tmp_path):
    from goose.engine.methods.eagle2 import HeadDrafter, HeadState

    head = load_head(random_head(tiny_model, tmp_path / "h", 3), tiny_model)
    prompt = [random.Random(5).randrange(TINY_VOCAB) for _ in range(70)]
    hidden = torch.randn(len(prompt), tiny_model.config.hidden_size)
    trees = {}
    for cap in (16, 256):
        drafter, st = HeadDrafter(head, EagleConfig(catch_up=cap)), HeadState()
        st.take_features(hidden)
        drafter.begin(st, prompt + [7])  # after the prefill: the prompt's features and the first new token
        trees[cap] = drafter.grow(st, 7)[0]
        assert st.length == min(cap, len(prompt)) and st.fpos == len(prompt) and not st.feats  # fpos: the root's
    assert len(trees[16]) > 1 and len(trees[256]) > 1
    # a resting head (in `goose`) skips its positions: the next step runs only those after the rest
    more = [random.Random(6).randrange(TINY_VOCAB) for _ in range(8)]
    st.commit(more)
    st.take_features(torch.randn(5, tiny_model.config.hidden_size))
    st.skip()
    st.take_features(torch.randn(3, tiny_model.config.hidden_size))
    before = st.length
    drafter.grow(st, more[-1])
    assert st.length == before + 3 and st.fpos == len(prompt) + 8
    dec = Decoder(tiny_model, None, eagle(tiny_model, tmp_path / "h", catch_up=16), forward=LeanForward(tiny_model))
    assert dec.generate_ids(prompt, DecodeConfig(max_new_tokens=30))[0] == hf_greedy(tiny_model, prompt, 30)


def test_a_further_depth_is_drafted_only_while_its_nodes_can_pay_for_its_time(tiny_model, tmp_path):
    """Depths past the first are drafted while the joint probabilities of the nodes they expand sum to at least
    the tokens the depth's measured drafting time is worth; without a price (token_ms 0) to the configured depth."""
    from goose.engine.methods.eagle2 import HeadDrafter, HeadState

    head = load_head(random_head(tiny_model, tmp_path / "h", 3), tiny_model)
    prompt = [random.Random(8).randrange(TINY_VOCAB) for _ in range(12)]
    hidden = torch.randn(len(prompt), tiny_model.config.hidden_size)

    def depth(token_ms: float, depth_ms: float) -> tuple[int, float]:
        drafter, st = HeadDrafter(head, EagleConfig(depth=4, top_k=2)), HeadState()
        drafter.depth_ms = depth_ms
        st.take_features(hidden)
        drafter.begin(st, prompt + [7])
        tree = drafter.grow(st, 7, token_ms=token_ms)[0]
        return max(tree.depths), drafter.depth_ms

    assert depth(0.0, 0.0)[0] == 4 and depth(0.0, 0.0)[1] > 0  # each drafted depth is timed
    assert depth(1.0, 1e9)[0] == 1  # no depth's nodes can pay for a second of drafting
    assert depth(1e-12, 1.0)[0] == 4  # nor does a nearly free depth stop


def test_eagle2_config_bounds():
    for bad in (dict(depth=0), dict(top_k=0), dict(depth=33), dict(catch_up=0), dict(probe_every=-1),
                dict(pay_rate=0.0)):
        with pytest.raises(GooseError):
            EagleConfig(**bad)


# ---- the trainer --------------------------------------------------------------------------------------------

def _tiny_cfg(**kw):
    from goose.headtrain import TrainConfig

    base = dict(conversations=3, held_out=(1000, 1002), max_tokens=48, window=16, batch=2, epochs=1.0,
                unroll=2, checkpoint_every=1, draft_vocab=64, warmup=2)
    base.update(kw)
    return TrainConfig(**base)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.parametrize("taps,soft", [((), False), ((0,), True)])
def test_train_head_writes_a_head_that_loads_and_decodes_losslessly(worded, tmp_path, taps, soft):
    from goose.backends.lean import LeanForward
    from goose.headtrain import train_head

    model, tok = worded
    fwd = LeanForward(model)
    manifest = train_head(model, tok, fwd, tmp_path / "head", tmp_path / "work",
                          _tiny_cfg(feature_layers=taps, soft=soft), command="test")
    assert manifest["config"]["soft"] is soft
    assert manifest["steps"] >= 2 and manifest["draft_vocab"] == 64
    assert manifest["feature_layers"] == list(taps)
    data = torch.load(tmp_path / "work" / "data.pt")
    assert data["train"]["feats"].shape[1] == model.config.hidden_size * (len(taps) + 1)
    assert len(manifest["held_out_top1_by_depth"]) == 2
    assert manifest["data"]["train_conversations"] == [2000, 2003]
    assert manifest["data"]["held_out_conversations"] == [1000, 1002]
    assert all(0 <= a <= 1 for a in manifest["held_out_top1_by_depth"])
    assert json.loads((tmp_path / "head" / "manifest.json").read_text())["data"]["sha256"] == \
        manifest["data"]["sha256"]
    head = load_head(tmp_path / "head", model)
    assert head.cfg.draft_vocab_size == 64 and head.cfg.feature_layers == taps
    dec = Decoder(model, tok, eagle(model, tmp_path / "head"))
    ids = tok.encode("Hello there, how are you?")
    out, _ = dec.generate_ids(ids, DecodeConfig(max_new_tokens=12))
    assert out == Decoder(model, tok, "ar").generate_ids(ids, DecodeConfig(max_new_tokens=12))[0]


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_train_head_is_deterministic_and_resumes(worded, tmp_path, monkeypatch, precision):
    from goose.backends.lean import LeanForward
    from goose.headtrain import train_head

    model, tok = worded
    fwd = LeanForward(model)
    cfg = _tiny_cfg(epochs=2.0, precision=precision)
    manifest = train_head(model, tok, fwd, tmp_path / "a", tmp_path / "wa", cfg)
    assert manifest["precision"] == precision
    train_head(model, tok, fwd, tmp_path / "b", tmp_path / "wb", cfg)
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    calls = {"n": 0}
    real = torch.nn.utils.clip_grad_norm_

    def interrupted(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_head(model, tok, fwd, tmp_path / "c", tmp_path / "wc", cfg)
    assert not (tmp_path / "c" / "model.safetensors").exists()
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", real)
    train_head(model, tok, fwd, tmp_path / "c", tmp_path / "wc", cfg)  # resumes from step 2
    c = _weights(tmp_path / "c")
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_train_precision_auto_is_bfloat16_only_with_amx(monkeypatch):
    import goose.machine as machine
    from goose.headtrain import train_precision

    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16", "amx_tile"}))
    assert train_precision("auto") == "bfloat16"
    monkeypatch.setattr(machine, "cpu_flags", lambda: frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert train_precision("auto") == "float32"
    assert train_precision("bfloat16") == "bfloat16" and train_precision("float32") == "float32"
    with pytest.raises(GooseError, match="precision must be one of"):
        train_precision("fp8")


@pytest.mark.parametrize("regenerate", [0, 8])
def test_train_head_collection_resumes_from_its_parts(worded, tmp_path, monkeypatch, regenerate):
    """Features collected a part at a time (`collect_chunk` conversations) are the data of one pass; a collection
    interrupted after a part resumes from it and collects only the rest; the parts go once data.pt is written."""
    import goose.headtrain as ht
    from goose.backends.lean import LeanForward

    model, tok = worded
    fwd = LeanForward(model)
    whole = ht.train_head(model, tok, fwd, tmp_path / "a", tmp_path / "wa",
                          _tiny_cfg(regenerate=regenerate, collect_chunk=1000))
    name = "regenerate_collect" if regenerate else "collect"
    real, calls = getattr(ht, name), []

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kw)

    monkeypatch.setattr(ht, name, flaky)
    cfg = _tiny_cfg(regenerate=regenerate, collect_chunk=1)
    with pytest.raises(KeyboardInterrupt):
        ht.train_head(model, tok, fwd, tmp_path / "b", tmp_path / "wb", cfg)
    assert [p.name for p in (tmp_path / "wb" / "parts").iterdir()] == ["train-2000-2001.pt"]
    calls.clear()
    monkeypatch.setattr(ht, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    parts = ht.train_head(model, tok, fwd, tmp_path / "b", tmp_path / "wb", cfg)
    assert len(calls) == 4  # 2 train + 2 held-out conversations left, one part each
    assert parts["data"]["sha256"] == whole["data"]["sha256"] and parts["data"]["train_tokens"] == \
        whole["data"]["train_tokens"]
    assert not (tmp_path / "wb" / "parts").exists() and (tmp_path / "wb" / "data.pt").exists()
    with pytest.raises(GooseError, match="collect_chunk"):
        ht.train_head(model, tok, fwd, tmp_path / "c", tmp_path / "wc", _tiny_cfg(collect_chunk=0))


def test_regenerated_data_is_the_targets_own_greedy_answer(worded):
    """`--regenerate`: each first question answered by the target, batched; every answer equals the Engine's
    plain greedy answer to the same prompt, labels are the next tokens of the answer, repeats are answered once."""
    from goose import Engine
    from goose.backends.lean import LeanForward
    from goose.engine.requests import eos_ids
    from goose.headtrain import regenerate_collect

    model, tok = worded
    fwd = LeanForward(model)
    convs = [(i, [{"role": "user", "content": q}, {"role": "assistant", "content": "ignored"}])
             for i, q in enumerate(["How do geese fly?", "Name three rivers.", "How do geese fly?", "Why?"])]
    d = regenerate_collect(fwd, tok, convs, prompt_tokens=32, new_tokens=10, eos=eos_ids(model, tok), batch=2)
    starts = d["starts"].tolist() + [len(d["tokens"])]
    assert len(starts) - 1 == 3 and len(d["feats"]) == len(d["tokens"]) == len(d["labels"])
    with Engine(model, tok, "ar", max_batch=1, prefix_cache_mb=0, memory_mb=0) as eng:
        for k, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            ids, lab = d["tokens"][a:b].tolist(), d["labels"][a:b].tolist()
            p = int(d["prompt_lengths"][k])
            assert 0 < b - a - p <= 10
            assert lab[p - 1 : -1] == ids[p:]  # the label of each position is the token that follows it
            assert ids[p:] == eng.generate(ids[:p], max_new_tokens=b - a - p).token_ids


def test_train_head_refuses_what_does_not_fit_in_memory(worded, tmp_path):
    from goose.backends.lean import LeanForward
    from goose.headtrain import train_head

    model, tok = worded
    with pytest.raises(GooseError, match="budget"):
        train_head(model, tok, LeanForward(model), tmp_path / "h", tmp_path / "w",
                   _tiny_cfg(conversations=100000, max_tokens=4096))


def test_train_head_refuses_features_collected_for_other_settings(worded, tmp_path):
    from goose.backends.lean import LeanForward
    from goose.headtrain import train_head

    model, tok = worded
    fwd = LeanForward(model)
    train_head(model, tok, fwd, tmp_path / "a", tmp_path / "w", _tiny_cfg())
    with pytest.raises(GooseError, match="other settings"):
        train_head(model, tok, fwd, tmp_path / "b", tmp_path / "w", _tiny_cfg(conversations=4))


def test_train_head_refuses_a_checkpoint_of_another_training(worded, tmp_path):
    """The features are reused for a new draft vocabulary, but the checkpoint of the old one is not resumed: it is
    refused with the setting that differs, before any step (a checkpoint of no recorded settings, too)."""
    from goose.backends.lean import LeanForward
    from goose.headtrain import train_head

    model, tok = worded
    fwd = LeanForward(model)
    train_head(model, tok, fwd, tmp_path / "a", tmp_path / "w", _tiny_cfg())
    with pytest.raises(GooseError, match=r"checkpoint of another training \(draft_vocab 64 there, 32 here\)"):
        train_head(model, tok, fwd, tmp_path / "b", tmp_path / "w", _tiny_cfg(draft_vocab=32))
    assert not (tmp_path / "b").exists()
    ckpt = tmp_path / "w" / "checkpoint.pt"
    state = torch.load(ckpt)
    del state["settings"]
    torch.save(state, ckpt)
    with pytest.raises(GooseError, match="written by an older goose"):
        train_head(model, tok, fwd, tmp_path / "b", tmp_path / "w", _tiny_cfg())
    ckpt.unlink()
    assert train_head(model, tok, fwd, tmp_path / "b", tmp_path / "w", _tiny_cfg(draft_vocab=32))["draft_vocab"] == 32


@pytest.mark.parametrize("fused,fmt", [(False, "Q8_0"), (True, "Q8_0"), (False, "Q4_0")])
def test_fast_head_drafts_what_the_head_drafts(tiny_model, tmp_path, fused, fmt):
    """goose's kernels (Q8_0 blocks or float32 panels) give the head's own forward up to their rounding (a fused
    head's depth-1 rows through its fuse folded into fc, deeper rows as an unfused head's)."""
    import goose.backends.cpukernel as ck
    from goose.backends.head import FastHead, HeadCache

    if ck.unavailable_reason() is not None:
        pytest.skip(f"goose's kernels do not run here: {ck.unavailable_reason()}")
    model = make_tiny_llama(dtype=torch.float32, seed=4)
    head = load_head(random_head(model, tmp_path / "h", 3, 64, fused=fused), model)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(0.3)
    fast = FastHead(head, fmt)
    toks = torch.tensor([5, 9, 11, 3])
    feats = torch.randn(4, 64 if fused else 32)
    pos = torch.arange(4)
    tol = {"q8": 0.1, "q4": 0.3}.get(fast.kind[:2], 1e-4)
    mine, theirs = HeadCache(), HeadCache()
    with torch.no_grad():
        ref = head.logits(head.layer(toks[None], feats[None], pos[None], cache=theirs, at=0)[0])[0]
        got = fast.logits(fast.layer(toks, feats, pos, mine, 0))
        assert (got - ref).abs().max() <= tol * ref.abs().max()
        # draft rows of a tree: two rows at 4-5, then three at 6-8 that see the cache before row 4 and, of rows
        # 4..8, what `allowed` says (back = 2: the mask starts two rows before the call's own)
        for at, n, allowed, back in ((4, 2, torch.eye(2, dtype=torch.bool), 0),
                                     (6, 3, torch.tensor([[1, 0, 1, 0, 0], [0, 1, 0, 1, 0], [1, 0, 0, 0, 1]],
                                                         dtype=torch.bool), 2)):
            t, f, p = torch.randint(0, 64, (n,)), torch.randn(n, 32), torch.full((n,), 4)
            mask = torch.cat([torch.ones(n, at - back, dtype=torch.bool), allowed], dim=1)
            ref = head.logits(head.layer(t[None], f[None], p[None], mask=mask, cache=theirs, at=at)[0])[0]
            got = fast.logits(fast.layer(t, f, p, mine, at, allowed, back))
            assert (got - ref).abs().max() <= tol * ref.abs().max()
    # the masks matter: the same rows seeing every earlier row give other drafts
    with torch.no_grad():
        every = fast.logits(fast.layer(t, f, p, mine, at))
    assert (every - got).abs().max() > 1e-3 * got.abs().max()


def _run_arms(pay, steps: int, with_head: tuple[float, int], without: tuple[float, int],
              charged: float = 0.0) -> list[bool]:
    """`steps` steps through `pay` on a fake clock: a step with the head takes with_head[0] ms and commits
    with_head[1] tokens, one without takes without[0] ms for without[1]; a step with the head is also `charged`
    ms (its drafting's hold-up of a batch's other requests). The arms chosen."""
    now = [0.0]
    pay.clock = lambda: now[0]
    chosen = []
    for _ in range(steps):
        on = pay.drafts()
        chosen.append(on)
        ms, tokens = with_head if on else without
        now[0] += ms / 1e3
        if on:
            pay.charge(charged)
        pay.observe(tokens)
    return chosen


def test_goose_drafts_with_the_head_only_while_its_steps_commit_more_tokens_per_ms():
    from goose.engine.methods.goose import _HeadPay

    def gaps(chosen, arm):  # steps between the tries of `arm` after the first three (the warm-up)
        at = [i for i, x in enumerate(chosen) if x == arm and i >= 3]
        return [b - a for a, b in zip(at, at[1:])]

    # the head adds 2 ms to a 5 ms step for no more tokens: it rests, and is tried one step in four at first, then,
    # each probe losing again, half as often
    slow = _run_arms(_HeadPay(EagleConfig(pay_rate=0.5, probe_every=4)), 60, (7.0, 1), (5.0, 1))
    assert slow[:3] == [True, True, False]  # the head's first step (unmeasured), then each arm measured once
    assert gaps(slow, True) == [8, 16] and sum(slow[3:]) == 3
    # two tokens a step for 7 ms beat one for 5 ms: the head drafts, and the plain arm is probed as rarely
    fast = _run_arms(_HeadPay(EagleConfig(pay_rate=0.5, probe_every=4)), 60, (7.0, 2), (5.0, 1))
    assert fast[:3] == [True, True, False]
    assert gaps(fast, False) == [8, 16]
    # the text changes: the head stops paying, and the probes see it
    pay = _HeadPay(EagleConfig(pay_rate=0.5, probe_every=4))
    _run_arms(pay, 20, (7.0, 2), (5.0, 1))
    late = _run_arms(pay, 40, (7.0, 1), (5.0, 1))
    assert sum(late[20:]) <= 2
    # and back: after the probes have backed off to one in 64 steps, the first probe that wins sets them back,
    # and the head drafts again
    assert pay.rates.interval == 4 * 16 or sum(_run_arms(pay, 200, (7.0, 1), (5.0, 1))) < 8
    assert pay.rates.interval == 4 * 16
    back = _run_arms(pay, 80, (7.0, 3), (5.0, 1))
    won = back.index(True)
    assert won <= 64 and sum(back[won : won + 8]) >= 6  # the head drafts again, the plain arm probed one in four
    assert sum(back[-10:]) >= 9  # (the plain arm, resting now, probed as it loses: less and less)
    always = _HeadPay(EagleConfig(probe_every=0))
    assert all(_run_arms(always, 10, (70.0, 0), (1.0, 5)))
    # the rates are the method's, across requests: a new request starts from what the earlier ones measured
    first = _HeadPay(EagleConfig(pay_rate=0.5, probe_every=4))
    _run_arms(first, 20, (7.0, 1), (5.0, 1))
    second = _run_arms(_HeadPay(EagleConfig(pay_rate=0.5, probe_every=4), first.rates), 4, (7.0, 1), (5.0, 1))
    assert second == [True, False, False, False]  # its first step (unmeasured), then the faster arm at once
    # in a batch of 4 the head's 2 ms hold up 3 other requests: 2 tokens for 7 + 6 ms lose to 1 for 5 ms, though
    # the request's own clock (7 ms) says they win
    batched = _run_arms(_HeadPay(EagleConfig(pay_rate=0.5, probe_every=4)), 60, (7.0, 2), (5.0, 1), charged=6.0)
    assert gaps(batched, True) == [8, 16]


def test_goose_learns_whether_its_head_pays_across_requests(tiny_model, tmp_path):
    from dataclasses import replace

    from goose.config import DeviceAwareConfig

    folder = random_head(tiny_model, tmp_path / "h", 2, 30)
    prompt = [7, 3, 9, 12, 7, 3, 9]
    for carry in (True, False):
        cfg = GooseConfig(eagle=EagleConfig(head=str(folder)), device_aware=replace(DeviceAwareConfig(),
                                                                                   carry_over=carry))
        dec = Decoder(tiny_model, None, "goose", cfg, cost=FLAT)
        for _ in range(2):
            assert dec.generate_ids(prompt, DecodeConfig(max_new_tokens=20))[0] == hf_greedy(tiny_model, prompt, 20)
        seen = dec.method._pay.seen  # the method's own rates: its requests' forks measured into them, or not
        assert (seen[True] > 0 and seen[False] > 0) == carry and (sum(seen.values()) == 0) == (not carry)


def test_a_head_fits_a_lower_precision_copy_of_its_model_but_not_another_model(tmp_path):
    from goose.backends.head import target_identity, target_mismatch

    model = make_tiny_llama(dtype=torch.float32, seed=4)
    folder = random_head(model, tmp_path / "h", 0, 30)
    mine = target_identity(model)
    half = target_identity(make_tiny_llama(dtype=torch.float32, seed=4).to(torch.bfloat16))
    assert not target_mismatch(mine, half)
    near = dict(mine, lm_head_digest=mine["lm_head_digest"] * 1.0005)  # rounding apart: the same weights
    far = dict(mine, lm_head_digest=mine["lm_head_digest"] * 1.01)
    assert not target_mismatch(near, mine) and target_mismatch(far, mine)
    assert load_head(folder, model) is not None
    other = target_identity(make_tiny_llama(dtype=torch.float32, seed=5))
    assert target_mismatch(mine, other) == [f"lm_head_digest {mine['lm_head_digest']} vs {other['lm_head_digest']}"]


@pytest.mark.parametrize("backend", ["hf", "lean", "lean-by-layer"])
def test_feature_taps_are_the_normalized_streams_after_those_layers(tmp_path, backend):
    """A fused head's input: the residual stream after each tapped layer (RMS-normalized), then the final state,
    the same rows as a forward without taps gives, and the same logits."""
    from goose.protocols import Segment, tap_norm

    model = make_tiny_llama(dtype=torch.float32, seed=5, layers=3)
    fwd = HFForward(model) if backend == "hf" else LeanForward(model)
    if backend == "lean-by-layer":
        fwd.plan = None  # the per-projection path (qwen3, PyTorch's kernels)
    ids = [5, 9, 11, 3, 17, 2, 8]
    plain, tapped = fwd.new_cache(), fwd.new_cache()
    plain.reset()
    tapped.reset()
    a, b = Segment(plain, ids, features=True), Segment(tapped, ids, features=(0, 1))
    la, lb = fwd.run([a])[0], fwd.run([b])[0]
    assert torch.equal(la, lb)
    assert b.hidden.shape == (len(ids), 3 * 32)
    assert torch.equal(b.hidden[:, 64:], a.hidden)
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate((0, 1)):
        ref = tap_norm(states[layer + 1][0])
        assert (b.hidden[:, 32 * j : 32 * (j + 1)] - ref).abs().max() < 1e-4
    # a later step over a batch: taps only for the segment that asks, each its own rows
    c = fwd.new_cache()
    c.reset()
    fwd.run([Segment(c, ids[:4])])
    more = [Segment(c, ids[4:], features=(1,)), Segment(plain, [4, 6])]
    fwd.run(more)
    assert more[0].hidden.shape == (3, 64) and more[1].hidden is None
    assert (more[0].hidden[:, :32] - tap_norm(states[2][0, 4:])).abs().max() < 1e-4
    with pytest.raises(GooseError, match="feature taps"):
        fwd.run([Segment(fwd.new_cache(), ids, features=(3,))])


def test_soft_labels_are_the_next_rows_distribution_over_the_draft_vocabulary(tmp_path):
    from goose.headtrain import IGNORE, _masks, _soft_examples, unrolled_loss

    t2d = torch.full((10,), IGNORE, dtype=torch.long)
    t2d[torch.tensor([2, 5, 7])] = torch.tensor([0, 1, 2])  # draft vocabulary: target tokens 2, 5, 7
    data = {"soft_ids": torch.tensor([[5, 2, 9], [7, 9, 2], [9, 8, 1]], dtype=torch.int32),
            "soft_probs": torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1], [0.7, 0.2, 0.1]], dtype=torch.float16)}
    ids, q = _soft_examples(data, t2d)
    # row 0 learns position 1's distribution: 7 (0.6) and 2 (0.1) inside, 9 outside -> renormalized
    assert ids[0].tolist() == [2, 0, 0] and torch.allclose(q[0], torch.tensor([6 / 7, 0.0, 1 / 7]), atol=1e-3)
    assert q[1].sum() == 0  # position 2's tokens all lie outside the draft vocabulary
    assert q[2].sum() == 0  # the last row has no next position
    # the soft loss is the hard one when the distribution is one token
    torch.manual_seed(0)
    model = make_tiny_llama(dtype=torch.float32)
    head = load_head(random_head(model, tmp_path / "h", 1, 20), model)
    n = 6
    feats, nxt = torch.randn(1, n, 32), torch.randint(0, 20, (1, n))
    lab, pos = torch.randint(0, 20, (1, n)), torch.arange(n)[None]
    lab[0, -1] = IGNORE
    hard, _ = unrolled_loss(head, feats, nxt, lab, pos, 2, 0.0, _masks(n, 2))
    one = (lab.clamp_min(0)[..., None].expand(1, n, 3).contiguous(), torch.tensor([1.0, 0.0, 0.0]).expand(1, n, 3))
    soft, _ = unrolled_loss(head, feats, nxt, lab, pos, 2, 0.0, _masks(n, 2), soft=one)
    assert torch.allclose(hard, soft, atol=1e-5)


def test_q4_0_rows_are_gguf_blocks_of_the_weights():
    import numpy as np

    from goose.backends.head import q4_0_rows

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5, 64, generator=gen)
    w[1, :32] = 0.0  # an all-zero block: scale 0, every weight 0
    w[2, 40] = -9.0  # a block whose largest weight is negative: it maps to q = 0
    rows = q4_0_rows(w)
    assert all(r.dtype == np.uint8 and r.shape == (2 * 18,) for r in rows)
    for i, r in enumerate(rows):
        for b in range(2):
            blk = r[18 * b : 18 * (b + 1)]
            d = float(blk[:2].view(np.float16)[0])
            q = np.concatenate([blk[2:] & 0xF, blk[2:] >> 4]).astype(np.float32)
            back = (q - 8) * d
            ref = w[i, 32 * b : 32 * (b + 1)].numpy()
            err = np.abs(back - ref)  # half a step, a whole one where 8 d clamps to 7 d (GGUF's own rounding)
            assert np.all(err <= abs(d) * 1.01 + 1e-6) and np.mean(err <= abs(d) / 2 + 1e-2 * abs(d)) >= 0.9, (i, b)
    assert float(rows[1][:2].view(np.float16)[0]) == 0.0
    assert (rows[2][18 + 2 + 8] & 0xF) == 0 and abs(float(rows[2][18:20].view(np.float16)[0]) - 9 / 8) < 1e-3


def test_feature_layers_option_names_the_tapped_layers_or_refuses(worded, tmp_path):
    from goose.headtrain import feature_layers_for, train_head

    assert feature_layers_for("none", 30) == () and feature_layers_for("auto", 30) == (1, 14)
    assert feature_layers_for(" 3,7 ", 30) == (3, 7)
    for bad in ("7,3", "29", "1,1", "x", "-1"):
        with pytest.raises(GooseError, match="feature layers"):
            feature_layers_for(bad, 30)
    model, tok = worded
    with pytest.raises(GooseError, match="feature layers"):  # refused before anything is collected
        train_head(model, tok, None, tmp_path / "h", tmp_path / "w", _tiny_cfg(feature_layers=(5,)))
    assert not (tmp_path / "w" / "data.pt").exists()


@pytest.mark.parametrize("method", ["eagle2", "goose"])
def test_a_fused_head_is_handed_the_tapped_streams(tiny_model, tmp_path, monkeypatch, method):
    from goose.engine.methods.eagle2 import HeadState

    folder = random_head(tiny_model, tmp_path / "h", 1, 40, fused=True)
    widths = []
    take = HeadState.take_features
    monkeypatch.setattr(HeadState, "take_features", lambda self, h: (widths.append(h.shape[1]), take(self, h))[1])
    m = eagle(tiny_model, folder) if method == "eagle2" else "goose"
    cfg = GooseConfig(eagle=EagleConfig(head=str(folder)))
    dec = Decoder(tiny_model, None, m, cfg, cost=FLAT)
    assert dec.method.features == (0,)
    prompt = [5, 9, 11, 3, 5, 9, 11]
    out, _ = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=10))
    assert out == hf_greedy(tiny_model, prompt, 10)
    assert widths and set(widths) == {2 * tiny_model.config.hidden_size}
