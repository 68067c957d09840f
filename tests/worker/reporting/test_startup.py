"""An attempt's start, phase by phase: laps without gaps, on wall clocks across processes."""

from __future__ import annotations

import time

import pytest

from contract.callbacks import StartupPhase
from contract.job_env import SUBMITTED_AT_ENV
from worker.reporting.startup import StartupClock, process_started_at, submitted_at


def test_each_lap_posts_the_time_since_the_last() -> None:
    posted: list[tuple[StartupPhase, float]] = []
    clock = StartupClock(lambda phase, seconds: posted.append((phase, seconds)), since=100.0)
    clock.lap(StartupPhase.JOB, at=101.5)
    clock.lap(StartupPhase.DRIVER, at=104.0)
    before = time.time()
    clock.lap(StartupPhase.WORKERS)  # now
    assert posted[:2] == [(StartupPhase.JOB, 1.5), (StartupPhase.DRIVER, 2.5)]
    assert posted[2][0] == StartupPhase.WORKERS
    assert posted[2][1] >= before - 104.0


def test_a_lap_before_the_last_is_zero_and_the_next_starts_where_the_last_ended() -> None:
    """The job phase starts on the service's clock and ends on the head's; a rank's process
    may have started (an idle worker Ray reuses) before the driver called fit()."""
    posted: list[tuple[StartupPhase, float]] = []
    clock = StartupClock(lambda phase, seconds: posted.append((phase, seconds)), since=100.0)
    clock.lap(StartupPhase.WORKERS, at=99.0)
    clock.lap(StartupPhase.PROCESS_GROUP, at=102.0)
    # No overlap: the phases add up to the wall time from 100 to 102.
    assert posted == [(StartupPhase.WORKERS, 0.0), (StartupPhase.PROCESS_GROUP, 2.0)]


def test_ranks_that_post_nothing_still_lap() -> None:
    clock = StartupClock(None, since=0.0)
    clock.lap(StartupPhase.DATA, at=1.0)


def test_the_submit_time_comes_from_the_jobs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SUBMITTED_AT_ENV, "1764412800.125")
    assert submitted_at() == 1764412800.125
    for unusable in ("", "soon"):
        monkeypatch.setenv(SUBMITTED_AT_ENV, unusable)
        assert submitted_at() is None
    monkeypatch.delenv(SUBMITTED_AT_ENV)
    assert submitted_at() is None


def test_this_process_started_before_now() -> None:
    started = process_started_at()
    assert started <= time.time()
    # The kernel's record of this test process (pytest has run a while, not a day).
    assert time.time() - started < 86_400
