"""Streaming (HF streamers and the text iterator) and `model.generate(custom_generate=...)`."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import goose
from conftest import TINY_EOS, TINY_VOCAB, hf_greedy, make_tiny_llama
from goose.decoding import Decoder
from goose.errors import GooseError
from goose.selection.costmodel import CostCurve

BIG_TREES = CostCurve((1, 128), (10, 10.5))


class Recorder(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value) -> None:
        self.puts.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


@pytest.fixture(scope="module")
def worded():
    """A tiny random Llama over SmolLM2's real tokenizer (multi-byte pieces, spaces, newlines)."""
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    return make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=2), tok


def _prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        base = [rng.randrange(2, TINY_VOCAB) for _ in range(rng.randrange(2, 12))]
        out.append(base * rng.randrange(1, 4))
    return out


# ---- streaming -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["ar", "pld", "goose"])
def test_streamer_receives_prompt_then_exactly_the_generated_tokens(model, method):
    dec = Decoder(model, None, method, cost=BIG_TREES)
    for prompt in _prompts(4):
        rec = Recorder()
        res = dec.generate(prompt, 25, streamer=rec)
        assert rec.puts[0] == prompt and rec.ended == 1
        streamed = [t for block in rec.puts[1:] for t in block]
        assert streamed == res.token_ids == hf_greedy(model, prompt, 25)
        assert len(streamed) == 25 or streamed[-1] == TINY_EOS  # cut exactly at the limit / stop token


def test_max_new_tokens_inside_an_accepted_block_is_cut_exactly(model):
    prompt = [5, 6, 7, 8, 9, 10] * 6  # repetitive: long blocks are accepted
    dec = Decoder(model, None, "pld")
    for limit in range(1, 12):
        rec = Recorder()
        res = dec.generate(prompt, limit, streamer=rec)
        assert sum(len(b) for b in rec.puts[1:]) == len(res.token_ids) <= limit
        assert res.token_ids == hf_greedy(model, prompt, limit)


def test_text_stream_pieces_concatenate_to_the_generated_text(worded):
    model, tok = worded
    dec = Decoder(model, tok, "goose", cost=BIG_TREES)
    for seed, prompt in enumerate(["Hello world, hello world, hello", "def f(x):\n    return x\n\ndef g(", "é ü 你好"]):
        for options in ({}, {"do_sample": True, "seed": seed, "temperature": 1.5}):
            stream = dec.stream(prompt, 40, **options)
            pieces = list(stream)
            whole = dec.generate(prompt, 40, **options)
            assert "".join(pieces) == whole.text == stream.result.text
            assert stream.result.token_ids == whole.token_ids
            assert all(pieces) and not any(p.endswith("\ufffd") for p in pieces[:-1])  # no half characters


def test_text_iterator_streamer_from_another_thread(worded):
    model, tok = worded
    dec = Decoder(model, tok, "pld")
    streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    box = {}
    worker = threading.Thread(target=lambda: box.update(res=dec.generate("one two one two one", 30, streamer=streamer)))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text.strip() == box["res"].text.strip()


def test_stream_needs_a_tokenizer(model):
    with pytest.raises(GooseError, match="tokenizer"):
        Decoder(model, None, "ar").stream([3, 4], 5)


# ---- model.generate(custom_generate=...) -----------------------------------------------------------------

def _hf(model, prompt, **kw):
    ids = torch.tensor([prompt])
    return model.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=0, **kw)


@pytest.mark.parametrize("method", ["ar", "pld", "tr", "goose-paper", "goose"])
def test_custom_generate_greedy_returns_what_generate_returns(model, method):
    for prompt in _prompts(5, seed=1):
        ref = _hf(model, prompt, max_new_tokens=20, do_sample=False)
        got = _hf(model, prompt, max_new_tokens=20, do_sample=False, custom_generate=goose.custom_generate,
                  goose_method=method)
        assert torch.equal(got, ref), method


def test_custom_generate_honours_eos_token_id_and_max_length(model):
    prompt = _prompts(1, seed=5)[0]
    free = hf_greedy(model, prompt, 30)
    stop = free[7]
    ref = _hf(model, prompt, max_new_tokens=30, eos_token_id=stop)
    got = _hf(model, prompt, max_new_tokens=30, eos_token_id=stop, custom_generate=goose.custom_generate)
    assert torch.equal(got, ref) and got[0, -1] == stop
    ref = _hf(model, prompt, max_length=len(prompt) + 9)
    got = _hf(model, prompt, max_length=len(prompt) + 9, custom_generate=goose.custom_generate)
    assert torch.equal(got, ref)


