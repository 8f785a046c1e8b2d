"""vLLM-compatible clients and dashboards: vLLM's request extensions that goose honours exactly (`ignore_eos`,
`min_tokens` where exact, neutral values of the rest), a 400 naming any other field, and vLLM's Prometheus
series beside goose's own, counting what the responses say. A live server on a loopback port, a tiny random
Llama with SmolLM2's tokenizer whose stop token is one its greedy text reaches early."""

from __future__ import annotations

import json

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from conftest import make_tiny_llama  # noqa: E402
from goose import Engine  # noqa: E402
from serving import live_server  # noqa: E402
from test_server import TIMEOUT, raw, wait_idle  # noqa: E402

PROMPT = [17, 923, 4410, 88, 3001, 42, 5, 777, 1203, 64]  # token ids (completions accept them)
N = 12


@pytest.fixture(scope="module")
def setup():
    """(engine, plain greedy continuation of PROMPT without any stop token, the stop token's first index)."""
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    model = make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=4)
    with Engine(model, tok, "ar", max_batch=1) as probe:
        full = probe.submit(PROMPT, N, eos=[]).result(timeout=TIMEOUT).token_ids
    assert len(full) == N
    stop_at = full.index(full[3])  # the stop token: the 4th greedy token, first reached at stop_at <= 3
    model.generation_config.eos_token_id = full[3]
    eng = Engine(model, tok, "goose", max_batch=4, max_queue=8, prefix_cache_mb=0.02)
    yield eng, full, stop_at
    eng.close(timeout=10, cancel=True)


@pytest.fixture(scope="module")
def url(setup):
    with live_server(setup[0]) as base:
        yield base


@pytest.fixture()
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def ids_of(r) -> list[int]:
    return r.model_extra["goose"]["completion_token_ids"]


# ---- request fields -----------------------------------------------------------------------------------
@pytest.mark.parametrize("speculative", ["goose", "off", "pld"])
def test_ignore_eos_generates_exactly_max_tokens_of_the_greedy_text(client, setup, speculative):
    _, full, stop_at = setup
    spec = {"speculative": speculative}
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, extra_body=spec)
    assert ids_of(plain) == full[: stop_at + 1] and plain.choices[0].finish_reason == "stop"
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0,
                                  extra_body={"ignore_eos": True, **spec})
    assert ids_of(r) == full and r.usage.completion_tokens == N and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "min_tokens": N, **spec}))
    assert ids_of(chunks[-1]) == full and chunks[-1].usage.completion_tokens == N
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_ignore_eos_with_sampling_and_chat(client, setup):
    """Sampled: exactly max_tokens tokens, and the same ones for the same seed (the stop token may be among them)."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Count geese."}], max_completion_tokens=20,
              temperature=1.0, seed=7, extra_body={"ignore_eos": True, "top_k": 50})
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.usage.completion_tokens == 20 and ids_of(a) == ids_of(b)


def test_vllm_benchmark_payload_is_accepted(url):
    """What `vllm bench serve --backend openai-chat` sends, with the neutral values of vLLM's other fields."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi there"}], "max_completion_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0,
            "top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "n": 1, "seed": 3,
            "skip_special_tokens": True, "spaces_between_special_tokens": True, "stop_token_ids": [],
            "include_stop_str_in_output": False, "priority": 0, "add_generation_prompt": True,
            "continue_final_message": False, "echo": False, "chat_template_kwargs": {}, "tools": [],
            "tool_choice": "none", "parallel_tool_calls": True, "response_format": {"type": "text"},
            "min_tokens": 5, "use_beam_search": False}
    status, _, out = raw(url, "POST", "/v1/chat/completions", body)
    assert status == 200, out
    events = [json.loads(e[6:]) for e in out.decode().split("\n\n") if e.startswith("data: {")]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["usage"]["completion_tokens"] == 5


def test_router_payload_is_accepted(url):
    """What vLLM's router (`goose replicas`) passes on: the client's body plus its fields at neutral values."""
    for path, body in (
        ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                  "stream": False, "user": "a", "logprobs": False, "no_stop_trim": False,
                                  "ignore_eos": False, "continue_final_message": False, "skip_special_tokens": True,
                                  "separate_reasoning": True, "stream_reasoning": True,
                                  "return_hidden_states": False, "include_reasoning": True}),
        ("/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 4, "stream": False, "echo": False,
                             "user": "a", "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                             "return_hidden_states": False})):
        status, _, out = raw(url, "POST", path, body)
        assert status == 200, out


@pytest.mark.parametrize("field, value", [
    ("no_stop_trim", True), ("return_hidden_states", True), ("separate_reasoning", False),
    ("stream_reasoning", False), ("include_reasoning", False),
    ("min_p", 0.05), ("repetition_penalty", 1.1), ("stop_token_ids", [5]), ("skip_special_tokens", False),
    ("include_stop_str_in_output", True), ("priority", 2), ("use_beam_search", True), ("tools", [{"type": "x"}]),
    ("tool_choice", "required"), ("response_format", {"type": "json_object"}), ("add_generation_prompt", False),
    ("continue_final_message", True), ("echo", True), ("chat_template_kwargs", {"enable_thinking": True}),
    ("truncate_prompt_tokens", 8), ("prompt_logprobs", 1), ("min_tokens", 3), ("best_of", 2),
    ("frobnicate", 1), ("guided_json", {"type": "object"}), ("stream_options", {"continuous_usage_stats": True}),
])
def test_fields_goose_cannot_honour_get_a_400_naming_them(url, field, value):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True,
            field: value}
    status, _, out = raw(url, "POST", "/v1/chat/completions", body)
    err = json.loads(out)["error"]
    assert status == 400 and field in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("extra, needle", [
    ({"min_tokens": 3}, "ignore_eos"),  # would need the stop tokens masked
    ({"min_tokens": 3, "ignore_eos": True, "stop": ["x"]}, "stop strings"),
    ({"min_tokens": 9, "ignore_eos": True}, "at least min_tokens"),  # max_tokens 4 < 9
    ({"min_tokens": -1}, "min_tokens"),
])
def test_min_tokens_only_where_it_is_exact(url, extra, needle):
    status, _, out = raw(url, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                          **extra})
    assert status == 400 and needle in json.loads(out)["error"]["message"]
    ok, _, out = raw(url, "POST", "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 4,
                                                      "min_tokens": 4, "ignore_eos": True, "temperature": 0})
    assert ok == 200 and json.loads(out)["usage"]["completion_tokens"] == 4


