"""Shared fixtures: a tiny random Llama built from a config (no download) and its greedy reference."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import strategies as st

from goose.config import GooseConfig, NgramConfig, SpineTreeConfig
from goose.drafting.datastore import Datastore, from_token_ids
from goose.selection.costmodel import CostCurve

TINY_VOCAB = 96
TINY_EOS = 1
# A CPU-like cost curve (ms per forward by rows): a second row costs most, 4-8 rows little more
CPU_CURVE = CostCurve((1, 2, 4, 8, 16, 32, 64, 128), (58, 93, 95, 98, 118, 154, 232, 407))


def make_tiny_llama(dtype=torch.float64, seed: int = 0, vocab: int = TINY_VOCAB, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=TINY_EOS, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return peaked(LlamaForCausalLM(cfg).to(dtype).eval())


def peaked(model):
    """Larger weights than the init default give peaked, repetitive greedy text (exercises the spine)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.generation_config.eos_token_id = TINY_EOS
    model.generation_config.pad_token_id = 0
    return model


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int = TINY_EOS) -> list[int]:
    """Reference: Hugging Face greedy `model.generate`, generated tokens only."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_GREEDY: dict = {}


def greedy_memo(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """`hf_greedy`, remembered per (model object, prompt, max_new_tokens): for models whose weights no test
    changes afterwards."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _GREEDY:
        _GREEDY[key] = hf_greedy(model, prompt, max_new_tokens)
    return _GREEDY[key]


_STORES: dict = {}


def greedy_store(model) -> Datastore:
    """A store of the tiny model's own greedy continuations (so retrieval gets accepted)."""
    key = id(model)
    if key not in _STORES:
        rng = random.Random(0)
        docs = []
        for _ in range(12):
            p = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 8))]
            docs.append(p + hf_greedy(model, p, 30))
        docs.append([5, 6, 7, 8] * 5 + hf_greedy(model, [5, 6, 7, 8] * 5, 30))
        _STORES[key] = from_token_ids(docs, {"tokenizer": {"vocab_size": TINY_VOCAB}})
    return _STORES[key]


_HEADS: dict = {}


def method_for(name: str, model, cost=None):
    """Method names as the decoder takes them; `rest` with a store of the model's own greedy text, `eagle2` with
    a random draft head for the model (priced by `cost`, as the decoder's would be)."""
    if name == "rest":
        from goose.engine.methods import Rest

        return Rest(store=greedy_store(model))
    if name == "eagle2":
        import tempfile
        from pathlib import Path

        from goose.config import EagleConfig
        from goose.engine.methods import Eagle2

        if id(model) not in _HEADS:
            _HEADS[id(model)] = (model, random_head(model, Path(tempfile.mkdtemp(prefix="goose-head-")), 1, 48))
        return Eagle2(EagleConfig(head=str(_HEADS[id(model)][1])), cost)
    return name


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_llama()


@pytest.fixture(autouse=True)
def _threads(request):
    """Tiny models run fastest on one thread (no oversubscription); the real model keeps them all."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="session")
def _cost_curves_in_tmp(tmp_path_factory):
    """Cost curves the tests measure (tiny random models) go to a temporary folder, not the user's cache."""
    from goose.engine import measure as costmodel

    root = tmp_path_factory.mktemp("goose-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(costmodel, "cache_root", lambda: root)
        yield


# Property-based inputs shared by the losslessness oracles (float64 and float32 kernel paths).
prompts = st.one_of(
    st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=40),
    # repetitive prompts: a short motif repeated (exercises the spine, consensus and bypass)
    st.builds(lambda motif, reps, tail: motif * reps + tail,
              st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=6), st.integers(2, 8),
              st.lists(st.integers(2, TINY_VOCAB - 1), max_size=3)),
)
configs = st.builds(
    lambda budget, chain, ext, sizes: GooseConfig(
        ngram=NgramConfig(ngram_sizes=sizes, max_chain=chain, max_extended_chain=max(chain, ext)),
        tree=SpineTreeConfig(budget=budget)),
    st.integers(1, 80), st.integers(1, 25), st.integers(1, 120),
    st.sampled_from([(5, 4, 3), (3, 2, 1), (2,), (4, 1)]),
)


def filled_cache(fwd, tokens: list[int]):
    """A new cache of `fwd` holding the keys and values of `tokens` (one forward)."""
    from goose.protocols import Segment

    cache = fwd.new_cache()
    cache.reset()
    with torch.inference_mode():
        fwd.run([Segment(cache, tokens)])
    return cache


@pytest.fixture(scope="module")
def worded():
    """A tiny random Llama with SmolLM2's vocabulary, and SmolLM2's tokenizer (servers that speak text)."""
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    return make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=2), tok


def random_head(model, folder, seed: int = 0, draft_vocab: int | None = None, eagle1: bool = False,
                fused: bool = False):
    """A draft head of random weights for `model`, written to `folder` (`goose.backends.head`'s format).
    `draft_vocab`: tokens it can propose (a random subset; default all); `eagle1`: the EAGLE-1/2 layout (no
    input or final norm, the target's own output head); `fused`: it also reads the stream after the first
    decoder layer (EAGLE-3's feature fusion)."""
    from goose.backends.head import DraftHead, HeadConfig, save_head

    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    size = vocab if eagle1 or draft_vocab is None else draft_vocab
    head = DraftHead(HeadConfig.for_target(model, size, (0,) if fused else ()), model.get_input_embeddings().weight,
                     norms=not eagle1, own_lm_head=not eagle1)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if p.dim() == 1 else 0.3))
    head.d2t = torch.randperm(vocab, generator=gen)[:size].sort().values
    return save_head(head, folder, dtype=torch.float32)
