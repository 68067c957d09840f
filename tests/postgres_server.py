"""The PostgreSQL server the tests run against.

`TUNEYARD_TEST_POSTGRES_URL` when it is set; else the machine's own at 127.0.0.1:5432 (CI's);
else a throwaway server started from the `pgserver` wheel, which ships PostgreSQL's binaries,
so that `make test` runs the PostgreSQL half on a laptop with no server too. The throwaway
one listens on a Unix socket in a temporary folder and is stopped and deleted when the test
process exits.
"""

from __future__ import annotations

import functools
import os
import tempfile

from sqlalchemy import create_engine

URL_ENV = "TUNEYARD_TEST_POSTGRES_URL"
MACHINE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def answers(url: str) -> bool:
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 3})
        with engine.connect():
            pass
        engine.dispose()
        return True
    except Exception:
        return False


@functools.cache
def admin_url() -> str:
    """Where to make each test session's databases (it may not answer: see `answers`)."""
    if (url := os.environ.get(URL_ENV)) is not None:
        return url
    if answers(MACHINE_URL):
        return MACHINE_URL
    return start_throwaway_server() or MACHINE_URL


def start_throwaway_server() -> str | None:
    """A new PostgreSQL server of the process's own, its admin URL; None without the wheel."""
    try:
        import pgserver  # type: ignore[import-untyped]
    except ImportError:
        return None
    folder = tempfile.mkdtemp(prefix="tuneyard-test-postgres-")
    # "delete": stopped and its folder removed at exit (pgserver registers that itself).
    server = pgserver.get_server(folder, cleanup_mode="delete")
    # postgresql://postgres:@/postgres?host=<the socket's folder>
    uri: str = server.get_uri()
    return uri.replace("postgresql://", "postgresql+psycopg://", 1)
