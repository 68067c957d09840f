"""API2 Broken Authentication: the run tokens workers post with (/v1/internal/runs/…).

The token is checked first, with a read: a wrong one is refused alike for a run that does
not exist (no probing for run ids), and before the request takes a write session, so that
unauthenticated posts cannot queue for SQLite's one write lock (or PostgreSQL's row lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from app.services import callbacks
from app.storage.db import make_engine
from app.storage.models import Run

BAD_TOKEN = {"Authorization": "Bearer rt_not-the-token"}

# One valid body per callback route, so that only the token decides the answer.
BODIES: dict[str, dict[str, Any]] = {
    "status": {"attempt": 1, "status": "running"},
    "metrics": {
        "attempt": 1,
        "points": [{"step": 1, "name": "loss", "value": 1.0, "time": "2026-01-01T00:00:00Z"}],
    },
    "checkpoints": {"attempt": 1, "step": 1, "path": "/s/ckpt_1", "kind": "deepspeed"},
    "events": {"attempt": 1, "type": "message", "message": "hello"},
}


class TestUnknownRunsAndBadTokens:
    @pytest.mark.parametrize("route", sorted(BODIES))
    @pytest.mark.parametrize("headers", [BAD_TOKEN, {}], ids=["bad-token", "no-token"])
    def test_an_unknown_run_is_401_like_a_bad_token_on_a_real_run(
        self,
        client: TestClient,
        auth: dict[str, str],
        started: tuple[str, dict[str, str]],
        route: str,
        headers: dict[str, str],
    ) -> None:
        """The same answer for both: a caller without the token cannot probe for run ids."""
        run_id, _ = started
        answers = [
            client.post(f"/v1/internal/runs/{target}/{route}", json=BODIES[route], headers=headers)
            for target in ("run_unknown", run_id)
        ]
        for r in answers:
            assert r.status_code == 401, r.text
            assert r.json() == {"error": "unauthorized", "detail": "invalid or expired run token"}
        assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["status"] == "starting"

    def test_another_runs_token_on_an_unknown_run_is_401(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        _, worker = started
        r = client.post(
            "/v1/internal/runs/run_unknown/status", json=BODIES["status"], headers=worker
        )
        assert r.status_code == 401

    def test_the_token_is_checked_before_the_body(
        self, client: TestClient, started: tuple[str, dict[str, str]]
    ) -> None:
        """An unauthenticated caller learns nothing about the schema either."""
        run_id, _ = started
        r = client.post(
            f"/v1/internal/runs/{run_id}/status", json={"nonsense": True}, headers=BAD_TOKEN
        )
        assert r.status_code == 401

    def test_an_unknown_run_costs_a_comparison_too(
        self,
        client: TestClient,
        started: tuple[str, dict[str, str]],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """The timing of the answer does not tell a run that exists from one that does not:
        both compare the token's hash, once, in constant time."""
        run_id, _ = started
        compared: list[str] = []
        real = callbacks.secret_matches

        def spy(secret: str, expected_hash: str) -> bool:
            compared.append(expected_hash)
            return real(secret, expected_hash)

        monkeypatch.setattr(callbacks, "secret_matches", spy)
        for target in ("run_unknown", run_id):
            r = client.post(
                f"/v1/internal/runs/{target}/status", json=BODIES["status"], headers=BAD_TOKEN
            )
            assert r.status_code == 401
        assert len(compared) == 2
        assert all(len(h) == 64 for h in compared)


class TestBadTokensTakeNoWriteLock:
    @contextmanager
    def _writer_holding(
        self,
        client: TestClient,
        database_url: str,
        session_factory: sessionmaker[Session],
        run_id: str,
    ) -> Iterator[None]:
        """Another request's write in progress: on SQLite the database's write lock is held
        (what every write waits for), on PostgreSQL the run's row is locked."""
        if database_url.startswith("sqlite"):
            engine = make_engine(database_url)
            try:
                with engine.connect() as connection:
                    # BEGIN IMMEDIATE (app/storage/db.py): SQLite's one write lock until
                    # rolled back.
                    connection.exec_driver_sql("UPDATE runs SET step = step")
                    try:
                        yield
                    finally:
                        connection.rollback()
            finally:
                engine.dispose()
        else:
            with session_factory() as session:
                assert session.get(Run, run_id, with_for_update=True) is not None
                try:
                    yield
                finally:
                    session.rollback()

    def _answer_while_held(
        self,
        client: TestClient,
        database_url: str,
        session_factory: sessionmaker[Session],
        run_id: str,
        send: Callable[[], httpx.Response],
    ) -> httpx.Response:
        """What `send` gets back while a write holds the run: within 15 s (time to spare on a
        loaded machine, half SQLite's 30 s busy timeout), so an answer that queued behind the
        write, which is held until this returns, fails the test."""
        with (
            ThreadPoolExecutor(max_workers=1) as pool,
            self._writer_holding(client, database_url, session_factory, run_id),
        ):
            return pool.submit(send).result(timeout=15)

    @pytest.mark.parametrize("route", ["status", "metrics"])
    def test_a_bad_token_is_refused_while_a_write_holds_the_lock(
        self,
        client: TestClient,
        database_url: str,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
        route: str,
    ) -> None:
        run_id, _ = started
        # Before: the post queued behind the write and answered only after it.
        reply = self._answer_while_held(
            client,
            database_url,
            session_factory,
            run_id,
            lambda: client.post(
                f"/v1/internal/runs/{run_id}/{route}", json=BODIES[route], headers=BAD_TOKEN
            ),
        )
        assert reply.status_code == 401

    def test_a_good_token_still_waits_its_turn_and_writes(
        self,
        client: TestClient,
        auth: dict[str, str],
        database_url: str,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
    ) -> None:
        run_id, worker = started
        point = {"step": 1, "name": "loss", "value": 1.0, "time": datetime.now(UTC).isoformat()}
        with ThreadPoolExecutor(max_workers=1) as pool:
            with self._writer_holding(client, database_url, session_factory, run_id):
                answer = pool.submit(
                    client.post,
                    f"/v1/internal/runs/{run_id}/metrics",
                    json={"attempt": 1, "points": [point]},
                    headers=worker,
                )
                time.sleep(0.3)
                assert not answer.done()  # it needs the write, so it waits for it
            assert answer.result(timeout=10).status_code == 200
        data = client.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert [(m["step"], m["value"]) for m in data] == [(1, 1.0)]

    def test_a_control_poll_reads_while_a_write_holds_the_lock(
        self,
        client: TestClient,
        database_url: str,
        session_factory: sessionmaker[Session],
        started: tuple[str, dict[str, str]],
    ) -> None:
        """Every live run's worker polls for preemption: a read, which must not wait for a
        write that holds the run (its row lock on PostgreSQL, which the poll took too)."""
        run_id, worker = started
        # Before: it locked the run's row (FOR UPDATE) and answered after the write.
        reply = self._answer_while_held(
            client,
            database_url,
            session_factory,
            run_id,
            lambda: client.get(
                f"/v1/internal/runs/{run_id}/control", params={"attempt": 1}, headers=worker
            ),
        )
        assert (reply.status_code, reply.json()) == (200, {"preempt": False})
