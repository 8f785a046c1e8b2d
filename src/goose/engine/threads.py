"""A fair share of a contended CPU: how many threads the step loop's forwards run on.

goose's kernels and torch's run their parallel regions on one OpenMP team, whose threads wait for each other at
the end of every region: a forward holds hundreds of them. On a quiet machine that costs nothing. When other
processes take the cores, a team thread that was descheduled holds every region up until the scheduler runs it
again, and a forward becomes tens of times slower (measured: `ar` fell from 128 to 8 tokens/s on 2 cores beside
2 busy processes) while one thread alone would only lose its share.

`ThreadGovernor` measures instead of guessing: the loop runs its forwards on all threads (`torch`'s count when
the governor was made), and `FIRST_PROBE_S` seconds after it starts, then every `PROBE_S` seconds, it runs one
forward on the other setting ("one thread", or all of them again) as a probe: the next forward of
at most `PROBE_ROWS` query rows (a prompt chunk of hundreds of rows on one thread would cost a quiet machine a
forward's time again: measured 507 against 183 ms for 188 prompt rows in int8 on a Zen 3 core pair). A probe faster
than `SWITCH` times the median of the current setting's recent forwards of the same size (rows, in powers of
two) switches the setting. Each probe that does not switch doubles the wait for the next one, up to `MAX_PROBE_S`
(a probe on all threads beside busy processes can cost a hundred forwards' time), and on all threads a forward
`SURPRISE` times slower than its size's median (the machine got busy) makes the next small forward a probe on one
thread (a cheap one), at most every `FIRST_PROBE_S`. So on a quiet machine the probes cost one forward in
thousands; on a busy one the loop moves to one thread within a few forwards, and back within `MAX_PROBE_S` of the
machine going quiet (one thread's own timings are too noisy there to tell a quiet machine from a lucky forward).
A new governor starts where another one of the process left off in the last `REMEMBER_S` seconds (its setting and
its wait for the next probe, with no early probe): a process-wide hint that shapes speed only.

The loop also knows whether the thread it runs on shares its core with another process: a forward's thread CPU
time against its wall time (`after`'s `cpu`; on a quiet machine 1.00 on one thread or all, the team's waits spin).
While the median share of the current setting's recent forwards is below `SHARED` (more runnable threads than cores),
on all threads a probe on one thread is due at the next small forward (at most every `FIRST_PROBE_S`) and is weighed
against the mean of its size's recent forwards, not their median: a team with a descheduled thread costs rare
forwards of tens of forwards' time, which a median does not see; and on one thread no probe on all threads is run
(it would be such a forward, and lose); that probe is due again after the same wait, so a machine that goes quiet
gets all threads back as before. Measured on a Zen 1 (2 cores) beside 2 busy processes: one thread's share
0.48-0.72, all threads' 0.48-0.66; beside 1 busy process one thread's 0.99; `ar` on one thread there 0.57x of its
quiet 2-thread speed, 0.15-0.26x with the probes and the medians alone. A share alone does not move the loop: a
server's load client on the same 2 cores (Zen 3, 16 streams) brought all threads' share to 0.78-0.80 with 8-row
forwards as fast as on one thread and prompt chunks twice as fast (519 rows: 1167 ms on one thread); moving to one
thread there cost a third of the server's throughput.

"One thread" is one OpenMP thread whose projections (most of a forward's work) run on the kernels' claim pool
of all the threads (`cpukernel.claim_threads`, team.h): the calling thread and the pool's workers take blocks
of a projection's panels from one counter and the caller does whatever no running thread took, so a worker the
scheduler took off its core holds a projection up only while it holds a block, never at a barrier; attention
and torch's own operations run on the loop's thread alone. Measured on a Zen 3 (2 cores; `benchmarks/contended.py
--fixed`, 96 tokens x 2 prompts, `ar` / `goose`, tokens/s, one OpenMP thread against the pool): beside 2 busy
processes exact 27.2 / 24.4 against 30.1 / 38.3, int8 43.7 / 43.5 against 66.3 / 57.1; beside 1 busy process
exact 43.8 / 45.7 against 49.2 / 47.3, int8 82.2 / 73.0 against 81.2 / 74.4. On a quiet machine the pool ran
0.71-1.07x of all threads on OpenMP (exact 56.8 / 53.2 against 68.1 / 66.7), and a probe moves the loop there only
when it is faster by the margin of `SWITCH`."""

from __future__ import annotations

import time
from collections import deque

import torch

from ..backends.cpukernel import claim_threads, claimed

PROBE_S = 2.0  # seconds between probes of the other thread setting
FIRST_PROBE_S = 0.25  # a new governor's first probe comes this soon (a busy machine is found at once)
REMEMBER_S = 30.0  # a new governor starts on the setting another one in this process chose this recently
SWITCH = 0.8  # a probe this fraction of the current setting's median time (or less) switches
RECENT = 8  # forwards per (setting, size) whose median the probe is compared with
PROBE_ROWS = 16  # only forwards of at most this many query rows are probes (a due probe waits for one)
MAX_PROBE_S = 32.0  # the longest wait between probes (each probe that does not switch doubles it from PROBE_S)
SURPRISE = 1.5  # a forward on all threads this many times slower than its size's median makes a probe due at once
SHARED = 0.8  # the loop's thread on the CPU less than this fraction of its recent forwards' wall time: a shared core


def _bucket(rows: int) -> int:
    return 1 << max(0, int(rows) - 1).bit_length()


