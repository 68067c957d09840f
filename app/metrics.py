"""Prometheus metrics for `GET /metrics`: one registry per app, so tests (and two apps in
one process) never share counters."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.storage.models import Run
from contract.statuses import RunStatus

# Seconds from a run entering the queue to Ray accepting its job. It includes the wait for a
# free slot under `max_concurrent_runs`, so the buckets reach into minutes.
_DISPATCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600)
_LOOP_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class RunsByStatus(Collector):
    """Counted from the database at scrape time, so every replica reports the same truth
    and nothing drifts after a restart."""

    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self._session_factory = session_factory

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("tuneyard_runs", "Runs by status", labels=["status"])
        with self._session_factory() as session:
            counts = dict(
                session.execute(select(Run.status, func.count()).group_by(Run.status))
                .tuples()
                .all()
            )
        for status in RunStatus:
            family.add_metric([status.value], counts.get(status.value, 0))
        yield family


class ServiceMetrics:
    def __init__(self, session_factory: sessionmaker[Session]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(RunsByStatus(session_factory))
        self.dispatch_latency = Histogram(
            "tuneyard_dispatch_latency_seconds",
            "From a run entering the queue to Ray accepting its job",
            buckets=_DISPATCH_BUCKETS,
            registry=self.registry,
        )
        self.ray_submit_duration = Histogram(
            "tuneyard_ray_submit_duration_seconds",
            "How long Ray's submit_job call took",
            buckets=_LOOP_BUCKETS,
            registry=self.registry,
        )
        self.reconcile_duration = Histogram(
            "tuneyard_reconcile_duration_seconds",
            "One pass of the reconcile loop over every live run",
            buckets=_LOOP_BUCKETS,
            registry=self.registry,
        )
        self.schedule_duration = Histogram(
            "tuneyard_schedule_duration_seconds",
            "One scheduling pass over the queue: its decision and the claims it made, "
            "under the scheduler's lock (Ray's free resources are read before it)",
            buckets=_LOOP_BUCKETS,
            registry=self.registry,
        )
        self.callbacks = Counter(
            "tuneyard_callbacks",
            "Worker callbacks accepted, by kind",
            labelnames=["kind"],
            registry=self.registry,
        )
        self.metric_points = Counter(
            "tuneyard_metric_points_received",
            "Metric points received from workers (a retried batch counts again; it is stored once)",
            registry=self.registry,
        )
