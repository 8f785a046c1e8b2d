"""The web playground in a real headless browser (Debian's chromium through playwright): open the page, send a
prompt, wait for both answers, check that the coloured tokens concatenate to the API's text."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
sync_api = pytest.importorskip("playwright.sync_api")

from conftest import make_tiny_llama  # noqa: E402
from goose import Engine  # noqa: E402
from serving import live_server  # noqa: E402

CHROMIUM = os.environ.get("GOOSE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install chromium; .ci/run does)")
BROWSER_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-extensions", "--disable-sync", "--no-first-run",
                "--disable-component-update", "--disable-default-apps"]


@pytest.fixture(scope="module")
def served():
    from transformers import AutoTokenizer

    from goose.loading.model import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir("smollm2-135m"))
    model = make_tiny_llama(dtype=torch.float32, vocab=len(tok), seed=2)
    eng = Engine(model, tok, "goose", max_batch=4)
    with live_server(eng) as base:
        yield base
    eng.close(timeout=10, cancel=True)


def test_playground_streams_coloured_tokens_equal_to_the_api(served, tmp_path):
    prompt = "Write a haiku about geese."
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=BROWSER_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            outside: list[str] = []
            page.on("request", lambda r: None if r.url.startswith(served) else outside.append(r.url))
            page.goto(served + "/", timeout=30_000)
            page.wait_for_function("document.getElementById('model').textContent === 'tiny'", timeout=30_000)
            page.fill("#prompt", prompt)
            page.fill("#maxtokens", "40")
            page.click("#send")
            page.wait_for_selector("#verdict[data-state=done]", timeout=120_000)
            verdict = page.inner_text("#verdict")
            spans = page.eval_on_selector_all("#out-goose span.tok",
                                              "els => els.map(e => [e.textContent, e.dataset.source])")
            off_text = page.eval_on_selector("#out-off", "e => e.textContent")
            stats = page.inner_text("#stats-goose")
            page.screenshot(path=str(tmp_path / "playground.png"))
        finally:
            browser.close()
    assert not errors and not outside
    client = openai.OpenAI(base_url=served + "/v1", api_key="x", max_retries=0, timeout=60)
    api = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                         temperature=0).choices[0].message.content
    assert "".join(t for t, _ in spans) == api == off_text and api
    assert {s for _, s in spans} <= {"spine", "branch", "bonus"}
    assert "identical text" in verdict and "tok/s" in stats and "τ" in stats
