"""/metrics: Prometheus metrics with the ``radixrt:`` prefix and a ``model_name`` label.

Request-level numbers (tokens, latencies) are recorded in the HTTP process when a request finishes
(a TokenizerManager listener); worker-level numbers (queue, KV usage, evictions, retractions) are read
from the worker's stats at scrape time. Each server owns its registry.

With tenants, every ``radixrt:tenant_*`` series also carries a ``tenant`` label (`TENANT_SERIES`): the
worker's per-tenant counters and KV shares (``StatsOut.tenants``), and TTFT / e2e histograms observed here.
The listener learns a request's tenant from `REQUEST_TENANT`, which the route sets before generating (the
tasks that run the request copy it).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "radixrt:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)

# worker stat -> (metric name, help); gauges are point-in-time, counters cumulative since start
_WORKER_GAUGES = {
    "num_running_reqs": (
        "num_running_reqs",
        "Requests running in the worker (decoding or in chunked prefill)",
    ),
    "num_queue_reqs": ("num_queue_reqs", "Requests waiting in the worker's queue"),
    "kv_token_usage": ("token_usage", "Fraction of KV slots held by running requests"),
    "kv_used_tokens": ("kv_used_tokens", "KV slots held by running requests"),
    "kv_cached_tokens": ("kv_cached_tokens", "Tokens held by the RadixCache"),
    "kv_total_tokens": ("kv_total_tokens", "KV pool size in tokens"),
    "cache_hit_rate": ("cache_hit_rate", "Cached prompt tokens / prompt tokens, since start"),
}
# With --enable-hierarchical-cache (and --hicache-storage-dir): the tiers behind the device pool, and pins
_TIER_GAUGES = {
    "kv_host_used_tokens": ("kv_host_used_tokens", "Tokens held by the host tier"),
    "kv_host_total_tokens": ("kv_host_total_tokens", "Host tier size in tokens"),
    "disk_tokens": ("disk_tokens", "Tokens stored by the disk tier"),
    "disk_bytes": ("disk_bytes", "Bytes stored by the disk tier"),
    "kv_pinned_tokens": ("kv_pinned_tokens", "Tokens held by TTL pins"),
    "disk_tier_failed": ("disk_tier_failed", "1 while the disk tier cannot write (see the log and /health)"),
}
_TIER_COUNTERS = {
    "host_backup_tokens": ("host_backup_tokens", "Tokens copied device -> host"),
    "host_load_tokens": ("host_load_tokens", "Tokens loaded host -> device before an extend"),
    "host_evicted_tokens": ("host_evicted_tokens", "Tokens dropped by the host tier's LRU"),
    "device_dropped_tokens": ("device_dropped_tokens", "Tokens evicted from the device with no host room"),
    "disk_load_tokens": ("disk_load_tokens", "Tokens loaded disk -> device"),
    "disk_written_chunks": ("disk_written_chunks", "Chunks written to the disk tier"),
    "disk_rejected_files": ("disk_rejected_files", "Disk files rejected (checksum, identity, truncation)"),
    "disk_write_errors": ("disk_write_errors", "Chunks the disk tier failed to write"),
    "disk_dir_recreations": (
        "disk_dir_recreations",
        "Times the disk tier's vanished directory was recreated",
    ),
    "disk_lost_chunks": ("disk_lost_chunks", "Disk chunks lost with a vanished storage directory"),
    "kv_pins_yielded": (
        "kv_pins_yielded",
        "TTL pins released early for a request that did not fit beside them",
    ),
}
_CACHED_BY_TIER = {
    "device": "cached_tokens_device",
    "host": "cached_tokens_host",
    "disk": "cached_tokens_disk",
}
_WORKER_COUNTERS = {
    "evicted_tokens": ("evicted_tokens", "Tokens evicted from the RadixCache"),
    "retractions": ("num_retractions", "Running requests retracted to free KV memory"),
    "computed_prefill_tokens": (
        "computed_prefill_tokens",
        "Prompt tokens computed by prefill (cache misses)",
    ),
}

# With --speculative-algorithm: worker stat -> (metric name, help), labelled with the algorithm
_SPEC_COUNTERS = {
    "spec_verify_steps": ("spec_verify_steps", "Speculative verify forwards"),
    "spec_verify_reqs": (
        "spec_verify_reqs",
        "Drafted requests verified (one per request per verify forward)",
    ),
    "spec_draft_tokens": ("spec_draft_tokens", "Draft tokens verified"),
    "spec_accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted into outputs"),
    "spec_skipped_batch_steps": (
        "spec_skipped_batch_steps",
        "Decode steps not speculative: more running requests than --speculative-max-batch-size",
    ),
    "spec_skipped_cost_steps": (
        "spec_skipped_cost_steps",
        "Decode steps not speculative: drafts found, but plain decoding predicted faster",
    ),
    "spec_backoff_req_steps": (
        "spec_backoff_req_steps",
        "Request-steps whose draft was left out of a verify step (its acceptance did not pay for its tokens)",
    ),
}
_SPEC_GAUGES = {
    "spec_accept_length": (
        "spec_accept_length",
        "Tokens per drafted request per verify forward (accepted drafts + 1), since start",
    ),
    "spec_index_tokens": ("spec_index_tokens", "Tokens of finished requests in the SUFFIX global index"),
    "spec_index_nodes": ("spec_index_nodes", "Suffix trie nodes of the SUFFIX global index"),
}

# StatsOut.tenants key -> (metric name, help) per tenant; counters cumulative since the worker started
_TENANT_COUNTERS = {
    "requests": ("tenant_requests", "Requests the worker received"),
    "prompt_tokens": ("tenant_prompt_tokens", "Prompt tokens of received requests"),
    "cached_tokens": ("tenant_cached_tokens", "Prompt tokens of finished requests served from the cache"),
    "generated_tokens": ("tenant_generation_tokens", "Generated tokens of finished requests"),
    "evicted_tokens": ("tenant_evicted_tokens", "The tenant's tokens evicted from the RadixCache"),
    "quota_waits": ("tenant_quota_waits", "Admissions deferred because the tenant was at its KV quota"),
}
_TENANT_GAUGES = {
    "hit_rate": ("tenant_cache_hit_rate", "Cached prompt tokens / prompt tokens, since start"),
    "kv_tokens_held": ("tenant_kv_held_tokens", "KV tokens the tenant holds now (cached plus running)"),
    "kv_quota_tokens": ("tenant_kv_quota_tokens", "The most KV tokens the tenant may hold under contention"),
}
_TENANT_HISTOGRAMS = {
    "tenant_time_to_first_token_seconds": "Time to first token",
    "tenant_e2e_request_latency_seconds": "Request latency, arrival to last token",
}
# Every per-tenant series, as /metrics exposes it (the README lists them).
TENANT_SERIES = tuple(
    [PREFIX + name + "_total" for name, _ in _TENANT_COUNTERS.values()]
    + [PREFIX + name for name, _ in _TENANT_GAUGES.values()]
    + [PREFIX + name for name in _TENANT_HISTOGRAMS]
)

# The tenant of the request being served (None: no tenants), set by the route that generates.
REQUEST_TENANT: ContextVar[str | None] = ContextVar("radixrt_request_tenant", default=None)


def outcome(meta: dict[str, Any]) -> str:
    """The ``finish_reason`` label of a finished request: its type, told apart for aborts by the HTTP
    status the worker gave (refused before any token, timed out) or a worker error."""
    reason = meta.get("finish_reason") or {}
    kind = str(reason.get("type", "unknown"))
    if kind != "abort":
        return kind
    status = reason.get("status_code")
    if status == 504:
        return "timeout"
    if status is not None and not meta.get("completion_tokens"):
        return "refused"
    if str(reason.get("message", "")).startswith("worker error"):
        return "error"
    return "abort"


class _WorkerCollector(Collector):
    """Exposes the most recent worker stats snapshot."""

    def __init__(self, model_name: str, spec_algorithm: str | None = None) -> None:
        self.model_name = model_name
        self.spec_algorithm = spec_algorithm
        self.stats: dict[str, float] | None = None
        self.tenants: dict[str, dict[str, float]] | None = None

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            PREFIX + "worker_up", "1 while the worker process answers", labels=["model_name"]
        )
        up.add_metric([self.model_name], 0.0 if self.stats is None else 1.0)
        yield up
        if self.stats is None:
            return
        for key, (name, doc) in _WORKER_GAUGES.items():
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric([self.model_name], float(self.stats.get(key, 0.0)))
            yield g
        for key, (name, doc) in _WORKER_COUNTERS.items():
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], float(self.stats.get(key, 0.0)))
            yield c
        by_tier = CounterMetricFamily(
            PREFIX + "cached_tokens_by_tier",
            "Cached prompt tokens of finished requests, by the tier they were served from",
            labels=["model_name", "tier"],
        )
        for tier, key in _CACHED_BY_TIER.items():
            by_tier.add_metric([self.model_name, tier], float(self.stats.get(key, 0.0)))
        yield by_tier
        for table, family in ((_TIER_GAUGES, GaugeMetricFamily), (_TIER_COUNTERS, CounterMetricFamily)):
            for key, (name, doc) in table.items():
                if key in self.stats:  # only the tiers this server has
                    m = family(PREFIX + name, doc, labels=["model_name"])
                    m.add_metric([self.model_name], float(self.stats[key]))
                    yield m
        if self.spec_algorithm is not None:
            for table, family in ((_SPEC_COUNTERS, CounterMetricFamily), (_SPEC_GAUGES, GaugeMetricFamily)):
                for key, (name, doc) in table.items():
                    m = family(PREFIX + name, doc, labels=["model_name", "algorithm"])
                    m.add_metric([self.model_name, self.spec_algorithm], float(self.stats.get(key, 0.0)))
                    yield m
        if self.tenants is None:
            return
        labels = ["model_name", "tenant"]
        for table, family in ((_TENANT_COUNTERS, CounterMetricFamily), (_TENANT_GAUGES, GaugeMetricFamily)):
            for key, (name, doc) in table.items():
                m = family(PREFIX + name, doc + ", per tenant", labels=labels)
                for tenant, values in sorted(self.tenants.items()):
                    m.add_metric([self.model_name, tenant], float(values.get(key, 0.0)))
                yield m


class ServerMetrics:
    """All metrics of one server; ``on_finished`` is a TokenizerManager listener."""

    def __init__(self, model_name: str, tenants: bool = False, spec_algorithm: str | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(
                model_name
            )

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.cached_tokens = counter(
            "cached_tokens", "Prompt tokens of finished requests served from the cache"
        )
        self.aborted = counter("num_aborted_requests", "Requests aborted because the client disconnected")
        self.worker_restarts = counter("worker_restarts", "Worker processes started after one died")
        self._requests = Counter(
            PREFIX + "num_requests",
            "Requests that reached the worker, once each, by outcome: stop, length, abort (aborted by a "
            "client or the API), refused (a 4xx/429/503 before any token), timeout (--request-timeout), "
            "error (the worker failed)",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two output tokens", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "Request latency, arrival to last token", LATENCY_BUCKETS
        )
        self._worker = _WorkerCollector(model_name, spec_algorithm)
        self.registry.register(self._worker)
        # per tenant, only with tenants (without them /metrics stays as it was)
        self.tenant_ttft: Histogram | None = None
        self.tenant_e2e: Histogram | None = None
        if tenants:

            def per_tenant(name: str) -> Histogram:
                doc = _TENANT_HISTOGRAMS[name] + ", per tenant"
                labels = ["model_name", "tenant"]
                return Histogram(PREFIX + name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

            self.tenant_ttft = per_tenant("tenant_time_to_first_token_seconds")
            self.tenant_e2e = per_tenant("tenant_e2e_request_latency_seconds")

    def on_finished(self, result: dict[str, Any]) -> None:
        """Record one finished request (a TokenizerManager result with its ``timing``)."""
        meta = result["meta_info"]
        self.prompt_tokens.inc(meta["prompt_tokens"])
        self.generation_tokens.inc(meta["completion_tokens"])
        self.cached_tokens.inc(meta["cached_tokens"])
        self._requests.labels(self.model_name, outcome(meta)).inc()
        timing = result.get("timing") or {}
        if timing.get("ttft") is not None:
            self.ttft.observe(timing["ttft"])
        for gap in timing.get("itl", ()):
            self.itl.observe(gap)
        e2e = timing.get("e2e", meta.get("e2e_latency", 0.0))
        self.e2e.observe(e2e)
        tenant = REQUEST_TENANT.get()
        if self.tenant_ttft is not None and self.tenant_e2e is not None and tenant is not None:
            if timing.get("ttft") is not None:
                self.tenant_ttft.labels(self.model_name, tenant).observe(timing["ttft"])
            self.tenant_e2e.labels(self.model_name, tenant).observe(e2e)

    def render(
        self, worker_stats: dict[str, float] | None, tenants: dict[str, dict[str, float]] | None = None
    ) -> bytes:
        """The text exposition, with ``worker_stats`` (None: the worker is down) as worker metrics and
        ``tenants`` (``StatsOut.tenants``) as the per-tenant ones."""
        self._worker.stats = worker_stats
        self._worker.tenants = tenants if worker_stats is not None else None
        return generate_latest(self.registry)
