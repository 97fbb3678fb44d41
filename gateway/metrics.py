"""Prometheus metrics, in a registry per app (no module-global state).

Engine-side gauges (queue depth, running batch, KV pages) are read from the engine thread's
latest `EngineStats` snapshot at scrape time. Latencies are measured on the gateway side:
time to first token from arrival; time per output token between first and last token.
Prefix-cache counters (hit and miss tokens, evicted pages) are the engine's own totals, read
from the same snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.kv.prefix_cache import PrefixCacheStats
from engine.protocols import EngineStats
from gateway.access.connections import REASONS, Connections

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models")


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], queue_depth: Callable[[], int],
                 connections: Connections | None = None):
        r = self.registry = CollectorRegistry()
        self.in_flight = 0  # API requests being answered (streams until their last byte)
        self.requests = Counter(
            "switchboard_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r,
        )
        self.finished = Counter(
            "switchboard_sequences_finished", "Finished sequences (choices) by finish reason",
            ["finish_reason"], registry=r,
        )
        self.prompt_tokens = Counter(
            "switchboard_prompt_tokens", "Prompt tokens submitted", ["tenant"], registry=r
        )
        self.generation_tokens = Counter(
            "switchboard_generation_tokens", "Tokens generated", ["tenant"], registry=r
        )
        self.ttft = Histogram(
            "switchboard_time_to_first_token_seconds", "Time from arrival to the first token",
            buckets=TTFT_BUCKETS, registry=r,
        )
        self.queue_time = Histogram(
            "switchboard_request_queue_time_seconds",
            "Time a sequence waited in the engine before its first step (for a seat, KV pages "
            "or its adapter's load)", buckets=TTFT_BUCKETS, registry=r,
        )
        self.grammar_wait = Histogram(
            "switchboard_grammar_wait_seconds",
            "Time a constrained request waited for its grammar before it was queued (a cached "
            "grammar: none)", buckets=TTFT_BUCKETS, registry=r,
        )
        self.tpot = Histogram(
            "switchboard_time_per_output_token_seconds", "Mean time between output tokens",
            buckets=TPOT_BUCKETS, registry=r,
        )
        self.e2e = Histogram(
            "switchboard_e2e_request_latency_seconds", "Time from arrival to the last token",
            buckets=E2E_BUCKETS, registry=r,
        )
        gauges = {
            "switchboard_queue_depth": ("Sequences waiting for a batch seat", queue_depth),
            "switchboard_running_batch_size": (
                "Sequences in the running batch", lambda: stats().num_running),
            "switchboard_kv_pages_used": (
                "KV pages held by requests or pinned by sessions (evictable cache excluded)",
                lambda: stats().kv_pages_used),
            "switchboard_kv_pages_total": ("KV cache pages in all", lambda: stats().kv_pages_total),
            "switchboard_requests_in_flight": (
                "API requests being answered (streams until their last byte)",
                lambda: self.in_flight),
            "switchboard_jump_forward_tokens": (
                "Tokens appended by grammar jump-forward instead of sampled (cumulative)",
                lambda: stats().jump_forward_tokens,
            ),
        }
        for name, (doc, fn) in gauges.items():
            Gauge(name, doc, registry=r).set_function(fn)
        r.register(_PrefixCacheCollector(stats))
        if connections is not None:
            r.register(_ConnectionCollector(connections))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ConnectionCollector:
    """The HTTP connections (gateway/access/connections.py): open, the cap, and those we closed."""

    def __init__(self, connections: Connections):
        self.connections = connections

    def collect(self) -> Iterator[Metric]:
        c = self.connections
        yield GaugeMetricFamily("switchboard_connections_open", "Open HTTP connections",
                                value=c.open)
        yield GaugeMetricFamily("switchboard_connections_max", "The cap on open HTTP connections "
                                "(--max-connections, below the open-file limit)", value=c.cap)
        dropped = CounterMetricFamily("switchboard_connections_dropped", "HTTP connections the "
                                      "server closed, by reason: header_timeout, body_timeout, "
                                      "evicted (its place taken at the cap), refused (at the "
                                      "cap, all busy), stream_buffer (a client not reading its "
                                      "stream)", labels=["reason"])
        for reason in REASONS:
            dropped.add_metric([reason], c.dropped[reason])
        yield dropped


class _PrefixCacheCollector:
    """The engine's prefix-cache, preemption, step and speculative-decoding totals as
    Prometheus counters and gauges."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self) -> Iterator[Metric]:  # prometheus_client's `Collector` protocol
        stats = self.stats()
        p = stats.prefix
        for name, doc, value in [
            ("switchboard_prefix_cache_hit_tokens", "Prompt tokens served from cached KV",
             p.hit_tokens),
            ("switchboard_prefix_cache_miss_tokens", "Prompt tokens that had to be computed",
             p.miss_tokens),
            ("switchboard_prefix_cache_evicted_pages", "KV pages evicted from the prefix cache",
             p.evicted_pages),
            ("switchboard_preemptions", "Requests preempted: their KV dropped to make room, "
             "recomputed when they resume", stats.num_preemptions),
            ("switchboard_spec_draft_tokens", "Speculative draft tokens verified",
             stats.spec_drafted),
            ("switchboard_spec_accepted_tokens", "Speculative draft tokens accepted",
             stats.spec_accepted),
            ("switchboard_spec_forwards", "Sequence-steps that verified drafts",
             stats.spec_forwards),
            ("switchboard_spec_emitted_tokens", "Tokens produced by those sequence-steps "
             "(per forward: this / switchboard_spec_forwards)", stats.spec_emitted),
            ("switchboard_spec_forced_tokens", "Draft tokens a grammar forced (accepted "
             "without verification)", stats.spec_forced),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        steps = CounterMetricFamily("switchboard_engine_steps", "Engine steps that ran a batch, by "
                                    "kind: overlapped, synchronous, speculative", labels=["kind"])
        took = CounterMetricFamily("switchboard_engine_step_seconds", "Their wall time (device "
                                   "waits included), by kind", labels=["kind"])
        for kind, (n, seconds) in stats.step_times.items():
            steps.add_metric([kind], n)
            took.add_metric([kind], seconds)
        yield steps
        yield took
        loop = CounterMetricFamily("switchboard_engine_loop_seconds", "The engine core loop's "
                                   "wall time by part: waiting for work, applying commands, "
                                   "stepping, publishing outputs", labels=["part"])
        for part, seconds in stats.loop_seconds.items():
            loop.add_metric([part], seconds)
        yield loop
        yield GaugeMetricFamily("switchboard_prefix_cache_pages", "KV pages the prefix cache holds",
                                value=p.cached_pages)
        yield from _kv_tier_metrics(p)
        yield GaugeMetricFamily("switchboard_session_pinned_pages",
                                "KV pages sessions keep pinned between turns", value=p.pinned_pages)


def _kv_tier_metrics(p: PrefixCacheStats) -> Iterator[Metric]:
    """Per tier (device, host, disk): prompt tokens served, pages held or moved; per direction:
    bytes copied between device and host and the seconds the copies took (bandwidth: their
    ratio)."""
    hits = CounterMetricFamily("switchboard_kv_tier_hit_tokens",
                               "Prompt tokens served from cached KV, by the tier it was on",
                               labels=["tier"])
    hits.add_metric(["device"], p.hit_tokens - p.host_hit_tokens)
    hits.add_metric(["host"], p.host_hit_tokens)
    hits.add_metric(["disk"], p.disk_hit_tokens)  # read from disk, then loaded as host hits
    yield hits
    disk = CounterMetricFamily("switchboard_kv_tier_disk_pages",
                               "KV page files of the disk tier: written, read, rejected "
                               "(corrupt or another model, dtype or layout) and deleted (over "
                               "--kv-disk-gb)", labels=["op"])
    for op, n in [("written", p.disk_pages_written), ("read", p.disk_pages_read),
                  ("rejected", p.disk_pages_rejected), ("deleted", p.disk_pages_deleted)]:
        disk.add_metric([op], n)
    yield disk
    pages = GaugeMetricFamily("switchboard_kv_tier_pages", "KV pages the prefix cache holds, "
                              "by tier (a page may have a copy on both)", labels=["tier"])
    pages.add_metric(["device"], p.cached_pages)
    pages.add_metric(["host"], p.host_pages)
    yield pages
    yield GaugeMetricFamily("switchboard_kv_tier_host_pages_total",
                            "The host tier's size in pages (0: no host tier)",
                            value=p.host_pages_total)
    moved = CounterMetricFamily("switchboard_kv_tier_copy_bytes",
                                "Bytes of KV copied between the tiers", labels=["direction"])
    took = CounterMetricFamily("switchboard_kv_tier_copy_seconds",
                               "Time the KV copies between the tiers took", labels=["direction"])
    c = p.copy
    for direction, nbytes, seconds in [("to_host", c.bytes_to_host, c.seconds_to_host),
                                       ("to_device", c.bytes_to_device, c.seconds_to_device)]:
        moved.add_metric([direction], nbytes)
        took.add_metric([direction], seconds)
    yield moved
    yield took


class RequestCounter:
    """ASGI middleware: counts every response on the API routes by its status code, and the
    requests in flight (a draining server waits for those)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        endpoint = path if path in ENDPOINTS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        self.metrics.in_flight += 1
        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.in_flight -= 1
