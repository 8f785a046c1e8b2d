"""The arithmetic switch (``arith="exact"`` | ``"int8"``) from `load_model` to `Decoder`, `Engine`, the shared
forward per (model, arith), the cost-curve key, the bench's run directory and the command line: int8 runs only
on GGUF blocks (float32 weights are refused, never quantized), and every method, alone or in Engine batches
with the prefix cache, gives exactly the tokens of ``ar`` in the same arithmetic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goose.backends import cpukernel, int8, quant
from goose.backends.forward import HFForward
from goose.config import DecodeConfig
from goose.decoding import Decoder, default_forward
from goose.engine.prefix import BLOCK
from goose.engine.scheduler import Engine
from goose.errors import GooseError
from goose.loading.model import model_arith, record_arith
from goose.selection.costmodel import CostCurve

needs_int8 = pytest.mark.skipif(int8.kernels() is None or quant.kernels() is None or cpukernel.kernel() is None,
                                reason=f"integer kernels: {int8.unavailable_reason()}")
ROOT = Path(__file__).resolve().parents[1]
CHEAP = CostCurve((1, 2, 4, 8, 16, 32), (10, 10.5, 11, 12, 14, 20))  # given (nothing measured): big trees


def _qmodel(fmt: str):
    from test_int8 import _qmodel as qm

    return qm(fmt)


_AR: dict = {}


def ar_int8(qmodel, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding by goose in int8 (memoized per model, prompt and length)."""
    key = (id(qmodel), tuple(prompt), n)
    if key not in _AR:
        _AR[key] = Decoder(qmodel, None, "ar", arith="int8").generate_ids(prompt, DecodeConfig(n))[0]
    return _AR[key]


def test_the_arith_names_agree():
    from goose import cliargs
    from goose.backends.lean import ARITHS

    assert cliargs.ARITHS == ARITHS == ("exact", "int8")


# ---- choosing the forward ---------------------------------------------------------------------------------

@needs_int8
def test_default_forward_is_shared_per_model_and_arith():
    qmodel, model = _qmodel("Q8_0")
    exact, fi = default_forward(qmodel, "exact"), default_forward(qmodel, "int8")
    assert exact.arith == "exact" and fi.arith == "int8" and exact is not fi
    assert default_forward(qmodel, "int8") is fi and default_forward(qmodel) is exact  # (the model's own: exact)
    assert "+int8-" in fi.backend and "+int8-" not in exact.backend
    with pytest.raises(GooseError, match="GGUF blocks"):  # float32 weights: refused, not quantized
        default_forward(model, "int8")
    with pytest.raises(GooseError, match="unknown arith"):
        default_forward(qmodel, "int4")


@needs_int8
def test_the_model_records_its_arith_and_decoders_and_engines_follow_it():
    qmodel, _ = _qmodel("Q4_1")
    assert model_arith(qmodel) == "exact"
    record_arith(qmodel, "int8")  # what load_model(..., arith="int8") records
    try:
        assert model_arith(qmodel) == "int8"
        dec = Decoder(qmodel, None, "ar")
        assert dec.arith == "int8" and dec.forward is default_forward(qmodel, "int8")
        assert Decoder(qmodel, None, "ar", arith="exact").forward.arith == "exact"  # told otherwise
        with Engine(qmodel, None, "ar", thread=False) as eng:
            assert eng.arith == "int8" and eng.forward.arith == "int8"
    finally:
        record_arith(qmodel, "exact")


@needs_int8
def test_a_given_forward_must_compute_in_the_given_arith():
    qmodel, _ = _qmodel("Q8_0")
    fi = default_forward(qmodel, "int8")
    assert Decoder(qmodel, None, "ar", forward=fi).arith == "int8"  # the forward's own
    with pytest.raises(GooseError, match='arith="int8", not "exact"'):
        Decoder(qmodel, None, "ar", forward=fi, arith="exact")
    with pytest.raises(GooseError, match='arith="exact", not "int8"'):
        Engine(qmodel, None, "ar", forward=HFForward(qmodel), arith="int8", thread=False)


def test_int8_is_refused_on_the_hugging_face_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=1, n_head=2)).eval()
    assert isinstance(default_forward(gpt2), HFForward)
    with pytest.raises(GooseError, match="Llama-family forward.*arith=\"exact\""):
        Decoder(gpt2, None, "ar", arith="int8")
    with pytest.raises(GooseError, match="Llama-family forward"):
        Engine(gpt2, None, "ar", arith="int8", thread=False)


@needs_int8
def test_the_cost_curve_key_tells_the_arithmetics_apart():
    from goose.engine.measure import curve_key

    qmodel, _ = _qmodel("Q4_1")
    assert curve_key(qmodel, default_forward(qmodel, "int8")) != curve_key(qmodel, default_forward(qmodel, "exact"))


# ---- losslessness in int8 ---------------------------------------------------------------------------------

@needs_int8
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(3, 127), min_size=1, max_size=24), reps=st.integers(1, 4),
       n_new=st.integers(1, 24), fmt=st.sampled_from(["Q4_1", "Q8_0"]))
