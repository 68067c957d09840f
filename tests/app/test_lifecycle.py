"""app/services/lifecycle.py: the transition table, the named transitions, and what the
worker's and Ray's reports turn into."""

from __future__ import annotations

import ast
import itertools
import re
from datetime import UTC, datetime
from typing import Any

import pytest

from app.errors import Conflict, InvalidTransition
from app.services import lifecycle
from app.services.lifecycle import Failure, RayVerdict, can_transition
from app.services.rules.webhook_rules import WebhookConfig
from app.storage.models import Run
from contract.run_request import RunRequest
from contract.statuses import TERMINAL_STATUSES, RunStatus

# The webhook settings the lifecycle tells a run's end by: a service without service-wide
# subscribers (a run's own webhooks are its spec's).
HOOKS = WebhookConfig()

EARLIER = datetime(2026, 1, 1, tzinfo=UTC)


class _Events:
    """The named transitions only touch events; a list stands in for the session: `add`,
    `delete`, and `scalar`, which the transitions ask for the run's latest event."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    def add(self, obj: object) -> None:
        self.added.append(obj)

    def delete(self, obj: object) -> None:
        self.added.remove(obj)

    def scalar(self, _query: object) -> Any:
        return self.added[-1] if self.added else None

    @property
    def statuses(self) -> list[str | None]:
        return [e.status for e in self.added if e.type == "status"]


def _run(status: RunStatus, *, max_resubmits: int = 1, attempt: int = 1) -> Run:
    request = RunRequest.model_validate(
        {
            "model": "/models/m",
            "dataset": {"source": "/data/d.jsonl"},
            "fault_tolerance": {"max_resubmits": max_resubmits},
        }
    )
    return Run(
        id="run_x",
        status=status,
        attempt=attempt,
        resubmits=0,
        spec=request.worker_fields(),
        run_metadata={},
        step=0,
        latest_metrics={},
        callback_token_hash="h",
        ray_submission_id=f"run_x-{attempt}",
        queued_at=EARLIER,
    )


@pytest.fixture
def events() -> _Events:
    return _Events()


class TestTheTable:
    @pytest.mark.parametrize("terminal", sorted(TERMINAL_STATUSES))
    def test_terminal_states_only_go_back_to_queued_by_resume(self, terminal: RunStatus) -> None:
        allowed = {s for s in RunStatus if can_transition(terminal, s)}
        assert allowed <= {RunStatus.QUEUED}
        if terminal == RunStatus.SUCCEEDED:
            assert allowed == set()

    def test_the_happy_path_is_allowed(self) -> None:
        path = [RunStatus.QUEUED, RunStatus.STARTING, RunStatus.RUNNING, RunStatus.SUCCEEDED]
        assert all(can_transition(a, b) for a, b in itertools.pairwise(path))

    def test_an_illegal_change_is_refused_and_records_nothing(self, events: _Events) -> None:
        run = _run(RunStatus.SUCCEEDED)
        with pytest.raises(InvalidTransition, match="succeeded; it cannot become running"):
            lifecycle.start(events, run)  # type: ignore[arg-type]
        assert run.status == RunStatus.SUCCEEDED
        assert events.added == []


class TestNamedTransitions:
    def test_start_then_settle_stamps_times_clears_the_token_and_records_events(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.STARTING)
        lifecycle.start(events, run)  # type: ignore[arg-type]
        assert run.started_at is not None
        lifecycle.settle(events, run, RunStatus.FAILED, failure=Failure("x", "boom"), hooks=HOOKS)  # type: ignore[arg-type]
        assert run.finished_at is not None
        assert run.callback_token_hash is None
        assert (run.error_code, run.error_message) == ("x", "boom")
        assert events.statuses == ["running", "failed"]

    def test_settling_an_ended_run_changes_nothing(self, events: _Events) -> None:
        run = _run(RunStatus.CANCELLED)
        lifecycle.settle(events, run, RunStatus.FAILED, failure=Failure("x", "late"), hooks=HOOKS)  # type: ignore[arg-type]
        assert run.status == RunStatus.CANCELLED
        assert run.error_code is None
        assert events.added == []

    def test_a_worker_reporting_before_the_claim_committed_passes_through_starting(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.QUEUED)
        lifecycle.start(events, run)  # type: ignore[arg-type]
        assert events.statuses == ["starting", "running"]

    def test_unclaim_keeps_the_attempt_and_the_place_in_the_queue(self, events: _Events) -> None:
        run = _run(RunStatus.STARTING)
        lifecycle.unclaim(events, run, reason="Ray unavailable")  # type: ignore[arg-type]
        assert run.status == RunStatus.QUEUED
        assert (run.attempt, run.queued_at, run.resubmits) == (1, EARLIER, 0)

    def test_a_lost_attempt_is_queued_again_as_a_new_attempt_within_the_budget(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.RUNNING, max_resubmits=1)
        assert lifecycle.attempts_remain(run)
        lifecycle.requeue_or_fail(events, run, reason="lost", hooks=HOOKS)  # type: ignore[arg-type]
        assert run.status == RunStatus.QUEUED
        assert (run.attempt, run.resubmits) == (2, 1)
        assert run.queued_at > EARLIER  # to the back of the queue
        assert run.ray_submission_id is None and run.callback_token_hash is None
        assert "attempt 2 resumes from the latest checkpoint" in events.added[-1].message

        run.status = RunStatus.RUNNING
        assert not lifecycle.attempts_remain(run)
        lifecycle.requeue_or_fail(events, run, reason="lost again", hooks=HOOKS)  # type: ignore[arg-type]
        assert run.status == RunStatus.FAILED
        assert run.error_code == "lost"
        assert "fault_tolerance.max_resubmits" in (run.error_message or "")

    def test_a_lost_starting_attempt_counts_as_having_run(self, events: _Events) -> None:
        run = _run(RunStatus.STARTING)
        lifecycle.requeue_or_fail(events, run, reason="lost", hooks=HOOKS)  # type: ignore[arg-type]
        assert events.statuses == ["running", "queued"]
        assert run.attempt == 2

    def test_resume_starts_a_new_attempt_at_the_back_with_its_budget_anew(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.FAILED, attempt=3)
        run.resubmits = 1
        run.error_code, run.error_message = "lost", "gone"
        lifecycle.resume(events, run)  # type: ignore[arg-type]
        assert run.status == RunStatus.QUEUED
        assert (run.attempt, run.resubmits, run.error_code) == (4, 0, None)
        assert run.queued_at > EARLIER
        assert lifecycle.attempts_remain(run)

    @pytest.mark.parametrize("status", [RunStatus.SUCCEEDED, RunStatus.RUNNING, RunStatus.QUEUED])
    def test_only_failed_or_cancelled_runs_resume(self, events: _Events, status: RunStatus) -> None:
        with pytest.raises(Conflict, match="only a failed or cancelled run"):
            lifecycle.resume(events, _run(status))  # type: ignore[arg-type]

    def test_cancel_a_queued_run_at_once_and_a_live_one_through_cancelling(
        self, events: _Events
    ) -> None:
        queued = _run(RunStatus.QUEUED)
        assert lifecycle.request_cancel(events, queued, hooks=HOOKS) is None  # type: ignore[arg-type]
        assert queued.status == RunStatus.CANCELLED
        live = _run(RunStatus.RUNNING)
        assert lifecycle.request_cancel(events, live, hooks=HOOKS) == "run_x-1"  # type: ignore[arg-type]
        assert live.status == RunStatus.CANCELLING
        assert lifecycle.request_cancel(events, live, hooks=HOOKS) is None  # type: ignore[arg-type]
        with pytest.raises(Conflict):
            lifecycle.request_cancel(events, _run(RunStatus.SUCCEEDED), hooks=HOOKS)  # type: ignore[arg-type]


class TestWorkerReports:
    def test_a_late_running_does_not_undo_a_cancel(self, events: _Events) -> None:
        run = _run(RunStatus.CANCELLING)
        lifecycle.apply_worker_status(events, run, RunStatus.RUNNING, hooks=HOOKS)  # type: ignore[arg-type]
        assert run.status == RunStatus.CANCELLING

    def test_a_worker_failing_while_cancelling_waits_for_ray(self, events: _Events) -> None:
        run = _run(RunStatus.CANCELLING)
        lifecycle.apply_worker_status(  # type: ignore[arg-type]
            events, run, RunStatus.FAILED, failure=Failure("training_error", "killed"), hooks=HOOKS
        )
        assert run.status == RunStatus.CANCELLING
        assert events.added[-1].type == "message"

    def test_a_cluster_error_is_a_lost_attempt(self, events: _Events) -> None:
        run = _run(RunStatus.RUNNING)
        lifecycle.apply_worker_status(  # type: ignore[arg-type]
            events,
            run,
            RunStatus.FAILED,
            failure=Failure("cluster_error", "node died"),
            hooks=HOOKS,
        )
        assert (run.status, run.attempt) == (RunStatus.QUEUED, 2)

    def test_a_training_error_fails_the_run(self, events: _Events) -> None:
        run = _run(RunStatus.RUNNING)
        lifecycle.apply_worker_status(  # type: ignore[arg-type]
            events, run, RunStatus.FAILED, failure=Failure("training_error", "NaN"), hooks=HOOKS
        )
        assert (run.status, run.error_code) == (RunStatus.FAILED, "training_error")


class TestPreemption:
    """Preemption is a status of the table, as cancelling is: asked of a live run, left for
    the queue once the attempt stopped, and ended like any live run otherwise."""

    @pytest.mark.parametrize("live", [RunStatus.STARTING, RunStatus.RUNNING])
    def test_asked_of_a_live_run_once(self, events: _Events, live: RunStatus) -> None:
        run = _run(live)
        lifecycle.request_preemption(events, run, reason="a run of priority 90")  # type: ignore[arg-type]
        lifecycle.request_preemption(events, run, reason="asked again")  # type: ignore[arg-type]
        assert run.status == RunStatus.PREEMPTING
        assert run.preempt_reason == "a run of priority 90"
        assert events.statuses == ["preempting"]
        assert lifecycle.preempting(run)

    @pytest.mark.parametrize(
        "status",
        [RunStatus.QUEUED, RunStatus.CANCELLING, *sorted(TERMINAL_STATUSES)],
    )
    def test_nothing_else_is_preempted(self, events: _Events, status: RunStatus) -> None:
        run = _run(status)
        lifecycle.request_preemption(events, run, reason="r")  # type: ignore[arg-type]
        assert (run.status, run.preempt_requested_at, events.added) == (status, None, [])

    def test_the_stopped_attempt_is_queued_again_to_resume_with_no_budget_spent(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.RUNNING, max_resubmits=0)
        run.step = 7
        lifecycle.request_preemption(events, run, reason="needed")  # type: ignore[arg-type]
        lifecycle.apply_worker_status(  # type: ignore[arg-type]
            events, run, RunStatus.FAILED, failure=Failure("cluster_error", "stopped"), hooks=HOOKS
        )
        assert (run.status, run.attempt, run.resubmits) == (RunStatus.QUEUED, 2, 0)
        assert run.queue_reason == "preempted (resumes from step 7): needed"
        assert events.statuses == ["preempting", "queued"]

    def test_a_late_running_keeps_it_preempting_and_marks_it_started(self, events: _Events) -> None:
        run = _run(RunStatus.STARTING)
        lifecycle.request_preemption(events, run, reason="needed")  # type: ignore[arg-type]
        lifecycle.apply_worker_status(events, run, RunStatus.RUNNING, hooks=HOOKS)  # type: ignore[arg-type]
        assert run.status == RunStatus.PREEMPTING
        assert run.started_at is not None and run.attempt_started_at is not None

    def test_it_may_still_finish_fail_of_itself_or_be_cancelled(self, events: _Events) -> None:
        for status, then in (
            (RunStatus.SUCCEEDED, RunStatus.SUCCEEDED),
            (RunStatus.FAILED, RunStatus.FAILED),
        ):
            run = _run(RunStatus.RUNNING)
            lifecycle.request_preemption(events, run, reason="needed")  # type: ignore[arg-type]
            failure = Failure("training_error", "NaN") if status == RunStatus.FAILED else None
            lifecycle.apply_worker_status(events, run, status, failure=failure, hooks=HOOKS)  # type: ignore[arg-type]
            assert run.status == then
        run = _run(RunStatus.RUNNING)
        lifecycle.request_preemption(events, run, reason="needed")  # type: ignore[arg-type]
        assert lifecycle.request_cancel(events, run, hooks=HOOKS) == "run_x-1"  # type: ignore[arg-type]
        assert run.status == RunStatus.CANCELLING


def test_only_the_lifecycle_writes_a_runs_status() -> None:
    """`_move` is the one writer: no other code assigns a run's status or sets it in an
    UPDATE, over several lines or one, the lifecycle's own named transitions included (a
    new row is inserted as queued, which is no change)."""
    from pathlib import Path

    import app

    # An UPDATE of the runs table is `update(Run)` up to its `.values(...)`.
    writes = re.compile(
        r"\.status\s*=[^=]|update\(Run\)(?:[^;](?!update\())*?\.values\([^)]*\bstatus="
        r"|[\"']status[\"']\s*:\s*RunStatus",
        re.DOTALL,
    )

    def outside_move(path: Path) -> str:
        source = path.read_text()
        if path.name != "lifecycle.py":
            return source
        [move] = [
            node
            for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name == "_move"
        ]
        return source.replace(ast.get_source_segment(source, move) or "", "")

    offenders = [
        f"{path}: {found.group(0)!r}"
        for path in Path(app.__file__).parent.rglob("*.py")
        for found in writes.finditer(outside_move(path))
    ]
    assert offenders == []
    # The rule finds what it is for: the claim's old compare-and-set, written outside _move.
    assert writes.search(
        "update(Run)\n.where(Run.id == x)\n.values(\n    status=RunStatus.STARTING,\n)"
    )


class TestRayReports:
    @pytest.mark.parametrize(
        ("ray_status", "status", "expected", "verdict"),
        [
            ("SUCCEEDED", RunStatus.RUNNING, RunStatus.SUCCEEDED, RayVerdict.NOTHING),
            ("FAILED", RunStatus.RUNNING, RunStatus.FAILED, RayVerdict.NOTHING),
            ("FAILED", RunStatus.CANCELLING, RunStatus.CANCELLED, RayVerdict.NOTHING),
            ("STOPPED", RunStatus.RUNNING, RunStatus.FAILED, RayVerdict.NOTHING),
            ("STOPPED", RunStatus.CANCELLING, RunStatus.CANCELLED, RayVerdict.NOTHING),
            ("RUNNING", RunStatus.CANCELLING, RunStatus.CANCELLING, RayVerdict.STOP_JOB),
            ("RUNNING", RunStatus.RUNNING, RunStatus.RUNNING, RayVerdict.NOTHING),
            (None, RunStatus.CANCELLING, RunStatus.CANCELLED, RayVerdict.NOTHING),
            (None, RunStatus.RUNNING, RunStatus.QUEUED, RayVerdict.NOTHING),
        ],
    )
    def test_rays_view_settles_the_run(
        self,
        events: _Events,
        ray_status: str | None,
        status: RunStatus,
        expected: RunStatus,
        verdict: RayVerdict,
    ) -> None:
        run = _run(status)
        got = lifecycle.apply_ray_state(events, run, ray_status, job_failure="exit 1", hooks=HOOKS)  # type: ignore[arg-type]
        assert (run.status, got) == (expected, verdict)

    def test_a_starting_run_ray_never_heard_of_is_resubmitted_after_the_grace(
        self, events: _Events
    ) -> None:
        run = _run(RunStatus.STARTING)
        assert lifecycle.apply_ray_state(events, run, None, hooks=HOOKS) is RayVerdict.NOTHING  # type: ignore[arg-type]
        verdict = lifecycle.apply_ray_state(events, run, None, submit_grace_over=True, hooks=HOOKS)  # type: ignore[arg-type]
        assert verdict is RayVerdict.RESUBMIT
        assert run.status == RunStatus.STARTING
        assert run.queued_at == EARLIER


class TestEvents:
    def test_the_same_event_again_in_a_row_is_counted_on_one_row(self, events: _Events) -> None:
        run = _run(RunStatus.RUNNING)
        for _ in range(3):
            lifecycle.record_event(events, run, type="waiting", message="no GPU yet")  # type: ignore[arg-type]
        lifecycle.record_event(events, run, type="message", message="a GPU came")  # type: ignore[arg-type]
        lifecycle.record_event(events, run, type="waiting", message="no GPU yet")  # type: ignore[arg-type]
        assert [(e.message, e.repeats) for e in events.added] == [
            ("no GPU yet", 3),
            ("a GPU came", 1),
            ("no GPU yet", 1),  # not in a row: a new row
        ]

    def test_a_repeat_must_match_attempt_type_status_and_message(self, events: _Events) -> None:
        run = _run(RunStatus.RUNNING)
        lifecycle.record_event(events, run, type="message", message="m")  # type: ignore[arg-type]
        lifecycle.record_event(events, run, type="export", message="m")  # type: ignore[arg-type]
        lifecycle.record_event(events, run, type="export", message="m", status="running")  # type: ignore[arg-type]
        lifecycle.record_event(events, run, type="export", message="n", status="running")  # type: ignore[arg-type]
        run.attempt = 2
        lifecycle.record_event(events, run, type="export", message="n", status="running")  # type: ignore[arg-type]
        assert [e.repeats for e in events.added] == [1, 1, 1, 1, 1]

    def test_unclaim_takes_back_the_claims_event(self, events: _Events) -> None:
        run = _run(RunStatus.QUEUED)
        lifecycle.record_event(events, run, type="status", status="queued", message="run created")  # type: ignore[arg-type]
        for _ in range(4):
            # What `claim` records (its compare-and-set needs a real database).
            run.status = RunStatus.STARTING
            lifecycle.record_event(  # type: ignore[arg-type]
                events, run, type="status", status="starting", message="submitting Ray job"
            )
            lifecycle.unclaim(events, run, reason="Ray unavailable, will retry")  # type: ignore[arg-type]
        assert [(e.status, e.message, e.repeats) for e in events.added] == [
            ("queued", "run created", 1),
            ("queued", "Ray unavailable, will retry", 4),
        ]
        assert run.callback_token_hash == "h"  # a job Ray took anyway still reports

    def test_secrets_in_messages_and_errors_are_taken_out(self, events: _Events) -> None:
        run = _run(RunStatus.RUNNING)
        token = "rt_" + "A1b2" * 11
        lifecycle.settle(  # type: ignore[arg-type]
            events,
            run,
            RunStatus.FAILED,
            failure=Failure("job_failed", f"postgresql://u:pw-1234567@db/x said no to {token}"),
            hooks=HOOKS,
        )
        redacted = "postgresql://***@db/x said no to [redacted]"
        assert run.error_message == redacted
        assert events.added[-1].message == redacted
