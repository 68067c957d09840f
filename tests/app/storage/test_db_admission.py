"""Many more concurrent requests than worker threads and connections: every one is answered.

The pool and the thread limit are made tiny here so that a flood of a hundred requests is
enough to provoke what 50-100 concurrent clients provoked in production: sessions holding
every connection while they wait for a thread to close them, and every thread waiting for a
connection (issue 20). Real database, real app, requests through its ASGI interface.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker

from app.main import create_app
from app.settings import Settings
from app.storage import db
from tests.app.conftest import start_run
from tests.conftest import make_api_key
from tests.factories import run_request

# Fewer worker threads than requests in flight, and a pool a fraction of either.
THREADS = 4
REQUESTS = 120
# A checkout that has to wait this long fails the request (a 500), where the default would
# hold the test for 30 s per request.
POOL_TIMEOUT_S = 2.0


@pytest.fixture
def tiny_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db, "REQUEST_SESSION_SLOTS", 2)
    monkeypatch.setattr(db, "KEY_LOOKUP_SLOTS", 1)
    monkeypatch.setattr(db, "BACKGROUND_CONNECTIONS", 1)
    monkeypatch.setattr(db, "POOL_MAX_OVERFLOW", 0)
    monkeypatch.setattr(db, "POOL_TIMEOUT_S", POOL_TIMEOUT_S)


Call = Callable[[httpx.AsyncClient], Any]


def request_mix(root: Path, run_id: str, key: str, token: str) -> list[tuple[str, Call]]:
    """What clients of a busy service send: status polls, lists, metric reads, validations,
    creates, and a worker posting metrics."""
    auth = {"Authorization": f"Bearer {key}"}
    worker = {"Authorization": f"Bearer {token}"}
    body = run_request(root)

    def metrics_post(step: int) -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        return {"attempt": 1, "points": [{"step": step, "name": "loss", "value": 1.0, "time": now}]}

    calls: list[tuple[str, Call]] = [
        ("get run", lambda h: h.get(f"/v1/runs/{run_id}", headers=auth)),
        ("list runs", lambda h: h.get("/v1/runs", headers=auth)),
        ("read metrics", lambda h: h.get(f"/v1/runs/{run_id}/metrics", headers=auth)),
        ("validate", lambda h: h.post("/v1/runs/validate", json=body, headers=auth)),
        ("create", lambda h: h.post("/v1/runs", json=body, headers=auth)),
    ]
    mix = [calls[i % len(calls)] for i in range(REQUESTS)]
    for step in range(REQUESTS // 6):
        mix.insert(
            step * 7,
            (
                "post metrics",
                lambda h, s=step: h.post(
                    f"/v1/internal/runs/{run_id}/metrics", json=metrics_post(s), headers=worker
                ),
            ),
        )
    return mix


async def flood(app: FastAPI, mix: list[tuple[str, Call]]) -> list[tuple[str, int, str]]:
    """Every request at once; (what, status code, body) of each."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = THREADS
    answers: list[tuple[str, int, str]] = []

    async def one(http: httpx.AsyncClient, what: str, call: Call) -> None:
        response = await call(http)
        answers.append((what, response.status_code, response.text[:200]))

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://tuneyard") as http:
            # Not a timing assertion: only so that a stalled service fails instead of hanging.
            with anyio.fail_after(180):
                async with anyio.create_task_group() as tg:
                    for what, call in mix:
                        tg.start_soon(one, http, what, call)
    return answers


class TestAdmission:
    def test_a_flood_of_requests_is_answered_in_full(
        self,
        tiny_pool: None,
        settings: Settings,
        session_factory: sessionmaker[Session],
        tmp_path: Path,
    ) -> None:
        key = make_api_key(session_factory)
        auth = {"Authorization": f"Bearer {key}"}
        with TestClient(create_app(settings, start_background=False)) as setup:
            run_id, token = start_run(setup, auth, tmp_path, settings, session_factory)

        mix = request_mix(tmp_path, run_id, key, token)
        answers = anyio.run(flood, create_app(settings, start_background=False), mix)

        failed = [a for a in answers if not 200 <= a[1] < 300]
        assert len(answers) == len(mix)
        assert failed == []
        # The writes all landed: every worker post and every create.
        with TestClient(create_app(settings, start_background=False)) as check:
            stored = check.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
            listed = check.get("/v1/runs", params={"limit": 100}, headers=auth).json()["data"]
        assert len(stored) == sum(1 for what, _ in mix if what == "post metrics")
        assert len(listed) == 1 + sum(1 for what, _ in mix if what == "create")


