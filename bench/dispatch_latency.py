"""Benchmark 2, dispatch latency: from `POST /v1/runs` to the Ray job RUNNING, and to the
run's first metric visible through the API, for a tiny model (ZeRO-2, 2 CPU workers).

Each stage ends at a timestamp on this machine's clock: the service's events (`starting`,
`running` from the job's driver, `worker_started` and `engine_ready` from rank 0), Ray's job
record (`start_time`), Ray's job status and the metrics endpoint as polled from here, and
the first metric point's own time. The first run warms caches and is not counted.

    python -m bench.dispatch_latency [--runs 10]
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import median, record
from bench.service import (
    BenchService,
    TinyAssets,
    build_tiny_assets,
    running_service,
    tiny_run_body,
)

POLL_S = 0.05

# (stage, what it covers, the timestamps it runs between)
STAGES = [
    ("service", "POST handled, run stored, claimed by the dispatcher", "post", "starting"),
    ("submit to Ray", "runtime_env packaged and uploaded, job created", "starting", "ray_created"),
    ("Ray scheduling", "job supervisor started, driver launched", "ray_created", "ray_running"),
    ("driver start", "`python -m worker` imported, reported running", "ray_running", "running"),
    ("worker start", "Ray Train controller, 2 workers, process group", "running", "worker_started"),
    (
        "model load",
        "tokenizer, data, model, DeepSpeed initialize",
        "worker_started",
        "engine_ready",
    ),
    ("first step", "first optimizer step, its metrics logged", "engine_ready", "first_metric"),
    (
        "metric delivery",
        "metrics sender's batch, stored, polled",
        "first_metric",
        "metric_visible",
    ),
]
TOTALS = [
    ("POST → Ray job RUNNING", "post", "ray_running"),
    ("POST → first metric visible", "post", "metric_visible"),
]


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class _Poller(threading.Thread):
    """Notes the first moment `check()` is true, polling every POLL_S seconds."""

    def __init__(self, check: Any) -> None:
        super().__init__(daemon=True)
        self.check = check
        self.seen_at: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                if self.check():
                    self.seen_at = time.time()
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)


def measure_one(service: BenchService, assets: TinyAssets) -> dict[str, float]:
    body = tiny_run_body(assets, max_steps=2)
    with (
        httpx.Client(base_url=service.ray_dashboard_url, headers=service.ray_headers) as ray,
        httpx.Client(
            base_url=service.base_url, headers={"Authorization": f"Bearer {service.api_key}"}
        ) as api,
    ):
        posted = time.time()
        run = service.submit(body)
        submission_id = f"{run['id']}-1"

        def ray_running() -> bool:
            response = ray.get(f"/api/jobs/{submission_id}")
            return response.status_code == 200 and response.json()["status"] != "PENDING"

        def metric_visible() -> bool:
            response = api.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 1})
            return bool(response.status_code == 200 and response.json()["data"])

        pollers = {"ray_running": _Poller(ray_running), "metric_visible": _Poller(metric_visible)}
        for poller in pollers.values():
            poller.start()
        final = service.wait_terminal(run["id"], timeout_s=900)
        for poller in pollers.values():
            poller.stop.set()
            poller.join()
    if final["status"] != "succeeded":
        raise RuntimeError(f"run {run['id']} {final['status']}: {final.get('error')}")

    events = service.http.get(f"/v1/runs/{run['id']}/events", params={"limit": 1000}).json()
    first: dict[str, float] = {}
    for event in events["data"]:
        name = event["status"] if event["type"] == "status" else event["type"]
        first.setdefault(name, _epoch(event["created_at"]))
    metrics = service.http.get(f"/v1/runs/{run['id']}/metrics", params={"limit": 100}).json()
    job = service.ray_job(submission_id)
    stamps = {
        "post": posted,
        "starting": first["starting"],
        "ray_created": job["start_time"] / 1000,
        "ray_running": pollers["ray_running"].seen_at,
        "running": first["running"],
        "worker_started": first["worker_started"],
        "engine_ready": first["engine_ready"],
        "first_metric": min(_epoch(m["time"]) for m in metrics["data"]),
        "metric_visible": pollers["metric_visible"].seen_at,
    }
    missing = [name for name, value in stamps.items() if value is None]
    if missing:
        raise RuntimeError(f"run {run['id']}: never saw {missing}")
    return {name: float(value) for name, value in stamps.items() if value is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--title", default="Dispatch latency (benchmark 2)")
    args = parser.parse_args()

    samples: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="tuneyard-bench-dispatch-") as tmp:
        root = Path(tmp)
        assets = build_tiny_assets(root / "assets")
        with running_service(root / "home", allowed_roots=[assets.root]) as service:
            measure_one(service, assets)  # warm-up: page cache, compiled ops, Ray's workers
            for i in range(args.runs):
                samples.append(measure_one(service, assets))
                total = samples[-1]["metric_visible"] - samples[-1]["post"]
                print(f"run {i + 1}/{args.runs}: first metric visible after {total:.1f}s")
    report(args.title, samples)


def report(title: str, samples: list[dict[str, float]]) -> None:
    rows: list[dict[str, object]] = []
    for stage, covers, start, end in STAGES:
        durations = [s[end] - s[start] for s in samples]
        rows.append(
            {
                "stage": stage,
                "covers": covers,
                "median s": round(median(durations), 3),
                "min s": round(min(durations), 3),
                "max s": round(max(durations), 3),
            }
        )
    for name, start, end in TOTALS:
        durations = [s[end] - s[start] for s in samples]
        rows.append(
            {
                "stage": f"**{name}**",
                "covers": "total",
                "median s": round(median(durations), 3),
                "min s": round(min(durations), 3),
                "max s": round(max(durations), 3),
            }
        )
    notes = [
        f"{len(samples)} runs after one warm-up run, one at a time, each of a ~100k-parameter "
        "GPT-2: ZeRO-2, 2 CPU workers, batch 8 x 64 tokens, 2 steps, no HF export.",
        "Stage medians are taken stage by stage, so they need not add up to the totals' "
        f"medians. Polled moments (Ray RUNNING, metric visible) are late by up to {POLL_S}s.",
        "Ray's `start_time` is when Ray created the job record; RUNNING is Ray's status as "
        "seen by polling `GET /api/jobs/{submission_id}`; `running`, `worker_started` and "
        "`engine_ready` are the run's events as the service stored them.",
    ]
    record(title, rows, notes=notes)


if __name__ == "__main__":
    main()
