"""A training worker killed mid-run: Ray Train restarts the group from the latest checkpoint.

Decided by state, not by the clock: the run holds after a step the test chooses (after a
checkpoint, before its last step; worker/training/step_gate.py), the service has recorded that
checkpoint (so Ray Train has registered it), and only then is one of its own workers
killed. A kill timed by a wait could land after the last step on a fast machine, before
Ray knew the checkpoint on a busy one (a restart from nothing), or on another run's worker
on a shared one."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import psutil
import pytest

from app.cli.tiny_assets import write_jsonl_dataset
from contract.job_env import SPEC_ENV
from tests.e2e.conftest import Service
from tests.e2e.helpers import assert_succeeded, checkpoints, metric_series

pytestmark = pytest.mark.e2e

STEPS = 30
EVERY = 10
HOLD_AT = 15  # after the checkpoint at step 10, before the one at 20 and the end


def _workers_of(run_id: str) -> list[psutil.Process]:
    """This run's Ray Train workers: their environment holds the run's spec."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if "RayTrainWorker" not in " ".join(proc.info["cmdline"] or []):
            continue
        try:
            spec = proc.environ().get(SPEC_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if spec and json.loads(spec).get("run_id") == run_id:
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
    service.wait_held(service.hold_at(run_id, HOLD_AT), run_id, checkpoint=EVERY)
    workers = _workers_of(run_id)
    assert len(workers) == 2, workers
    workers[0].send_signal(signal.SIGKILL)

    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)
    events = service.http.get(f"/v1/runs/{run_id}/events").json()["data"]
    resumed = [e["message"] for e in events if e["type"] == "resumed"]
    # Exactly one restart, from the latest checkpoint before the hold.
    assert resumed == [f"attempt 1: resumed from the checkpoint at step {EVERY}"], events

    # Steps continue from the checkpoint: every step logged once, none beyond the end.
    assert sorted(metric_series(service, run_id, "loss")) == list(range(1, STEPS + 1))
    assert run["progress"]["step"] == STEPS
    final = Path(checkpoints(service, run_id, "deepspeed")[-1]["path"])
    assert (final / "latest").read_text().strip() == f"step_{STEPS}"
