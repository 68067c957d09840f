"""Apply Alembic migrations programmatically: the service upgrades its schema at start,
once the database answers."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import NullPool

log = logging.getLogger("tuneyard")

_ROOT = Path(__file__).resolve().parents[2]
_MAX_RETRY_DELAY_S = 5.0


class DatabaseUnavailable(RuntimeError):
    pass


def alembic_config(database_url: str) -> Config:
    cfg = Config(str(_ROOT / "alembic.ini"))
    cfg.set_main_option("script_location", str(_ROOT / "migrations"))
    # ConfigParser interpolation would choke on a '%' in a password.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade_database(database_url: str) -> None:
    command.upgrade(alembic_config(database_url), "head")


def prepare_database(database_url: str, *, wait_s: float) -> None:
    """What start-up does before serving: wait for the database, then bring its schema to
    head."""
    wait_for_database(database_url, timeout_s=wait_s)
    upgrade_database(database_url)


def wait_for_database(database_url: str, *, timeout_s: float) -> None:
    """A database that is still starting (a fresh container, a failover) gets `timeout_s`
    to answer before the service gives up, so start-up order does not matter."""
    url = make_url(database_url)
    connect_args = {"connect_timeout": 5} if url.get_backend_name() == "postgresql" else {}
    engine = create_engine(url, poolclass=NullPool, connect_args=connect_args)
    deadline = time.monotonic() + timeout_s
    delay = 0.25
    try:
        while True:
            try:
                with engine.connect():
                    return
            except OperationalError as exc:
                if time.monotonic() + delay > deadline:
                    raise DatabaseUnavailable(
                        f"the database at {url.render_as_string(hide_password=True)} did not "
                        f"answer within {timeout_s:g}s (TUNEYARD_DATABASE_WAIT_S): {exc.orig}"
                    ) from None
                log.warning("waiting for the database: %s", exc.orig)
                time.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_DELAY_S)
    finally:
        engine.dispose()
