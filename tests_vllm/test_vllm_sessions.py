"""`goose bench --engine vllm` sessions: vLLM's `suffix` method with its cache of responses set to the
other sessions (suffix@warm) stays token-identical to vLLM plain turn after turn, and the cache really
holds the other sessions' answers when a session starts. Run from .venv-vllm (`make test` does)."""

from __future__ import annotations

import pytest

from goose.bench.datasets import BUILTIN, Question
from goose.bench.vllm_engine import cpu_support, run_sessions, session_table

REASON = cpu_support()
if REASON:
    pytest.skip(REASON, allow_module_level=True)


def test_suffix_warm_sessions_identical_to_plain():
    from goose.loading.model import model_dir

    model = str(model_dir("smollm2-135m"))
    sessions = [BUILTIN[2], Question("q2", "writing", ("Write a haiku about the sea.", "Now one about rain."))]
    result = run_sessions(["plain", "suffix@warm"], model, sessions, chat=True, max_new_tokens=32, threads=2,
                          eager=True)
    table = session_table(result, sessions)
    assert table["all"]["suffix@warm"]["identical"] == table["all"]["suffix@warm"]["turns"] == 4
    assert table["all"]["plain"]["tau"] == pytest.approx(1.0, abs=0.05)  # one forward a token (+ prefill)
    for q in sessions:  # the cache held the other session's two turns' answers
        assert result["turns"]["suffix@warm"][q.question_id][0]["reset"] == {"cached": 2}
