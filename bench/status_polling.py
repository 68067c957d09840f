"""Benchmark 1, status polling: `GET /v1/runs/{id}` against Ray's own dashboard endpoint
`GET /api/jobs/{submission_id}` for the same job, with the same load generator (wrk, 32
connections). Rounds alternate sides; the table gives the median of the rounds.

Target: at least 2x Ray's requests/s, and a p99 of 50 ms or less.

    python -m bench.status_polling [--rounds 3] [--duration 10] [--database-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import median, record
from bench.loadgen import WrkResult, ensure_wrk, run_wrk
from bench.service import (
    DEFAULT_POSTGRES,
    BenchService,
    build_tiny_assets,
    cpu_seconds,
    running_service,
    scratch_postgres,
    tiny_run_body,
)

CONNECTIONS = 32
TARGET_RATIO = 2.0
TARGET_P99_MS = 50.0


@dataclass(frozen=True, slots=True)
class Round:
    wrk: WrkResult
    # CPU time the server's processes used per request: steadier than wall-clock figures on a
    # shared machine, and it says what each side's throughput would be on an idle core.
    cpu_ms_per_request: float


def service_processes(parent: Any) -> list[Any]:
    """`serve` and its HTTP worker processes, not the Ray head it also started."""
    workers = [
        child
        for child in parent.children()
        if any("spawn_main" in part for part in child.cmdline())
    ]
    return [parent, *workers]


def measure(
    service: BenchService, run_id: str, submission_id: str, *, rounds: int, duration_s: float
) -> dict[str, list[Round]]:
    import psutil

    targets = {
        "tuneyard GET /v1/runs/{id}": (
            f"{service.base_url}/v1/runs/{run_id}",
            {"Authorization": f"Bearer {service.api_key}"},
            service_processes(psutil.Process(service.proc.pid)),
        ),
        "Ray GET /api/jobs/{submission_id}": (
            f"{service.ray_dashboard_url}/api/jobs/{submission_id}",
            service.ray_headers,
            service.ray_processes(),
        ),
    }
    results: dict[str, list[Round]] = {name: [] for name in targets}
    for url, headers, _ in targets.values():  # warm both up: connections, caches, imports
        run_wrk(url, headers=headers, connections=CONNECTIONS, duration_s=2)
    for _ in range(rounds):
        for name, (url, headers, processes) in targets.items():
            cpu_before = cpu_seconds(processes)
            result = run_wrk(url, headers=headers, connections=CONNECTIONS, duration_s=duration_s)
            cpu_used = cpu_seconds(processes) - cpu_before
            if not result.ok:
                raise RuntimeError(f"{name}: {result.errors} errors of {result.requests}")
            results[name].append(Round(result, 1000 * cpu_used / result.requests))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=10, help="seconds per wrk run")
    parser.add_argument(
        "--postgres",
        action="store_true",
        help="on a scratch database of the PostgreSQL server at --postgres-url (default: SQLite)",
    )
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES)
    parser.add_argument("--title", default="Status polling (benchmark 1)")
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="TUNEYARD_WORKERS of the service: HTTP processes, one per core here",
    )
    args = parser.parse_args()
    ensure_wrk()

    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tuneyard-bench-")))
        database_url = (
            stack.enter_context(scratch_postgres(args.postgres_url)) if args.postgres else None
        )
        assets = build_tiny_assets(root / "assets")
        service = stack.enter_context(
            running_service(
                root / "home",
                allowed_roots=[assets.root],
                database_url=database_url,
                env={"TUNEYARD_WORKERS": str(args.workers)},
            )
        )
        # A real job, finished, so neither side's answer changes while it is measured.
        run = service.submit(tiny_run_body(assets, max_steps=2))
        run = service.wait_terminal(run["id"], timeout_s=900)
        submission_id = run["ray_submission_id"]
        service.ray_job(submission_id)  # Ray knows the job: a 200, not a 404
        results = measure(
            service, run["id"], submission_id, rounds=args.rounds, duration_s=args.duration
        )
    database = "PostgreSQL" if args.postgres else "SQLite"
    report(
        args.title,
        results,
        rounds=args.rounds,
        duration_s=args.duration,
        database=database,
        workers=args.workers,
    )


def report(
    title: str,
    results: dict[str, list[Round]],
    *,
    rounds: int,
    duration_s: float,
    database: str = "SQLite",
    workers: int = 1,
) -> None:
    (ours_name, ours), (ray_name, ray) = results.items()
    rows: list[dict[str, object]] = []
    for name, runs in results.items():
        rows.append(
            {
                "endpoint": name,
                "requests/s": median([r.wrk.requests_per_s for r in runs]),
                "p50 ms": median([r.wrk.p50_ms for r in runs]),
                "p99 ms": median([r.wrk.p99_ms for r in runs]),
                "server CPU ms/request": median([r.cpu_ms_per_request for r in runs]),
                "requests/s per round": ", ".join(f"{r.wrk.requests_per_s:.0f}" for r in runs),
            }
        )
    # Ratios of rounds measured side by side, then their median.
    ratio = median(
        [a.wrk.requests_per_s / b.wrk.requests_per_s for a, b in zip(ours, ray, strict=True)]
    )
    cpu_ratio = median(
        [b.cpu_ms_per_request / a.cpu_ms_per_request for a, b in zip(ours, ray, strict=True)]
    )
    p99 = median([r.wrk.p99_ms for r in ours])
    met = ratio >= TARGET_RATIO and p99 <= TARGET_P99_MS
    notes = [
        f"wrk, {CONNECTIONS} connections, 2 threads, {rounds} rounds of {duration_s:.0f} s per "
        "side, alternating; medians of the rounds. wrk runs on the same 2 cores as the "
        f"service and Ray. The service: `tuneyard serve` with {workers} HTTP worker "
        f"process(es) (TUNEYARD_WORKERS), database {database}.",
        "server CPU ms/request: user + system CPU time of the server's processes during the "
        "round over the requests served (tuneyard: the service's processes; Ray: every process "
        "of its head, whose idle work is included).",
        f"{ours_name} / {ray_name}: {ratio:.2f}x the requests/s (median of per-round "
        f"ratios); Ray uses {cpu_ratio:.2f}x the CPU per request.",
        f"Target: >= {TARGET_RATIO:.0f}x Ray's requests/s and p99 <= {TARGET_P99_MS:.0f} ms: "
        f"{'met' if met else 'MISSED'} ({ratio:.2f}x, p99 {p99:.1f} ms).",
    ]
    record(title, rows, notes=notes)


if __name__ == "__main__":
    main()
