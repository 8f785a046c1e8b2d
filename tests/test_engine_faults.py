"""Failure isolation in the engine's step loop: a fault injected into one request's own stage (cache allocation,
the method's start, prefix attach / reuse / store, its callbacks) fails that request alone, with an error
naming the stage, while the requests beside it finish with exactly their greedy tokens and the engine goes
on; a fault of the loop itself is recorded in `Engine.failure` and fails every request with that reason.
Each test asserts that the injected fault really fired inside the operation. Also: bounded step statistics
and unseeded sampling seeded from the OS's entropy."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from conftest import TINY_VOCAB, greedy_memo, make_tiny_llama
from goose import Engine, GooseError, RequestFailed
from goose.backends import cpukernel
from goose.engine import scheduler
from goose.engine import step as step_mod
from goose.engine.prefix import BLOCK
from goose.engine.step import Slot

needs_kernel = pytest.mark.skipif(cpukernel.kernel() is None, reason="goose's float32 kernel is unavailable")
MAX_NEW = 12
TIMEOUT = 60


@pytest.fixture(scope="module")
def model32():
    return make_tiny_llama(torch.float32, seed=5)


def _prompts(seed: int, shared: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Two good prompts and a bad one, all starting with `shared`."""
    rng = random.Random(seed)
    return tuple(shared + [rng.randrange(2, TINY_VOCAB) for _ in range(5 + i)] for i in range(3))


class Fault:
    """Counts how often the injected failure fired."""

    def __init__(self) -> None:
        self.fired = 0

    def __call__(self, *args, **kwargs):
        self.fired += 1
        raise MemoryError("injected fault")


def _slot_stage(monkeypatch, bad: list[int], name: str, make_fault):
    """Inject into `Slot.<name>` of the bad request's slot only: `make_fault(slot)` plants the failure inside
    the real operation, which then runs."""
    real = getattr(Slot, name)

    def wrapper(self, *args, **kwargs):
        if self.prompt == bad:
            make_fault(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Slot, name, wrapper)


STAGES = ["cache allocation", "method start", "prefix attach", "reuse_prefix", "prefix store", "on_tokens",
          "stop", "drafting", "selection", "tree tensors", "forward", "verification", "harvest"]


