"""A fair share of a contended CPU (`goose.engine.threads.ThreadGovernor`): the step loop moves its forwards to
one thread when a probe shows that faster, back when all threads are faster again, never on a quiet machine's
noise; the thread count torch runs on follows it, and the caller's count comes back; outputs never change."""

from __future__ import annotations

import pytest
import torch

from conftest import greedy_memo, make_tiny_llama
from goose import Engine
from goose.backends.cpukernel import claimed
from goose.config import EngineConfig
from goose.engine.threads import FIRST_PROBE_S, MAX_PROBE_S, PROBE_ROWS, PROBE_S, SHARED, ThreadGovernor, on_threads

DT = 2.0 ** -7  # seconds between forwards (exact in binary: probes fall on exact steps)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(gov: ThreadGovernor, clock: Clock, seconds_at, steps: int, rows: int = 4, share: float = 1.0) -> list[int]:
    """`steps` forwards taking ``seconds_at(threads)``, one every DT s, the calling thread on the CPU `share` of
    each forward's time; the thread count of each."""
    used = []
    for _ in range(steps):
        gov.before(rows)
        n = torch.get_num_threads()
        used.append(n)
        seconds = seconds_at(n)
        gov.after(rows, seconds, seconds * share)
        clock.now += DT
    return used


@pytest.fixture()
def threads(monkeypatch):
    monkeypatch.setattr(ThreadGovernor, "_chosen", (0, float("-inf"), 0))  # no hint from another test's governor
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_quiet_contended_quiet(threads):
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    quiet = {2: 0.010, 1: 0.016}  # one thread: 1.6x slower
    used = run(gov, clock, quiet.get, 1280)  # 10 s quiet: probes on one thread at 0.25 s, then 4 s later (then 8)
    assert gov.threads == 2 and gov.switches == 0
    assert [i for i, n in enumerate(used) if n == 1] == [FIRST_PROBE_S / DT, (FIRST_PROBE_S + 2 * PROBE_S) / DT]
    busy = {2: 0.200, 1: 0.030}  # two busy processes: the team waits for descheduled threads
    used = run(gov, clock, busy.get, 600)
    assert gov.threads == 1 and gov.switches == 1 and used.index(1) == 1  # surprised: a probe at once
    assert used[: int(2 * FIRST_PROBE_S / DT)].count(2) <= FIRST_PROBE_S / DT + 1  # on one thread within 0.5 s
    assert used[-50:].count(2) <= 1  # on one thread from then on (but for a probe)
    used = run(gov, clock, quiet.get, 600)  # quiet again: back to all threads at the next probe
    assert gov.threads == 2 and gov.switches == 2 and used[-50:].count(1) <= 1
    torch.set_num_threads(1)
    gov.release()
    assert torch.get_num_threads() == 2
    later = ThreadGovernor(threads=2, clock=clock)  # a new engine's governor starts where this one is
    assert later.threads == 2
    gov.threads = 1
    gov.before(4)
    gov.after(4, 0.03)
    assert ThreadGovernor(threads=2, clock=clock).threads == 1
    clock.now += 31  # too long ago: all threads again
    assert ThreadGovernor(threads=2, clock=clock).threads == 2


def test_one_thread_runs_the_projections_on_the_claim_pool_of_all(threads):
    """The one-thread setting (and `on_threads(1, ...)`) is one OpenMP thread whose projections run on the
    kernels' claim pool of all the threads; all threads and `release` give OpenMP's team back."""
    gov = ThreadGovernor(threads=2, clock=Clock())
    gov.probe_s = float("inf")
    gov.threads = 1
    gov.before(4)
    assert torch.get_num_threads() == 1 and claimed() == 2
    gov.threads = 2
    gov.before(4)
    assert torch.get_num_threads() == 2 and claimed() == 0
    gov.threads = 1
    gov.before(4)
    gov.release()
    assert torch.get_num_threads() == 2 and claimed() == 0
    assert on_threads(1, lambda: (torch.get_num_threads(), claimed())) == (1, 2)
    assert (torch.get_num_threads(), claimed()) == (2, 0)


