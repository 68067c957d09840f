"""Alembic environment: the URL comes from the caller or from tuneyard's settings."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection

from app.storage.db import make_engine
from app.storage.models import Base
from app.settings import Settings

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",  # SQLite cannot ALTER much
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url") or Settings().resolved_database_url
    engine = make_engine(url)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


if context.is_offline_mode():
    raise SystemExit("tuneyard migrations run online only: set TUNEYARD_DATABASE_URL")
run_migrations_online()
