"""Runs stay trustworthy while the service and the cluster crash, restart and disagree."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from ray.job_submission import JobSubmissionClient

from app.cli.tiny_assets import write_jsonl_dataset
from app.services.api_keys import find_api_key
from app.services.rules.run_rules import RequestPolicy
from app.services.runs import prepare_run, store_run
from app.storage.db import make_engine, make_session_factory, transaction
from app.storage.models import Run, utcnow
from contract.run_request import RunRequest
from tests.e2e.conftest import Service, make_service
from tests.e2e.helpers import assert_succeeded, checkpoints, metric_series

pytestmark = pytest.mark.e2e

# The runs a test stops mid-way (held after step 15, a checkpoint at 10 behind them).
STEPS = 30


def _long_request(model: Path, data: Path, *, steps: int, every: int) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data)},
        "training": {
            "max_steps": steps,
            "learning_rate": 1e-3,
            "batch_size_per_worker": 8,
            "seq_length": 64,
        },
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2},
        "checkpointing": {"every_n_steps": every, "keep_last": 2, "export_hf": False},
        "fault_tolerance": {"max_failures": 1},
    }


def ray_jobs_client(service: Service) -> JobSubmissionClient:
    """A client of the service's own Ray head, authenticated with the head's token."""
    token = (service.home / "ray" / "auth_token").read_text().strip()
    return JobSubmissionClient(
        service.http.get("/healthz").json()["ray"]["address"],
        headers={"Authorization": f"Bearer {token}"},
    )


def _events(service: Service, run_id: str) -> list[dict[str, Any]]:
    return list(service.http.get(f"/v1/runs/{run_id}/events").json()["data"])


def test_cancel_mid_run_then_resume_continues_the_step_count(
    service: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "news-life.jsonl", rows=2000, seed=7)
    run_id = service.submit(_long_request(tiny_model_dir, data, steps=STEPS, every=10))["id"]
    # Held after step 15, by state: a checkpoint (step 10) exists and the run is mid-way.
    service.wait_held(service.hold_at(run_id, 15), run_id, checkpoint=10)

    cancelled = service.http.post(f"/v1/runs/{run_id}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] in ("cancelling", "cancelled")
    assert service.http.post(f"/v1/runs/{run_id}/cancel").status_code == 200  # harmless
    run = service.wait_terminal(run_id, timeout_s=120)
    assert run["status"] == "cancelled", run
    stopped_at = run["progress"]["step"]
    assert stopped_at < STEPS

    ray = ray_jobs_client(service)
    assert ray.get_job_status(f"{run_id}-1").value == "STOPPED"
    conflict = service.http.post(f"/v1/runs/{run_id}/resume")
    assert conflict.status_code == 200, conflict.text
    assert conflict.json()["attempt"] == 2

    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)
    assert run["attempt"] == 2
    resumed = [e for e in _events(service, run_id) if e["type"] == "resumed"]
    assert [e["attempt"] for e in resumed] == [2]
    # Attempt 2 starts after attempt 1's last checkpoint, not from zero.
    page = service.http.get(
        f"/v1/runs/{run_id}/metrics", params={"name": "loss", "limit": 10000}
    ).json()["data"]
    second = sorted(m["step"] for m in page if m["attempt"] == 2)
    first_checkpointed = max(
        c["step"] for c in checkpoints(service, run_id, "deepspeed") if c["attempt"] == 1
    )
    resumed_at = int(re.search(r"step (\d+)", resumed[0]["message"]).group(1))  # type: ignore[union-attr]
    # (A checkpoint persisted in the moment of the cancel may not have been recorded yet,
    # so the one resumed from is at least the last recorded one.)
    assert resumed_at >= first_checkpointed > 0
    assert second[0] == resumed_at + 1
    assert second[-1] == STEPS
    again = service.http.post(f"/v1/runs/{run_id}/cancel")
    assert again.status_code == 409
    assert "succeeded" in again.json()["detail"]


def test_a_crash_between_commit_and_submit_leaves_exactly_one_ray_job(
    service: Service, tiny_model_dir: Path
) -> None:
    """The state a crash leaves: the run stored as `starting`, Ray never asked."""
    data = write_jsonl_dataset(service.data_dir / "news-crash.jsonl", rows=400, seed=8)
    request = RunRequest.model_validate(_long_request(tiny_model_dir, data, steps=6, every=3))
    engine = make_engine(f"sqlite:///{service.home / 'tuneyard.db'}")
    factory = make_session_factory(engine)
    key = service.http.headers["Authorization"].removeprefix("Bearer ")
    with transaction(factory) as session:
        owner = find_api_key(session, secret=key)
        assert owner is not None
        new = prepare_run(
            session,
            request=request,
            owner_id=owner.id,
            policy=RequestPolicy(roots=[tiny_model_dir.parent, service.data_dir]),
        )
        run, _ = store_run(session, new)
        run.status = "starting"
        run.ray_submission_id = f"{run.id}-1"
        run.updated_at = utcnow() - timedelta(minutes=5)
        run_id = run.id
    with factory() as session:
        stored = session.get(Run, run_id)
        assert stored is not None and stored.status == "starting"
    engine.dispose()

    run = service.wait_terminal(run_id)
    assert_succeeded(service, run)
    ray = ray_jobs_client(service)
    jobs = [j for j in ray.list_jobs() if (j.submission_id or "").startswith(run_id)]
    assert [j.submission_id for j in jobs] == [f"{run_id}-1"]
    assert any("resubmitting" in e["message"] for e in _events(service, run_id))


@pytest.fixture(scope="module")
def crashable_service(
    tmp_path_factory: pytest.TempPathFactory, tiny_models_root: Path
) -> Iterator[Service]:
    """A service the crash tests may crash, apart from the shared one: its own home,
    database and Ray head. One for the module: a start (service and head) takes 15 to 40 s
    on 2 cores, and each test leaves it running, with a head, as it found it."""
    svc = make_service(
        tmp_path_factory.mktemp("crash-home"),
        tmp_path_factory.mktemp("crash-data"),
        [tiny_models_root],
    )
    svc.start()
    try:
        yield svc
    finally:
        svc.http.close()
        svc.stop()
        head = svc.home / "ray" / "head.json"
        if head.exists():  # a test that left a head behind: take it down
            os.killpg(json.loads(head.read_text())["pid"], signal.SIGKILL)


@pytest.fixture
def own_service(crashable_service: Service) -> Service:
    """The crashable service, running: a test that failed with it killed does not take the
    next one down with it."""
    if crashable_service.proc is None or crashable_service.proc.poll() is not None:
        crashable_service.start()
    return crashable_service


@pytest.mark.own_cluster
def test_kill_9_the_service_mid_run_and_restart(own_service: Service, tiny_model_dir: Path) -> None:
    svc = own_service
    data = write_jsonl_dataset(svc.data_dir / "news.jsonl", rows=2000, seed=9)
    run_id = svc.submit(_long_request(tiny_model_dir, data, steps=200, every=100))["id"]
    svc.wait_for(run_id, {"running"}, timeout_s=300)
    while svc.http.get(f"/v1/runs/{run_id}").json()["progress"]["step"] < 5:
        time.sleep(0.2)
    head_before = json.loads((svc.home / "ray" / "head.json").read_text())

    svc.kill()
    # What a profile under way when the service died leaves, with no job Ray knows of.
    left = svc.home / "storage" / "profiles" / "profile-left-by-the-crash.json"
    left.parent.mkdir(parents=True, exist_ok=True)
    left.write_text("{}")
    time.sleep(5)  # training goes on; the worker buffers what it cannot post
    svc.start()

    # The restarted service re-attached to the head it started: no second head.
    assert json.loads((svc.home / "ray" / "head.json").read_text()) == head_before
    # And its profile reaper, started with it, deleted what the crash left.
    deadline = time.monotonic() + 60
    while left.exists():
        assert time.monotonic() < deadline, "the crash's profile file was not reaped"
        time.sleep(0.2)
    run = svc.wait_terminal(run_id)
    assert_succeeded(svc, run)
    assert run["attempt"] == 1
    # Every step's loss arrived, including those posted while the service was down.
    assert sorted(metric_series(svc, run_id, "loss")) == list(range(1, 201))


@pytest.mark.own_cluster
def test_restart_the_ray_head_mid_run(own_service: Service, tiny_model_dir: Path) -> None:
    svc = own_service
    data = write_jsonl_dataset(svc.data_dir / "news-head.jsonl", rows=2000, seed=10)
    run_id = svc.submit(_long_request(tiny_model_dir, data, steps=STEPS, every=10))["id"]
    # Held after step 15, by state: the checkpoint at step 10 exists, the run is mid-way.
    svc.wait_held(svc.hold_at(run_id, 15), run_id, checkpoint=10)

    head = json.loads((svc.home / "ray" / "head.json").read_text())
    os.killpg(head["pid"], signal.SIGKILL)  # the head and everything it ran
    killed = time.monotonic()

    # The run leaves `running` at once (the driver reports the cluster failure, or the
    # reconciler finds the job gone); the service starts a new head and attempt 2.
    svc.wait_for(run_id, {"queued", "starting"}, timeout_s=60)
    run = svc.wait_terminal(run_id)
    assert_succeeded(svc, run)
    assert run["attempt"] == 2
    new_head = json.loads((svc.home / "ray" / "head.json").read_text())
    assert new_head["pid"] != head["pid"]
    lost = [e for e in _events(svc, run_id) if e["message"].startswith("lost")]
    assert len(lost) == 1
    resumed = [e for e in _events(svc, run_id) if e["type"] == "resumed"]
    assert [e["attempt"] for e in resumed] == [2]
    assert time.monotonic() - killed < 600
