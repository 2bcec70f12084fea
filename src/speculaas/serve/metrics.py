"""Prometheus metrics of one engine (the standard client library, one registry per engine so
that several engines in a process, or replicas, each report their own): what an operator
watches to size a deployment and see where speculation pays."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OUTCOMES = ("ok", "cancelled", "error", "rejected")


class EngineMetrics:
    """Gauges read the engine when scraped (queue length, rows and images in flight); counters
    and histograms are fed by the engine thread as it works."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.registry = r = CollectorRegistry()
        Gauge("speculaas_queue_length", "requests waiting for a row", registry=r
              ).set_function(lambda: len(engine.waiting))
        Gauge("speculaas_rows_in_flight", "sample rows decoding (a guided image is two)",
              registry=r).set_function(engine.rows_in_flight)
        Gauge("speculaas_max_rows", "the engine's bound on rows in flight", registry=r
              ).set_function(lambda: engine.max_rows)
        self.tokens = Counter("speculaas_committed_tokens", "image tokens committed",
                              registry=r)
        self.forwards = Counter("speculaas_image_forwards",
                                "images stepped (one per image per iteration): committed "
                                "tokens / image forwards is the step compression", registry=r)
        self.iteration = Histogram("speculaas_iteration_seconds",
                                   "wall time of one iteration of a lane", registry=r,
                                   buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.compression = Histogram("speculaas_step_compression",
                                     "tokens per forward of each finished image", registry=r,
                                     buckets=(1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 12, 16))
        self.requests = Counter("speculaas_requests", "images by outcome", ["outcome"],
                                registry=r)
        for outcome in OUTCOMES:
            self.requests.labels(outcome)  # every outcome reported from the start, at 0

    def render(self) -> bytes:
        return generate_latest(self.registry)
