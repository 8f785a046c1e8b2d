"""Prometheus metrics of one server (a registry of its own, so several apps in a process never collide)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the app)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_TAU = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)


class Metrics:
    def __init__(self, engine) -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        self.requests = Counter("goose_requests", "Requests answered, by endpoint and outcome", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter("goose_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("goose_prompt_tokens_cached", "Prompt tokens of finished requests whose keys "
                                     "and values came from the engine's prefix cache", registry=r)
        self.generation_tokens = Counter("goose_generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.forward_calls = Counter("goose_forward_calls", "Target forward calls of finished requests (prefill "
                                     "counts as one)", registry=r)
        self.accepted = Counter("goose_accepted_tokens", "Draft tokens accepted, by draft source", ["source"],
                                registry=r)
        self.drafted = Counter("goose_drafted_tokens", "Draft tokens verified, by draft source", ["source"],
                               registry=r)
        self.tau = Histogram("goose_request_tau", "Tokens per target forward (tau) of finished requests",
                             buckets=_TAU, registry=r)
        self.ttft = Histogram("goose_time_to_first_token_seconds", "Seconds from submission to the first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("goose_time_per_output_token_seconds", "Mean seconds per output token after the "
                              "first, per request", buckets=_TPOT, registry=r)
        self.e2e = Histogram("goose_request_latency_seconds", "Seconds from submission to the last token",
                             buckets=_LATENCY, registry=r)
        Gauge("goose_requests_running", "Requests in the running batch (batch size)", registry=r) \
            .set_function(lambda: engine.load()[0])
        Gauge("goose_requests_waiting", "Requests in the queue (queue depth)", registry=r) \
            .set_function(lambda: engine.load()[1])
        Gauge("goose_engine_steps", "Batched forwards the engine has run", registry=r) \
            .set_function(lambda: engine.steps)
        self._sizes_seen: list[int] = []
        self.batch = Histogram("goose_batch_size", "Requests per engine step", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
                               registry=r)
        self._engine = engine

    def observe(self, endpoint: str, req) -> None:
        """Count a finished engine request (`goose.Request`)."""
        outcome = req.finish_reason or "unknown"
        self.requests.labels(endpoint, outcome).inc()
        st = req.slot.stats
        self.prompt_tokens.inc(st.prompt_tokens)
        self.cached_tokens.inc(st.cached_tokens)
        self.generation_tokens.inc(st.new_tokens)
        self.forward_calls.inc(st.forward_calls)
        for src in ("spine", "branch"):
            self.accepted.labels(src).inc(st.accepted.get(src, 0))
            self.drafted.labels(src).inc(st.drafted.get(src, 0))
        if st.forward_calls:
            self.tau.observe(st.tau)
        if req.ttft_s is not None:
            self.ttft.observe(req.ttft_s)
        if req.tpot_s is not None:
            self.tpot.observe(req.tpot_s)
        if req.finished_at is not None:
            self.e2e.observe(req.finished_at - req.submitted)

    def refused(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, f"http_{status}").inc()

    def render(self) -> bytes:
        counts = list(self._engine.batch_counts)  # steps run with n requests, for every n
        seen = self._sizes_seen or [0] * len(counts)
        for n, c in enumerate(counts):
            for _ in range(c - (seen[n] if n < len(seen) else 0)):
                self.batch.observe(n)
        self._sizes_seen = counts
        return generate_latest(self.registry)
