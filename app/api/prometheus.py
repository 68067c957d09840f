"""/metrics: Prometheus text, unauthenticated like any scrape target (counts only, no data)."""

from __future__ import annotations

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from app.api.deps import MetricsDep

router = APIRouter(tags=["health"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    description="Runs by status, dispatch latency, Ray submit time, reconcile loop duration "
    "and worker callbacks ingested.",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}},
)
def get_prometheus_metrics(metrics: MetricsDep) -> Response:
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)
