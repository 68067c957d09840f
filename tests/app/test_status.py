"""The run state machine: what may follow what."""

from __future__ import annotations

import itertools

import pytest

from app.errors import InvalidTransition
from app.models import Run
from app.services.run_status import set_status
from app.status import TERMINAL_STATUSES, RunStatus, can_transition


class _NoSession:
    """set_status only adds an event; a list stands in for the session's `add`."""

    def __init__(self) -> None:
        self.added: list[object] = []

    def add(self, obj: object) -> None:
        self.added.append(obj)


def _run(status: RunStatus) -> Run:
    return Run(
        id="run_x",
        status=status,
        attempt=1,
        spec={},
        run_metadata={},
        step=0,
        latest_metrics={},
        callback_token_hash="h",
    )


class TestTransitions:
    @pytest.mark.parametrize("terminal", sorted(TERMINAL_STATUSES))
    def test_terminal_states_only_go_back_to_queued_by_resume(self, terminal: RunStatus) -> None:
        allowed = {s for s in RunStatus if can_transition(terminal, s)}
        assert allowed <= {RunStatus.QUEUED}
        if terminal == RunStatus.SUCCEEDED:
            assert allowed == set()

    def test_the_happy_path_is_allowed(self) -> None:
        path = [RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.SUCCEEDED]
        assert all(can_transition(a, b) for a, b in itertools.pairwise(path))

    def test_set_status_refuses_an_illegal_change_and_records_nothing(self) -> None:
        session = _NoSession()
        run = _run(RunStatus.SUCCEEDED)
        with pytest.raises(InvalidTransition, match="succeeded; it cannot become running"):
            set_status(session, run, RunStatus.RUNNING)  # type: ignore[arg-type]
        assert run.status == RunStatus.SUCCEEDED
        assert session.added == []

    def test_set_status_stamps_times_clears_the_token_and_records_an_event(self) -> None:
        session = _NoSession()
        run = _run(RunStatus.STARTING)
        set_status(session, run, RunStatus.RUNNING)  # type: ignore[arg-type]
        assert run.started_at is not None
        set_status(session, run, RunStatus.FAILED, error_code="x", error_message="boom")  # type: ignore[arg-type]
        assert run.finished_at is not None
        assert run.callback_token_hash is None
        assert (run.error_code, run.error_message) == ("x", "boom")
        assert [e.status for e in session.added] == ["running", "failed"]  # type: ignore[attr-defined]

    def test_repeating_the_current_status_is_a_no_op(self) -> None:
        session = _NoSession()
        run = _run(RunStatus.FAILED)
        set_status(session, run, RunStatus.FAILED)  # type: ignore[arg-type]
        assert session.added == []
