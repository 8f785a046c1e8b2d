"""`goose serve`'s keys and tenants: a request that names no tenant is private with or without an API key (it
reuses no stored prefix, stores none, and has no suffix memory); a key file gives several keys, and a key's
tenant shares its requests' caches; `user` and `cache_salt` scope further inside it; a malformed key file is a
one-line startup error naming the line; `--hide-draft-sources` leaves the draft sources out of responses."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from conftest import TINY_EOS, TINY_VOCAB, greedy_memo, hf_greedy, make_tiny_llama  # noqa: E402
from goose import Engine  # noqa: E402
from goose.backends import cpukernel  # noqa: E402
from goose.decoding import encode_chat  # noqa: E402
from goose.server.keys import MAX_KEY_LINES, read_key_file  # noqa: E402
from serving import TIMEOUT, live_server, raw  # noqa: E402

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
SYSTEM = "You are the assistant of one client. Their secret plan: migrate the geese north in May. " * 2
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the plan?"}]


@pytest.fixture(scope="module")
def want(worded):
    model, tok = worded
    return hf_greedy(model, encode_chat(tok, MESSAGES), 8, eos=TINY_EOS)


def asker(base: str, key: str, want: list[int]):
    """ask(**kw): the cached prompt tokens of one greedy chat request (its tokens checked against `want`)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)

    def ask(**kw) -> int:
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, **kw)
        assert r.model_extra["goose"]["completion_token_ids"] == want
        return r.usage.prompt_tokens_details.cached_tokens

    return ask


@needs_kernel
def test_a_private_request_neither_reuses_nor_stores_prefixes():
    """`Engine.submit(..., private=True)`: no stored prefix is taken, none is stored, no memory is read or
    written; the tokens are the same."""
    model = make_tiny_llama(torch.float32, seed=7)
    prompt = [(7 * i) % (TINY_VOCAB - 2) + 2 for i in range(35)]
    with Engine(model, None, "goose", max_batch=2) as eng:
        first = eng.submit(prompt, 10, private=True).result(timeout=60)
        assert len(eng.prefixes) == 0 and len(eng.memories) == 0
        eng.generate(prompt, 10)  # the anonymous tenant stores it
        stored = len(eng.prefixes)
        again = eng.submit(prompt, 10, private=True).result(timeout=60)
        assert stored > 0 and len(eng.prefixes) == stored and again.stats.cached_tokens == 0
        assert eng.generate(prompt, 10).stats.cached_tokens > 0  # (what a shared request takes)
    assert first.token_ids == again.token_ids == greedy_memo(model, prompt, 10)


@needs_kernel
@pytest.mark.parametrize("api_key", [None, "the-one-key"])
def test_requests_naming_no_tenant_are_private_with_or_without_a_key(worded, want, api_key):
    model, tok = worded
    eng = Engine(model, tok, "goose", max_batch=2)
    try:
        with live_server(eng, api_key=api_key) as base:
            ask = asker(base, api_key or "none", want)
            assert [ask(), ask()] == [0, 0]  # nothing reused between clients, however many share the key
            assert len(eng.prefixes) == 0 and len(eng.memories) == 0  # nothing stored either
            assert ask(user="alice") == 0 and ask(user="alice") > 0  # a named tenant reuses its own prefix
            assert ask() == 0 and len(eng.memories) == 1
    finally:
        eng.close(timeout=10, cancel=True)


@needs_kernel
def test_a_key_files_tenant_shares_its_keys_caches(worded, want, tmp_path):
    model, tok = worded
    path = tmp_path / "keys"
    path.write_text("# key   tenant\n\nk-one   acme\n  k-two acme  \nk-three\n")
    eng = Engine(model, tok, "goose", max_batch=2)
    try:
        with live_server(eng, api_keys=read_key_file(str(path))) as base:
            one, two, three = (asker(base, k, want) for k in ("k-one", "k-two", "k-three"))
            assert one() == 0 and two() > 0  # the tenant comes from the key alone
            assert three() == 0 and three() == 0  # a key without a tenant names none: private
            assert one(user="bob") == 0 and two(user="bob") > 0  # `user` scopes inside the key's tenant
            assert two(extra_body={"cache_salt": "s"}) == 0
            assert len(eng.memories) == 3  # acme's, acme + bob's, acme + salt's
            for key in ("", "k-four", "k-one acme"):
                headers = {"Authorization": f"Bearer {key}"}
                assert raw(base, "POST", "/v1/completions", {"prompt": "x"}, headers)[0] == 401
    finally:
        eng.close(timeout=10, cancel=True)