class ThreadGovernor:
    """One step loop's thread setting (see the module docstring). Used on the loop's thread only: `before(rows)`
    sets the thread count for the next forward (of `rows` query rows in all), `after(rows, seconds)` records it;
    `release` gives the calling thread its full count back (when the loop stops stepping on a caller's thread)."""

    # the process's last chosen setting, when, and its probes in a row that did not switch (a hint)
    _chosen: tuple[int, float, int] = (0, float("-inf"), 0)

    def __init__(self, threads: int | None = None, probe_s: float = PROBE_S, clock=time.monotonic) -> None:
        self.clock = clock
        self.full = int(threads or torch.get_num_threads())
        self.threads = self.full  # the current setting
        self.probe_s = probe_s
        self.switches = 0
        self._recent: dict[tuple[int, int], deque] = {}
        self._last_probe = clock() - probe_s + min(FIRST_PROBE_S, probe_s)
        self._fails = 0  # probes in a row that did not switch (each doubles the wait for the next)
        chose, at, fails = ThreadGovernor._chosen
        if chose in (1, self.full) and 0 <= clock() - at < REMEMBER_S:  # another governor's setting, and its
            self.threads, self._fails, self._last_probe = chose, fails, clock()  # wait: no early probe
        self._due = False  # a surprising forward: the next small forward is a probe
        self._share: deque = deque(maxlen=RECENT)  # the current setting's recent forwards' CPU time over wall time
        self._probing = False
        self.probed = False  # the last forward was a probe (on the other setting)

    @property
    def enabled(self) -> bool:
        return self.full > 1

    def before(self, rows: int) -> None:
        """Set the threads of the next forward (`rows` query rows in all): the current setting, or the other one
        when a probe is due and the forward is small enough to be one."""
        if not self.enabled:
            return
        wait = min(self.probe_s * 2 ** self._fails, max(MAX_PROBE_S, self.probe_s))
        since = self.clock() - self._last_probe
        self._probing = rows <= PROBE_ROWS and (since >= wait or self._due and since >= FIRST_PROBE_S)
        if self._probing and self.threads == 1 and self.shared():
            self._probing, self._last_probe = False, self.clock()  # all threads would lose: the same wait again
        self._apply(self.other if self._probing else self.threads)

    def _apply(self, threads: int) -> None:
        """torch's threads for this thread's next forward; on one, the projections on the kernels' claim pool."""
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        claim = self.full if threads == 1 else 0
        if claim != claimed():  # (the calling thread's: an engine driven on its callers' threads meets several)
            claim_threads(claim)

    def shared(self) -> bool:
        """Whether the current setting's recent forwards shared the loop's core with another process (`SHARED`)."""
        return len(self._share) >= RECENT // 2 and sorted(self._share)[len(self._share) // 2] < SHARED

    def after(self, rows: int, seconds: float, cpu: float | None = None) -> None:
        """Record the forward just run (`rows` query rows in all, `seconds` long, `cpu` seconds of the calling
        thread's CPU time when known); a probe may switch."""
        if not self.enabled:
            return
        self.probed = self._probing
        size = _bucket(rows)
        ThreadGovernor._chosen = (self.threads, self.clock(), self._fails)
        if cpu is not None and seconds > 0 and not self._probing:
            self._share.append(cpu / seconds)
            if self.threads == self.full and self.probe_s < float("inf") and self.shared():  # a contended core:
                self._due = True  # a probe on one thread soon, weighed against the mean (the stalls count)
        if not self._probing:
            recent = self._recent.setdefault((self.threads, size), deque(maxlen=RECENT))
            if self.threads == self.full and len(recent) >= RECENT // 2 and self.probe_s < float("inf"):
                self._due = self._due or seconds > SURPRISE * sorted(recent)[len(recent) // 2]
            recent.append(seconds)
            return
        self._last_probe = self.clock()
        self._probing = self._due = False
        mine = self._recent.get((self.threads, size))
        self._recent.setdefault((self.other, size), deque(maxlen=RECENT)).append(seconds)
        if mine and seconds <= SWITCH * (sum(mine) / len(mine) if self.shared() else sorted(mine)[len(mine) // 2]):
            self._switch(self._last_probe)
            self._recent = {(self.threads, size): deque([seconds], maxlen=RECENT)}
        else:
            self._fails += 1
        ThreadGovernor._chosen = (self.threads, self.clock(), self._fails)

    def _switch(self, now: float) -> None:
        """To the other setting. The machine changed: medians and shares of either setting from before would flag
        the new normal as a surprise (the probe's own time is the new setting's first sample, where there is one)."""
        self.threads = self.other
        self.switches += 1
        self._fails = 0
        self._recent, self._share, self._due, self._last_probe = {}, deque(maxlen=RECENT), False, now
        ThreadGovernor._chosen = (self.threads, now, 0)

    def release(self) -> None:
        """Give the calling thread its full thread count back, its projections on OpenMP's team (the setting is
        kept for the next forward)."""
        if self.enabled:
            self._apply(self.full)

    @property
    def other(self) -> int:
        return 1 if self.threads == self.full else self.full


def on_threads(n: int, fn):
    """`fn()` with torch's parallel regions on `n` threads, as a governor's setting runs them: on one thread of a
    caller with more, the projections on the kernels' claim pool of the caller's count; the calling thread's
    count and pool are restored after."""
    before, claim = torch.get_num_threads(), claimed()
    torch.set_num_threads(n)
    claim_threads(before if n == 1 < before else 0)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)
        claim_threads(claim)
