"""Prometheus metrics of one server (a registry of its own, so several apps in a process never collide).

goose's own series (``goose_*``) and, beside them, the common series of vLLM's ``/metrics`` under vLLM's names
and labels (``vllm:*`` with ``model_name`` and ``engine="0"``), so dashboards and tools built for vLLM read
goose unchanged (docs/serving.md, "vLLM-compatible clients and dashboards"). Speculative decoding in vLLM's
terms: a draft is one verification forward that had draft tokens, its draft tokens are the nodes of goose's
draft tree (a tree can accept at most one path, so vLLM's acceptance rate reads lower for trees than for
chains), its accepted tokens those of the accepted path; mean acceptance length ``1 + accepted / drafts``.
"""

from __future__ import annotations

import hashlib

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.stats import SOURCES

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
_TAU = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0)


class _PrefixCacheCollector:
    """The engine's prefix cache (`goose.engine.prefix.PrefixCache`), read when scraped."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        store = self._engine.prefixes
        if store is None:
            return
        evicted = CounterMetricFamily("goose_prefix_cache_evicted_blocks", "Blocks the prefix cache dropped to "
                                      "keep to its byte budget")
        evicted.add_metric([], store.evicted)
        yield evicted
        hits = CounterMetricFamily("goose_prefix_cache_hit_tokens", "Prompt tokens copied from the prefix cache")
        hits.add_metric([], store.hits)
        yield hits
        yield GaugeMetricFamily("goose_prefix_cache_blocks", "Blocks in the prefix cache", value=len(store))
        yield GaugeMetricFamily("goose_prefix_cache_bytes", "Bytes of keys and values in the prefix cache",
                                value=store.bytes)
        yield GaugeMetricFamily("goose_prefix_cache_limit_bytes", "The prefix cache's byte budget",
                                value=store.max_bytes)


def tenant_label(tenant: str) -> str:
    """A tenant as a metrics label: "anonymous" for the anonymous tenant, else "t-" and the first 12 hex digits
    of its name's sha256 (names may be user ids or salts: /metrics never shows them)."""
    return "anonymous" if tenant == "" else "t-" + hashlib.sha256(tenant.encode("utf-8")).hexdigest()[:12]


class _MemoryCollector:
    """The suffix memories' sizes as the engine last published them (`Engine.memory_report`): totals, and the
    largest tenants' bytes under hashed labels (`tenant_label`; at most MEMORY_REPORT_TENANTS series)."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def collect(self):
        rep = self._engine.memory_report
        yield GaugeMetricFamily("goose_memory_bytes", "Bytes of the suffix memories of all tenants", value=rep.bytes)
        yield GaugeMetricFamily("goose_memory_tenants", "Tenants with a suffix memory", value=rep.tenants)
        evicted = CounterMetricFamily("goose_memory_evicted_sequences", "Sequences the suffix memories dropped to "
                                      "keep to their byte budget")
        evicted.add_metric([], rep.evicted)
        yield evicted
        per = GaugeMetricFamily("goose_memory_tenant_bytes", "Bytes of the suffix memory of each of the largest "
                                "tenants (hashed names)", labels=["tenant"])
        for tenant, nbytes in rep.largest:
            per.add_metric([tenant_label(tenant)], nbytes)
        yield per


class Metrics:
    def __init__(self, engine, model_name: str = "goose") -> None:
        r = self.registry = CollectorRegistry()
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, open fds
        r.register(_PrefixCacheCollector(engine))
        r.register(_MemoryCollector(engine))
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
        Gauge("goose_step_threads", "Threads the engine's forwards run on now (fewer than the cores while "
              "other processes hold them)", registry=r).set_function(lambda: engine.step_threads)
        self._sizes_seen: list[int] = []
        self.batch = Histogram("goose_batch_size", "Requests per engine step", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32),
                               registry=r)
        self._engine = engine
        self._vllm(engine, model_name)

    def _vllm(self, engine, model_name: str) -> None:
        """vLLM's names for the common series (see the module doc)."""
        r, names, labels = self.registry, ["model_name", "engine"], (model_name, "0")

        def counter(name, doc):
            return Counter(name, doc, names, registry=r).labels(*labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(*labels)

        Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", names, registry=r) \
            .labels(*labels).set_function(lambda: engine.load()[0])
        Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", names, registry=r) \
            .labels(*labels).set_function(lambda: engine.load()[1])
        self.v_prompt = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.v_cached = counter("vllm:prompt_tokens_cached", "Number of cached prompt tokens.")
        self.v_generation = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          names + ["finished_reason"], registry=r)
        self.v_success = {reason: success.labels(*labels, reason) for reason in ("stop", "length", "abort")}
        self.v_ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                                _LATENCY)
        self.v_itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                               _TPOT)
        self.v_itl_old = histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                   "seconds (vLLM's older name of the inter-token latency).", _TPOT)
        self.v_tpot = histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                "time_per_output_token_seconds per request.", _TPOT)
        self.v_e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                               _LATENCY)
        self.v_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.v_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.v_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")

    def observe(self, endpoint: str, req) -> None:
        """Count a finished engine request (`goose.Request`)."""
        outcome = req.finish_reason or "unknown"
        self.requests.labels(endpoint, outcome).inc()
        st = req.stats
        self.prompt_tokens.inc(st.prompt_tokens)
        self.cached_tokens.inc(st.cached_tokens)
        self.generation_tokens.inc(st.new_tokens)
        self.forward_calls.inc(st.forward_calls)
        for src in SOURCES:  # memory: drafted from earlier requests (the suffix memory); head: a draft head
            self.accepted.labels(src).inc(st.accepted.get(src, 0))
            self.drafted.labels(src).inc(st.drafted.get(src, 0))
        if st.forward_calls:
            self.tau.observe(st.tau)
        e2e = None if req.finished_at is None else req.finished_at - req.submitted
        for value, series in ((req.ttft_s, (self.ttft, self.v_ttft)), (req.tpot_s, (self.tpot, self.v_tpot)),
                              (e2e, (self.e2e, self.v_e2e))):  # goose's and vLLM's series of each latency
            if value is not None:
                for hist in series:
                    hist.observe(value)
        # vLLM's series
        self.v_prompt.inc(st.prompt_tokens)
        self.v_cached.inc(st.cached_tokens)
        self.v_generation.inc(st.new_tokens)
        self.v_success["stop" if outcome == "stop" else "length" if outcome == "length" else "abort"].inc()
        times = req.block_times  # one entry per committed block of tokens
        for a, b in zip(times, times[1:]):
            self.v_itl.observe(b - a)
            self.v_itl_old.observe(b - a)
        sizes = st.tree_sizes  # nodes verified per decoding step, root included
        self.v_drafts.inc(sum(1 for n in sizes if n > 1))
        self.v_draft_tokens.inc(sum(n - 1 for n in sizes))
        self.v_accepted.inc(sum(st.accept_lengths))

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
