"""Lookahead decoding: the n-gram pool, the Jacobi window as extra draft nodes, per-node logits of a
lookahead step, and token identity with greedy `model.generate`."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_EOS, TINY_VOCAB, hf_greedy
from goose.backends.forward import HFForward
from goose.backends.lean import LeanForward
from goose.backends.tree_tensors import ancestor_mask, is_chain, tree_depths
from goose.config import DecodeConfig, LookaheadConfig
from goose.decoding import Decoder
from goose.drafting.lookahead import JacobiWindow, NgramPool
from goose.drafting.tree import SPINE, DraftTree
from goose.engine.methods import Lookahead
from goose.engine.verify import greedy_walk


def test_pool_keeps_the_most_recent_distinct_guesses_per_key():
    pool = NgramPool(2)
    pool.add([1, 2, 3])
    pool.add([1, 4, 5])
    pool.add([1, 2, 3])  # a repeat becomes the most recent, not a second entry
    assert pool.guesses(1) == [(2, 3), (4, 5)]
    pool.add([1, 6, 7])  # over the guess-set size: the oldest goes
    assert pool.guesses(1) == [(6, 7), (2, 3)]
    pool.add([9, 1, 2])
    assert pool.guesses(9) == [(1, 2)] and pool.guesses(42) == [] and len(pool) == 3
    empty = NgramPool(0)
    empty.add([1, 2, 3])
    assert empty.guesses(1) == []


def test_window_rides_on_the_tree_as_extra_nodes():
    cfg = LookaheadConfig(window=3, ngram_size=3, guess_set_size=2)
    win = JacobiWindow(cfg, [10, 11, 12])
    win.levels = [[20, 21, 22], [30, 31, 32]]
    tree = DraftTree.root(5)
    tree.insert([6, 7], SPINE)
    tree.insert([6, 8], SPINE)  # merged trie-style under the shared first token
    assert tree.parents == [-1, 0, 1, 1]
    win.attach(tree)
    # level 0: a chain off the root; level 1, column j: under level 0, column j
    assert tree.all_tokens == [5, 6, 7, 8, 20, 21, 22, 30, 31, 32]
    assert tree.extra_parents == [0, 4, 5, 4, 5, 6]
    assert tree_depths(tree.topology()).tolist() == [0, 1, 2, 2, 1, 2, 3, 2, 3, 4]
    allowed = ancestor_mask(tree.topology())
    assert allowed[8].nonzero().flatten().tolist() == [0, 4, 5, 8]  # root, (0,0), (0,1), itself
    assert not is_chain(tree.topology()) and len(tree) == 4
    # the walk never enters the window even when the target predicts its tokens
    pred = [20] * 10
    assert greedy_walk(tree, pred).path == [0]
    # cut at a context limit: the window goes, the tree stays
    assert tree.within_depth(2).extra_tokens == [] and len(tree.within_depth(2)) == 4
    with pytest.raises(ValueError):  # extras come after every tree node
        tree.add(0, 9, SPINE)


def test_window_fills_then_emits_one_ngram_per_column():
    cfg = LookaheadConfig(window=2, ngram_size=3, guess_set_size=4)
    win = JacobiWindow(cfg, [7])
    assert win.levels == [[7, 7]]
    assert win.update([40, 41]) == [] and win.levels == [[7, 7], [40, 41]]  # filling
    grams = win.update([0, 0, 50, 51])  # predictions at level 1 make the n-grams
    assert grams == [[7, 40, 50], [7, 41, 51]]
    assert win.levels == [[40, 41], [50, 51]]


@pytest.mark.parametrize("backend", ["hf", "lean"])
@pytest.mark.parametrize("seed", range(3))
def test_lookahead_step_logits_equal_plain_forward_over_each_path(tiny_model, seed, backend):
    rng = random.Random(seed)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(1, 25))]
    cfg = LookaheadConfig(window=rng.randrange(1, 5), ngram_size=rng.randrange(2, 5), guess_set_size=3)
    win = JacobiWindow(cfg, prompt)
    win.levels = [[rng.randrange(2, TINY_VOCAB) for _ in range(cfg.window)] for _ in range(cfg.ngram_size - 1)]
    tree = DraftTree.root(rng.randrange(2, TINY_VOCAB))
    for _ in range(rng.randrange(0, 4)):
        tree.insert([rng.randrange(2, TINY_VOCAB) for _ in range(cfg.ngram_size - 1)], SPINE)
    win.attach(tree)
    fwd = HFForward(tiny_model) if backend == "hf" else LeanForward(tiny_model)
    parents = tree.all_parents
    with torch.inference_mode():
        fwd.reset()
        fwd(prompt)
        logits = fwd(tree.all_tokens, tree_depths(tree.topology()), ancestor_mask(tree.topology()))
        for i in range(len(parents)):
            path, node = [], i
            while node >= 0:
                path.append(tree.all_tokens[node])
                node = parents[node]
            ref = tiny_model(torch.tensor([prompt + path[::-1]])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, rtol=1e-9, atol=1e-9)
        fwd.keep([0])  # compaction drops the window with the rejected nodes
        assert fwd.length == len(prompt) + 1


prompts = st.one_of(
    st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=30),
    st.builds(lambda motif, reps: motif * reps, st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=5),
              st.integers(2, 6)),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 40), w=st.integers(1, 7), n=st.integers(2, 5), g=st.integers(0, 7),
       backend=st.sampled_from(["hf", "lean"]))
def test_lookahead_equals_greedy_generate(tiny_model, prompt, max_new, w, n, g, backend):
    ref = hf_greedy(tiny_model, prompt, max_new)
    method = Lookahead(LookaheadConfig(window=w, ngram_size=n, guess_set_size=g))
    fwd = HFForward(tiny_model) if backend == "hf" else LeanForward(tiny_model)
    dec = Decoder(tiny_model, None, method, forward=fwd)
    out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=max_new))
    assert out == ref
    assert len(out) == max_new or out[-1] == TINY_EOS


def test_lookahead_accepts_guesses_on_repetitive_text(tiny_model):
    prompt = [5, 6, 7, 8, 9, 10] * 4
    dec = Decoder(tiny_model, None, "lookahead")
    out, stats = dec.generate_ids(prompt, DecodeConfig(max_new_tokens=60))
    assert out == hf_greedy(tiny_model, prompt, 60)
    assert stats.forward_calls < stats.new_tokens and stats.accepted["spine"] > 0
