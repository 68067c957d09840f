"""Migrations are the only source of the schema: `upgrade head` must equal the models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app.migrate import upgrade_database
from app.models import Base
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
