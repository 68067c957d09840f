"""SQLite writes on the event loop (app/storage/loop_writes.py), against a real SQLite file whose
lock another connection holds, as the dispatcher's thread or another process would."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session, sessionmaker
from starlette.requests import Request

from app.storage import db
from app.storage.loop_writes import LoopWriter
from app.storage.slots import Slots


@pytest.fixture
def factory(tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    engine = db.make_engine(f"sqlite:///{tmp_path / 'writes.db'}")
    with engine.begin() as connection:
        connection.exec_driver_sql("CREATE TABLE t (n INTEGER PRIMARY KEY AUTOINCREMENT, x)")
    yield db.make_session_factory(engine)
    engine.dispose()


def request() -> Request:
    return Request({"type": "http", "method": "POST", "headers": [], "state": {}})


def insert(value: Any) -> Any:
    def write(session: Session) -> Any:
        session.execute(text("INSERT INTO t (x) VALUES (:x)"), {"x": value})
        return value

    return write


def stored(factory: sessionmaker[Session]) -> list[Any]:
    with factory() as session:
        return [row.x for row in session.execute(text("SELECT x FROM t ORDER BY n"))]


def test_writes_at_once_when_the_lock_is_free(factory: sessionmaker[Session]) -> None:
    writer = LoopWriter(factory, Slots(4))

    async def scenario() -> list[Any]:
        return [await writer.write(request(), insert(i)) for i in range(3)]

    assert anyio.run(scenario) == [0, 1, 2]
    assert stored(factory) == [0, 1, 2]


def test_waiting_writes_run_in_order_back_to_back_once_the_lock_is_free(
    factory: sessionmaker[Session],
) -> None:
    """Twenty writes queued behind a held lock all land once it is released, in the order
    they came (how fast is bench/load_mix.py's to measure)."""
    writer = LoopWriter(factory, Slots(4))
    holder = factory.kw["bind"].connect()
    holder.exec_driver_sql("INSERT INTO t (x) VALUES ('holder')")  # BEGIN IMMEDIATE, held

    async def scenario() -> tuple[list[Any], list[Any]]:
        results: list[Any] = []

        async def one(i: int) -> None:
            results.append(await writer.write(request(), insert(i)))

        async with anyio.create_task_group() as tg:
            for i in range(20):
                tg.start_soon(one, i)
                await anyio.sleep(0)
            await anyio.sleep(0.2)
            before = list(results)  # nothing lands while the lock is held
            holder.commit()
        return before, results

    try:
        before, results = anyio.run(scenario)
    finally:
        holder.close()
    assert before == []
    assert sorted(results) == list(range(20))
    assert stored(factory) == ["holder", *range(20)]


def test_a_failing_write_answers_its_own_waiter_and_the_queue_goes_on(
    factory: sessionmaker[Session],
) -> None:
    writer = LoopWriter(factory, Slots(4))
    holder = factory.kw["bind"].connect()
    holder.exec_driver_sql("INSERT INTO t (x) VALUES ('holder')")

    def fails(session: Session) -> None:
        session.execute(text("INSERT INTO t (x) VALUES ('rolled back')"))
        raise ValueError("the route's own error")

    async def scenario() -> dict[str, Any]:
        answers: dict[str, Any] = {}

        async def send(name: str, write: Any) -> None:
            try:
                answers[name] = await writer.write(request(), write)
            except ValueError as exc:
                answers[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(send, "before", insert("before"))
            await anyio.sleep(0.01)
            tg.start_soon(send, "fails", fails)
            await anyio.sleep(0.01)
            tg.start_soon(send, "after", insert("after"))
            await anyio.sleep(0.05)
            holder.commit()
        return answers

    try:
        answers = anyio.run(scenario)
    finally:
        holder.close()
    assert answers["before"] == "before" and answers["after"] == "after"
    assert isinstance(answers["fails"], ValueError)
    assert stored(factory) == ["holder", "before", "after"]


def test_a_write_gives_up_after_the_busy_timeout_as_sqlite_would(
    factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_MS", 200)
    writer = LoopWriter(factory, Slots(4))
    holder = factory.kw["bind"].connect()
    holder.exec_driver_sql("INSERT INTO t (x) VALUES ('holder')")

    async def scenario() -> None:
        await writer.write(request(), insert("never"))

    try:
        with pytest.raises(sqlite3.OperationalError, match="database is locked"):
            anyio.run(scenario)
    finally:
        holder.rollback()
        holder.close()
    assert stored(factory) == []


def test_a_waiter_that_goes_away_does_not_stop_the_queue(factory: sessionmaker[Session]) -> None:
    writer = LoopWriter(factory, Slots(4))
    holder = factory.kw["bind"].connect()
    holder.exec_driver_sql("INSERT INTO t (x) VALUES ('holder')")

    async def scenario() -> Any:
        with anyio.move_on_after(0.05):  # the client hung up while its write waited
            await writer.write(request(), insert("abandoned"))
        async with anyio.create_task_group() as tg:
            tg.start_soon(writer.write, request(), insert("next"))
            await anyio.sleep(0.05)
            holder.commit()
        return None

    try:
        anyio.run(scenario)
    finally:
        holder.close()
    # The abandoned write was queued and still lands (as a write under way would): what
    # matters is that the one behind it does.
    assert stored(factory) == ["holder", "abandoned", "next"]
