"""Load: 200 concurrent clients for 20 s against `tuneyard serve`, mixing what a busy
service sees: status polls, lists, metric reads, validations, creates, and a worker posting
metrics with its run's token. Once with `--workers 1` and once with `--workers 2`, on SQLite
and on PostgreSQL.

Target: every request answered, none failed, none slower than 2 s.

The service runs with its dispatcher and reconciler, pointed at a Ray address where nothing
listens: created runs stay queued (the dispatcher retries them, as it does when Ray is
down), so no training job competes with the service for the machine's 2 cores. The live
run whose worker posts metrics is made live in the database directly, with a token of ours.

    python -m bench.load_mix [--clients 200] [--duration 20] [--workers 1 2]
        [--databases sqlite postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from app.ports import free_port
from bench.common import REPO_ROOT, percentile, record
from bench.service import (
    DEFAULT_POSTGRES,
    build_tiny_assets,
    create_api_key,
    scratch_postgres,
    service_env,
    stop_service,
    tiny_run_body,
)

TARGET_WORST_S = 2.0
# Shares of the mix, by kind of request.
MIX = {
    "GET /v1/runs/{id}": 35,
    "GET /v1/runs": 15,
    "GET /v1/runs/{id}/metrics": 15,
    "POST /v1/runs/validate": 10,
    "POST /v1/internal/runs/{id}/metrics": 15,
    "POST /v1/runs": 10,
}
POINTS_PER_POST = 10
CLIENT_TIMEOUT_S = 120


@dataclass
class Tally:
    latencies_s: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, list[float]] = field(default_factory=dict)

    def fail(self, what: str) -> None:
        self.failures[what] = self.failures.get(what, 0) + 1


@contextlib.contextmanager
def serve(home: Path, *, workers: int, database_url: str | None) -> Iterator[tuple[str, str]]:
    """`python -m app serve` with N HTTP processes: (base URL, API key)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = service_env(
        home,
        port=port,
        allowed_roots=[home.parent],
        database_url=database_url,
        env={
            "TUNEYARD_WORKERS": str(workers),
            # Nothing listens there: see the module's docstring.
            "TUNEYARD_RAY_ADDRESS": f"http://127.0.0.1:{free_port()}",
            "TUNEYARD_LOG_LEVEL": "WARNING",
        },
    )
    key = create_api_key(env)
    base_url = f"http://127.0.0.1:{port}"
    log_path = home / "service.log"
    with log_path.open("ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app", "serve"],
            env=env,
            cwd=REPO_ROOT,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the service did not start:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(f"{base_url}/healthz", timeout=5).json()["database"] == "ok":
                    break
            time.sleep(0.3)
        yield base_url, key
    finally:
        stop_service(proc)


def make_live_run(base_url: str, key: str, database_url: str, body: dict[str, Any]) -> str:
    """A run in `running` whose worker token is ours: (run id); the token is the run id
    reversed, good enough for a benchmark."""
    from sqlalchemy import update

    from app.security import hash_secret
    from app.storage.db import make_engine, make_session_factory, transaction
    from app.storage.models import Run

    auth = {"Authorization": f"Bearer {key}"}
    run_id: str = httpx.post(f"{base_url}/v1/runs", json=body, headers=auth, timeout=30).json()[
        "id"
    ]
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(
                    status="running",
                    ray_submission_id=f"{run_id}-1",
                    callback_token_hash=hash_secret(run_id[::-1]),
                )
            )
    finally:
        engine.dispose()
    return run_id