def test_a_due_probe_waits_for_a_small_forward(threads):
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    busy = {2: 0.200, 1: 0.030}
    assert run(gov, clock, busy.get, 8, rows=PROBE_ROWS) == [2] * 8  # before the first probe is due
    big = run(gov, clock, busy.get, 640, rows=PROBE_ROWS + 1)  # 5 s of prompt chunks: never one on one thread
    assert big.count(1) == 0 and gov.switches == 0
    small = run(gov, clock, busy.get, 3, rows=PROBE_ROWS)  # the probe waited for this one, and it switches
    assert small == [1, 1, 1] and gov.switches == 1
    assert run(gov, clock, busy.get, 10, rows=300) == [1] * 10  # the setting itself covers every forward


def test_probes_that_do_not_switch_come_ever_more_rarely(threads):
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    busy = {2: 0.200, 1: 0.030}
    run(gov, clock, busy.get, 40)
    assert gov.threads == 1
    used = run(gov, clock, busy.get, int(120 / DT))  # two busy minutes on one thread
    probes = [i * DT for i, n in enumerate(used) if n == 2]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] >= 2 * PROBE_S and max(gaps) <= MAX_PROBE_S + DT
    assert len(probes) <= 3 + 120 / MAX_PROBE_S  # 6 here (every 2 s: 60 probes, each a slow forward)
    later = ThreadGovernor(threads=2, clock=clock)  # a new engine's governor in this process: where this one is,
    used = run(later, clock, busy.get, int(MAX_PROBE_S / DT))  # its wait included (no early probe on two threads)
    assert later.threads == 1 and 2 not in used[: int((MAX_PROBE_S - 1) / DT)]


def stalling(fast: float, stall: float, every: int, one: float):
    """Seconds of a forward beside busy processes: on all threads `fast`, but every `every`-th one waits `stall`
    for a descheduled team thread; on one thread `one`."""
    calls = [0]

    def seconds_at(n: int) -> float:
        if n == 1:
            return one
        calls[0] += 1
        return stall if calls[0] % every == 0 else fast

    return seconds_at


def test_a_shared_core_moves_the_loop_to_one_thread_and_holds_back_probes_on_all(threads):
    """Beside as many busy processes as cores the loop's thread gets a share of its core (0.48-0.72 measured on 2
    cores beside 2), and a team with a descheduled thread costs rare forwards of tens of forwards' time, which
    medians do not see (here all threads' median even looks faster than one thread's). On all threads a median
    share below SHARED makes a probe on one thread due, weighed against the mean, stalls included: the loop moves
    to one thread; on one thread no probe on all threads runs while it lasts. Once the core is the thread's own
    again (beside one busy process, or quiet), probes come as before, and a quiet machine gets all threads back."""
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    busy = stalling(0.013, 0.300, 10, 0.019)
    used = run(gov, clock, busy, int(2 * FIRST_PROBE_S / DT) + 12, share=SHARED - 0.2)  # within half a second
    assert gov.threads == 1 and gov.switches == 1  # by a probe weighed against the stalls
    assert used[-10:] == [1] * 10
    used = run(gov, clock, busy, int(60 / DT), share=SHARED - 0.1)  # a busy minute on a shared core
    assert 2 not in used and gov.shared()
    beside_one = {2: 0.030, 1: 0.011}
    used = run(gov, clock, beside_one.get, int(2 * MAX_PROBE_S / DT))  # its own core: probes, all threads lose
    assert 2 in used and gov.threads == 1 and not gov.shared()
    quiet = {2: 0.010, 1: 0.016}
    used = run(gov, clock, quiet.get, int(2 * MAX_PROBE_S / DT))
    assert gov.threads == 2 and gov.switches == 2 and used[-50:].count(1) <= 1
    used = run(gov, clock, quiet.get, int(10 / DT), share=SHARED + 0.05)  # a quiet machine's shares: no switch
    assert gov.threads == 2 and gov.switches == 2


