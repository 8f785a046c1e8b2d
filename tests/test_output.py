"""A request's output on its way out (`goose.engine.output`): `TokenBlock`s carry each token's draft source to
every front end, and `Decoder.stream` / `Request.stream` detokenize incrementally (a token costs the same however
long the stream is) and honour stop strings."""

from __future__ import annotations

import random

import pytest
import torch

from goose.decoding import Decoder
from goose.drafting.tree import BRANCH, HEAD, MEMORY, ROOT, SPINE
from goose.engine.output import Detokenizer, TokenBlock
from goose.engine.scheduler import Engine


class CountingTokenizer:
    """A tokenizer that counts the tokens it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok, self.decoded = tok, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


@pytest.fixture(scope="module")
def long_model(worded):
    """A tiny Llama with SmolLM2's vocabulary and room for 4,100 tokens, which never emits a stop token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _, tok = worded
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4200,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[tok.eos_token_id] = 0.0  # its logit 0 is never the largest of 49,152 random ones
    return model, tok


def test_decoder_stream_costs_the_same_per_token_for_1000_and_4000_tokens(long_model):
    model, tok = long_model
    per_token = {}
    for n in (1000, 4000):
        counting = CountingTokenizer(tok)
        dec = Decoder(model, counting, "ar", memory_mb=0, prefix_cache_mb=0)
        counting.decoded = 0  # (the prompt's encoding decodes nothing; reset anyway)
        stream = dec.stream([1, 2, 3], n)
        text = "".join(stream)
        assert len(stream.result.token_ids) == n and text == tok.decode(stream.result.token_ids,
                                                                         skip_special_tokens=True)
        per_token[n] = counting.decoded / n
    assert per_token[4000] <= 1.5 * per_token[1000], per_token


def test_decoder_stream_ends_at_a_stop_string(worded):
    model, tok = worded
    dec = Decoder(model, tok, "goose")
    full = dec.generate("The quick brown fox", 60)
    assert len(full.text) > 20
    stop = full.text[12:16]
    stream = dec.stream("The quick brown fox", 60, stop=stop)
    text = "".join(stream)
    assert text == stream.result.text and stop in text and text.find(stop) + len(stop) > len(text) - 8 * 4
    assert full.text.startswith(text) and len(stream.result.token_ids) < len(full.token_ids)
    with pytest.raises(Exception, match="stop string"):
        dec.stream("The quick brown fox", 10, stop=[""])  # bad input: refused before anything is decoded


def test_blocks_carry_their_tokens_draft_sources(worded):
    """on_tokens receives TokenBlocks whose sources name each token's draft source; the tokens are the output."""
    model, tok = worded
    blocks = []
    with Engine(model, tok, "goose", thread=False) as eng:
        prompt = tok("one two three one two three one two three one two")["input_ids"]
        req = eng.submit(prompt, 40, on_tokens=blocks.append)
        streamed = list(eng.drive(req))
    assert all(isinstance(b, TokenBlock) and len(b.sources) == len(b) for b in blocks)
    assert [list(b) for b in streamed] == [list(b) for b in blocks]
    assert sum((list(b) for b in blocks), []) == req.result(0).token_ids
    known = {SPINE, BRANCH, MEMORY, HEAD, ROOT}
    assert all(s in known for b in blocks for s in b.sources) and all(b.sources[-1] == ROOT for b in blocks)
    names = [b.source_name(i) for b in blocks for i in range(len(b))]
    assert set(names) <= {"spine", "branch", "memory", "head", "bonus"} and names.count("bonus") == len(blocks)


@pytest.mark.parametrize("seed", range(6))
def test_detokenizer_pieces_concatenate_to_the_decoding(worded, seed):
    _, tok = worded
    rng = random.Random(seed)
    ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 80))]
    blocks, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        blocks.append(TokenBlock(ids[i:i + n], [rng.choice([SPINE, BRANCH, ROOT]) for _ in ids[i:i + n]]))
        i += n
    det = Detokenizer.of(tok)
    assert "".join(det.pieces(blocks)) == det.text == tok.decode(ids, skip_special_tokens=True)


def _lone_bytes(tok) -> list[int]:
    """SmolLM2's tokens that decode to U+FFFD alone (single bytes of multi-byte characters)."""
    return [i for i in range(len(tok)) if tok.decode([i]) == "\ufffd"]


def test_a_stream_of_undecodable_tokens_stays_linear_and_shows_its_text(worded):
    """Tokens whose text keeps ending inside a character (SmolLM2 has hundreds that decode to U+FFFD alone)
    used to make every token decode the whole tail again (2,000 of them: 0.99 s, nothing shown): the window
    is now bounded, the text is shown as it goes, and the pieces still concatenate to the decoding."""
    _, tok = worded
    lone = _lone_bytes(tok)
    assert len(lone) > 100
    rng = random.Random(0)
    per_token, shown = {}, {}
    for n in (500, 2000):
        ids = [rng.choice(lone) for _ in range(n)]
        counting = CountingTokenizer(tok)
        det = Detokenizer.of(counting)
        pieces = [p for b in ids for p, _ in det.feed([b])]
        shown[n] = len("".join(pieces))
        assert "".join(pieces) + det.finish() == tok.decode(ids, skip_special_tokens=True)
        per_token[n] = counting.decoded / n
    assert per_token[2000] <= 1.2 * per_token[500] and per_token[2000] < 60, per_token
    assert shown[2000] > 1500  # shown while streaming, not only at the end


@pytest.mark.parametrize("seed", range(8))
def test_detokenizer_with_partial_characters_concatenates_to_the_decoding(worded, seed):
    """Random runs of ordinary tokens and of single bytes of multi-byte characters (the ones that complete
    into characters and the ones that never do), fed in random blocks: the pieces and the rest are exactly
    the decoding."""
    _, tok = worded
    rng = random.Random(seed)
    lone = _lone_bytes(tok)
    ids = []
    while len(ids) < 200:
        ids += [rng.choice(lone) for _ in range(rng.randint(0, 12))]
        ids += [rng.randrange(len(tok)) for _ in range(rng.randint(0, 5))]
        ids += tok("héllo → 世界 🦆")["input_ids"] if rng.random() < 0.3 else []
    det = Detokenizer.of(tok)
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 6)
        out += [p for p, _ in det.feed(ids[i:i + n])]
        i += n
    assert "".join(out) + det.finish() == tok.decode(ids, skip_special_tokens=True)
