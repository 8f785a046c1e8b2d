"""The oracles on tiny random models of every supported architecture (float64, built from a config):
per-node tree logits equal a plain forward over each path (across KV compaction), and every method is
token-identical to greedy `model.generate`. Sliding-window models get a window of 8 and prompts and
generations well past it; unsupported attention is refused, never mis-verified."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import CPU_CURVE, TINY_EOS, TINY_VOCAB, hf_greedy, peaked
from goose.backends.forward import FULL, SLIDING, HFForward, attention_layers
from goose.backends.lean import LeanForward
from goose.backends.tree_tensors import ancestor_mask, tree_depths
from goose.config import DecodeConfig
from goose.decoding import Decoder, default_forward
from goose.drafting.tree import BRANCH, DraftTree
from goose.errors import GooseError

WINDOW = 8
SMALL = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
IDS = dict(eos_token_id=TINY_EOS, bos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


def _configs():
    import transformers as tf

    return {
        "llama": lambda: tf.LlamaConfig(**SMALL, **IDS),
        "mistral": lambda: tf.MistralConfig(**SMALL, **IDS, sliding_window=WINDOW),
        # layer 0 full, layer 1 sliding: the per-layer-type mask dict
        "qwen2": lambda: tf.Qwen2Config(**SMALL, **IDS, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1),
        "qwen3": lambda: tf.Qwen3Config(**SMALL, **IDS, head_dim=8),  # q/k norms
        "qwen3-window": lambda: tf.Qwen3Config(**SMALL, **IDS, head_dim=8, use_sliding_window=True,
                                               sliding_window=WINDOW, max_window_layers=1),
        "gemma3": lambda: tf.Gemma3TextConfig(
            **{**SMALL, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1}, **IDS,
            head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING]),
        "phi3": lambda: tf.Phi3Config(**SMALL, **IDS, sliding_window=WINDOW),
        "gpt2": lambda: tf.GPT2Config(vocab_size=TINY_VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=1024,
                                      **IDS),
        # partial rotary (a quarter of each head), parallel residual
        "gpt_neox": lambda: tf.GPTNeoXConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.25,
                                             max_position_embeddings=1024, **IDS),
    }


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen3-window", "gemma3", "phi3", "gpt2", "gpt_neox")
SLIDING_ARCHS = ("mistral", "qwen2", "qwen3-window", "gemma3", "phi3")
_MODELS: dict = {}


def tiny(arch: str):
    """A seeded tiny float64 model; weights scaled up (as in conftest) so greedy text repeats."""
    if arch not in _MODELS:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        cfg = _configs()[arch]()
        cfg._attn_implementation = "sdpa"
        _MODELS[arch] = peaked(AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval())
    return _MODELS[arch]


def deep_tree(rng: random.Random, n: int) -> DraftTree:
    """Random tree whose nodes mostly hang off recent ones: depths reach past the window."""
    tree = DraftTree.root(rng.randrange(2, TINY_VOCAB))
    while len(tree) < n:
        tree.add(rng.randrange(max(0, len(tree) - 3), len(tree)), rng.randrange(2, TINY_VOCAB), BRANCH)
    return tree


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_kinds(arch):
    kinds, window = attention_layers(tiny(arch))
    if arch in SLIDING_ARCHS:
        assert window == WINDOW and SLIDING in kinds
        assert (FULL in kinds) == (arch in ("qwen2", "qwen3-window", "gemma3"))
    else:
        assert window is None and set(kinds) == {FULL}


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_plain_forward_over_each_path(arch):
    model = tiny(arch)
    rng = random.Random(1)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(13)]  # longer than the window
    fwd = HFForward(model)
    committed = list(prompt)
    with torch.inference_mode():
        fwd.reset()
        fwd(prompt)
        for step in range(3):  # trees on top of compacted caches; depths reach past the window
            tree = deep_tree(rng, 24)
            logits = fwd(tree.tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology()))
            for i in range(len(tree)):
                path = [tree.tokens[j] for j in tree.path_to(i)]
                ref = model(torch.tensor([committed + path])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, rtol=1e-9, atol=1e-9,
                                           msg=lambda m: f"step {step}, node {i}: {m}")
            keep = tree.path_to(rng.randrange(len(tree)))
            fwd.keep(keep)
            committed += [tree.tokens[j] for j in keep]
        assert fwd.length == len(committed)
        chain = [rng.randrange(2, TINY_VOCAB) for _ in range(11)]  # a causal run past the window
        logits = fwd(chain)
        ref = model(torch.tensor([committed + chain])).logits[0, -len(chain):]
        torch.testing.assert_close(logits, ref, rtol=1e-9, atol=1e-9)


METHODS = ("ar", "pld", "tr", "goose", "goose-paper")


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    motif = [rng.randrange(2, TINY_VOCAB) for _ in range(4)]
    return [
        [rng.randrange(2, TINY_VOCAB) for _ in range(3)],
        [rng.randrange(2, TINY_VOCAB) for _ in range(29)],
        motif * 5 + [motif[0]],  # repetitive: drafts get accepted
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_method_equals_greedy_generate(arch):
    model = tiny(arch)
    tokens = forwards = 0
    for prompt in _prompts(ARCHS.index(arch)):
        ref = hf_greedy(model, prompt, 30)
        for method in METHODS:
            dec = Decoder(model, None, method, cost=CPU_CURVE)
            out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=30))
            assert out == ref, f"{arch}: {method} diverged from greedy generate on {prompt}"
            assert stats.new_tokens == len(out)
            if method == "goose-paper":
                tokens, forwards = tokens + stats.new_tokens, forwards + stats.forward_calls
    assert forwards < tokens  # drafts were accepted: the trees were really verified


def test_only_the_llama_family_without_a_window_takes_the_lean_forward():
    lean = {a for a in ARCHS if isinstance(default_forward(tiny(a)), LeanForward)}
    assert lean == {"llama", "qwen3"}


def test_mixed_layers_behind_a_single_mask_are_refused():
    model = tiny("mistral")  # Mistral applies one mask to all its layers
    model.config.layer_types = [FULL, SLIDING]
    try:
        with pytest.raises(GooseError, match="mixes full and sliding"):
            Decoder(model, None, "ar")
    finally:
        del model.config.layer_types


def test_other_attention_kinds_are_refused():
    model = tiny("qwen2")
    types = model.config.layer_types
    model.config.layer_types = ["linear_attention", FULL]
    try:
        with pytest.raises(GooseError, match="linear_attention"):
            Decoder(model, None, "ar")
    finally:
        model.config.layer_types = types


def test_local_attention_by_index_is_refused():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=4, window_size=8,
                       attention_types=[[["global", "local"], 1]], max_position_embeddings=256)
    with pytest.raises(GooseError, match="local-attention"):
        Decoder(GPTNeoForCausalLM(cfg).eval(), None, "ar")