def test_custom_generate_scores_and_logits_match_generate(model):
    prompt = [5, 6, 7, 8, 5, 6, 7]
    kw = dict(max_new_tokens=8, return_dict_in_generate=True, output_scores=True, output_logits=True,
              do_sample=False, repetition_penalty=1.3)
    ref = _hf(model, prompt, **kw)
    got = _hf(model, prompt, custom_generate=goose.custom_generate, **kw)
    assert torch.equal(got.sequences, ref.sequences)
    for a, b in zip(got.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b)
    for a, b in zip(got.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b)


def test_custom_generate_sampling_is_seeded_by_torch_and_equals_ar(model):
    prompt = [5, 6, 7, 8, 9] * 3
    kw = dict(max_new_tokens=25, do_sample=True, temperature=0.8, top_p=0.9, top_k=30,
              custom_generate=goose.custom_generate)
    torch.manual_seed(0)
    ar = _hf(model, prompt, goose_method="ar", **kw)
    torch.manual_seed(0)
    gs = _hf(model, prompt, **kw)
    torch.manual_seed(1)
    other = _hf(model, prompt, **kw)
    assert torch.equal(ar, gs) and not torch.equal(gs, other)


def test_directory_entry_streams(model):
    prompt = [5, 6, 7, 8, 5, 6, 7]
    rec = Recorder()
    got = _hf(model, prompt, max_new_tokens=20, custom_generate=goose.HUB_ENTRY, trust_remote_code=True,
              streamer=rec, goose_method="pld")
    assert torch.equal(got, _hf(model, prompt, max_new_tokens=20))
    assert rec.puts[0] == prompt and rec.ended == 1
    assert [t for b in rec.puts[1:] for t in b] == got[0, len(prompt):].tolist()


@pytest.mark.parametrize("kw, needle", [
    ({"num_beams": 2}, "beam"),
    ({"output_attentions": True, "return_dict_in_generate": True}, "output_attentions"),
])
def test_custom_generate_refuses_what_it_cannot_do(model, kw, needle):
    with pytest.raises(GooseError, match=needle):
        _hf(model, [5, 6, 7], max_new_tokens=5, custom_generate=goose.custom_generate, **kw)


def test_custom_generate_refuses_batches_and_padding(model):
    ids = torch.tensor([[5, 6, 7], [7, 8, 9]])
    with pytest.raises(GooseError, match="one sequence"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=0,
                       custom_generate=goose.custom_generate)
    ids = torch.tensor([[0, 6, 7]])
    with pytest.raises(GooseError, match="padded"):
        model.generate(ids, attention_mask=torch.tensor([[0, 1, 1]]), max_new_tokens=3, pad_token_id=0,
                       custom_generate=goose.custom_generate)


def test_interleaved_requests_on_one_model_each_decode_on_their_own_cache(worded):
    """A paused stream, other decoders of the same model (one of them measuring its cost curve), a second
    stream of the same decoder and custom_generate in between: every output equals its request run alone."""
    model, tok = worded
    a, b = Decoder(model, tok, "ar"), Decoder(model, tok, "pld")
    assert a.forward is b.forward  # the packed weights are shared, the caches are not
    prompts = ["one two three one two three", "something else", "three two one"]
    alone = [a.generate(p, 20).token_ids for p in prompts]
    streams = [a.stream(prompts[0], 20), a.stream(prompts[2], 20)]
    its = [iter(s) for s in streams]
    first = [next(it) for it in its]
    assert b.generate(prompts[1], 20).token_ids == alone[1]
    Decoder(model, tok, "goose", cost=None)  # builds (measures or loads) a cost curve on the shared forward
    ids = torch.tensor([tok(prompts[1])["input_ids"]])
    hub = model.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=goose.custom_generate,
                         max_new_tokens=20, do_sample=False, goose_method="ar")
    assert hub[0, ids.shape[1]:].tolist() == alone[1]
    texts = [f + "".join(it) for f, it in zip(first, its)]
    assert [s.result.token_ids for s in streams] == [alone[0], alone[2]]
    assert texts == [s.result.text for s in streams]