def test_every_method_through_decoder_arith_int8_equals_ar_in_int8(prompt, reps, n_new, fmt):
    """Each method with ``Decoder(..., arith="int8")`` (the forward chosen by the decoder) against ``ar``."""
    from conftest import method_for
    from goose.engine.methods import METHODS

    qmodel, _ = _qmodel(fmt)
    prompt = (prompt * reps)[:60]  # repeated text makes the lookup methods draft long
    want = ar_int8(qmodel, prompt, n_new)
    for method in METHODS:
        out, _ = Decoder(qmodel, None, method_for(method, qmodel, CHEAP), cost=CHEAP, arith="int8").generate_ids(
            prompt, DecodeConfig(n_new))
        assert out == want, method


@needs_int8
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_engine_batches_with_the_prefix_cache_equal_ar_in_int8(data):
    """Requests built from shared prefixes (and an earlier request's whole output: the next turn), several
    methods, batched on one int8 Engine with its prefix cache: each equals ``ar`` in int8 alone, and later
    requests really took blocks from the cache."""
    fmt = data.draw(st.sampled_from(["Q4_1", "Q8_0"]))
    qmodel, _ = _qmodel(fmt)
    rng = random.Random(data.draw(st.integers(0, 10**6)))
    heads = [[rng.randrange(3, 128) for _ in range(rng.randrange(BLOCK, 4 * BLOCK))] for _ in range(2)]
    methods = ["ar", "goose", "pld", "goose-paper", "lookahead", "tr"]
    with Engine(qmodel, None, "goose", max_batch=data.draw(st.integers(1, 4)), arith="int8") as eng:
        assert eng.arith == "int8" and eng.prefixes.max_bytes > 0 and eng.forward.plan is not None
        opener = heads[0] + [rng.randrange(3, 128)]
        first = eng.generate(opener, 10)
        prompts = []
        for i in range(data.draw(st.integers(2, 5))):
            h = rng.randrange(2)
            if rng.random() < 0.3:
                prompt = opener + first.token_ids + [5, 6]
            else:
                prompt = heads[h][: rng.randrange(1, len(heads[h]) + 1)] + \
                    [rng.randrange(3, 128) for _ in range(rng.randrange(0, 10))]
            prompts.append((prompt, rng.randrange(1, 14), methods[i % len(methods)]))
        reqs = [eng.submit(p, n, method=m) for p, n, m in prompts]
        results = [r.result(timeout=300) for r in reqs]
    assert first.token_ids == ar_int8(qmodel, opener, 10)
    for (prompt, n, m), res in zip(prompts, results):
        assert res.token_ids == ar_int8(qmodel, prompt, n), (m, prompt)
    stored = (opener + first.token_ids)[:-1]  # the opener's prompt and output (its last token never fed)
    for (prompt, _, _), res in zip(prompts, results):
        common = len(os.path.commonprefix([prompt, stored]))
        assert res.stats.cached_tokens >= min(common, len(prompt) - 1) // BLOCK * BLOCK, prompt


@needs_int8
def test_each_engine_keeps_prefixes_of_its_own_arith_only():
    """One model, an exact and an int8 Engine, the same prompts through each: every request reuses its own
    engine's stored prefixes and equals ``ar`` in that engine's arithmetic (the caches never mix)."""
    qmodel, _ = _qmodel("Q4_1")
    rng = random.Random(7)
    head = [rng.randrange(3, 128) for _ in range(3 * BLOCK)]
    prompts = [head + [rng.randrange(3, 128) for _ in range(k)] for k in (1, 4, 9)]
    outs = {}
    for arith in ("exact", "int8", "exact"):  # exact again after int8 stored its entries
        with Engine(qmodel, None, "goose", max_batch=1, arith=arith) as eng:
            res = [eng.generate(p, 12) for p in prompts]
        assert all(r.stats.cached_tokens > 0 for r in res[1:]), arith  # later prompts took the shared head
        ref = Decoder(qmodel, None, "ar", arith=arith)
        assert [r.token_ids for r in res] == [ref.generate_ids(p, DecodeConfig(12))[0] for p in prompts], arith
        outs.setdefault(arith, []).append([r.token_ids for r in res])
    assert outs["exact"][0] == outs["exact"][1]


@needs_int8
def test_a_mismatch_is_reported_with_logits_of_the_models_arith():
    from goose.backends.lean import LeanForward
    from goose.cliargs import first_mismatch

    qmodel, _ = _qmodel("Q8_0")
    prompt = [5, 9, 17, 33, 60, 61, 62]
    ref = ar_int8(qmodel, prompt, 6)
    got = ref[:3] + [(ref[3] + 1) % 128] + ref[4:]
    record_arith(qmodel, "int8")
    try:
        info = first_mismatch(qmodel, prompt, ref, got)
    finally:
        record_arith(qmodel, "exact")
    logits = LeanForward(qmodel, arith="int8")(prompt + ref[:3])[-1]
    assert info["position"] == 3 and info["ar_token"] == ref[3] and info["token"] == got[3]
    assert info["ar_logit"] == float(logits[ref[3]]) == float(logits.max()) and info["logit"] == float(logits[got[3]])


