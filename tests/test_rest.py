"""REST: suffix array and lookups against brute force, the frequency trie, the saved store, the CLI, and
token identity with greedy `model.generate`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import TINY_EOS, TINY_VOCAB, greedy_store, hf_greedy
from goose.cli import main
from goose.config import DecodeConfig, RestConfig
from goose.decoding import Decoder
from goose.drafting import datastore as ds
from goose.drafting.baselines import build_trie
from goose.engine.methods import Rest
from goose.errors import GooseError
from goose.loading.model import model_dir

docs_st = st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=1, max_size=6)


def brute_suffixes(tokens: list[int]) -> list[int]:
    return sorted(range(len(tokens)), key=lambda i: tokens[i:])


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(st.integers(-1, 4), max_size=80))
def test_suffix_array_equals_sorting_all_suffixes(tokens):
    assert ds.suffix_array(np.array(tokens, dtype=np.int32)).tolist() == brute_suffixes(tokens)


@settings(max_examples=150, deadline=None)
@given(docs=docs_st, query=st.lists(st.integers(0, 5), min_size=1, max_size=4))
def test_find_returns_every_occurrence(docs, query):
    store = ds.from_token_ids(docs)
    toks = store.tokens.tolist()
    m = len(query)
    brute = sorted(i for i in range(len(toks)) if toks[i : i + m] == query)
    lo, hi = store.find(query)
    assert sorted(store.sa[lo:hi].tolist()) == brute


@settings(max_examples=100, deadline=None)
@given(docs=docs_st, context=st.lists(st.integers(0, 5), min_size=1, max_size=12),
       min_suffix=st.integers(1, 3), max_suffix=st.integers(3, 8), length=st.integers(1, 5))
def test_longest_match_and_continuations_equal_brute_force(docs, context, min_suffix, max_suffix, length):
    store = ds.from_token_ids(docs)
    toks = store.tokens.tolist()

    def occ(q):
        return [i for i in range(len(toks)) if toks[i : i + len(q)] == q]

    best = 0
    for m in range(min(max_suffix, len(context)), min_suffix - 1, -1):
        if occ(context[-m:]):
            best = m
            break
    m, lo, hi = store.longest_match(context, max_suffix, min_suffix)
    assert m == best
    conts = store.continuations(context, length, 10**6, max_suffix, min_suffix)
    if best == 0:
        assert conts == []
        return
    expect = []
    for i in occ(context[-best:]):
        c = []
        for t in toks[i + best : i + best + length]:
            if t == ds.SEP:
                break
            c.append(t)
        if c:
            expect.append(tuple(c))
    assert sorted(conts) == sorted(expect)


def test_continuations_are_sampled_evenly_when_the_match_is_frequent():
    store = ds.from_token_ids([[1, 2, i % 7 + 3] for i in range(100)])
    conts = store.continuations([9, 1], 2, 10, 4, 1)
    assert len(conts) == 10 and all(c[0] == 2 for c in conts)
    assert len({c for c in conts}) > 1  # not the first ten of one sorted block


def test_trie_keeps_the_most_frequent_prefixes_within_the_budget():
    conts = [(1, 2, 3)] * 3 + [(1, 2, 4)] * 2 + [(5, 6)]
    tree = build_trie(0, conts, 4)
    # counts: (1)=5 (1,2)=5 (1,2,3)=3 (1,2,4)=2 (5)=1 (5,6)=1
    assert tree.tokens == [0, 1, 2, 3, 4] and tree.parents == [-1, 0, 1, 2, 2]
    assert tree.ranks == [0, 0, 0, 0, 1]
    full = build_trie(0, conts, 100)
    assert len(full) == 7 and full.tokens[5:] == [5, 6]
    assert build_trie(0, [], 10).route == "ar" and len(build_trie(0, conts, 0)) == 1


@settings(max_examples=100, deadline=None)
@given(conts=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=5).map(tuple), max_size=20),
       budget=st.integers(0, 30))
def test_trie_is_closed_under_parents_and_holds_only_retrieved_paths(conts, budget):
    tree = build_trie(9, conts, budget)
    prefixes = {c[:d] for c in conts for d in range(1, len(c) + 1)}
    assert len(tree) - 1 == min(budget, len(prefixes))
    for i in range(1, len(tree)):
        path = tuple(tree.tokens[j] for j in tree.path_to(i)[1:])
        assert path in prefixes


def test_store_round_trips_through_the_cache_memory_mapped(tmp_path):
    store = ds.from_token_ids([[3, 4, 5], [3, 4, 6]], {"name": "t"})
    ds.save(store, tmp_path / "t")
    back = ds.load("t", tmp_path / "t")
    assert not back.tokens.flags.writeable and not back.sa.flags.writeable  # memory-mapped, read-only
    assert back.tokens.tolist() == store.tokens.tolist() and back.sa.tolist() == store.sa.tolist()
    assert back.continuations([3, 4], 3, 10, 4, 1) in ([(5,), (6,)], [(6,), (5,)])
    assert back.info()["bytes"] > 0 and back.meta["docs"] == 2 and back.meta["tokens"] == 6


def test_missing_store_names_the_build_command(tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(GooseError, match="goose datastore build --name default"):
        Decoder(tiny_model, None, "rest")


class FakeTokenizer:
    name_or_path = "fake"

    def __init__(self, shift: int = 0) -> None:
        self.shift = shift

    def __len__(self) -> int:
        return 50

    def __call__(self, texts, add_special_tokens=False):
        one = isinstance(texts, str)
        ids = [[(ord(c) + self.shift) % 50 for c in t] for t in ([texts] if one else texts)]
        return {"input_ids": ids[0] if one else ids}


def test_store_built_for_another_tokenizer_is_refused(tmp_path):
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "a.py").write_text("def f(x):\n    return x\n")
    (folder / "skip.bin").write_text("not read")
    store = ds.build(FakeTokenizer(), [str(folder)], "code", path=tmp_path / "code")
    assert store.meta["docs"] == 1 and store.meta["sources"] == {str(folder): 1}
    ds.check_tokenizer(store, FakeTokenizer(), 50)
    with pytest.raises(GooseError, match="built for tokenizer"):
        ds.check_tokenizer(store, FakeTokenizer(shift=1), 50)
    with pytest.raises(GooseError, match="vocabulary of 50"):
        ds.check_tokenizer(store, None, 40)
    with pytest.raises(GooseError, match="unknown source"):
        ds.build(FakeTokenizer(), [str(tmp_path / "nowhere")], "x", path=tmp_path / "x")


def test_cli_builds_and_describes_a_store(tmp_path, monkeypatch, capsys):
    model = str(model_dir("smollm2-135m"))  # resolved before the cache dir moves
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "m.py").write_text("import os\n\ndef main():\n    print(os.getcwd())\n" * 20)
    assert main(["datastore", "build", "--source", str(folder), "--source", "python-stdlib", "--max-docs", "3",
                 "--model", model, "--name", "mini", "--no-progress"]) == 0
    assert (tmp_path / "goose" / "datastores" / "mini" / "sa.npy").is_file()
    capsys.readouterr()
    assert main(["datastore", "info", "--name", "mini"]) == 0
    out = capsys.readouterr().out
    assert "python-stdlib (3 docs)" in out and "tokens" in out and "vocab 49152" in out
    assert main(["datastore", "info", "--name", "absent"]) == 2
    assert "goose datastore build --name absent" in capsys.readouterr().err


prompts = st.one_of(
    st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=30),
    st.builds(lambda motif, reps: motif * reps, st.lists(st.integers(2, TINY_VOCAB - 1), min_size=1, max_size=5),
              st.integers(2, 6)),
    st.sampled_from([[5, 6, 7, 8] * 5, [5, 6, 7, 8] * 3]),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts, max_new=st.integers(1, 40), budget=st.integers(0, 40), length=st.integers(1, 12),
       backend=st.sampled_from(["hf", "lean"]))
def test_rest_equals_greedy_generate(tiny_model, prompt, max_new, budget, length, backend):
    from goose.backends.forward import HFForward
    from goose.backends.lean import LeanForward

    ref = hf_greedy(tiny_model, prompt, max_new)
    method = Rest(RestConfig(node_budget=budget, continuation_length=length, min_suffix=1), greedy_store(tiny_model))
    fwd = HFForward(tiny_model) if backend == "hf" else LeanForward(tiny_model)
    out, _ = Decoder(tiny_model, None, method, forward=fwd).generate_ids(prompt, DecodeConfig(max_new_tokens=max_new))
    assert out == ref
    assert len(out) == max_new or out[-1] == TINY_EOS


def test_rest_accepts_retrieved_continuations(tiny_model):
    prompt = [5, 6, 7, 8] * 5
    out, stats = Decoder(tiny_model, None, Rest(store=greedy_store(tiny_model))).generate_ids(
        prompt, DecodeConfig(max_new_tokens=30))
    assert out == hf_greedy(tiny_model, prompt, 30)
    assert stats.forward_calls < stats.new_tokens and stats.accepted["spine"] > 0


def test_python_stdlib_corpus_reads_source_files():
    docs = list(ds.corpus("python-stdlib", max_docs=2))
    assert len(docs) == 2 and all(d.strip() for d in docs)
    assert Path(ds.python_stdlib_dir()).is_dir()
