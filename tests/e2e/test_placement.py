"""A run the cluster cannot place never sits in `running` while Ray Train waits forever.

The local cluster has CPUs only, so `use_gpu: true` is a run it can never place: the
service refuses it at validation; a second service, configured for a cluster that
autoscales and with a short placement timeout, accepts it, and the run shows that it is
waiting for resources and then fails, once, with the placement timeout's message.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.cli.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import Service, make_service

pytestmark = pytest.mark.e2e

PLACEMENT_TIMEOUT_S = 20


def _gpu_request(model: Path, data: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "dataset": {"source": str(data)},
        "training": {"max_steps": 2, "batch_size_per_worker": 2, "seq_length": 32},
        "deepspeed": {"zero_stage": 2},
        "resources": {"num_workers": 2, "use_gpu": True},
    }


@pytest.fixture
def gpu_request(service: Service, tiny_model_dir: Path) -> dict[str, Any]:
    data = write_jsonl_dataset(service.data_dir / "placement.jsonl", rows=64, seed=5)
    return _gpu_request(tiny_model_dir, data)


@pytest.fixture
def autoscaling_service(
    service: Service, tmp_path_factory: pytest.TempPathFactory, tiny_models_root: Path
) -> Iterator[Service]:
    """A service for an autoscaling cluster, on the shared service's Ray head."""
    svc = make_service(
        tmp_path_factory.mktemp("autoscaling-home"), service.data_dir, [tiny_models_root]
    )
    svc.env.update(
        {
            "TUNEYARD_RAY_ADDRESS": service.http.get("/healthz").json()["ray"]["address"],
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(service.home / "ray" / "auth_token"),
            "TUNEYARD_STORAGE_PATH": str(service.home / "storage"),
            "TUNEYARD_CLUSTER_AUTOSCALES": "true",
            "TUNEYARD_PLACEMENT_TIMEOUT_S": str(PLACEMENT_TIMEOUT_S),
        }
    )
    with svc.running():
        yield svc


def test_a_gpu_run_on_the_cpu_cluster_is_refused_at_validation(
    service: Service, gpu_request: dict[str, Any]
) -> None:
    # The service reads the cluster's nodes in the background; a head that has just
    # started may not list its node yet, and then nothing is refused.
    deadline = time.monotonic() + 60
    while True:
        report = service.http.post("/v1/runs/validate", json=gpu_request).json()
        if not report["valid"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert report["valid"] is False, report
    (error,) = report["errors"]
    assert error["field"] == "resources.use_gpu"
    assert error["message"].startswith(
        "the run asks for 2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs"
    )

    response = service.http.post("/v1/runs", json=gpu_request)
    assert response.status_code == 422
    assert response.json()["detail"] == report["errors"]


def test_on_an_autoscaling_cluster_it_waits_then_fails_after_the_placement_timeout(
    autoscaling_service: Service, gpu_request: dict[str, Any]
) -> None:
    svc = autoscaling_service
    assert svc.http.post("/v1/runs/validate", json=gpu_request).json()["valid"] is True
    started = time.monotonic()
    run = svc.wait_terminal(svc.submit(gpu_request)["id"], timeout_s=180)
    took = time.monotonic() - started

    assert run["status"] == "failed", (run, svc.log_path.read_text()[-3000:])
    assert run["error"]["code"] == "unplaceable"
    assert run["error"]["message"].startswith(
        f"the run's 2 workers could not be placed within the placement timeout "
        f"({PLACEMENT_TIMEOUT_S} s, TUNEYARD_PLACEMENT_TIMEOUT_S)"
    )
    assert run["attempt"] == 1  # not resubmitted: another attempt would wait the same
    # Ray's default would retry the wait forever. Job start-up, the controller and its
    # teardown add some 40 s on 2 idle cores, more on busy ones.
    assert PLACEMENT_TIMEOUT_S < took < PLACEMENT_TIMEOUT_S + 120, took

    events = svc.http.get(f"/v1/runs/{run['id']}/events").json()["data"]
    (waiting,) = [e for e in events if e["type"] == "waiting_for_resources"]
    assert waiting["message"] == (
        "the run asks for 2 workers x 1 GPU + 1 CPU, but the cluster has no GPUs; the cluster "
        f"may grow (autoscaling): waiting up to {PLACEMENT_TIMEOUT_S} s for the workers to be "
        "placed"
    )
    assert [e["status"] for e in events if e["type"] == "status"] == [
        "queued",
        "starting",
        "running",
        "failed",
    ]