# ---- /metrics --------------------------------------------------------------------------------------------
def scrape(url: str) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} of /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, _, body = raw(url, "GET", "/metrics")
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}


V = (("engine", "0"), ("model_name", "tiny"))


def test_vllm_series_count_what_the_responses_say(client, url, setup):
    engine = setup[0]
    wait_idle(engine)
    before = scrape(url)
    got = []
    for i in range(5):  # distinct prompts of one tenant (the prefix cache keeps 0.02 MiB: they evict each other)
        prompt = PROMPT if i == 1 else [(t * (i + 3)) % 5000 + 10 for t in range(1, 41)]  # PROMPT: a stop
        got.append(client.completions.create(model="tiny", prompt=prompt, max_tokens=8 + i, temperature=0,
                                             user="series", extra_body={"ignore_eos": i % 2 == 0}))
    wait_idle(engine)
    after = scrape(url)

    def delta(name, labels=V):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    assert delta("vllm:prompt_tokens_total") == sum(r.usage.prompt_tokens for r in got) == 170
    assert delta("vllm:generation_tokens_total") == sum(r.usage.completion_tokens for r in got)
    assert delta("vllm:prompt_tokens_cached_total") == sum(r.usage.prompt_tokens_details.cached_tokens for r in got)
    reasons = [r.choices[0].finish_reason for r in got]
    for reason in ("stop", "length"):
        labels = tuple(sorted(V + (("finished_reason", reason),)))
        assert delta("vllm:request_success_total", labels) == reasons.count(reason)
    assert reasons.count("stop") == 1
    for hist in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert delta(hist + "_count") == 5 and delta(hist + "_sum") > 0
    tokens = [r.usage.completion_tokens for r in got]
    assert delta("vllm:request_time_per_output_token_seconds_count") == sum(n >= 2 for n in tokens)
    itl = delta("vllm:inter_token_latency_seconds_count")  # one per token block after the first
    assert 0 < itl <= sum(n - 1 for n in tokens) and delta("vllm:time_per_output_token_seconds_count") == itl
    goose = [r.model_extra["goose"] for r in got]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == sum(sum(g["accepted"].values()) for g in goose)
    assert delta("vllm:spec_decode_num_draft_tokens_total") == sum(sum(g["drafted"].values()) for g in goose)
    assert 0 < delta("vllm:spec_decode_num_drafts_total") <= sum(g["forward_calls"] - 1 for g in goose)
    assert after[("vllm:num_requests_running", V)] == 0 and after[("vllm:num_requests_waiting", V)] == 0
    # goose's own series beside them, and the prefix cache's evictions
    assert delta("goose_generation_tokens_total", ()) == delta("vllm:generation_tokens_total")
    store = engine.prefixes
    assert after[("goose_prefix_cache_evicted_blocks_total", ())] == store.evicted > 0
    assert after[("goose_prefix_cache_bytes", ())] == store.bytes <= after[("goose_prefix_cache_limit_bytes", ())]
    assert after[("goose_prefix_cache_blocks", ())] == len(store)


# ---- a soak whose working set outgrows the prefix cache ------------------------------------------------
def test_soak_with_unique_prompts_and_stops_makes_the_prefix_cache_evict(url, setup, tmp_path, capsys):
    from goose.cli import main

    engine = setup[0]
    wait_idle(engine)
    out = tmp_path / "soak.json"
    rc = main(["bench-serve", "--url", url + "/v1", "--concurrency", "3", "--requests", "3", "--max-tokens", "6",
               "--soak", "24", "--soak-unique", "--soak-stop-rate", "0.5", "--json", str(out), "--timeout", "120"])
    soak = json.loads(out.read_text())["soak"]
    assert rc == 0 and soak["requests"] == 24 and soak["errors"] == 0 and soak["running_after"] == 0
    assert soak["unique_prompts"] and soak["prefix_evicted_blocks"] > 0 and soak["prompt_tokens"] > 0
    assert soak["prefix_cache_mb_after"] <= 0.02
    assert soak["merged"] == 0 and soak["rss_mid_mb"] > 0  # every soak request was its own tenant's first
    assert engine.memories.dropped + len(engine.memories) >= 15  # a tenant each (cancelled ones leave no text)
    assert "blocks evicted" in capsys.readouterr().out
    assert main(["bench-serve", "--url", url + "/v1", "--soak", "1", "--soak-stop-rate", "2"]) == 2
    wait_idle(engine)
