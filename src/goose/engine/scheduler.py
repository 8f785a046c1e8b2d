"""`Engine`: many requests at once on one model, continuously batched.

One background thread owns the forward, every request's KV cache and method state, and runs the step loop
(`engine.step`) over all running requests: requests join and leave at step boundaries, prompts are
prefilled in chunks inside the same forwards as the running requests' trees (a step's prompt tokens share
one budget, so a long prompt delays the others by at most one chunk per step), and the `goose` method's
subtrees are chosen for the whole batch at once under the batched cost curve (`selector.allocate`).
Callers talk to it only through `Request` objects (thread-safe).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import heapq
import itertools
import logging
import operator
import os
import queue
import secrets
import threading
import time
from collections import deque
from typing import NamedTuple

import torch

from ..backends.cpukernel import release_thread_team
from ..config import EngineConfig, GooseConfig
from ..drafting.memory import MemoryPool
from ..errors import (
    EngineClosed,
    EngineFailed,
    GooseError,
    MethodNotAllowed,
    QueueFull,
    RequestCancelled,
    RequestFailed,
)
from ..machine import trim_heap
from ..selection.costmodel import BatchCostCurve, TrackedCost
from .measure import load_or_measure_batch
from .methods import METHODS, Method, make_method
from .output import Detokenizer, TokenBlock, stop_check, text_decoder
from .prefix import BLOCK, PrefixCache
from .requests import (
    GenerationResult,
    context_limit,
    decode_config,
    default_forward,
    encode,
    eos_ids,
    id_set,
    pick_forward,
)
from .step import DECODE, PREFILL, Slot, step
from .threads import ThreadGovernor, on_threads

_END = object()  # end of a request's block queue
log = logging.getLogger("goose.engine")
BATCH_SIZES_KEPT = 4096  # Engine.batch_sizes: the sizes of this many most recent steps
TRIM_S = 5.0  # while busy, the step loop hands the C heap's free memory back at most this often (and when idle)
MEMORY_REPORT_S = 1.0  # while busy, the step loop publishes the suffix memories' sizes at most this often
MEMORY_REPORT_TENANTS = 16  # tenants named in that report (the largest; the rest only in the totals)


class MemoryReport(NamedTuple):
    """The suffix memories' sizes (`Engine.memory_report`): bytes and tenants in all, sequences evicted and
    tenants dropped so far, and the largest tenants' bytes (at most MEMORY_REPORT_TENANTS of them)."""

    bytes: int
    tenants: int
    evicted: int
    dropped: int
    largest: tuple[tuple[str, int], ...]