@needs_kernel
@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_in_one_request_stage_fails_that_request_only(model32, monkeypatch, stage):
    rng = random.Random(STAGES.index(stage))
    shared = [rng.randrange(2, TINY_VOCAB) for _ in range(3 * BLOCK)]
    good1, bad, good2 = _prompts(STAGES.index(stage), shared)
    fault = Fault()
    extra: dict = {}
    with Engine(model32, None, "goose", max_batch=3) as eng:
        assert eng.generate(shared + [5], 4).token_ids == greedy_memo(model32, shared + [5], 4)  # stores `shared`
        if stage == "cache allocation":  # the cache's own reset fails inside Slot.begin
            _slot_stage(monkeypatch, bad, "begin", lambda s: setattr(s.cache, "reset", fault))
            why = "starting the request"
        elif stage == "method start":
            _slot_stage(monkeypatch, bad, "begin", lambda s: setattr(s.method, "start", fault))
            why = "starting the request"
        elif stage == "prefix attach":  # copying the stored blocks into the bad request's cache fails
            real_attach = eng.prefixes.attach

            def attach(prompt, cache, *a, **kw):
                if prompt == bad:
                    cache.write_prefix = fault
                return real_attach(prompt, cache, *a, **kw)

            monkeypatch.setattr(eng.prefixes, "attach", attach)
            why = "reusing a stored prefix"
        elif stage == "reuse_prefix":  # the slot refuses the prefix (its own check raising)
            _slot_stage(monkeypatch, bad, "reuse_prefix", lambda s: setattr(s, "filled", -1) or fault())
            why = "reusing a stored prefix"
        elif stage == "prefix store":  # reading the bad request's entries for the store fails
            real_store = eng.prefixes.store

            def store(tokens, cache, *a, **kw):
                if tokens[: len(bad)] == bad:
                    cache.entries = fault
                return real_store(tokens, cache, *a, **kw)

            monkeypatch.setattr(eng.prefixes, "store", store)
            why = "storing the prefix"
        elif stage == "drafting":  # the step loop's own stages: the bad request's part of the batch fails
            _slot_stage(monkeypatch, bad, "begin", lambda s: setattr(s.method, "candidates", fault))
            why = "drafting failed"
        elif stage == "selection":  # the batch's choice raises on the bad request's candidates
            bad_cands, real_allocate = [], step_mod.allocate  # (kept alive: no other object takes their ids)

            def candidates(slot_method, real):
                return lambda *a: (c := real(*a), bad_cands.append(c))[0]

            _slot_stage(monkeypatch, bad, "begin",
                        lambda s: setattr(s.method, "candidates", candidates(s.method, s.method.candidates)))

            def allocate(cands, *a):
                if any(c is b for c in cands for b in bad_cands):
                    fault()
                return real_allocate(cands, *a)

            monkeypatch.setattr(step_mod, "allocate", allocate)
            why = "selecting the tree failed"
        elif stage == "tree tensors":
            real_tensorize = step_mod._tensorize
            monkeypatch.setattr(step_mod, "_tensorize",
                                lambda w: fault() if w.slot.prompt == bad else real_tensorize(w))
            why = "building the tree tensors failed"
        elif stage == "forward":  # the shared forward raises while the bad request's segment is in it
            bad_caches, real_run = [], eng.forward.run
            _slot_stage(monkeypatch, bad, "begin", lambda s: bad_caches.append(s.cache))
            monkeypatch.setattr(eng.forward, "run", lambda segs: fault() if any(
                seg.cache is c for seg in segs for c in bad_caches) else real_run(segs))
            why = "the forward failed"
        elif stage == "verification":
            _slot_stage(monkeypatch, bad, "begin", lambda s: setattr(s.chooser, "walk", fault))
            why = "verifying failed"
        elif stage == "harvest":  # the method learning from the bad request's logits (prefill or a step)
            _slot_stage(monkeypatch, bad, "begin", lambda s: setattr(s.method, "harvest", fault))
            why = "ing failed"
        elif stage == "on_tokens":
            extra = {"on_tokens": fault}
            why = "injected fault"
        else:
            extra = {"stop": fault}
            why = "injected fault"
        reqs = [eng.submit(good1, MAX_NEW), eng.submit(bad, MAX_NEW, **extra), eng.submit(good2, MAX_NEW)]
        for r in reqs:
            assert r.wait(TIMEOUT)
        assert fault.fired >= 1, f"the {stage} fault never fired"
        assert reqs[1].finish_reason == "error" and why in str(reqs[1].error), (stage, reqs[1].error)
        if stage not in ("on_tokens", "stop"):  # (a callback's own exception reaches its caller as it is)
            assert isinstance(reqs[1].error, RequestFailed)
        with pytest.raises((GooseError, MemoryError)):
            reqs[1].result()
        for r, p in ((reqs[0], good1), (reqs[2], good2)):
            assert r.result().token_ids == greedy_memo(model32, p, MAX_NEW), stage
        assert eng.failure is None
        monkeypatch.undo()
        after = eng.generate(bad, MAX_NEW)  # the engine goes on, and serves the same prompt afterwards
        assert after.token_ids == greedy_memo(model32, bad, MAX_NEW)


def test_a_failing_weights_check_fails_the_requests_it_covers_and_the_engine_goes_on(model32):
    prompt = list(range(2, 2 + 2 * BLOCK))
    with Engine(model32, None, "ar", max_batch=2) as eng:
        real = eng.forward.stale
        fault = Fault()
        calls = []

        def stale():
            calls.append(1)
            if len(calls) == 3 and not fault.fired:  # while the requests decode
                fault()
            return real()

        eng.forward.stale = stale
        reqs = [eng.submit(prompt, 200), eng.submit(prompt[::-1], 200)]
        for r in reqs:
            assert r.wait(TIMEOUT)
        assert fault.fired == 1
        assert all(r.finish_reason == "error" and "checking the model's weights failed" in str(r.error)
                   for r in reqs)
        assert eng.failure is None
        assert eng.generate(prompt, MAX_NEW).token_ids == greedy_memo(model32, prompt, MAX_NEW)


def test_a_loop_failure_is_recorded_and_fails_every_request(model32):
    eng = Engine(model32, None, "ar", max_batch=1)
    real = eng._next_step
    fault = Fault()
    steps = []
    queued = threading.Event()

    def next_step():
        queued.wait(TIMEOUT)  # the loop steps only once both requests are queued (a slow machine's submit lags)
        steps.append(1)
        if len(steps) == 4:
            fault()
        return real()

    eng._next_step = next_step
    try:
        reqs = [eng.submit([3, 4, 5], 500), eng.submit([6, 7], 500)]  # one running, one waiting
        queued.set()
        for r in reqs:
            assert r.wait(TIMEOUT)
        assert fault.fired == 1
        assert eng.failure == "MemoryError: injected fault"
        for r in reqs:
            assert r.finish_reason == "error" and "the engine stopped: MemoryError" in str(r.error)
        with pytest.raises(GooseError, match="failed"):
            eng.submit([3, 4], 4)
        deadline = time.monotonic() + TIMEOUT
        while eng._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        eng.close(timeout=10)


