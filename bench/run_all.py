"""`make bench`: every benchmark in bench/, one after another, each in a process of its own.

A benchmark is a module here that records a table (`record(` from bench.common) and runs as
`python -m bench.<name>`; helpers (service, loadgen, training, tutorial_baseline...) are
not. They run in the order of issue 7, then any others by name. One that fails does not
stop the rest; the exit status says whether all succeeded.

    python -m bench.run_all [--only status_polling,metric_ingest]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.common import BENCHMARKS_MD
from bench.loadgen import LoadGeneratorMissing, ensure_wrk

BENCH_DIR = Path(__file__).resolve().parent
ORDER = [
    "status_polling",
    "dispatch_latency",
    "training_overhead",
    "step_overhead",
    "packing_throughput",
    "metric_ingest",
    "memory_estimate",
    "zero3_load_memory",
]
_IS_BENCHMARK = re.compile(r"^\s*record\(|[^.\w]record\(", re.M)


def benchmarks() -> list[str]:
    found = []
    for path in BENCH_DIR.glob("*.py"):
        if path.stem in {"__init__", "common", "run_all"}:
            continue
        text = path.read_text()
        if '__name__ == "__main__"' in text and _IS_BENCHMARK.search(text):
            found.append(path.stem)
    return sorted(found, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated names; default: all")
    args = parser.parse_args()
    names = benchmarks()
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            print(f"no such benchmark: {', '.join(unknown)} (have: {', '.join(names)})")
            return 2
        names = [n for n in names if n in wanted]
    try:
        ensure_wrk()
    except LoadGeneratorMissing as exc:
        print(f"note: {exc}; status_polling will fail without it", flush=True)

    results: dict[str, tuple[int, float]] = {}
    for name in names:
        print(f"\n=== bench.{name} ===", flush=True)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", f"bench.{name}"], cwd=BENCH_DIR.parent)
        results[name] = (done.returncode, time.monotonic() - started)

    print("\n=== summary ===")
    for name, (code, seconds) in results.items():
        print(f"  {name:<22} {'ok' if code == 0 else f'FAILED ({code})':<12} {seconds:6.0f}s")
    print(f"tables appended to {BENCHMARKS_MD}")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