class TestWritesOnTheLoop:
    """SQLite writes that touch the database alone run on the event loop when its lock is
    free (app/api/deps.py run_in_write_session, app/storage/db.py write_if_unlocked)."""

    @pytest.fixture
    def sqlite_factory(self, tmp_path: Path) -> Any:
        engine = db.make_engine(f"sqlite:///{tmp_path / 'writes.db'}")
        with engine.begin() as connection:
            connection.exec_driver_sql("CREATE TABLE t (x INTEGER)")
        yield db.make_session_factory(engine)
        engine.dispose()

    @staticmethod
    def count(factory: sessionmaker[Session]) -> int:
        with factory() as session:
            return int(session.execute(text("SELECT count(*) FROM t")).scalar_one())

    def test_commits_rolls_back_and_steps_aside_for_a_held_lock(
        self, sqlite_factory: sessionmaker[Session]
    ) -> None:
        def insert(session: Session) -> int:
            return session.execute(text("INSERT INTO t VALUES (1)")).rowcount  # type: ignore[attr-defined]

        assert db.write_if_unlocked(sqlite_factory, insert) == (True, 1)
        assert self.count(sqlite_factory) == 1

        def fails(session: Session) -> None:
            session.execute(text("INSERT INTO t VALUES (2)"))
            raise RuntimeError("the route's own error")

        with pytest.raises(RuntimeError, match="the route's own error"):
            db.write_if_unlocked(sqlite_factory, fails)
        assert self.count(sqlite_factory) == 1  # rolled back

        # Another connection holds the write lock: nothing is done, and at once (the caller
        # is the event loop), not after SQLite's 30 s busy timeout.
        holder = sqlite_factory.kw["bind"].connect()
        holder.exec_driver_sql("INSERT INTO t VALUES (3)")  # BEGIN IMMEDIATE, held
        try:
            assert db.write_if_unlocked(sqlite_factory, insert) == (False, None)
        finally:
            holder.commit()
            holder.close()
        assert self.count(sqlite_factory) == 2
        # Every pooled connection went back with the busy timeout the other writers rely on.
        with sqlite_factory.kw["bind"].connect() as connection:
            timeout = connection.exec_driver_sql("PRAGMA busy_timeout").scalar()
        assert timeout == db.SQLITE_BUSY_TIMEOUT_MS

    def test_a_post_waits_for_a_held_lock_without_stalling_the_loop(
        self, settings: Settings, session_factory: sessionmaker[Session], tmp_path: Path
    ) -> None:
        """While another connection holds SQLite's lock, a worker's metric post waits for it
        and then lands; the event loop answers reads meanwhile."""
        if not settings.resolved_database_url.startswith("sqlite"):
            pytest.skip("SQLite's write lock")
        key = make_api_key(session_factory)
        auth = {"Authorization": f"Bearer {key}"}
        with TestClient(create_app(settings, start_background=False)) as setup:
            run_id, token = start_run(setup, auth, tmp_path, settings, session_factory)
        post = {
            "attempt": 1,
            "points": [
                {"step": 7, "name": "loss", "value": 0.5, "time": datetime.now(UTC).isoformat()}
            ],
        }
        app = create_app(settings, start_background=False)
        holder = db.make_engine(settings.resolved_database_url)
        held = holder.connect()

        async def scenario() -> tuple[int, int, bool]:
            async with app.router.lifespan_context(app):
                held.exec_driver_sql("UPDATE runs SET step = step")  # takes the write lock
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                    posting = {}

                    async def send() -> None:
                        posting["answer"] = await http.post(
                            f"/v1/internal/runs/{run_id}/metrics",
                            json=post,
                            headers={"Authorization": f"Bearer {token}"},
                        )

                    with anyio.fail_after(60):
                        async with anyio.create_task_group() as tg:
                            tg.start_soon(send)
                            await anyio.sleep(0.3)
                            # The post is waiting for the lock; the loop still answers.
                            read = await http.get(f"/v1/runs/{run_id}", headers=auth)
                            waiting = "answer" not in posting
                            await anyio.to_thread.run_sync(held.commit)
                    return read.status_code, posting["answer"].status_code, waiting

        try:
            read, posted, waited = anyio.run(scenario)
        finally:
            held.close()
            holder.dispose()
        assert (read, posted, waited) == (200, 200, True)
        with TestClient(create_app(settings, start_background=False)) as check:
            stored = check.get(f"/v1/runs/{run_id}/metrics", headers=auth).json()["data"]
        assert [(m["step"], m["value"]) for m in stored] == [(7, 0.5)]


class HungRay:
    """Ray's dashboard answering nothing: its client sets no timeout, so calls wait."""

    address = "http://user:secret@ray.invalid:8265"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.waiting = 0

    def reachable(self) -> bool:
        self.waiting += 1
        self.release.wait(60)
        return True


def test_a_hung_ray_holds_up_health_checks_and_nothing_else(
    tiny_pool: None, settings: Settings, session_factory: sessionmaker[Session], tmp_path: Path
) -> None:
    """More unauthenticated health checks than the service has database slots, all waiting
    on Ray: status polls are still answered (a health check holds no slot while it waits)."""
    key = make_api_key(session_factory)
    auth = {"Authorization": f"Bearer {key}"}
    with TestClient(create_app(settings, start_background=False)) as setup:
        run_id, _ = start_run(setup, auth, tmp_path, settings, session_factory)
    app = create_app(settings, start_background=False)
    ray = HungRay()

    async def scenario() -> tuple[int, list[int]]:
        async with app.router.lifespan_context(app):
            app.state.tuneyard.jobs = ray
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
                health: list[int] = []

                async def check() -> None:
                    health.append((await http.get("/healthz")).status_code)

                with anyio.fail_after(60):
                    async with anyio.create_task_group() as tg:
                        for _ in range(2 * db.REQUEST_SESSION_SLOTS):
                            tg.start_soon(check)
                        while ray.waiting < db.REQUEST_SESSION_SLOTS:
                            await anyio.sleep(0.05)
                        poll = await http.get(f"/v1/runs/{run_id}", headers=auth)
                        ray.release.set()
                return poll.status_code, health

    poll, health = anyio.run(scenario)
    assert poll == 200
    assert health == [200] * (2 * db.REQUEST_SESSION_SLOTS)