def test_step_statistics_are_bounded(model32, monkeypatch):
    monkeypatch.setattr(scheduler, "BATCH_SIZES_KEPT", 16)
    with Engine(model32, None, "ar", max_batch=2) as eng:
        eng.generate_batch([[3, 4], [5, 6, 7]], 40)
        assert eng.steps > 16
        assert len(eng.batch_sizes) == 16 and len(eng.batch_counts) == 3
        assert sum(eng.batch_counts) == eng.steps and eng.batch_counts[2] > 0


def test_unseeded_sampling_draws_its_seed_from_the_os(model32):
    """torch's global generator starts from the same seed in every process: an unseeded request must not
    repeat the previous run's text, so each draws a seed of its own from the OS."""
    seeds, outs = [], []
    for _ in range(2):
        torch.manual_seed(0)  # what every fresh process starts from
        with Engine(model32, None, "ar", max_batch=1) as eng:
            req = eng.submit([3, 4, 5], 24, do_sample=True, temperature=2.0)
            outs.append(req.result(TIMEOUT).token_ids)
            seeds.append(req.slot.cfg.seed)
    assert all(isinstance(s, int) for s in seeds) and seeds[0] != seeds[1]
    with Engine(model32, None, "ar", max_batch=1) as eng:  # the drawn seed reproduces the text
        again = eng.generate([3, 4, 5], 24, do_sample=True, temperature=2.0, seed=seeds[0]).token_ids
    assert again == outs[0]


def test_errors_are_typed(model32):
    """A caller tells a full queue, a closed engine, a failed request and a cancelled one apart by type."""
    from goose import EngineClosed, QueueFull, RequestCancelled

    eng = Engine(model32, None, "ar", max_batch=1, max_queue=1, thread=False)
    first = eng.submit([5, 6, 7], 4)
    with pytest.raises(QueueFull):
        eng.submit([5, 6, 7], 4)
    first.cancel()
    eng.step()
    with pytest.raises(RequestCancelled):
        first.result(timeout=5)
    bad = eng.submit([5, 6, 7], 4, stop=lambda toks: 1 / 0)  # its own callback raising fails it alone
    while eng.step():
        pass
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=5)
    eng.close()
    with pytest.raises(EngineClosed):
        eng.submit([5, 6, 7], 4)
    assert issubclass(RequestFailed, GooseError) and issubclass(QueueFull, GooseError)


@needs_kernel
def test_a_request_failing_in_a_step_stores_no_prefix_of_its_own(model32, monkeypatch):
    """A slot whose own stage failed in a step is over (`Slot.fail`: done) and its request is failed after the
    step's prefix store, which used to store its prompt and output as a finished request's (entries of a
    failed stage included); now nothing of it is stored."""
    rng = random.Random(11)
    prompt = [rng.randrange(2, TINY_VOCAB) for _ in range(3 * BLOCK + 2)]
    stored: list = []
    with Engine(model32, None, "ar", max_batch=2, thread=False) as eng:
        req = eng.submit(prompt, 8)
        while req.slot.state != step_mod.DECODE:
            eng.step()
        monkeypatch.setattr(eng.prefixes, "store", lambda tokens, *a: stored.append(tokens))
        req.slot.fail("verifying", MemoryError("injected"))  # as a stage of the step would
        eng._store_prefixes([req])
        assert stored == []
        ok = eng.submit(prompt[:-1], 1)
        while not ok.done:
            eng.step()
    assert stored and stored[0][: len(prompt) - 1] == prompt[:-1]  # (a finished request's are stored)


@needs_kernel
def test_failed_steps_in_a_row_are_counted_and_a_good_step_resets_them(model32, monkeypatch):
    """Every step failing in its shared work fails its requests but not the engine: `failed_steps` counts
    them in a row (a server's /health answers 503 from FAILED_STEPS on), and one good step resets it."""
    from goose.server.app import FAILED_STEPS, Serving

    with Engine(model32, None, "ar", max_batch=2) as eng:
        real = step_mod.step
        monkeypatch.setattr(scheduler, "step", lambda *a, **k: (_ for _ in ()).throw(MemoryError("shared")))
        for i in range(FAILED_STEPS):
            r = eng.submit([5, 6, 7], 4)
            assert r.wait(TIMEOUT) and r.finish_reason == "error"
        assert eng.failed_steps >= FAILED_STEPS and "shared" in eng.step_failure and eng.failure is None
        serving = Serving(eng, "tiny")
        health = serving.health()
        assert health.status_code == 503 and b"steps all failed" in health.body
        monkeypatch.setattr(scheduler, "step", real)
        assert eng.generate([5, 6, 7], 4).token_ids == greedy_memo(model32, [5, 6, 7], 4)
        assert eng.failed_steps == 0 and serving.health().status_code == 200