class Request:
    """One submitted request. `result()` waits for its `GenerationResult`; `stream()` yields its text pieces
    as they are accepted; `tokens()` its `TokenBlock`s; `cancel()` stops it at the next step boundary.
    `finish_reason`: "stop" (a stop token or `stop`), "length" (max_new_tokens), "cancelled" or "error".
    `stats` and `token_ids` are read safely once it is done (while it runs, the engine's thread writes them)."""

    def __init__(self, rid: int, prompt: list[int], slot: Slot, decode, on_tokens, tenant: str = "",
                 private_memory: bool = False, private: bool = False) -> None:
        self.id = rid
        self.prompt = prompt
        self.tenant = tenant  # the prefix-cache and suffix-memory scope of this request (see Engine.submit)
        self.private = private  # reuses no stored prefix and stores none (and private_memory)
        self.private_memory = private_memory or private  # drafts from no earlier request's text, leaves none
        self.slot = slot
        self.method = slot.method.name  # the method decoding this request
        self._decode = decode
        self._on_tokens = on_tokens
        self._blocks: queue.Queue = queue.Queue()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self.error: BaseException | None = None
        self.finish_reason: str | None = None
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self.block_times: list[float] = []  # when each token block was committed (inter-token latency)
        self.finished_at: float | None = None
        self._result: GenerationResult | None = None

    # ---- caller side ---------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop this request at the next step boundary (its slot is freed); a no-op once it is done."""
        self._cancel.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the request is over; False on timeout."""
        return self._done.wait(timeout)

    def result(self, timeout: float | None = None) -> GenerationResult:
        """The finished request's result; raises the request's error, GooseError if it was cancelled, or
        TimeoutError after `timeout` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        if self.error is not None:
            raise self.error
        if self.finish_reason == "cancelled":
            raise RequestCancelled(f"request {self.id} was cancelled")
        return self._result

    def tokens(self, timeout: float | None = None):
        """Token blocks (`TokenBlock`s) as they are committed (the first block is the first token). Stopping the
        iteration early cancels the request. Raises the request's error at the end, TimeoutError when no block
        came for `timeout` seconds."""

        def wait():
            try:
                return self._blocks.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no tokens for {timeout} s") from None

        return self._until_end(wait)

    def _until_end(self, next_block):
        """The blocks `next_block()` hands out until the end mark; stopping early cancels the request; the
        request's error is raised at the end."""
        finished = False
        try:
            while True:
                block = next_block()
                if block is _END:
                    finished = True
                    break
                yield block
        finally:
            if not finished:
                self.cancel()
        if self.error is not None:
            raise self.error

    def stream(self, timeout: float | None = None):
        """Text pieces as they are accepted (they concatenate to `result().text`; each token is decoded a
        bounded number of times, `Detokenizer`); see `tokens`."""
        if self._decode is None:
            raise GooseError("streaming text needs a tokenizer")
        yield from Detokenizer(self._decode).pieces(self.tokens(timeout))

    @property
    def stats(self):
        """The request's `Stats` (tokens, forwards, acceptance per draft source, timings)."""
        return self.slot.stats

    @property
    def token_ids(self) -> list[int]:
        """The tokens generated so far (a copy)."""
        return list(self.slot.out)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from submission to the first generated token."""
        return None if self.first_token_at is None else self.first_token_at - self.submitted

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per generated token after the first."""
        n = self.slot.stats.new_tokens
        if self.finished_at is None or self.first_token_at is None or n < 2:
            return None
        return (self.finished_at - self.first_token_at) / (n - 1)

    # ---- engine side ---------------------------------------------------------------------------------
    def _deliver(self, block: TokenBlock) -> None:
        self.block_times.append(time.perf_counter())
        if self.first_token_at is None:
            self.first_token_at = self.block_times[0]
        self._blocks.put(block)
        if self._on_tokens is not None:
            self._on_tokens(block)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error = reason, error
        self.finished_at = time.perf_counter()
        s = self.slot
        if reason in ("stop", "length"):
            text = self._decode(s.out) if self._decode is not None else None
            self._result = GenerationResult(text, list(s.out), s.stats)
        s.cache = s.method = s.stop = None  # free the KV cache and per-request state now (and the stop's cycle)
        self._on_tokens = None
        self._blocks.put(_END)
        self._done.set()


_UNSET = object()  # a keyword setting not given (its EngineConfig default applies)


def _settings(given: EngineConfig | None, **keywords) -> EngineConfig:
    """`given`, or an EngineConfig built from the keyword settings that were passed (not both)."""
    passed = {k: v for k, v in keywords.items() if v is not _UNSET}
    if given is None:
        return EngineConfig(**passed)
    if passed:
        raise GooseError(f"give {', '.join(passed)} inside engine_config, not beside it")
    if not isinstance(given, EngineConfig):
        raise GooseError(f"engine_config must be an EngineConfig, got {type(given).__name__}")
    return given


