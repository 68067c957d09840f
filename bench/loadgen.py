"""wrk, the HTTP load generator both sides of a comparison are measured with."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

_UNITS_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


class LoadGeneratorMissing(RuntimeError):
    pass


def ensure_wrk() -> str:
    """The path of `wrk`; installed from the system packages when we may, else a clear error."""
    found = shutil.which("wrk")
    if found:
        return found
    apt = shutil.which("apt-get")
    command: list[str] | None = None
    if apt and os.geteuid() == 0:
        command = [apt, "install", "-y", "wrk"]
    elif apt and shutil.which("sudo"):
        command = ["sudo", "-n", apt, "install", "-y", "wrk"]
    if command is not None:
        print(f"wrk not found; installing it: {' '.join(command)}", flush=True)
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
        )
        found = shutil.which("wrk")
        if result.returncode == 0 and found:
            return found
    raise LoadGeneratorMissing(
        "this benchmark needs the HTTP load generator wrk: install it with "
        "`apt-get install wrk` (Debian/Ubuntu) or `brew install wrk`, then run it again"
    )


@dataclass(frozen=True, slots=True)
class WrkResult:
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # socket errors and non-2xx/3xx answers

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.requests > 0


def run_wrk(
    url: str,
    *,
    headers: dict[str, str] | None = None,
    connections: int = 32,
    threads: int = 2,
    duration_s: float = 10,
    timeout_s: float = 10,
) -> WrkResult:
    command = [
        ensure_wrk(),
        f"-t{threads}",
        f"-c{connections}",
        f"-d{max(1, round(duration_s))}s",
        f"--timeout={max(1, round(timeout_s))}s",
        "--latency",
    ]
    for name, value in (headers or {}).items():
        command += ["-H", f"{name}: {value}"]
    output = subprocess.run([*command, url], capture_output=True, text=True, check=True).stdout
    return parse_wrk(output)


def parse_wrk(output: str) -> WrkResult:
    def latency(pct: str) -> float:
        match = re.search(rf"^\s*{pct}%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M)
        if match is None:
            raise ValueError(f"no {pct}% latency in wrk's output:\n{output}")
        return float(match.group(1)) * _UNITS_MS[match.group(2)]

    rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M)
    total = re.search(r"^\s*(\d+) requests in", output, re.M)
    if rate is None or total is None:
        raise ValueError(f"unexpected wrk output:\n{output}")
    errors = 0
    socket = re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    )
    if socket is not None:
        errors += sum(int(g) for g in socket.groups())
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    if non_2xx is not None:
        errors += int(non_2xx.group(1))
    return WrkResult(
        requests_per_s=float(rate.group(1)),
        p50_ms=latency("50"),
        p99_ms=latency("99"),
        requests=int(total.group(1)),
        errors=errors,
    )
