"""What the training benchmarks share: a model that takes 512 tokens, Ray jobs on the
service's own cluster, and per-step timings read back from a tuneyard run."""

from __future__ import annotations

import contextlib
import itertools
import json
import shlex
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, median
from bench.service import BenchService

# Steps whose times are left out: DeepSpeed's first steps and the data loader warming up.
WARMUP_STEPS = 10


def build_model(root: Path) -> Path:
    """The tests' tiny GPT-2 (~100k parameters, 2 layers), with room for 512 positions."""
    from app.cli.tiny_assets import build_tiny_gpt2

    model = root / "tiny-gpt2-512"
    if not (model / "config.json").exists():
        build_tiny_gpt2(model, n_positions=512)
    return model


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def run_ray_job(
    service: BenchService, entrypoint: str, *, name: str, timeout_s: float = 600
) -> None:
    """Run `entrypoint` as a Ray job on the service's cluster, as tuneyard runs its worker,
    so both sides of a comparison train on the same Ray head and the same cores."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(service.ray_dashboard_url, headers=service.ray_headers)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        submission_id=f"{name}-{int(time.time() * 1000)}",
        runtime_env={
            "py_modules": [str(REPO_ROOT / "bench"), str(REPO_ROOT / "worker")],
            "env_vars": {"DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"},
        },
        entrypoint_num_cpus=0,
    )
    deadline = time.monotonic() + timeout_s
    status = client.get_job_status(job_id)
    while not status.is_terminal():
        if time.monotonic() > deadline:
            client.stop_job(job_id)
            raise TimeoutError(f"Ray job {job_id} still {status} after {timeout_s}s")
        time.sleep(1.0)
        status = client.get_job_status(job_id)
    if status != JobStatus.SUCCEEDED:
        logs = client.get_job_logs(job_id)
        raise RuntimeError(f"Ray job {job_id} ended {status}:\n{logs[-4000:]}")


def metric_rows(service: BenchService, run_id: str, name: str) -> list[dict[str, Any]]:
    """Every value of one metric of a run, in step order, following the pages."""
    rows: list[dict[str, Any]] = []
    cursor: str | None = None
    while True:
        params: dict[str, Any] = {"name": name, "limit": 1000}
        if cursor:
            params["cursor"] = cursor
        response = service.http.get(f"/v1/runs/{run_id}/metrics", params=params)
        response.raise_for_status()
        page = response.json()
        rows.extend(page["data"])
        cursor = page.get("next_cursor")
        if not cursor:
            return sorted(rows, key=lambda r: r["step"])


def run_tuneyard(service: BenchService, body: dict[str, Any]) -> dict[str, Any]:
    """Submit a run over HTTP, wait for it, and fail loudly unless it succeeded."""
    run = service.submit(body)
    # Once a second, as `run_ray_job` polls Ray for the other side: the benchmark's own
    # polling takes CPU from the training on small machines, and must take the same on both.
    final = service.wait_terminal(run["id"], timeout_s=600, poll_s=1.0)
    if final["status"] != "succeeded":
        logs = service.http.get(f"/v1/runs/{run['id']}/logs", params={"tail": 60}).text
        raise RuntimeError(f"run {run['id']} ended {final['status']}: {final['error']}\n{logs}")
    return final


def step_intervals(service: BenchService, run_id: str) -> list[float]:
    """Wall-clock seconds between consecutive steps of a run, from the times at which rank 0
    logged each step: the whole step, tuneyard's own logging and reductions included.

    Needs `log_every_n_steps: 1`. The first entry (step 1) has no predecessor and is
    `step_time_seconds` of step 1 instead; it falls in the warm-up anyway.
    """
    rows = metric_rows(service, run_id, "step_time_seconds")
    times = [datetime.fromisoformat(r["time"]) for r in rows]
    steps = [r["step"] for r in rows]
    if steps != list(range(1, len(steps) + 1)):
        raise RuntimeError(f"run {run_id}: expected a metric for every step, got steps {steps}")
    return [rows[0]["value"]] + [(b - a).total_seconds() for a, b in itertools.pairwise(times)]


def run_tutorial(
    service: BenchService,
    *,
    model: Path,
    data: Path,
    steps: int,
    index: int,
    batch_size: int,
    seq_length: int,
) -> dict[str, list[float]]:
    """The tutorial-style script (bench/tutorial_baseline.py) as a plain Ray job on the
    service's head, ZeRO-2; what it measured, from the JSON it writes."""
    out = service.home / f"tutorial-{index}.json"
    args = [
        "python",
        "-m",
        "bench.tutorial_baseline",
        f"--model={model}",
        f"--data={data}",
        f"--out={out}",
        f"--storage={service.home / 'tutorial-storage'}",
        f"--steps={steps}",
        f"--batch-size={batch_size}",
        f"--seq-length={seq_length}",
        "--zero-stage=2",
    ]
    run_ray_job(service, shlex.join(args), name=f"tutorial-{index}")
    result: dict[str, list[float]] = json.loads(out.read_text())
    return result


def steady(values: list[float]) -> list[float]:
    return values[WARMUP_STEPS:]


def steady_median(values: list[float]) -> float:
    return median(steady(values))


@contextlib.contextmanager
def bench_home(name: str) -> Iterator[Path]:
    """A fresh folder for one benchmark's service, model and data; removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"tuneyard-bench-{name}-") as root:
        yield Path(root)
