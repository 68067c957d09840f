"""tests/conftest.py's `-n auto`: how many processes a session gets for the halves it runs
(`make test` runs the two halves one after the other)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import pytest_xdist_auto_num_workers
from tests.e2e.lanes import LANES

ROOT = Path(__file__).resolve().parents[1]


def _config(args: list[str], ignore: list[str] | None = None) -> Any:
    return SimpleNamespace(
        rootpath=ROOT, args=args, getoption=lambda name: ignore if name == "ignore" else None
    )


@pytest.mark.parametrize(
    ("args", "ignore", "expected"),
    [
        (["tests"], ["tests/e2e"], "cores"),  # make test's first half
        (["tests/e2e"], None, "lanes"),  # its second half
        (["tests/e2e/test_defaults.py::test_x"], None, "lanes"),
        (["tests"], None, "both"),  # a plain `pytest`
        (["tests/app", "tests/e2e/test_profile.py"], None, "both"),
        (["tests/app/test_lifecycle.py"], None, "cores"),
    ],
)
def test_auto_counts_a_process_per_lane_and_per_core_for_the_halves_selected(
    args: list[str], ignore: list[str] | None, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    want = {"cores": 4, "lanes": len(LANES), "both": len(LANES) + max(1, 4 - len(LANES))}
    assert pytest_xdist_auto_num_workers(_config(args, ignore)) == want[expected]


def test_the_environment_still_decides_when_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")
    assert pytest_xdist_auto_num_workers(_config(["tests/e2e"])) == 7
