"""What every benchmark shares: the machine's details and one way to record a result."""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _os_name() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return f"{platform.system()} {platform.release()}"


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def _git_commit() -> str:
    try:
        commit = _git("rev-parse", "--short", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{commit}{' (with uncommitted changes)' if dirty else ''}"


def machine_details() -> str:
    """One line per fact, as markdown list items: enough to tell two machines apart."""
    facts = {
        "CPU": f"{_cpu_model()}, {os.cpu_count()} cores",
        "RAM": _ram_gib(),
        "OS": f"{_os_name()} (kernel {platform.release()})",
        "Python": platform.python_version(),
        "torch / ray / deepspeed": " / ".join(_version(d) for d in ("torch", "ray", "deepspeed")),
        "git commit": _git_commit(),
        # Other work on a shared machine moves every number: this says how busy it was.
        "load average (1, 5, 15 min) when recorded": " / ".join(
            f"{x:.1f}" for x in os.getloadavg()
        ),
    }
    return "\n".join(f"- {name}: {value}" for name, value in facts.items())


def _text(value: object) -> str:
    """Floats to three significant digits (whole numbers from 100 up), the rest as `str`."""
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def _cell(value: object) -> str:
    return _text(value).replace("|", "\\|").replace("\n", " ")


def record(title: str, rows: list[dict[str, object]], *, notes: list[str] | None = None) -> None:
    """Print the rows as a table and append them, with the machine's details, to
    BENCHMARKS.md as a section `## <title>` (not with TUNEYARD_BENCH_DRY_RUN set)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    columns = list(rows[0]) if rows else []
    table = Table(title=Text(title))
    for column in columns:
        table.add_column(Text(column))
    for row in rows:
        table.add_row(*(Text(_text(row.get(c, ""))) for c in columns))
    console = Console()
    console.print(table)
    for note in notes or []:
        console.print(Text(f"  {note}"))

    if os.environ.get("TUNEYARD_BENCH_DRY_RUN"):
        console.print(Text("TUNEYARD_BENCH_DRY_RUN is set: not appended to BENCHMARKS.md"))
        return
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {title}", "", f"Measured {when} on:", "", machine_details(), ""]
    if columns:
        lines.append("| " + " | ".join(_cell(c) for c in columns) + " |")
        lines.append("|" + "|".join(" --- " for _ in columns) + "|")
        lines.extend(
            "| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows
        )
        lines.append("")
    if notes:
        lines.extend(f"- {note}" for note in notes)
        lines.append("")
    with BENCHMARKS_MD.open("a") as f:
        if BENCHMARKS_MD.stat().st_size == 0:
            f.write("# Benchmarks\n\n")
        f.write("\n".join(lines) + "\n")


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 to 100) by nearest rank: a value that was actually observed."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return float(ordered[rank - 1])
