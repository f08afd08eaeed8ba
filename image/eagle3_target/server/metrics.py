"""Prometheus metrics of the target server, kept in a per-app registry.

A registry per app (not prometheus_client's global one) lets several apps live in one process, as the tests
and the benchmark do, without duplicate-metric errors.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class ServerMetrics:
    """Every server metric, registered in its own CollectorRegistry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "eagle3_requests",
            "HTTP requests by route template and status code.",
            ["route", "code"],
            registry=r,
        )
        self.request_duration = Histogram(
            "eagle3_request_duration_seconds",
            "Request latency by route template, body read to last byte handed to the server.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("eagle3_tokens", "Tokens run through the target for supervision.", registry=r)
        self.batch_tokens = Histogram(
            "eagle3_batch_tokens",
            "Tokens per engine batch (after coalescing).",
            buckets=_BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        self.response_bytes = Counter(
            "eagle3_response_bytes",
            "Supervision answer bytes by format and by the transport they left over (http, nccl, mooncake).",
            ["format", "transport"],
            registry=r,
        )
        self.inflight = Gauge("eagle3_inflight_requests", "Requests being handled right now.", registry=r)
        self.answer_bytes_in_flight = Gauge(
            "eagle3_answer_bytes_in_flight",
            "Bytes held by answers being computed or sent (capped by --max-response-bytes-in-flight).",
            registry=r,
        )
        self.answer_memory_refusals = Counter(
            "eagle3_answer_memory_refusals",
            "Requests refused with 503 because the answers in flight held --max-response-bytes-in-flight.",
            registry=r,
        )
        self.send_timeouts = Counter(
            "eagle3_send_timeouts",
            "Connections closed because their client took no byte of an answer for --response-send-timeout.",
            registry=r,
        )
        self.queue_depth = Gauge(
            "eagle3_queue_depth", "Supervision requests waiting for the engine.", registry=r
        )
        self.active_clients = Gauge(
            "eagle3_active_clients",
            "Distinct clients with a data request in the last 10 minutes (protocol.CONSUMER_WINDOW_SECONDS).",
            registry=r,
        )
        self.ready = Gauge("eagle3_ready", "1 once the model is loaded and the canary passed.", registry=r)
        self.model_info = Info("eagle3_model", "Identity of the served target model.", registry=r)

    def count_response(self, format: str, *, tokens: int, size: int, transport: str) -> None:
        """One supervision answer (native `format`, or "nemo"): its tokens, and its bytes by transport."""
        self.tokens.inc(tokens)
        self.response_bytes.labels(format=format, transport=transport).inc(size)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
