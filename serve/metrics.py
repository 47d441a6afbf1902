"""Prometheus metrics of a serving process, answered at ``GET /metrics`` in the text format (prometheus_client).

    moco_http_requests_total{route, method, status}        counter
    moco_http_request_seconds{route, method}               histogram of the whole request
    moco_query_phase_seconds{phase}                        histogram of the engine's own phases per query
                                                           (decode, queue, embed, search, metadata)
    moco_batcher_queue_depth                               gauge: query batches waiting for the encoder
    moco_index_items / moco_index_generation               gauges: the live generation and its item count
    moco_index_last_swap_timestamp_seconds                 gauge: when this process last switched generation
    moco_encoder_info{provider, arch, sha256}              the encoder and its execution provider

Routes are the API's route templates (``/api/items/{item_id}``); the web app's many paths are counted as
``ui`` and anything else as ``other``, so the label set stays small whatever clients ask for.

Under ``moco serve --workers N`` every worker writes its samples to files in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode, set up by the supervisor before the workers start), and whichever worker
answers ``/metrics`` reports all of them: counters and histograms summed, the gauges one series per worker
(``pid`` label). The gauges are refreshed once a second by each process and at each scrape.
"""

from __future__ import annotations

import os
import threading
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PHASES = ("decode", "queue", "embed", "search", "metadata")
# request latency buckets (s): the API answers in milliseconds, uploads of large images take longer
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
REFRESH_S = 1.0


def multiprocess() -> bool:
    return bool(os.environ.get(MULTIPROC_ENV))


class ServeMetrics:
    """The metrics of one serving process over ``engine`` (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = CollectorRegistry()  # its own: several apps in one process (tests) do not collide
        r = self.registry
        gauge = {"multiprocess_mode": "all"}  # one series per worker (pid label) under --workers
        self.requests = Counter(
            "moco_http_requests", "HTTP requests answered", ["route", "method", "status"], registry=r
        )
        self.latency = Histogram(
            "moco_http_request_seconds",
            "time to answer an HTTP request",
            ["route", "method"],
            buckets=BUCKETS,
            registry=r,
        )
        self.phases = Histogram(
            "moco_query_phase_seconds", "engine time per query image and phase", ["phase"], buckets=BUCKETS, registry=r
        )
        self.queue_depth = Gauge(
            "moco_batcher_queue_depth", "query batches waiting for the encoder", registry=r, **gauge
        )
        self.items = Gauge("moco_index_items", "items in the live generation", registry=r, **gauge)
        self.generation = Gauge(
            "moco_index_generation", "number of the live generation (g000003 -> 3)", registry=r, **gauge
        )
        self.last_swap = Gauge(
            "moco_index_last_swap_timestamp_seconds",
            "when this process last switched to a new generation (its start if never)",
            registry=r,
            **gauge,
        )
        self.encoder = Gauge(
            "moco_encoder_info",
            "the encoder: its execution provider, architecture, sha256",
            ["provider", "arch", "sha256"],
            registry=r,
            **gauge,
        )
        self._swaps_seen, self._started = -1, time.time()
        self.refresh()
        threading.Thread(target=self._refresh_forever, name="moco-metrics", daemon=True).start()

    def observe_phases(self, timings: dict[str, float]) -> None:
        for phase in PHASES:
            if phase in timings:
                self.phases.labels(phase).observe(timings[phase])

    def refresh(self) -> None:
        """Set the gauges from the engine's state (cheap: a few attribute reads)."""
        engine = self.engine
        self.queue_depth.set(engine.queue_depth())
        gen = engine.generation
        self.generation.set(int(gen.lstrip("g") or 0) if gen.lstrip("g").isdigit() else -1)
        self.items.set(engine.item_count())
        if engine.swaps != self._swaps_seen:
            self._swaps_seen = engine.swaps
            self.last_swap.set(engine.last_swap or self._started)
            self.encoder.clear()
            info = engine.encoder_info()
            self.encoder.labels(info["provider"], info["arch"], info["sha256"][:12]).set(1)

    def _refresh_forever(self) -> None:  # a daemon thread: it ends with the process
        while True:
            time.sleep(REFRESH_S)
            try:
                self.refresh()
            except Exception:  # a closed engine at shutdown, a generation being swapped: next second
                pass

    def exposition(self) -> tuple[bytes, str]:
        """``(body, content type)`` of ``GET /metrics``: this process's metrics, or every worker's."""
        self.refresh()
        if multiprocess():
            from prometheus_client import multiprocess as mp

            registry = CollectorRegistry()
            mp.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def route_label(scope: dict) -> str:
    """The route template a request matched (``/api/items/{item_id}``), ``ui`` for the web app, or ``other``."""
    path = scope.get("path", "")
    route = scope.get("route")
    template = getattr(route, "path", None)
    if template and (template.startswith("/api") or template == "/metrics") and "{rest" not in template:
        return template
    if path.startswith("/api") or path == "/metrics":
        return "other"
    return "ui"


class RequestMetrics:
    """Pure ASGI middleware: count and time every HTTP request by route, method and status."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tic = time.perf_counter()
        status = [500]

        async def recording_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            route, method = route_label(scope), scope.get("method", "")
            self.metrics.requests.labels(route, method, str(status[0])).inc()
            self.metrics.latency.labels(route, method).observe(time.perf_counter() - tic)
