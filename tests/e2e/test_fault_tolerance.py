"""A training worker killed mid-run: Ray Train restarts the group from the latest checkpoint."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from app.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import Service
from tests.e2e.helpers import assert_succeeded, checkpoints, metric_series

pytestmark = pytest.mark.e2e

STEPS = 100
EVERY = 20


def _train_workers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "RayTrainWorker" in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


def test_a_killed_worker_resumes_from_the_latest_checkpoint(
    service: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "news-ft.jsonl", rows=2000, seed=5)
    body = {
        "model": str(tiny_model_dir),
        "dataset": {"source": str(data)},
        "training": {
            "max_steps": STEPS,
            "learning_rate": 1e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"every_n_steps": EVERY, "keep_last": 2, "export_hf": False},
        "fault_tolerance": {"max_failures": 1},
    }
    run_id = service.submit(body)["id"]

    deadline = time.monotonic() + 300
    while not (saved := checkpoints(service, run_id, "deepspeed")):
        assert time.monotonic() < deadline, "no checkpoint was recorded"
        time.sleep(0.2)
    workers = _train_workers()
    assert workers, "no Ray Train worker process found"
    workers[0].send_signal(signal.SIGKILL)
    # (The reported progress lags training by up to a flush interval, so the checkpoint
    # that was already recorded is the lower bound of where training had got to.)
    saved_before_kill = max(c["step"] for c in saved)

    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)
    events = service.http.get(f"/v1/runs/{run_id}/events").json()["data"]
    resumed = [e for e in events if e["type"] == "resumed"]
    # Exactly one restart: the kill landed mid-run, and the group came back once.
    assert len(resumed) == 1, events
    step = int(re.search(r"step (\d+)", resumed[0]["message"]).group(1))  # type: ignore[union-attr]
    assert saved_before_kill <= step < STEPS and step % EVERY == 0

    # Steps continue from the checkpoint: every step logged once, none beyond the end.
    assert sorted(metric_series(service, run_id, "loss")) == list(range(1, STEPS + 1))
    assert run["progress"]["step"] == STEPS
    final = Path(checkpoints(service, run_id, "deepspeed")[-1]["path"])
    assert (final / "latest").read_text().strip() == f"step_{STEPS}"