# ---- the bench's run directory ----------------------------------------------------------------------------

def test_a_bench_run_is_resumed_only_in_its_own_arith(tmp_path):
    from goose.bench import store

    pinned = {"model": "m", "dtype": "float32", "max_new_tokens": 8, "chat": False, "sampling": None,
              "threads": 1, "device": "cpu", "software": {"goose": "x"}}
    assert store.pinned_conflict(tmp_path, {**pinned, "arith": "int8"}, {**pinned, "arith": "int8"}) is None
    why = store.pinned_conflict(tmp_path, {**pinned, "arith": "exact"}, {**pinned, "arith": "int8"})
    assert why is not None and "arith='exact', not 'int8'" in why
    # runs recorded before the arith was: exact
    assert store.pinned_conflict(tmp_path, pinned, {**pinned, "arith": "exact"}) is None
    assert "arith" in (store.pinned_conflict(tmp_path, pinned, {**pinned, "arith": "int8"}) or "")


# ---- the command line and the packaged model --------------------------------------------------------------

def _goose(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "goose", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def test_cli_refuses_int8_with_float32_weights_before_loading():
    r = _goose("generate", "--weights", "float32", "--arith", "int8", "hello", timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert 'arith="int8"' in r.stderr and "--weights gguf" in r.stderr and "never quantized" in r.stderr
    r = _goose("generate", "--arith", "int4", "hello", timeout=120)
    assert r.returncode == 2 and "int4" in r.stderr


def test_serve_and_bench_refuse_int8_with_float32_weights(tmp_path):
    r = _goose("serve", "--weights", "float32", "--arith", "int8", "--port", "1", timeout=120)
    assert r.returncode == 2 and 'arith="int8"' in r.stderr and "never quantized" in r.stderr
    out = tmp_path / "run"
    r = _goose("bench", "--weights", "float32", "--arith", "int8", "--methods", "ar", "--limit", "1",
               "--out", str(out), timeout=120)
    assert r.returncode == 2 and 'arith="int8"' in r.stderr and not out.exists()
    r = _goose("bench", "--engine", "vllm", "--arith", "int8", "--out", str(out), timeout=120)
    assert r.returncode == 2 and "vLLM" in r.stderr and not out.exists()


def test_load_model_refuses_int8_for_a_float32_folder(tmp_path):
    """A Hugging Face folder holds float32 weights: int8 is refused after the load names them; exact loads."""
    from transformers import AutoTokenizer

    from conftest import make_tiny_llama
    from goose.loading.model import load_model, model_dir

    make_tiny_llama(torch.float32).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(model_dir("smollm2-135m")).save_pretrained(tmp_path)
    with pytest.raises(GooseError, match="float32 weights.*--weights gguf"):
        load_model(str(tmp_path), arith="int8")
    with pytest.raises(GooseError, match="unknown arith"):
        load_model(str(tmp_path), arith="fp8")
    net, _ = load_model(str(tmp_path))
    assert model_arith(net) == "exact" and default_forward(net).arith == "exact"


@pytest.mark.slow
@needs_int8
def test_cli_generate_arith_int8_on_the_packaged_model_is_lossless():
    args = ("generate", "--chat", "--max-new-tokens", "24", "--json", "--verify", "--method", "pld",
            "Write a haiku about the sea.")
    r = _goose(*args, "--arith", "int8")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["lossless"] is True and len(got["token_ids"]) == 24
    exact = json.loads(_goose(*args).stdout)
    assert exact["lossless"] is True
    r = _goose("profile", "--arith", "int8", "--plot", "")
    assert r.returncode == 0 and "+int8-" in r.stdout, r.stderr


def test_auto_is_int8_exactly_where_the_integer_kernels_run_gguf_blocks(tmp_path):
    """``--arith auto`` (the command line's default): int8 for a GGUF source kept as blocks on the CPU where the
    integer kernels run, exact for float32 weights, other devices or dtypes and Hugging Face folders; the
    command line records the arithmetic that ran."""
    import argparse

    from goose.cliargs import add_model_args, cli_arith
    from goose.loading.model import resolve_arith

    here = "int8" if int8.unavailable_reason() is None else "exact"
    assert resolve_arith("auto", "smollm2-135m") == here
    assert resolve_arith("auto", "smollm2-135m", weights="float32") == "exact"
    assert resolve_arith("auto", "smollm2-135m", dtype="bfloat16") == "exact"
    assert resolve_arith("auto", str(tmp_path)) == "exact"  # a folder: float32 weights
    assert resolve_arith("exact", "smollm2-135m") == "exact" and resolve_arith("int8", str(tmp_path)) == "int8"
    p = argparse.ArgumentParser()
    add_model_args(p)
    args = p.parse_args([])
    assert args.arith == "auto" and cli_arith(args) == here and args.arith == here
