"""``GET /metrics`` of ``kvrows serve``: Prometheus text from one registry per server.

The engine's gauges (``Engine.gauges()``: rows running and waiting, KV bytes held and the
budget, prefix-cache bytes and hits, tokens generated) are read at each scrape by a
collector; what the server itself sees (time to first token and per output token as the
client receives them, requests by how they ended, the tokens it sent) is counted as it
happens. ``spec/server.md`` §5 lists every series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Seconds: from a millisecond (a prefix hit on a tiny model) to a minute (a long prompt
#: behind a full queue).
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class _EngineCollector(Collector):
    """The engine's gauges, read when scraped (``gauges``: a thread-safe snapshot)."""

    def __init__(self, gauges: Callable[[], Any]) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        g = self._gauges()
        yield GaugeMetricFamily(
            "kvrows_requests_running", "Requests the engine holds a row for", value=g.running
        )
        yield GaugeMetricFamily(
            "kvrows_requests_waiting", "Requests waiting for admission", value=g.waiting
        )
        yield GaugeMetricFamily(
            "kvrows_kv_bytes_held",
            "KV bytes the engine holds (rows, pools, prefix cache)",
            value=g.kv_bytes_held,
        )
        if g.kv_budget is not None:
            yield GaugeMetricFamily(
                "kvrows_kv_budget_bytes", "The engine's KV byte budget", value=g.kv_budget
            )
        yield GaugeMetricFamily(
            "kvrows_prefix_cache_bytes",
            "Bytes of the in-memory prefix cache",
            value=g.prefix_cache_bytes,
        )
        for name, text, value in (
            ("kvrows_prefix_hits", "Requests that reused a cached prefix", g.prefix_hits),
            ("kvrows_prefix_hit_tokens", "Prompt tokens reused from cached prefixes",
             g.prefix_hit_tokens),
            ("kvrows_prefix_store_hit_tokens", "Of those, tokens loaded from the disk store",
             g.store_hit_tokens),
            ("kvrows_generated_tokens", "Tokens the engine generated", g.generated_tokens),
            ("kvrows_preemptions", "Rows preempted to free KV", g.preemptions),
            ("kvrows_engine_requests_finished", "Requests the engine finished",
             g.requests_finished),
        ):  # fmt: skip
            yield CounterMetricFamily(name, text, value=value)


class ServerMetrics:
    """One server's registry: the engine's gauges and the server's own series."""

    def __init__(self, gauges: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(gauges))
        r = self.registry
        self.time_to_first_token = Histogram(
            "kvrows_time_to_first_token_seconds",
            "From the HTTP request's arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "kvrows_time_per_output_token_seconds",
            "Mean seconds between a request's output tokens after the first",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "kvrows_requests",
            "Generation requests by how they ended (stop, length, cancelled, rejected, "
            "error, or the HTTP status of a refusal)",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvrows_prompt_tokens", "Prompt tokens of finished requests", registry=r
        )
        self.cached_tokens = Counter(
            "kvrows_cached_prompt_tokens",
            "Prompt tokens reused from a prefix (usage.prompt_tokens_details.cached_tokens)",
            registry=r,
        )
        self.completion_tokens = Counter(
            "kvrows_completion_tokens", "Completion tokens sent to clients", registry=r
        )
        self.open_requests = Gauge(
            "kvrows_http_requests_open",
            "Generation requests the server is answering now",
            registry=r,
        )
        self.draining = Gauge("kvrows_draining", "1 while the server drains", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
