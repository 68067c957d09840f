"""Migrations are the only source of the schema: `upgrade head` must equal the models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from app.storage.migrate import alembic_config, upgrade_database
from app.storage.models import Base
from tests.conftest import create_postgres_database, drop_postgres_database


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    request.getfixturevalue("postgres_url")  # skips or fails when PostgreSQL is absent
    url = create_postgres_database()
    yield url
    drop_postgres_database(url)


def test_upgrade_head_on_an_empty_database_matches_the_models(empty_database: str) -> None:
    upgrade_database(empty_database)
    engine = create_engine(empty_database)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        tables = set(inspect(conn).get_table_names())
    engine.dispose()
    assert diff == []
    assert {"runs", "metrics", "checkpoints", "events", "api_keys"} <= tables


def test_upgrade_is_idempotent(empty_database: str) -> None:
    upgrade_database(empty_database)
    upgrade_database(empty_database)  # a restarted service upgrades again: nothing to do


def test_the_shared_queue_revision_counts_the_gpus_of_runs_not_done(
    empty_database: str,
) -> None:
    """Runs queued or live before the upgrade ask for their spec's GPUs: quotas, fair share
    and resume read the column, which new runs fill as they are created."""
    command.upgrade(alembic_config(empty_database), "b6f2d8e4a913")  # the revision before
    engine = create_engine(empty_database)
    gpu = '{"resources": {"use_gpu": true, "num_workers": 4, "gpus_per_worker": 2}}'
    cpu = '{"resources": {"use_gpu": false, "num_workers": 4}}'
    with engine.begin() as conn:
        for run_id, status, spec in (
            ("run_gpu", "queued", gpu),
            ("run_cpu", "running", cpu),
            ("run_done", "succeeded", gpu),
        ):
            conn.execute(
                text(
                    "INSERT INTO runs (id, status, attempt, spec, metadata, step, "
                    "latest_metrics, created_at, updated_at, queued_at) VALUES (:id, :status, "
                    "1, :spec, '{}', 0, '{}', :now, :now, :now)"
                ),
                {"id": run_id, "status": status, "spec": spec, "now": "2026-11-01 00:00:00+00"},
            )
    upgrade_database(empty_database)
    with engine.connect() as conn:
        gpus = dict(conn.execute(text("SELECT id, gpus FROM runs")).all())
    engine.dispose()
    assert gpus == {"run_gpu": 8, "run_cpu": 0, "run_done": 0}


def test_the_tenant_isolation_revision_keeps_the_operators_deliveries_the_operators(
    empty_database: str,
) -> None:
    """A delivery queued before the upgrade to a URL that is not one of its run's own hooks
    went to a service-wide subscriber: it stays signed with the service's secret and listed
    to no tenant. Keys made before keep no secret of their own (their receivers verify the
    service's, as before) until rotated."""
    command.upgrade(alembic_config(empty_database), "c4a7e1f9d2b8")  # the revision before
    engine = create_engine(empty_database)
    spec = '{"webhooks": [{"url": "https://tenant.example/hook"}]}'
    now = "2026-11-01 00:00:00+00"
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO api_keys (id, name, key_hash, created_at) "
                "VALUES ('key_1', 'old', 'h', :now)"
            ),
            {"now": now},
        )
        conn.execute(
            text(
                "INSERT INTO runs (id, owner_id, status, attempt, spec, metadata, step, "
                "latest_metrics, created_at, updated_at, queued_at) VALUES ('run_1', 'key_1', "
                "'cancelled', 1, :spec, '{}', 0, '{}', :now, :now, :now)"
            ),
            {"spec": spec, "now": now},
        )
        for delivery_id, url in (
            ("whd_own", "https://tenant.example/hook"),
            ("whd_operator", "https://ops.example/all-runs"),
        ):
            conn.execute(
                text(
                    "INSERT INTO webhook_deliveries (id, run_id, event, url, payload, status, "
                    "attempts, next_attempt_at, created_at) VALUES (:id, 'run_1', "
                    "'run.cancelled', :url, '{}', 'pending', 0, :now, :now)"
                ),
                {"id": delivery_id, "url": url, "now": now},
            )
    upgrade_database(empty_database)
    with engine.connect() as conn:
        wide = dict(conn.execute(text("SELECT id, service_wide FROM webhook_deliveries")).all())
        secret = conn.execute(text("SELECT webhook_secret FROM api_keys")).scalar_one()
    engine.dispose()
    assert {k: bool(v) for k, v in wide.items()} == {"whd_own": False, "whd_operator": True}
    assert secret is None