async def drive(
    base_url: str, key: str, run_id: str, body: dict[str, Any], *, clients: int, duration_s: float
) -> tuple[Tally, float]:
    auth = {"Authorization": f"Bearer {key}"}
    worker = {"Authorization": f"Bearer {run_id[::-1]}"}
    kinds, weights = list(MIX), list(MIX.values())
    tally = Tally()
    steps = iter(range(10**9))

    def metrics_body() -> dict[str, Any]:
        now = datetime.now(UTC).isoformat()
        first = next(steps) * POINTS_PER_POST
        points = [
            {"step": first + i, "name": "loss", "value": 1.0 / (first + i + 1), "time": now}
            for i in range(POINTS_PER_POST)
        ]
        return {"attempt": 1, "points": points}

    async def send(http: aiohttp.ClientSession, kind: str) -> int:
        match kind:
            case "GET /v1/runs/{id}":
                request = http.get(f"/v1/runs/{run_id}", headers=auth)
            case "GET /v1/runs":
                request = http.get("/v1/runs", headers=auth)
            case "GET /v1/runs/{id}/metrics":
                request = http.get(f"/v1/runs/{run_id}/metrics?limit=100", headers=auth)
            case "POST /v1/runs/validate":
                request = http.post("/v1/runs/validate", json=body, headers=auth)
            case "POST /v1/internal/runs/{id}/metrics":
                url = f"/v1/internal/runs/{run_id}/metrics"
                request = http.post(url, json=metrics_body(), headers=worker)
            case _:
                request = http.post("/v1/runs", json=body, headers=auth)
        async with request as response:
            await response.read()  # the whole answer, as a client would wait for it
            return response.status

    async def client(http: aiohttp.ClientSession, seed: int, end: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            kind = rng.choices(kinds, weights)[0]
            start = time.monotonic()
            try:
                ok = 200 <= await send(http, kind) < 300
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            tally.latencies_s.append(time.monotonic() - start)
            tally.by_kind.setdefault(kind, []).append(tally.latencies_s[-1])
            if not ok:
                tally.fail(kind)

    # aiohttp, not httpx: with 200 connections httpx's async pool cost the client about 7 ms
    # of CPU per request, a whole core at 150 requests/s, on the cores the service shares:
    # the benchmark measured its client. aiohttp's costs a fraction of that (BENCHMARKS.md).
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    timeout = aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as http:
        began = time.monotonic()
        end = began + duration_s
        await asyncio.gather(*(client(http, seed, end) for seed in range(clients)))
        elapsed = time.monotonic() - began
    return tally, elapsed


def measure(
    root: Path, *, workers: int, database: str, clients: int, duration_s: float, pg_url: str
) -> dict[str, object]:
    assets = build_tiny_assets(root / "assets")
    body = tiny_run_body(assets)
    with contextlib.ExitStack() as stack:
        database_url = (
            stack.enter_context(scratch_postgres(pg_url)) if database == "postgresql" else None
        )
        home = root / f"home-{database}-{workers}"
        base_url, key = stack.enter_context(serve(home, workers=workers, database_url=database_url))
        resolved = database_url or f"sqlite:///{home / 'tuneyard.db'}"
        run_id = make_live_run(base_url, key, resolved, body)
        tally, elapsed = asyncio.run(
            drive(base_url, key, run_id, body, clients=clients, duration_s=duration_s)
        )
    latencies = tally.latencies_s
    failed = sum(tally.failures.values())
    return {
        "serve": f"--workers {workers}",
        "database": "PostgreSQL" if database == "postgresql" else "SQLite",
        "requests answered": len(latencies) - failed,
        "failures": failed,
        "requests/s": len(latencies) / elapsed,
        "p50 ms": 1000 * percentile(latencies, 50),
        "p99 ms": 1000 * percentile(latencies, 99),
        "worst ms": 1000 * max(latencies, default=float("nan")),
        f"over {TARGET_WORST_S:.0f} s": sum(1 for s in latencies if s > TARGET_WORST_S),
        "p99 ms by kind": ", ".join(
            f"{k} {1000 * percentile(v, 99):.0f}" for k, v in sorted(tally.by_kind.items())
        ),
        "failed by kind": ", ".join(f"{k}: {n}" for k, n in tally.failures.items()) or "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20, help="seconds of load")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--databases", nargs="+", choices=["sqlite", "postgresql"], default=["sqlite", "postgresql"]
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument("--title", default="Load: 200 clients, mixed requests")
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="tuneyard-bench-") as tmp:
        for database in args.databases:
            for workers in args.workers:
                row = measure(
                    Path(tmp),
                    workers=workers,
                    database=database,
                    clients=args.clients,
                    duration_s=args.duration,
                    pg_url=args.postgres_url,
                )
                print(row, flush=True)
                rows.append(row)
    met = all(r["failures"] == 0 and r[f"over {TARGET_WORST_S:.0f} s"] == 0 for r in rows)
    shares = ", ".join(f"{k} {v}%" for k, v in MIX.items())
    notes = [
        f"{args.clients} clients (one asyncio process, aiohttp, keep-alive), each sending its next "
        f"request as soon as the last is answered, for {args.duration:.0f} s; the mix: "
        f"{shares}. A worker post carries {POINTS_PER_POST} metric points.",
        "The service: `tuneyard serve` with its dispatcher and reconciler, Ray address "
        "unreachable so that created runs stay queued; the client runs on the same 2 cores.",
        "Latency: from sending a request to its whole answer, as the client saw it; "
        f"failures: non-2xx answers and transport errors ({CLIENT_TIMEOUT_S} s client timeout).",
        f"Target: no failure and no request over {TARGET_WORST_S:.0f} s: "
        f"{'met' if met else 'MISSED'}.",
    ]
    record(args.title, rows, notes=notes)


if __name__ == "__main__":
    main()
