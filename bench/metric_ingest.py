"""Benchmark 5, metric ingest: the points per second the worker callback endpoint
(`POST /v1/internal/runs/{id}/metrics`) stores, on SQLite and on PostgreSQL, with the
latency of status polling (`GET /v1/runs/{id}`) measured alongside.

The service runs without Ray or dispatcher (bench.service.serve_http_only), so that no
reconciler touches the runs: each is created as `POST /v1/runs` would, then moved to
`running` with a run token, as the dispatcher and the worker would. Each poster is one run's
worker, posting batches back to back; a poller in a process of its own reads one run's
status at a fixed rate meanwhile.

    python -m bench.metric_ingest [--duration 10] [--postgres-url URL | --no-postgres]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import secrets
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import median, percentile, record
from bench.service import (
    DEFAULT_POSTGRES,
    TinyAssets,
    build_tiny_assets,
    running_http_only_service,
    scratch_postgres,
)

POSTERS = 4
BATCH_SIZES = (100, 2000)  # a few steps' worth; the worker's largest batch (METRICS_BATCH_POINTS)
NAMES = ("loss", "learning_rate", "tokens_per_second", "samples_per_second", "grad_norm")
POLLERS = 2
POLL_INTERVAL_S = 0.05  # per poller: 40 requests/s in all, a handful of dashboards


@dataclass
class Fixture:
    database_url: str
    api_key: str
    runs: list[tuple[str, str]]  # (run id, run token)


def prepare(database_url: str, assets: TinyAssets, *, runs: int) -> Fixture:
    """An API key and `runs` running runs with tokens, written with the service's own code."""
    from app.security import hash_secret
    from app.services import lifecycle
    from app.services.api_keys import create_api_key
    from app.services.rules.run_rules import RequestPolicy
    from app.services.runs import prepare_run, store_run
    from app.storage.db import make_engine, make_session_factory, transaction
    from app.storage.migrate import upgrade_database
    from app.storage.models import Run
    from contract.run_request import RunRequest

    upgrade_database(database_url)
    engine = make_engine(database_url)
    created: list[tuple[str, str]] = []
    try:
        with transaction(make_session_factory(engine)) as session:
            key, api_key = create_api_key(session, name="bench")
            for _ in range(runs):
                request = RunRequest.model_validate(
                    {
                        "model": str(assets.model),
                        "dataset": {"source": str(assets.dataset), "text_field": "text"},
                        "training": {"max_steps": 1_000_000, "seq_length": 64},
                    }
                )
                new = prepare_run(
                    session,
                    request=request,
                    owner_id=key.id,
                    policy=RequestPolicy(roots=[assets.root]),
                )
                run, _ = store_run(session, new)
                token = f"rt_{secrets.token_urlsafe(32)}"
                run.callback_token_hash = hash_secret(token)
                run.ray_submission_id = f"{run.id}-1"
                lifecycle.start(session, run, message="bench")
                created.append((run.id, token))
            session.flush()
            assert all(session.get(Run, run_id) for run_id, _ in created)
    finally:
        engine.dispose()
    return Fixture(database_url=database_url, api_key=api_key, runs=created)