def test_a_core_shared_with_a_light_process_keeps_all_threads_where_they_are_as_fast(threads):
    """A server's own load client takes part of a core: the loop's share drops below SHARED (0.78-0.80 measured),
    yet its forwards on all threads are as fast as on one, without stalls (and its prompt chunks, never probes,
    twice as fast: measured on a Zen 3, 1167 ms for 519 rows on one thread). The probes that the share makes due
    lose, and the loop stays on all threads, probing no more often than every FIRST_PROBE_S."""
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    used = run(gov, clock, {2: 0.028, 1: 0.029}.get, int(60 / DT), share=SHARED - 0.05)
    assert gov.threads == 2 and gov.switches == 0
    assert 0 < used.count(1) <= 60 / FIRST_PROBE_S + 1


def test_noise_within_the_margin_never_switches(threads):
    clock = Clock()
    gov = ThreadGovernor(threads=2, clock=clock)
    times = iter([0.010, 0.013, 0.009, 0.012] * 500)
    run(gov, clock, lambda n: next(times) * (1.2 if n == 1 else 1.0), 2000)  # one thread 1.2x: within SWITCH
    assert gov.switches == 0 and gov.threads == 2


def test_one_thread_machines_are_left_alone(threads):
    torch.set_num_threads(1)
    gov = ThreadGovernor(clock=Clock())
    assert not gov.enabled
    gov.before(1)
    gov.after(1, 1.0)
    assert torch.get_num_threads() == 1 and gov.threads == 1


def test_an_engine_on_one_thread_gives_the_same_tokens_and_the_callers_threads_back(threads):
    model = make_tiny_llama(torch.float32, seed=11)
    torch.set_num_threads(2)
    prompt = [5, 9, 17, 33, 60, 5, 9, 17, 33]
    with Engine(model, None, "goose", engine_config=EngineConfig(max_batch=1), thread=False) as eng:
        eng.governor.threads = 1  # as after a switch: every forward on one thread
        eng.governor.probe_s = float("inf")
        req = eng.submit(prompt, 30)
        out = [t for block in eng.drive(req) for t in block]
    assert out == greedy_memo(model, prompt, 30) and torch.get_num_threads() == 2
    assert EngineConfig(adapt_threads=False).adapt_threads is False


def test_trees_are_priced_by_the_curve_of_the_threads_in_use(threads, monkeypatch):
    """An engine on 2 threads also has the cost curve measured on one (cached under threads=1), and a step run
    while the governor holds one thread gets that curve; on all threads, the other."""
    from goose.engine import scheduler
    from goose.engine.measure import curve_key

    model = make_tiny_llama(torch.float32, seed=12)
    torch.set_num_threads(2)
    seen = []
    real = scheduler.step
    monkeypatch.setattr(scheduler, "step", lambda fwd, slots, cost, *a: (seen.append(cost), real(fwd, slots, cost, *a)))
    prompt = [5, 9, 17, 33, 60, 5, 9, 17, 33]
    with Engine(model, None, "goose", engine_config=EngineConfig(max_batch=2), thread=False) as eng:
        assert eng._cost_one is not None and eng._cost_one is not eng._cost
        assert torch.get_num_threads() == 2  # measuring on one thread gave the thread count back
        keys = {n: scheduler.on_threads(n, lambda: curve_key(model, eng.forward)) for n in (1, 2)}
        assert keys[1] != keys[2]  # two cached curves, one per thread count
        eng.governor.probe_s = float("inf")
        for threads_in_use, want in ((2, eng._cost), (1, eng._cost_one)):
            eng.governor.threads = threads_in_use
            seen.clear()
            out = [t for block in eng.drive(eng.submit(prompt, 12)) for t in block]
            assert seen and all(c is want for c in seen)
            assert out == greedy_memo(model, prompt, 12)
