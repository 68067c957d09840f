"""A second service in the shape of a real deployment: PostgreSQL, and a Ray cluster it did
not start (TUNEYARD_RAY_ADDRESS, token from RAY_AUTH_TOKEN_PATH), sharing the storage."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli.tiny_assets import write_jsonl_dataset
from tests.conftest import create_postgres_database, drop_postgres_database
from tests.e2e.conftest import Service, make_service
from tests.e2e.helpers import assert_succeeded, checkpoints, metric_series

pytestmark = pytest.mark.e2e


@pytest.fixture
def remote_service(
    service: Service,
    postgres_url: str,
    tmp_path_factory: pytest.TempPathFactory,
    tiny_models_root: Path,
) -> Iterator[Service]:
    database = create_postgres_database()
    svc = make_service(
        tmp_path_factory.mktemp("remote-home"),
        service.data_dir,
        [tiny_models_root],
        database_url=database,
    )
    head = service.http.get("/healthz").json()["ray"]["address"]
    svc.env.update(
        {
            "TUNEYARD_RAY_ADDRESS": head,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(service.home / "ray" / "auth_token"),
            # Ray Train storage must be shared by everything on the cluster.
            "TUNEYARD_STORAGE_PATH": str(service.home / "storage"),
        }
    )
    try:
        with svc.running():
            yield svc
    finally:
        drop_postgres_database(database)


def test_a_run_on_postgresql_against_an_existing_cluster(
    remote_service: Service, service: Service, tiny_model_dir: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "news-remote.jsonl", rows=400, seed=11)
    run = remote_service.submit(
        {
            "model": str(tiny_model_dir),
            "dataset": {"source": str(data)},
            "training": {
                "max_steps": 6,
                "learning_rate": 3e-3,
                "batch_size_per_worker": 8,
                "seq_length": 64,
            },
            "deepspeed": {"zero_stage": 2},
            "resources": {"num_workers": 2},
            "checkpointing": {"every_n_steps": 3},
            "fault_tolerance": {"max_failures": 0},
        }
    )
    run = remote_service.wait_terminal(run["id"])
    assert_succeeded(remote_service, run)
    assert sorted(metric_series(remote_service, run["id"], "loss")) == list(range(1, 7))
    assert [c["step"] for c in checkpoints(remote_service, run["id"], "deepspeed")] == [3, 6]
    # The service did not start a head of its own.
    assert not (remote_service.home / "ray" / "head.json").exists()
    assert remote_service.http.get("/healthz").json()["database"] == "ok"