class Engine:
    """Serves many requests at once on one model (see the module docstring). Thread-safe.

    `method`: the default method of every request (a name of `goose.METHODS`); a request may name another
    with ``submit(..., method=...)``. `engine_config`: every setting below (`goose.config.EngineConfig`);
    the keywords `max_batch`, `max_queue`, `prefill_chunk`, `prefix_cache_mb` and `memory_mb` build one instead.
    `max_batch`: requests decoded together (more wait in a FIFO queue:
    more requests per forward raise throughput and each request's time per token). `max_queue`: waiting
    requests beyond which `submit` raises GooseError (None: unbounded). `prefill_chunk`: prompt tokens all
    prefilling requests may add in one step (None: each request's ``prefill_chunk`` option, 512 by default).

    `prefix_cache_mb`: room for the keys and values of prompts (and finished requests' outputs) that later
    requests starting with the same tokens reuse instead of prefilling them again (`goose.engine.prefix`;
    whole blocks of 8 tokens, least recently used dropped first; 0 turns it off; only on goose's kernels,
    where reuse gives the same bits). A request admitted beside an earlier one whose prompt shares its first
    blocks waits for that prefill to end, then copies them.

    `memory_mb`: room for earlier requests' prompts and outputs that `goose` drafts from
    (`goose.drafting.memory`): one memory per tenant, all within this many MiB together (least recently used
    sequences dropped first; 0 turns it off); emptied when the weights change.

    Failures: an exception in one request's own stage (its cache allocation, prefix attach or store, its
    callbacks) fails that request alone; the step loop itself failing sets `failure` (the reason), fails
    every queued and running request with it and closes the engine (docs/reliability.md).

    `arith`: the forward's arithmetic, as `Decoder`'s ("exact" or "int8"; None: the model's own). An engine
    has one, so its prefix cache only ever holds keys and values of that arithmetic.

    `thread`: True (default) runs the step loop on a background thread of the engine's own; False leaves it
    to the caller: `run()` runs it on the calling thread until `close()`. torch's OpenMP runtime (libgomp)
    keeps a team of worker threads per thread that ran torch work, and once the process holds more such
    threads than CPUs every idle worker sleeps instead of spinning, which made the step loop ~2.8x slower on
    2 cores. So the constructor and `submit` free their calling thread's team after their own torch work,
    and the engine frees its own whenever it runs out of requests (`cpukernel.release_thread_team`); other
    torch work on other threads while the engine decodes slows both (docs/performance-log.md §8).
    """

    def __init__(self, model, tokenizer=None, method: str | Method = "goose", max_batch: int = _UNSET, config=None,
                 *, forward=None, max_queue: int | None = _UNSET, prefill_chunk: int | None = _UNSET,
                 prefix_cache_mb: float = _UNSET, memory_mb: float = _UNSET, thread: bool = True,
                 engine_config: EngineConfig | None = None, arith: str | None = None) -> None:
        self.settings = settings = _settings(engine_config, max_batch=max_batch, max_queue=max_queue,
                                             prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb,
                                             memory_mb=memory_mb)
        if settings.freeze_gc:
            freeze_heap()  # before the engine's own objects exist: only what the caller already holds is frozen
        # the step loop's own (see goose.engine.prefix)
        self.prefixes = PrefixCache(settings.prefix_cache_bytes, settings.max_tenants)
        # earlier requests' prompts and outputs, one memory per tenant (used on the engine's thread only)
        self.memories = MemoryPool(settings.memory_bytes, (config or GooseConfig()).memory, settings.max_tenants)
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.max_batch, self.max_queue = settings.max_batch, settings.max_queue
        self.prefill_chunk = settings.prefill_chunk
        self._own_forward = forward is None
        # one arithmetic per engine (Decoder's `arith`), so its prefix cache never mixes two
        self.forward, self.arith = pick_forward(model, forward, arith)
        self.vocab = model.get_output_embeddings().weight.shape[0]
        self.eos = eos_ids(model, tokenizer)
        self.limit = context_limit(model)
        self.failed_steps = 0  # steps in a row whose shared work failed (every request in them failed)
        self.step_failure: str | None = None  # why the last such step failed
        room = self.forward.max_entries
        if room is not None:  # a static cache bounds what a request may hold (with a step's tree beside it)
            room = max(room - settings.tree_room, 1)
            self.limit = room if self.limit is None else min(self.limit, room)
        self._templates: dict[str, Method] = {}
        self._tpl_lock = threading.Lock()  # preparing a method (maybe measuring a cost curve) takes seconds
        # the threads of the loop's forwards (one while that is faster: a contended CPU; `goose.engine.threads`)
        on_cpu = next(model.parameters()).device.type == "cpu"
        self.governor = ThreadGovernor() if settings.adapt_threads and on_cpu else None
        self._threads = torch.get_num_threads()
        # the batched cost curve trees are priced by: on all threads, and on one (while the governor runs one)
        self._cost = self._cost_one = None
        self.method = method if isinstance(method, Method) else None
        self.default_method = method if self.method is None else method.name
        if self.method is None:
            self._template(method)
        else:
            self.method.prepare(model, self.forward, tokenizer)
            self._templates[self.default_method] = self.method
        for name in settings.methods or ():  # the methods requests may name, prepared now (never mid-serving)
            self._template(name)
        self._cond = threading.Condition()
        self._calls: deque = deque()  # (fn, Future) to run on the loop's thread between steps (`call`)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._ids = itertools.count(1)
        self._closed = False
        self.steps = 0  # forwards run so far
        self._checked_at = 0  # self.steps at the last weights check
        self.batch_sizes: deque[int] = deque(maxlen=BATCH_SIZES_KEPT)  # requests per step, recent steps only
        self.batch_counts = [0] * (self.max_batch + 1)  # steps run with n requests, for every n (fixed size)
        self.failure: str | None = None  # why the step loop stopped for good (None: it runs, or was closed)
        # the suffix memories' sizes as the step loop last published them (`MemoryReport`; read from any thread)
        self.memory_report = MemoryReport(0, 0, 0, 0, ())
        self._memory_changed, self._reported_at = False, 0.0
        self._trimmed_at = time.monotonic()  # when the loop last handed free heap memory back (`trim_heap`)
        self.last_step_at: float | None = None  # time.monotonic() when the last step ended (None: none yet)
        self._thread = threading.Thread(target=self._loop, name="goose-engine", daemon=True) if thread else None
        self._runner_done = threading.Event()
        self._runner: threading.Thread | None = None
        if self._thread is not None:
            self._thread.start()
            release_thread_team()  # this thread's torch work (above) is done: the engine's team is the only one

    # ---- public API ----------------------------------------------------------------------------------
    def submit(self, prompt_or_ids: str | list[int], max_new_tokens: int = 128, chat: bool = False, *,
               method: str | None = None, stop=None, eos=None, on_tokens=None, tenant: str = "",
               private_memory: bool = False, private: bool = False, chooser=None, speculative: bool = True,
               **options) -> Request:
        """Queue one request; returns at once. `options` are DecodeConfig fields (do_sample, temperature,
        top_k, top_p, seed, prefill_chunk; sampling without a seed draws one from the OS's entropy, so
        no two runs repeat each other). `stop(tokens) -> bool` is asked after every generated token (or
        `stop` is a string or a list of them: the request ends once its text holds one, `goose.engine.output`);
        `eos`: stop token ids (default: the model's); `on_tokens(block)` is called on the engine's thread
        with each committed `TokenBlock` (an exception there fails this request only). `chooser`: how each
        token is picked (`goose.engine.sampling.Chooser`; default: from the options, greedy or sampling).
        `tenant`: the prefix-cache and suffix-memory scope: a request reuses only prefixes stored, and drafts
        only from text seen, by requests of the same tenant ("" = the anonymous tenant). `private_memory`:
        the request neither drafts from the suffix memory nor adds its text to it. `private`: that, and it
        neither reuses stored prefixes nor stores its own (`goose serve` sets it for requests that name no
        tenant). `speculative`: False decodes this request plainly (the method "ar": no drafts, whatever
        `method` says). `method` must be one of `EngineConfig.methods` when the engine was given them
        (`MethodNotAllowed` otherwise). Bad input raises GooseError here, before anything is queued."""
        cfg = decode_config(dict(options, max_new_tokens=max_new_tokens))
        if cfg.do_sample and cfg.seed is None:
            cfg = dataclasses.replace(cfg, seed=secrets.randbits(63))
        if isinstance(prompt_or_ids, str):
            ids = encode(self.tokenizer, prompt_or_ids, chat)
        else:
            ids = [int(t) for t in prompt_or_ids]
            if any(not 0 <= t < self.vocab for t in ids):
                raise GooseError(f"token ids must be in 0..{self.vocab - 1}")
        stop = stop_check(stop, self.tokenizer)
        template = self._template("ar" if not speculative else method or self.default_method)
        rid = next(self._ids)
        req_box: list[Request] = []
        slot = Slot(ids, cfg, template.fork(), None, self.eos if eos is None else id_set(eos),
                    self.limit, chooser, stop=None if stop is None else _guarded(stop, req_box))
        decode = None if self.tokenizer is None else text_decoder(self.tokenizer)
        req = Request(rid, ids, slot, decode, on_tokens, str(tenant), bool(private_memory), bool(private))
        req_box.append(req)
        with self._cond:
            if self._closed:
                if self.failure is not None:
                    raise EngineFailed(f"the engine is closed: it failed ({self.failure})")
                raise EngineClosed("the engine is closed")
            if self.max_queue is not None and len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} waiting requests)")
            self._waiting.append(req)
            self._cond.notify_all()
        if self._thread not in (None, threading.current_thread()):  # preparing it may have run torch work here
            release_thread_team()
        return req

    def generate(self, prompt_or_ids, max_new_tokens: int = 128, chat: bool = False, **options) -> GenerationResult:
        return self.submit(prompt_or_ids, max_new_tokens, chat, **options).result()

    def generate_batch(self, prompts: list, max_new_tokens: int = 128, chat: bool = False,
                       **options) -> list[GenerationResult]:
        """Submit every prompt, wait for all; results in input order."""
        reqs = [self.submit(p, max_new_tokens, chat, **options) for p in prompts]
        return [r.result() for r in reqs]

    @property
    def offered_methods(self) -> tuple[str, ...]:
        """The methods a request may name: the default one first, then `EngineConfig.methods` ("ar" among them),
        or every method when the engine was given none."""
        return tuple(dict.fromkeys((self.default_method, *(self.settings.methods or METHODS))))

    @property
    def step_threads(self) -> int:
        """The threads the step loop's forwards run on now (the thread governor's setting; without one, torch's
        count when the engine was made)."""
        return self.governor.threads if self.governor is not None else self._threads

    def load(self) -> tuple[int, int]:
        """(running requests, waiting requests)."""
        with self._cond:
            return len(self._running), len(self._waiting)

    def close(self, timeout: float | None = None, cancel: bool = False) -> None:
        """Accept no more requests; finish the queued and running ones (all cancelled at once with `cancel`,
        or the ones still unfinished after `timeout` seconds), then stop the engine's thread."""
        with self._cond:
            self._closed = True
            if cancel:
                self._cancel_all()
            self._cond.notify_all()
        if self._thread is None and (self._runner is None or threading.current_thread() is self._runner):
            return  # no loop runs (thread=False, run() never called), or close() was called from inside it
        if not self._wait_loop(timeout):
            with self._cond:
                self._cancel_all()
            self._wait_loop(None)

    def _cancel_all(self) -> None:
        """Cancel every queued and running request and wake the loop (the caller holds the condition)."""
        for r in [*self._waiting, *self._running]:
            r.cancel()
        self._cond.notify_all()

    def _wait_loop(self, timeout: float | None) -> bool:
        """Wait up to `timeout` seconds for the step loop (the engine's thread or `run()`) to end."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return self._runner_done.wait(timeout)

    def run(self) -> None:
        """With ``thread=False``: run the step loop on this thread until `close()` (called from another
        thread) and the queued and running requests are finished."""
        self._callers_loop("run()")
        self._runner = threading.current_thread()
        try:
            self._loop()
        finally:
            self._runner_done.set()

    def step(self) -> bool:
        """With ``thread=False``: one step of the loop on this thread, without waiting (queued requests are
        admitted, the running ones advance by one forward); False when no request is queued or running (nothing
        was done). For a caller that drives several engines in turns (`benchmarks/concurrency_ab.py`) or its own
        loop. A failure of the loop itself ends the engine as in `run()` and is raised here."""
        self._callers_loop("step()")
        with self._cond:
            if not self._waiting and not self._running:
                return False
        try:
            return self._next_step()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            if self.governor is not None and self.load() == (0, 0):
                self.governor.release()  # nothing left to step: the caller's thread gets its thread count back

    def call(self, fn, timeout: float | None = None):
        """``fn()`` run where the engine's state is owned: on the step loop's thread between two steps while a
        loop runs (its result returned, its exception raised here; TimeoutError after `timeout` seconds), else
        on the calling thread. How a server exports or restores the suffix memories (`memories`) safely."""
        runner = self._thread if self._thread is not None else self._runner
        if runner is None or not runner.is_alive() or runner is threading.current_thread():
            return fn()
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._calls.append((fn, done))
            self._cond.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done.done():
            if not runner.is_alive():  # the loop ended before it ran the call: nothing else owns the state now
                self._run_calls()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            concurrent.futures.wait([done], timeout=0.1 if left is None else min(0.1, left))
        return done.result(0)

    def export_memories(self, timeout: float | None = None) -> list[tuple[str, list[bytes]]]:
        """A copy of the suffix memories, every tenant's sequences (`MemoryPool.export`), taken between steps."""
        return self.call(self.memories.export, timeout)

    def restore_memories(self, tenants: list[tuple[str, list]], timeout: float | None = None) -> None:
        """Restore `tenants`' sequences (`MemoryPool.restore`: as `export_memories` lists them) as the oldest
        memories. The pool is rebuilt on the calling thread (the step loop goes on meanwhile: a large snapshot
        stalls no request), then, between two steps, what the engine's pool learned meanwhile is inserted after
        it as the most recently used and the rebuilt pool takes its place. `timeout` bounds the wait for the
        loop's thread only, not the rebuild."""
        restored = self.memories.empty_like()
        restored.restore(tenants)

        def swap() -> None:
            restored.absorb(self.memories)
            self.memories = restored
            self._memory_changed = True
            self._report_memory(time.monotonic())

        self.call(swap, timeout)

    def _run_calls(self) -> None:
        """Run the calls queued by `call` (on the loop's thread)."""
        while True:
            with self._cond:
                if not self._calls:
                    return
                fn, done = self._calls.popleft()
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    done.set_exception(exc)

    def drive(self, req: Request):
        """With ``thread=False``: `req`'s token blocks, stepping the loop on this thread whenever none is
        waiting (other requests advance beside it); raises the request's error at the end. Stopping the
        iteration early cancels the request. How `goose.Decoder` decodes."""
        self._callers_loop("drive()")

        def step_until_block():
            while True:
                try:
                    return req._blocks.get_nowait()
                except queue.Empty:
                    if not self.step() and req._blocks.empty():
                        raise GooseError(f"request {req.id} is not queued in this engine") from None

        def blocks():
            try:
                yield from req._until_end(step_until_block)
            finally:
                if self.governor is not None:
                    self.governor.release()  # the caller's thread gets its own thread count back

        return blocks()

    def _callers_loop(self, call: str) -> None:
        """`call` (run() or step()) drives the loop from the caller: refused when the engine runs its own thread
        or `run()` already loops."""
        if self._thread is not None:
            raise GooseError(f"this engine runs its own thread; {call} is for Engine(..., thread=False)")
        if self._runner is not None:
            raise GooseError("the engine's loop is already running (run())")

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals -----------------------------------------------------------------------------------
    def _template(self, name: str) -> Method:
        """The prepared method `name` whose forks serve requests (prepared once; cost curves measured once)."""
        if self.settings.methods is not None and name not in self.offered_methods:
            raise MethodNotAllowed(f"method '{name}' is not offered here; choose one of: "
                                   f"{', '.join(self.offered_methods)}")
        with self._tpl_lock:
            tpl = self._templates.get(name)
            if tpl is None:
                tpl = make_method(name, self.vocab, self.config)
                tpl.prepare(self.model, self.forward, self.tokenizer)
                self._templates[name] = tpl
            if tpl.cost is not None and self._cost is None:  # one request at a time: the method's own curve
                track = TrackedCost if self.settings.track_cost else (lambda curve: curve)
                self._cost = track(BatchCostCurve.single(tpl.cost) if self.max_batch == 1 else
                                   load_or_measure_batch(self.model, self.forward, self.max_batch))
                if self.governor is not None and self.governor.enabled:  # measured (once: cached) on one thread
                    self._cost_one = track(on_threads(1, lambda: load_or_measure_batch(self.model, self.forward,
                                                                                       self.max_batch)))
            return tpl

    def _loop(self) -> None:
        """The step loop. A failure of one request's own stage fails that request only (`_guard`); anything
        else ends the engine: `failure` says why, every queued and running request fails with that reason,
        and `submit` refuses new ones (a server then restarts the engine or exits)."""
        try:
            while self._next_step():
                pass
        except BaseException as exc:  # the engine cannot go on: every request learns why
            self._fail(exc)
            if self._thread is None:
                raise  # run() on the caller's thread: the caller sees it
        finally:
            self._run_calls()  # (calls queued as the loop ended: nothing else owns the state now)

    def _fail(self, exc: BaseException) -> None:
        """The loop failed: record why, fail every queued and running request with it, refuse new ones."""
        self.failure = f"{type(exc).__name__}: {exc}"
        log.error("the engine stopped: %s", self.failure, exc_info=exc)
        with self._cond:
            self._closed = True
            for r in [*self._waiting, *self._running]:
                try:
                    r._finish("error", EngineFailed(f"the engine stopped: {self.failure}"))
                except BaseException:  # noqa: BLE001 - one broken request must not keep the others waiting
                    r._done.set()
            self._waiting.clear()
            self._running.clear()
            self._cond.notify_all()

    @staticmethod
    def _guard(r: Request, stage: str | None, fn, *args) -> bool:
        """Run one request's own stage `fn(*args)`; on an exception that request alone fails (with `stage`
        named in its error; None: the caller's own exception, as raised by its callback). True when it ran."""
        try:
            fn(*args)
            return True
        except Exception as exc:
            r._finish("error", exc if stage is None else RequestFailed.stage(stage, exc))
            return False

    def _next_step(self) -> bool:
        with self._cond:
            idle = not self._waiting and not self._running
        now = time.monotonic()
        if idle or now - self._trimmed_at >= TRIM_S:  # the heap's free memory goes back (between steps only)
            trim_heap()
            self._trimmed_at = now
        if idle:  # an idle engine keeps no OpenMP team: torch work on other threads meanwhile runs at full speed
            release_thread_team()
        if self._memory_changed and (idle or now - self._reported_at >= MEMORY_REPORT_S):
            self._report_memory(now)
        with self._cond:
            while not self._waiting and not self._running and not self._calls:
                if self._closed:
                    return False
                self._cond.wait()
        self._run_calls()
        with self._cond:
            for r in [r for r in self._waiting if r._cancel.is_set()]:
                self._waiting.remove(r)
                r._finish("cancelled")
            admitting = bool(self._waiting) and len(self._running) < self.max_batch
        if admitting or self.steps - self._checked_at >= self.settings.weights_check_steps:
            self._checked_weights()
        with self._cond:
            self._running = [r for r in self._running if not r.done]
            admitted = []
            free = self.forward.free_caches  # (a static cache's free slots: a request waits for one)
            while self._waiting and len(self._running) < self.max_batch and (free is None or len(admitted) < free):
                self._running.append(self._waiting.popleft())
                admitted.append(self._running[-1])
            if free == 0 and not self._running and self._waiting:  # none will come back: held outside the engine
                r = self._waiting.popleft()
                r._finish("error", RequestFailed("every cache slot of the forward is held outside this engine"))
            running = list(self._running)
        reuse = self.prefixes.max_bytes > 0 and PrefixCache.supports(self.forward)
        for r in admitted:
            r.slot.method.memory = None if r.private_memory else self.memories.get(r.tenant)
            self._guard(r, "starting the request (cache allocation)", self._start, r)
        if reuse:
            self._share_prefixes([r for r in running if not r.done])
        for r in running:
            if r._cancel.is_set():
                r._finish("cancelled")
        running = [r for r in running if not r.done]
        if running:
            try:
                one = self.governor is not None and self.governor.threads == 1 and self._cost_one is not None
                step(self.forward, [r.slot for r in running], self._cost_one if one else self._cost,
                     self.prefill_chunk, self.settings, self.governor)
                self.failed_steps = 0
            except Exception as exc:  # a failure of the step's shared work fails the requests in it
                err = exc if isinstance(exc, GooseError) else RequestFailed(f"decoding failed: {exc!r}")
                for r in running:
                    r._finish("error", err)
                self.failed_steps += 1  # (in a row: a server's /health reports a loop that fails every step)
                self.step_failure = f"{type(exc).__name__}: {exc}"[:500]
            self.steps += 1
            self.batch_sizes.append(len(running))
            self.batch_counts[min(len(running), self.max_batch)] += 1
            if any(r.slot.done for r in running if not r.done):  # none finishes on weights that changed under it
                self._checked_weights()
            if reuse:
                self._store_prefixes(running)
            for r in running:
                if r.done:
                    continue
                s = r.slot
                if s.error is not None:  # its own stage failed in this step (engine.step's `Slot.fail`)
                    r._finish("error", s.error)
                    continue
                if s.new and not self._guard(r, None, r._deliver, TokenBlock(s.new, s.new_sources)):
                    continue
                if r.error is not None:  # its `stop` raised
                    r._finish("error", r.error)
                elif s.done:
                    if not r.private_memory:
                        self.memories.insert(r.tenant, s.prompt + s.out)
                        self._memory_changed = True
                    r._finish(s.finish_reason)
        with self._cond:
            self._running = [r for r in self._running if not r.done]
        self.last_step_at = time.monotonic()
        return True

    def _start(self, r: Request) -> None:
        """An admitted request's KV cache (made now: a static cache's slot is held only while it runs) and start."""
        r.slot.cache = self.forward.new_cache()
        r.slot.begin(self.settings.tree_room)

    def _report_memory(self, now: float) -> None:
        """Publish the suffix memories' sizes (`memory_report`): one tuple, replaced whole, so a reader on another
        thread never sees the pool mid-change."""
        pool = self.memories
        largest = heapq.nlargest(MEMORY_REPORT_TENANTS, pool.tenant_bytes().items(), key=operator.itemgetter(1))
        self.memory_report = MemoryReport(pool.nbytes, len(pool), pool.evicted, pool.dropped, tuple(largest))
        self._memory_changed, self._reported_at = False, now

    def _share_prefixes(self, running: list[Request]) -> None:
        """Requests that have prefilled nothing of their own take the longest stored prefix of their prompt
        (stored by their own tenant); one whose prompt shares more whole blocks with an earlier request of the
        same tenant still prefilling waits for it (its prefix is stored when that prefill ends) instead of
        computing the same entries beside it. A failure here fails that request only."""
        leaders = []
        for r in running:
            s = r.slot
            s.hold = False
            if r.private:
                continue
            if s.unstarted and not self._guard(r, "reusing a stored prefix", self._attach, r):
                continue
            if s.unstarted:
                usable = (len(s.prompt) - 1) // BLOCK * BLOCK
                s.hold = any(min(usable, len(os.path.commonprefix([s.prompt, t.slot.prompt]))) // BLOCK * BLOCK
                             > s.filled for t in leaders if t.tenant == r.tenant)
            if s.state == PREFILL and not s.hold:
                leaders.append(r)

    def _attach(self, r: Request) -> None:
        s = r.slot
        longer = self.prefixes.attach(s.prompt, s.cache, more_than=s.filled, tenant=r.tenant)
        if longer:
            s.reuse_prefix(longer)

    def _store_prefixes(self, running: list[Request]) -> None:
        """Prompts whose prefill just ended, and finished requests' prompt + output, into the prefix cache (the
        request's tenant's part). A failure fails that request and empties the cache (it may be half-written)."""
        for r in running:
            s = r.slot
            if r.done or r.error is not None or s.error is not None or r.private:  # failed or cancelled, or private
                continue
            if s.done:
                tokens = s.prompt + s.out
            elif s.state == DECODE and len(s.out) == len(s.new) and s.new:  # its first step after the prefill
                tokens = s.prompt
            else:
                continue
            if not self._guard(r, "storing the prefix", self.prefixes.store, tokens, s.cache, r.tenant):
                self.prefixes.clear()

    def _checked_weights(self) -> None:
        """`_check_weights`; when the check itself fails, no request may go on (the weights may have changed
        under them): the running and waiting ones fail with the reason, the engine goes on."""
        try:
            self._check_weights()
        except Exception as exc:
            err = RequestFailed.stage("checking the model's weights", exc)
            self.prefixes.clear()
            with self._cond:
                for r in [*self._running, *self._waiting]:
                    r._finish("error", err)
                self._waiting.clear()

    def _check_weights(self) -> None:
        """When the model's weights changed, the running requests fail (their caches hold keys and values of
        the old weights); the waiting ones decode with a forward built from the new weights, or fail when the
        forward was given by the caller (it holds packed copies of the old ones)."""
        self._checked_at = self.steps
        if not self.forward.stale():
            return
        self.prefixes.clear()  # entries of the old weights
        self.memories.clear()  # drafts learned from the old weights' outputs
        self._memory_changed = True
        with self._cond:
            for r in self._running:
                r._finish("error", RequestFailed("the model's weights changed while this request was decoded"))
            if self._own_forward:  # (the waiting requests' caches are made at admission, from the new forward)
                self.forward = default_forward(self.model, self.arith)
            else:
                for r in self._waiting:
                    r._finish("error", RequestFailed("the model's weights changed since the engine's forward packed "
                                                  "them: build a new Engine"))
                self._waiting.clear()


def freeze_heap() -> None:
    """Collect the garbage, then move every object alive now out of the cyclic collector's reach (`gc.freeze`).

    A full collection walks every tracked object of the process; with torch, transformers and a model loaded
    that is ~360k objects and ~200 ms, during which no step runs. The step loop's own long-lived objects
    (n-gram indexes, memories, statistics) trigger one every few dozen requests. Frozen objects are still freed
    when their last reference goes (a model and its engine hold no reference cycle: tested), only a cycle among
    them would stay; collecting first leaves no garbage to freeze. Each call costs a collection of what is not
    frozen yet (the first ~200 ms, later ones far less). `EngineConfig.freeze_gc` turns it off."""
    gc.collect()
    gc.freeze()


def _guarded(stop, box: list):
    """`stop` whose exception ends (and later fails) its own request instead of the whole step."""

    def guarded(tokens: list[int]) -> bool:
        try:
            return bool(stop(tokens))
        except Exception as exc:
            box[0].error = exc
            return True

    return guarded


