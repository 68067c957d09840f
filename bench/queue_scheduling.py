"""The scheduler under a team's queue: 200 queued runs from 10 API keys (priorities,
GPU and CPU runs, quotas on some keys) on a 4-node cluster of 8 GPUs each, 24 runs live.
Per pass: the time of the decision (`queue.schedule` in its locked transaction, claims
included, as the dispatcher runs it), the database statements it issues, and the time of
a run view's queue position (`GET /v1/runs/{id}` on a queued run), on SQLite and on
PostgreSQL.

Each pass starts from the same database (the claims are rolled back), so every pass
decides over the full queue, the worst case.

    python -m bench.queue_scheduling [--passes 30] [--postgres URL]
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from bench.common import median, percentile, record

KEYS = 10
QUEUED = 200
LIVE = 24
NODES = [{"CPU": 64.0, "GPU": 8.0} for _ in range(4)]
DEFAULT_PG = os.environ.get(
    "TUNEYARD_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def _spec(rng: random.Random) -> dict[str, Any]:
    gpu = rng.random() < 0.7
    workers = rng.choice([1, 2, 4, 8])
    return {
        "resources": {
            "num_workers": workers,
            "use_gpu": gpu,
            "cpus_per_worker": rng.choice([1, 2, 4]),
            "gpus_per_worker": 1 if gpu else None,
        },
        "deepspeed": {"tensor_parallel_size": rng.choice([1, 2]) if workers % 2 == 0 else 1},
    }


def _fill(factory: sessionmaker[Session]) -> None:
    from app.services.queue import asked_gpus
    from app.storage.models import ApiKey, Run, new_id, utcnow

    rng = random.Random(7)
    now = utcnow()
    with factory.begin() as session:
        keys = [
            ApiKey(
                id=new_id("key"),
                name=f"team-{i}",
                key_hash=f"{i:064d}",
                max_running_runs=rng.choice([None, 2, 4]),
                max_gpus=rng.choice([None, 8, 16]),
            )
            for i in range(KEYS)
        ]
        session.add_all(keys)
        for i in range(QUEUED + LIVE):
            spec = _spec(rng)
            live = i < LIVE
            session.add(
                Run(
                    id=new_id("run"),
                    owner_id=rng.choice(keys).id,
                    status="running" if live else "queued",
                    spec=spec,
                    run_metadata={},
                    priority=rng.choice([10, 50, 50, 50, 80]),
                    preemptible=True,
                    gpus=asked_gpus(spec),
                    queued_at=now - timedelta(seconds=QUEUED + LIVE - i),
                    attempt_started_at=now - timedelta(hours=1) if live else None,
                )
            )


@contextmanager
def _database(kind: str, pg_url: str) -> Iterator[str]:
    from app.storage.migrate import upgrade_database

    if kind == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{Path(tmp) / 'bench.db'}"
            upgrade_database(url)
            yield url
        return
    name = f"tuneyard_bench_{os.getpid()}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{name}"'))
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = make_url(pg_url).set(database=name).render_as_string(hide_password=False)
    try:
        upgrade_database(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _measure(url: str, passes: int) -> dict[str, object]:
    from app.services import lifecycle, queue
    from app.settings import Settings
    from app.storage.db import make_engine, make_session_factory
    from app.storage.models import Run, utcnow

    engine = make_engine(url)
    factory = make_session_factory(engine)
    _fill(factory)
    statements = 0

    @event.listens_for(engine, "before_cursor_execute")
    def _count(*_: Any) -> None:
        nonlocal statements
        statements += 1

    settings = Settings(max_concurrent_runs=64, preemption_min_run_s=600)
    times, counts, started = [], [], 0
    for _ in range(passes):
        statements = 0
        with factory() as session:
            begun = time.perf_counter()
            admitted = queue.schedule(
                session,
                settings=settings,
                hooks=settings.webhook_config(),
                free_nodes=[dict(n) for n in NODES],
                now=utcnow(),
            )
            for run_id, _queued_at in admitted:
                lifecycle.claim(session, run_id, token_hash="0" * 64)
            session.flush()
            times.append(time.perf_counter() - begun)
            session.rollback()  # the next pass decides over the same full queue
        counts.append(statements)
        started = len(admitted)
    with factory() as session:
        some = list(session.query(Run).filter(Run.status == "queued").limit(20))
        view_times = []
        for run in some:
            begun = time.perf_counter()
            queue.queue_positions(session, [run])
            view_times.append(time.perf_counter() - begun)
    engine.dispose()
    return {
        "decision p50 ms": round(median(times) * 1000, 1),
        "decision p95 ms": round(percentile(times, 95) * 1000, 1),
        "statements per pass": int(median(counts)),
        "runs started per pass": started,
        "queue position p50 ms": round(median(view_times) * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--postgres", default=DEFAULT_PG, help="an admin URL (CREATE DATABASE)")
    parser.add_argument(
        "--title", default=f"Scheduler: {QUEUED} queued runs from {KEYS} keys, {LIVE} live"
    )
    args = parser.parse_args()
    rows = []
    for kind in ("sqlite", "postgresql"):
        with _database(kind, args.postgres) as url:
            rows.append({"database": kind, **_measure(url, args.passes)})
    record(
        args.title,
        rows,
        notes=[
            "A pass: lock, read live and queued runs and the keys' limits, decide "
            "(app/services/scheduling.py), write changed reasons, claim the admitted runs. "
            "Ray's free resources are read before the pass, outside the lock, and not timed.",
            "Statements: every SQL statement the pass sends, claims and their events included.",
            "Queue position: the fair-share order of the whole queue, computed per read.",
        ],
    )


if __name__ == "__main__":
    main()