@pytest.mark.parametrize("text, needle", [
    ("k1 acme extra\n", "line 1: expected 'KEY' or 'KEY TENANT', got 3 fields"),
    ("# keys\nk1\nk2 t\nk1 u\n", "line 4: the key of line 2 again"),
    ("ключ\n", "line 1: a key is 1 to 256 visible ASCII characters"),
    ("k" * 257 + "\n", "line 1: a key is 1 to 256"),
    ("k1 " + "t" * 129 + "\n", "line 1: a tenant has at most 128 characters"),
    ("\n# nothing here\n", "holds no key"),
    ("".join(f"k{i}\n" for i in range(MAX_KEY_LINES + 1)), "more than 10,000 lines"),
])
def test_a_malformed_key_file_is_a_one_line_startup_error(tmp_path, capsys, text, needle):
    from goose.cli import main

    path = tmp_path / "keys"
    path.write_text(text)
    assert main(["serve", "--model", "smollm2-135m", "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and str(path) in err


def test_a_key_and_a_key_file_are_not_both_given(tmp_path, capsys):
    from goose.cli import main

    path = tmp_path / "keys"
    path.write_text("k1\n")
    assert main(["serve", "--model", "smollm2-135m", "--api-key", "k0", "--api-key-file", str(path)]) == 2
    assert "not both" in capsys.readouterr().err


def test_hidden_draft_sources(worded):
    model, tok = worded
    eng = Engine(model, tok, "goose", max_batch=2)
    body = {"model": "tiny", "prompt": "a b c a b c a b c a b", "max_tokens": 24, "temperature": 0}
    try:
        for hide in (False, True):
            with live_server(eng, hide_sources=hide) as base:
                status, _, out = raw(base, "POST", "/v1/completions", body)
                info = json.loads(out)["goose"]
                assert status == 200 and info["completion_token_ids"] and info["forward_calls"] >= 1
                assert ("accepted" in info and "drafted" in info) is not hide
                status, _, out = raw(base, "POST", "/v1/completions", {**body, "stream": True, "sources": True})
                events = [json.loads(e[6:]) for e in out.decode().split("\n\n")[:-2]]
                pieces = [e for e in events if "pieces" in e.get("goose", {})]
                assert status == 200 and bool(pieces) is not hide
                assert ("accepted" in events[-1]["goose"]) is not hide
    finally:
        eng.close(timeout=10, cancel=True)


@pytest.mark.parametrize("flag", ["", "  "])
def test_an_empty_api_key_is_refused_even_with_the_environment_set(capsys, monkeypatch, flag):
    """`--api-key ""` used to turn authentication off silently, even with GOOSE_API_KEY set."""
    from goose.cli import main

    monkeypatch.setenv("GOOSE_API_KEY", "from-the-environment")
    assert main(["serve", "--model", "smollm2-135m", "--api-key", flag]) == 2
    assert "API key given is empty" in capsys.readouterr().err


def test_the_openapi_document_needs_the_api_key(worded):
    from serving import raw

    model, tok = worded
    with Engine(model, tok, "ar", max_batch=1) as eng:
        with live_server(eng, api_key="k1") as base:
            assert raw(base, "GET", "/openapi.json")[0] == 401
            status, _, body = raw(base, "GET", "/openapi.json", headers={"Authorization": "Bearer k1"})
    assert status == 200 and "/v1/chat/completions" in json.loads(body)["paths"]
