"""Stop strings counted in bytes: emoji and CJK characters are several byte-level tokens each, and a stop
string of them ends the request at the token that completes it, in the engine (`Engine.submit(stop=[...])`)
and through the server (finish_reason, completion_tokens, the stream's end), however the tokens are split
into committed blocks."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_tiny_llama
from goose import Engine, GooseError
from goose.engine.output import MAX_STOP_BYTES, StopStrings

CYCLE_TEXT = "白鹅🦢 goose"  # byte-level tokens, none of them twice: a bigram model can repeat it
PROMPT = [5, 6, 7]
# the last one: 12 characters of 19 tokens, past a window of (characters + 4) tokens
STOPS = ["鹅🦢", "🦢 goose白", " goose白鹅", "白鹅🦢 goose白鹅🦢 goose白", "白鹅🦢 goose白鹅🦢"]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    return AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))


@pytest.fixture(scope="module")
def cycle(tok):
    ids = tok(CYCLE_TEXT)["input_ids"]
    assert len(ids) == len(set(ids)) and len(ids) > len(CYCLE_TEXT)  # characters of several tokens
    return ids


@pytest.fixture(scope="module")
def scripted(tok, cycle):
    return scripted_llama(len(tok), cycle)


def scripted_llama(vocab: int, cycle: list[int]):
    """A Llama whose greedy output repeats `cycle` forever after any other token: its layers add nothing (the
    attention and MLP outputs are zero), each cycle token's embedding is a direction of its own, and the
    output head maps that direction to the next token of the cycle."""
    model = make_tiny_llama(dtype=torch.float32, vocab=vocab, seed=3)
    hidden = model.config.hidden_size
    assert len(cycle) < hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        head.zero_()
        emb[:, len(cycle)] = 1.0  # every other token leads into the cycle
        head[cycle[0], len(cycle)] = 10.0
        for k, t in enumerate(cycle):
            emb[t].zero_()
            emb[t, k] = 1.0
            head[cycle[(k + 1) % len(cycle)], k] = 10.0
    return model


def expected(tok, cycle, stop: str) -> list[int]:
    """The cycle's tokens up to the first one whose text holds `stop`."""
    out = []
    while stop not in tok.decode(out, skip_special_tokens=True):
        assert len(out) < 100, f"{stop!r} is not in the cycle's text"
        out.append(cycle[len(out) % len(cycle)])
    return out


@pytest.mark.parametrize("method", ["ar", "goose"])
def test_the_engine_stops_at_the_token_that_completes_an_emoji_or_cjk_stop(tok, cycle, scripted, method):
    """"ar" commits one token per step (every stop string spans several blocks), "goose" drafts the repeated
    cycle and commits many per step (stop strings inside one block)."""
    with Engine(scripted, tok, method, max_batch=2) as eng:
        plain = eng.generate(PROMPT, 40)
        assert plain.token_ids == [cycle[k % len(cycle)] for k in range(40)]  # the script runs
        for stop in STOPS:
            req = eng.submit(PROMPT, 300, stop=[stop, "never there"])
            got = req.result(timeout=60)
            want = expected(tok, cycle, stop)
            assert req.finish_reason == "stop" and got.token_ids == want, stop
            assert got.text.endswith(stop) and got.stats.new_tokens == len(want)
        assert eng.submit(PROMPT, 300, stop="🦢").result(timeout=60).token_ids == expected(tok, cycle, "🦢")


def test_the_stop_window_holds_the_stop_strings_bytes(tok):
    """Checked token by token on every prefix of a text of emoji and CJK, the window finds a stop string at
    exactly the token whose text first holds it (also stop strings of 1-byte tokens after multi-byte ones)."""
    text = "Hello 🦢🦢🦢 world 白鹅飞 over the lake. 🦢🦢🦢! " + "abc " * 40 + "🦢🦢🦢 白鹅飞"
    ids = tok(text)["input_ids"]
    for stop in ["🦢🦢🦢", "白鹅飞", "lake. 🦢", "🦢!", "abc 🦢", " 白鹅飞", "🦢🦢🦢 白鹅飞", "no such text"]:
        check = StopStrings(tok, [stop])
        first = next((k for k in range(1, len(ids) + 1) if check(ids[:k])), None)
        want = next((k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k])), None)
        assert first == want, stop
        assert check.window(ids) > 0  # a window, not the whole text


def test_stop_strings_are_bounded_in_bytes(tok):
    with pytest.raises(GooseError, match="MAX_STOP_BYTES"):
        StopStrings(tok, ["鹅" * (MAX_STOP_BYTES // 3 + 1)])  # fewer characters than bytes
    with pytest.raises(GooseError, match="non-empty"):
        StopStrings(tok, [""])
    with pytest.raises(GooseError, match="tokenizer"):
        StopStrings(None, ["x"])
    StopStrings(tok, ["鹅" * (MAX_STOP_BYTES // 3)])


# ---- through the server ---------------------------------------------------------------------------------

def test_the_server_ends_a_request_at_an_emoji_stop(tok, cycle, scripted):
    pytest.importorskip("fastapi")
    from serving import live_server, raw

    stop = "白鹅🦢 goose白鹅🦢"  # 12 characters, 19 tokens
    want = expected(tok, cycle, stop)
    text = tok.decode(want, skip_special_tokens=True)
    text = text[: text.find(stop)]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 500, "temperature": 0, "stop": [stop]}
    eng = Engine(scripted, tok, "ar", max_batch=2)
    try:
        with live_server(eng) as base:
            status, _, out = raw(base, "POST", "/v1/completions", body)
            r = json.loads(out)
            assert status == 200 and r["choices"][0]["finish_reason"] == "stop"
            assert r["choices"][0]["text"] == text and r["goose"]["completion_token_ids"] == want
            assert r["usage"]["completion_tokens"] == len(want)
            steps = eng.steps
            status, _, out = raw(base, "POST", "/v1/completions", {**body, "stream": True,
                                                                    "stream_options": {"include_usage": True}})
            events = out.decode().split("\n\n")
            assert status == 200 and events[-2] == "data: [DONE]"  # the stream closed
            chunks = [json.loads(e[6:]) for e in events[:-2]]
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
            assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"
            assert chunks[-1]["usage"]["completion_tokens"] == len(want)
            assert eng.steps - steps <= len(want) + 1  # no decoding on to max_tokens
            over = "鹅" * (MAX_STOP_BYTES // 3 + 1)
            status, _, out = raw(base, "POST", "/v1/completions", {**body, "stop": [over]})
            err = json.loads(out)["error"]
            assert status == 400 and "MAX_STOP_BYTES" in err["message"] and err["param"] == "stop"
    finally:
        eng.close(timeout=10, cancel=True)