def _body(attempt: int, first_step: int, points: int) -> bytes:
    """`points` points over consecutive steps from `first_step`, every name at each step."""
    now = datetime.now(UTC).isoformat()
    items = []
    steps = -(-points // len(NAMES))
    for i in range(steps):
        step = first_step + i
        for name in NAMES[: min(len(NAMES), points - i * len(NAMES))]:
            items.append(f'{{"step":{step},"name":"{name}","value":{step * 0.001},"time":"{now}"}}')
    last = first_step + steps - 1
    return (
        f'{{"attempt":{attempt},"points":[{",".join(items)}],'
        f'"progress":{{"step":{last},"total_steps":1000000}}}}'
    ).encode()


@dataclass
class PosterResult:
    posts: int
    points: int
    latencies_ms: list[float]


def _post_loop(
    base_url: str, run_id: str, token: str, batch: int, until: float, out: list[PosterResult]
) -> None:
    result = PosterResult(0, 0, [])
    steps_per_post = -(-batch // len(NAMES))
    with httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        timeout=60,
    ) as client:
        step = 1
        while time.monotonic() < until:
            body = _body(1, step, batch)
            started = time.perf_counter()
            response = client.post(f"/v1/internal/runs/{run_id}/metrics", content=body)
            result.latencies_ms.append(1000 * (time.perf_counter() - started))
            response.raise_for_status()
            result.posts += 1
            result.points += int(response.json()["stored"])
            step += steps_per_post
    out.append(result)


def _poll_loop(url: str, api_key: str, duration_s: float, interval_s: float, out: Any) -> None:
    """In a process of its own: GET `url` every `interval_s` from POLLERS threads."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()

    def poll() -> None:
        nonlocal errors
        until = time.monotonic() + duration_s
        with httpx.Client(headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as c:
            c.get(url)  # connect first: the connection's setup is not what is measured
            next_at = time.monotonic()
            while next_at < until:
                started = time.perf_counter()
                ok = c.get(url).status_code == 200
                elapsed = 1000 * (time.perf_counter() - started)
                with lock:
                    latencies.append(elapsed)
                    errors += 0 if ok else 1
                next_at += interval_s
                time.sleep(max(0.0, next_at - time.monotonic()))

    threads = [threading.Thread(target=poll) for _ in range(POLLERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((latencies, errors))


@contextlib.contextmanager
def polling(url: str, api_key: str, duration_s: float) -> Iterator[list[tuple[list[float], int]]]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(
        target=_poll_loop, args=(url, api_key, duration_s, POLL_INTERVAL_S, queue), daemon=True
    )
    proc.start()
    result: list[tuple[list[float], int]] = []
    try:
        yield result
    finally:
        result.append(queue.get(timeout=duration_s + 60))
        proc.join(timeout=30)


def measure(
    fixture: Fixture, home: Path, *, duration_s: float, label: str
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with running_http_only_service(home, database_url=fixture.database_url) as (base_url, _):
        status_url = f"{base_url}/v1/runs/{fixture.runs[0][0]}"
        with polling(status_url, fixture.api_key, min(5.0, duration_s)) as idle:
            pass
        idle_latencies, _ = idle[0]
        rows.append(
            {
                "database": label,
                "points/post": "-",
                "posters": 0,
                "points/s stored": "-",
                "posts/s": "-",
                "post p50 ms": "-",
                "post p99 ms": "-",
                "polling p50 ms": median(idle_latencies),
                "polling p99 ms": percentile(idle_latencies, 99),
            }
        )
        first_step = 0
        for batch in BATCH_SIZES:
            # Each round posts new steps, so that every point is a new row.
            first_step += 10_000_000
            results: list[PosterResult] = []
            with polling(status_url, fixture.api_key, duration_s) as polled:
                started = time.monotonic()
                until = started + duration_s
                threads = [
                    threading.Thread(
                        target=_post_loop,
                        args=(base_url, run_id, token, batch, until, results),
                    )
                    for run_id, token in fixture.runs
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                elapsed = time.monotonic() - started
            latencies, poll_errors = polled[0]
            if poll_errors:
                raise RuntimeError(f"{poll_errors} status polls failed during ingest")
            posts = [ms for r in results for ms in r.latencies_ms]
            rows.append(
                {
                    "database": label,
                    "points/post": batch,
                    "posters": len(fixture.runs),
                    "points/s stored": sum(r.points for r in results) / elapsed,
                    "posts/s": len(posts) / elapsed,
                    "post p50 ms": median(posts),
                    "post p99 ms": percentile(posts, 99),
                    "polling p50 ms": median(latencies),
                    "polling p99 ms": percentile(latencies, 99),
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10, help="seconds per measurement")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES, help="a server to use")
    parser.add_argument("--no-postgres", action="store_true")
    parser.add_argument("--title", default="Metric ingest (benchmark 5)")
    args = parser.parse_args()

    rows: list[dict[str, object]] = []
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="tuneyard-bench-ingest-") as tmp:
        root = Path(tmp)
        assets = build_tiny_assets(root / "assets")
        sqlite_url = f"sqlite:///{root / 'sqlite-home' / 'tuneyard.db'}"
        (root / "sqlite-home").mkdir()
        fixture = prepare(sqlite_url, assets, runs=POSTERS)
        rows += measure(fixture, root / "sqlite-home", duration_s=args.duration, label="SQLite")
        if not args.no_postgres:
            try:
                with scratch_postgres(args.postgres_url) as pg_url:
                    fixture = prepare(pg_url, assets, runs=POSTERS)
                    rows += measure(
                        fixture, root / "pg-home", duration_s=args.duration, label="PostgreSQL"
                    )
            except Exception as exc:  # a missing server is reported, not fatal
                if "connect" not in str(exc).lower():
                    raise
                notes.append(f"PostgreSQL skipped: cannot connect ({type(exc).__name__}).")
    notes = [
        f"{POSTERS} posters (one per run, as {POSTERS} workers would), each posting its next "
        f"batch as soon as the last was answered, {args.duration:.0f} s per row; every point "
        f"is new ({len(NAMES)} names per step). points/s stored: the endpoint's `stored` "
        "counts over the wall-clock time.",
        f"Polling alongside: {POLLERS} clients in a separate process, each "
        f"`GET /v1/runs/{{id}}` every {1000 * POLL_INTERVAL_S:.0f} ms; the rows with 0 "
        "posters are the same polling with nothing posted.",
        "The load generator (Python threads, httpx) runs on the same 2 cores as the service.",
        *notes,
    ]
    record(args.title, rows, notes=notes)


if __name__ == "__main__":
    main()
