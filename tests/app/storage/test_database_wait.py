"""At start-up the service waits for a database that is not answering yet, then gives up
with a message that names the setting and hides the password."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from app.ports import free_port
from app.storage.migrate import DatabaseUnavailable, wait_for_database


def test_a_database_that_comes_up_late_is_waited_for(tmp_path: Path) -> None:
    # SQLite cannot open a file in a folder that does not exist yet: "not answering".
    folder = tmp_path / "later"
    timer = threading.Timer(1.0, folder.mkdir)
    timer.start()
    started = time.monotonic()
    wait_for_database(f"sqlite:///{folder / 'tuneyard.db'}", timeout_s=30)
    assert time.monotonic() - started >= 0.9
    timer.join()


def test_gives_up_naming_the_setting_without_the_password() -> None:
    port = free_port()  # nothing listens on it
    url = f"postgresql+psycopg://tuneyard:hunter2@127.0.0.1:{port}/tuneyard"
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable) as caught:
        wait_for_database(url, timeout_s=1.5)
    assert time.monotonic() - started < 15
    message = str(caught.value)
    assert "TUNEYARD_DATABASE_WAIT_S" in message and "did not answer within 1.5s" in message
    assert "hunter2" not in message


def test_an_answering_database_returns_at_once(database_url: str) -> None:
    started = time.monotonic()
    wait_for_database(database_url, timeout_s=0)
    assert time.monotonic() - started < 5
