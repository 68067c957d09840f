"""The dispatcher and reconciler on a real database, with a stand-in for Ray's answers.

A real Ray cluster cannot be made to refuse a job or to vanish on cue; the stand-in
answers the way Ray's JobSubmissionClient does in those cases (see app/cluster/ray_jobs.py).
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from app.cluster.ray_jobs import JobRecord, JobState, RayRejected, RayUnavailable, redact
from app.cluster.runtime_env import JOB_PACKAGES
from app.security import hash_secret
from app.services.dispatch import (
    MAX_SCHEDULE_REST_S,
    SCHEDULE_REST_FACTOR,
    Dispatcher,
    build_runtime_env,
)
from app.services.lifecycle import RAY_AWAY
from app.settings import Settings
from app.storage.models import Event, Run, utcnow
from contract.run_request import RunRequest
from tests.app.worker_calls import bearer, job_token, post_status, worker_headers
from tests.factories import run_request


class ScriptedRay:
    address = "http://ray.invalid"

    def __init__(self) -> None:
        self.submitted: list[dict[str, Any]] = []
        self.fail_with: Exception | None = None
        self.states: dict[str, JobState | None] = {}
        self.logs_text = ""
        self.stopped: list[str] = []
        self._lock = threading.Lock()

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str] | None = None,
    ) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        with self._lock:
            self.submitted.append(
                {
                    "submission_id": submission_id,
                    "entrypoint": entrypoint,
                    "runtime_env": runtime_env,
                    "metadata": metadata or {},
                    "submitted_at": time.time(),
                }
            )

    def state(self, submission_id: str) -> JobState | None:
        return self.states.get(submission_id, JobState(status="RUNNING", message=""))

    def list_jobs(self) -> list[JobRecord]:
        """The submitted jobs Ray still knows (a state of None: forgotten)."""
        with self._lock:
            jobs = list(self.submitted)
        return [
            JobRecord(job["submission_id"], state.status, job["submitted_at"], job["metadata"])
            for job in jobs
            if (state := self.state(job["submission_id"])) is not None
        ]

    def logs(self, submission_id: str) -> str:
        return self.logs_text

    def stop(self, submission_id: str) -> None:
        self.stopped.append(submission_id)

    # Each node's free resources, as the dashboard reports them; None: not readable (the
    # scheduler then judges slots and quotas only).
    free: list[dict[str, float]] | None = None

    def free_resources(self) -> list[dict[str, float]]:
        if self.free is None:
            raise RayUnavailable("the scripted Ray reports no resources")
        return [dict(node) for node in self.free]


def dispatch_to(
    ray: ScriptedRay, settings: Settings, session_factory: sessionmaker[Session]
) -> ScriptedRay:
    """Run one dispatch pass against the scripted Ray; the Ray, for its `submitted` list."""
    jobs: Any = ray
    Dispatcher(settings=settings, session_factory=session_factory, jobs=jobs).dispatch_queued_runs()
    return ray


@pytest.fixture
def ray() -> ScriptedRay:
    return ScriptedRay()


@pytest.fixture
def dispatcher(
    settings: Settings, session_factory: sessionmaker[Session], ray: ScriptedRay
) -> Dispatcher:
    return Dispatcher(settings=settings, session_factory=session_factory, jobs=ray)  # type: ignore[arg-type]


def _create(client: TestClient, auth: dict[str, str], root: Path) -> str:
    return str(client.post("/v1/runs", json=run_request(root), headers=auth).json()["id"])


def _run(session_factory: sessionmaker[Session], run_id: str) -> Run:
    with session_factory() as session:
        run = session.get(Run, run_id)
        assert run is not None
        return run


def _events(session_factory: sessionmaker[Session], run_id: str) -> list[Event]:
    with session_factory() as session:
        return list(session.scalars(select(Event).where(Event.run_id == run_id).order_by(Event.id)))


def test_after_a_scheduling_pass_the_dispatcher_rests_in_proportion_to_it(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    dispatcher: Dispatcher,
) -> None:
    """Every create wakes the dispatcher, and on SQLite a pass holds the whole service's
    write lock while it ranks the queue: it rests SCHEDULE_REST_FACTOR times as long as the
    pass before the next one, at most MAX_SCHEDULE_REST_S. PostgreSQL has no such lock."""
    assert dispatcher.rest_s() == 0
    for _ in range(3):
        _create(client, auth, tmp_path)
    began = time.monotonic()
    dispatcher.dispatch_queued_runs()
    took = time.monotonic() - began
    if settings.resolved_database_url.startswith("sqlite"):
        assert 0 < dispatcher.rest_s() <= min(SCHEDULE_REST_FACTOR * took, MAX_SCHEDULE_REST_S)
    else:
        assert dispatcher.rest_s() == 0


class CountingRay(ScriptedRay):
    """Counts the dashboard reads of the nodes' usage a pass makes."""

    def __init__(self) -> None:
        super().__init__()
        self.free = [{"CPU": 2.0}]
        self.usage_reads = 0

    def free_resources(self) -> list[dict[str, float]]:
        self.usage_reads += 1
        return super().free_resources()


def test_an_idle_queue_asks_ray_nothing(
    client: TestClient,
    auth: dict[str, str],
    tmp_path: Path,
    settings: Settings,
    session_factory: sessionmaker[Session],
) -> None:
    """A pass with nothing queued (every tick of an idle service) neither reads Ray's usage
    nor submits; one with a run queued reads it once and submits the run."""
    ray = CountingRay()
    jobs: Any = ray
    dispatcher = Dispatcher(settings=settings, session_factory=session_factory, jobs=jobs)
    for _ in range(3):
        assert dispatcher.dispatch_queued_runs() == 0
    assert ray.usage_reads == 0 and not ray.submitted
    _create(client, auth, tmp_path)
    assert dispatcher.dispatch_queued_runs() == 1
    assert ray.usage_reads == 1 and len(ray.submitted) == 1
    assert dispatcher.dispatch_queued_runs() == 0  # the run left the queue
    assert ray.usage_reads == 1


class TestDispatch:
    def test_submits_a_queued_run_with_everything_the_worker_needs(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        assert dispatcher.dispatch_queued_runs() == 1

        (job,) = ray.submitted
        assert job["submission_id"] == f"{run_id}-1"
        assert job["entrypoint"] == "python -m worker"
        env = job["runtime_env"]
        assert [Path(p).name for p in env["py_modules"]] == ["worker", "contract"]
        assert env["py_modules"] == JOB_PACKAGES
        spec = json.loads(env["env_vars"]["TUNEYARD_RUN_SPEC"])
        assert spec["run_id"] == run_id
        assert spec["attempt"] == 1
        assert spec["storage_path"] == settings.storage.root
        assert spec["model"] == str((tmp_path / "model").resolve())
        assert "metadata" not in spec
        assert env["env_vars"]["TUNEYARD_CALLBACK_URL"] == settings.resolved_callback_url
        assert env["env_vars"]["DS_ACCELERATOR"] == "cpu"

        run = _run(session_factory, run_id)
        assert run.status == "starting"
        assert run.ray_submission_id == f"{run_id}-1"
        # Only the token's hash is stored.
        assert run.callback_token_hash == hash_secret(env["env_vars"]["TUNEYARD_RUN_TOKEN"])

    def test_the_worker_spec_parses_as_the_worker_reads_it(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        from contract.run_request import RunSpec

        _create(client, auth, tmp_path)
        dispatcher.dispatch_queued_runs()
        spec = RunSpec.model_validate(
            json.loads(ray.submitted[0]["runtime_env"]["env_vars"]["TUNEYARD_RUN_SPEC"])
        )
        assert spec.training.max_steps == 5
        assert spec.deepspeed.zero_stage == 2

    def test_ray_unreachable_leaves_the_run_queued_and_retries_with_backoff(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr("app.services.dispatch.time.monotonic", lambda: now[0])
        run_id = _create(client, auth, tmp_path)
        ray.fail_with = RayUnavailable("cannot reach Ray at http://ray.invalid")
        dispatcher.dispatch_queued_runs()

        assert _run(session_factory, run_id).status == "queued"
        assert any("Ray unavailable" in e.message for e in _events(session_factory, run_id))

        ray.fail_with = None
        dispatcher.dispatch_queued_runs()  # still backing off: not even tried
        assert _run(session_factory, run_id).status == "queued"
        now[0] += 1.5
        dispatcher.dispatch_queued_runs()
        assert _run(session_factory, run_id).status == "starting"
        assert [j["submission_id"] for j in ray.submitted] == [f"{run_id}-1"]

    def test_the_backoff_doubles_while_ray_stays_away(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr("app.services.dispatch.time.monotonic", lambda: now[0])
        calls = []

        def down(**kwargs: Any) -> None:
            calls.append(now[0])
            raise RayUnavailable("down")

        monkeypatch.setattr(ray, "submit", down)
        _create(client, auth, tmp_path)
        for _ in range(200):  # 100 s of ticks every half second
            dispatcher.dispatch_queued_runs()
            now[0] += 0.5
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
        assert max(gaps) == 30.0

    def test_ray_rejecting_the_job_fails_the_run_with_its_message(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        run_id = _create(client, auth, tmp_path)
        ray.fail_with = RayRejected("runtime_env py_modules: bad package")
        dispatcher.dispatch_queued_runs()

        run = _run(session_factory, run_id)
        assert run.status == "failed"
        assert run.error_code == "ray_rejected"
        assert "bad package" in (run.error_message or "")

    def test_concurrent_dispatchers_submit_each_run_once(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        ray: ScriptedRay,
    ) -> None:
        ids = []
        for i in range(6):
            (tmp_path / str(i)).mkdir()
            ids.append(_create(client, auth, tmp_path / str(i)))
        roomy = settings.model_copy(update={"max_concurrent_runs": 100})
        peers = [
            Dispatcher(settings=roomy, session_factory=session_factory, jobs=ray)  # type: ignore[arg-type]
            for _ in range(3)
        ]
        threads = [threading.Thread(target=p.dispatch_queued_runs) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(j["submission_id"] for j in ray.submitted) == sorted(f"{i}-1" for i in ids)

    def test_at_most_max_concurrent_runs_oldest_first_with_queue_positions(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        ray: ScriptedRay,
    ) -> None:
        ids = []
        for i in range(5):
            (tmp_path / str(i)).mkdir()
            ids.append(_create(client, auth, tmp_path / str(i)))
        two = settings.model_copy(update={"max_concurrent_runs": 2})
        dispatch_to(ray, two, session_factory)
        assert [j["submission_id"] for j in ray.submitted] == [f"{i}-1" for i in ids[:2]]

        positions = [
            client.get(f"/v1/runs/{i}", headers=auth).json()["queue_position"] for i in ids
        ]
        assert positions == [None, None, 1, 2, 3]
        listed = client.get("/v1/runs", headers=auth).json()["data"]
        assert [r["queue_position"] for r in listed] == [3, 2, 1, None, None]

        dispatch_to(ray, two, session_factory)  # still two live: nothing more goes
        assert len(ray.submitted) == 2


class TestReconcile:
    @pytest.fixture
    def run_id(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, dispatcher: Dispatcher
    ) -> str:
        run_id = _create(client, auth, tmp_path)
        dispatcher.dispatch_queued_runs()
        return run_id

    def test_ray_failed_fails_the_run_with_rays_message_and_log_tail(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        monkeypatch.setenv("RAY_AUTH_TOKEN", "s3cr3t-ray-token")
        ray.logs_text = "\n".join(f"line {i}" for i in range(50)) + (
            "\nconnecting with s3cr3t-ray-token\nKilled: out of memory"
        )
        ray.states[f"{run_id}-1"] = JobState(status="FAILED", message="exit code 137")
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert run.status == "failed"
        assert run.error_code == "job_failed"
        message = run.error_message or ""
        assert "exit code 137" in message
        assert "Killed: out of memory" in message
        assert "line 20" not in message  # only the tail
        assert "s3cr3t-ray-token" not in message

    def test_a_lost_job_with_attempts_left_starts_a_new_attempt(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        with session_factory.begin() as session:
            session.execute(update(Run).where(Run.id == run_id).values(status="running"))
        ray.states[f"{run_id}-1"] = None
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert (run.status, run.attempt, run.error_code) == ("queued", 2, None)
        assert any(e.message.startswith("lost") for e in _events(session_factory, run_id))

        dispatcher.dispatch_queued_runs()
        assert ray.submitted[-1]["submission_id"] == f"{run_id}-2"
        spec = json.loads(ray.submitted[-1]["runtime_env"]["env_vars"]["TUNEYARD_RUN_SPEC"])
        assert spec["attempt"] == 2

    def test_cancelling_settles_when_ray_confirms_and_re_asks_until_then(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        with session_factory.begin() as session:
            session.execute(update(Run).where(Run.id == run_id).values(status="cancelling"))
        dispatcher.reconcile_live_runs()  # Ray still says RUNNING
        assert ray.stopped == [f"{run_id}-1"]
        assert _run(session_factory, run_id).status == "cancelling"

        ray.states[f"{run_id}-1"] = JobState(status="STOPPED", message="")
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert run.status == "cancelled"
        assert run.error_code is None

    def test_ray_succeeded_settles_a_run_whose_callback_was_lost(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        ray.states[f"{run_id}-1"] = JobState(status="SUCCEEDED", message="")
        dispatcher.reconcile_live_runs()
        assert _run(session_factory, run_id).status == "succeeded"

    def test_ray_stopped_fails_a_run_nobody_cancelled(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        ray.states[f"{run_id}-1"] = JobState(status="STOPPED", message="stopped by operator")
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert run.status == "failed"
        assert run.error_code == "stopped"

    def test_a_running_job_ray_forgot_is_lost_when_no_attempts_remain(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        with session_factory.begin() as session:
            run = session.get(Run, run_id)
            assert run is not None
            run.status = "running"
            run.spec = {**run.spec, "fault_tolerance": {"max_resubmits": 0}}
        ray.states[f"{run_id}-1"] = None
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert run.status == "failed"
        assert run.error_code == "lost"

    def test_a_starting_run_ray_never_received_is_resubmitted_under_the_same_id(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        ray.states[f"{run_id}-1"] = None
        dispatcher.reconcile_live_runs()
        assert len(ray.submitted) == 1, "a fresh `starting` run may still be mid-submit"

        with session_factory.begin() as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(updated_at=utcnow() - timedelta(minutes=5))
            )
        dispatcher.reconcile_live_runs()
        assert [j["submission_id"] for j in ray.submitted] == [f"{run_id}-1", f"{run_id}-1"]
        run = _run(session_factory, run_id)
        assert run.status == "starting"
        new_token = job_token(ray.submitted[-1])
        assert run.callback_token_hash == hash_secret(new_token)

    def test_ray_unreachable_changes_nothing(
        self,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        def down(_: str) -> None:
            raise RayUnavailable("down")

        monkeypatch.setattr(ray, "state", down)
        dispatcher.reconcile_live_runs()
        assert _run(session_factory, run_id).status == "starting"

    def test_ray_unreachable_is_logged_once_a_minute_not_every_tick(
        self,
        run_id: str,
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Every create wakes the reconciler: with Ray down that was a warning per create."""
        now = [1000.0]
        monkeypatch.setattr("app.logs.time.monotonic", lambda: now[0])
        up = ray.state

        def down(_: str) -> None:
            raise RayUnavailable("down")

        def warnings() -> list[str]:
            return [r.getMessage() for r in caplog.records if "Ray unavailable" in r.getMessage()]

        monkeypatch.setattr(ray, "state", down)
        for _ in range(50):  # 50 ticks in 10 s
            dispatcher.reconcile_live_runs()
            now[0] += 0.2
        assert warnings() == ["reconcile: Ray unavailable: down"]
        now[0] += 60
        dispatcher.reconcile_live_runs()
        assert warnings()[1:] == [
            "reconcile: Ray unavailable: down (49 more like it in the last 60 s)"
        ]

        # Back, then down again: the new outage is logged at once.
        monkeypatch.setattr(ray, "state", up)
        dispatcher.reconcile_live_runs()
        monkeypatch.setattr(ray, "state", down)
        dispatcher.reconcile_live_runs()
        assert len(warnings()) == 3


class TestJobEnvironment:
    """What `build_runtime_env` gives every job beyond the run itself: the operator's
    variables (TUNEYARD_JOB_ENV, TUNEYARD_JOB_ENV_PASSTHROUGH) and the placement settings."""

    def _env_vars(self, tmp_path: Path, settings: Settings) -> dict[str, str]:
        spec = RunRequest.model_validate(run_request(tmp_path)).worker_fields()
        run = Run(id="run_env", attempt=1, spec=spec)
        env: dict[str, str] = build_runtime_env(run, token="rt_token", settings=settings)[
            "env_vars"
        ]
        return env

    def test_configured_and_forwarded_variables_reach_every_job(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("HF_TOKEN", "hf_forwarded")
        monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", "not-forwarded")
        settings = Settings(
            home=tmp_path,
            job_env={"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0"},
            job_env_passthrough="HF_TOKEN,NCCL_*",
        )
        env = self._env_vars(tmp_path, settings)
        assert env["HF_TOKEN"] == "hf_forwarded"
        assert env["NCCL_IB_HCA"] == "mlx5_0"
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        # tuneyard's own variables are all there, as tuneyard set them.
        assert env["TUNEYARD_RUN_TOKEN"] == "rt_token"
        assert json.loads(env["TUNEYARD_RUN_SPEC"])["run_id"] == "run_env"

    def test_tuneyards_own_variables_win_over_anything_configured(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        # Settings refuse these names; a job gets tuneyard's values even if one slipped by.
        settings = Settings(home=tmp_path)
        monkeypatch.setattr(
            Settings,
            "resolved_job_env",
            lambda self, environ=None: {"TUNEYARD_RUN_TOKEN": "forged", "PYTHONUNBUFFERED": "0"},
        )
        env = self._env_vars(tmp_path, settings)
        assert env["TUNEYARD_RUN_TOKEN"] == "rt_token"
        assert env["PYTHONUNBUFFERED"] == "1"

    @pytest.mark.parametrize(("autoscales", "flag"), [(False, "0"), (True, "1")])
    def test_the_placement_settings_reach_ray_train_and_the_driver(
        self, tmp_path: Path, autoscales: bool, flag: str
    ) -> None:
        settings = Settings(home=tmp_path, placement_timeout_s=45, cluster_autoscales=autoscales)
        env = self._env_vars(tmp_path, settings)
        assert float(env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"]) == 45
        assert env["TUNEYARD_CLUSTER_AUTOSCALES"] == flag

    def test_a_forwarded_credential_is_redacted_from_job_logs(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("HF_TOKEN", "hf_forwarded_secret")
        monkeypatch.setenv("TUNEYARD_JOB_ENV", '{"WANDB_API_KEY": "wandb_configured_secret"}')
        logged = redact("token=hf_forwarded_secret key=wandb_configured_secret iface=enp0s31f6")
        assert logged == "token=[redacted] key=[redacted] iface=enp0s31f6"

    def test_a_secret_set_or_changed_after_a_redaction_is_redacted_too(
        self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
    ) -> None:
        # The secrets are read once per version of the environment and of Ray's token file
        # (every log line is redacted), never kept past a change of either.
        assert redact("s=later_set_secret") == "s=later_set_secret"
        monkeypatch.setenv("LATER_TOKEN", "later_set_secret")
        assert redact("s=later_set_secret") == "s=[redacted]"
        monkeypatch.setenv("LATER_TOKEN", "changed_secret_value")
        assert redact("s=later_set_secret s=changed_secret_value") == (
            "s=later_set_secret s=[redacted]"
        )
        token = tmp_path / "auth_token"
        token.write_text("ray_token_version_1")
        monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        assert redact("ray_token_version_1") == "[redacted]"
        token.write_text("ray_token_version_2")
        os.utime(token, ns=(time.time_ns(), time.time_ns() + 10**9))
        assert redact("ray_token_version_1 ray_token_version_2") == (
            "ray_token_version_1 [redacted]"
        )


class TestRunTokens:
    """The token in a job's runtime_env is readable by anyone with the Ray dashboard; it is
    good for its run's one attempt, and only until that attempt ends."""

    @pytest.fixture
    def run_id(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, dispatcher: Dispatcher
    ) -> str:
        run_id = _create(client, auth, tmp_path)
        dispatcher.dispatch_queued_runs()
        return run_id

    def test_a_requeued_run_gets_a_new_token_and_the_old_one_is_refused(
        self,
        client: TestClient,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        first = worker_headers(ray)
        assert post_status(client, run_id, first, "running", attempt=1).status_code == 200
        ray.states[f"{run_id}-1"] = None  # the head restarted: attempt 1 is lost
        dispatcher.reconcile_live_runs()
        assert _run(session_factory, run_id).status == "queued"
        # Between the attempts no token is good at all.
        assert post_status(client, run_id, first, "running", attempt=1).status_code == 401

        dispatcher.dispatch_queued_runs()
        second = worker_headers(ray)
        assert ray.submitted[-1]["submission_id"] == f"{run_id}-2"
        assert second != first
        assert post_status(client, run_id, first, "running", attempt=1).status_code == 401
        assert post_status(client, run_id, first, "running", attempt=2).status_code == 401
        assert post_status(client, run_id, second, "running", attempt=2).status_code == 200
        assert _run(session_factory, run_id).status == "running"

    def test_a_resubmission_of_the_same_attempt_gets_a_new_token(
        self,
        client: TestClient,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
    ) -> None:
        first = worker_headers(ray)
        ray.states[f"{run_id}-1"] = None
        with session_factory.begin() as session:
            session.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(updated_at=utcnow() - timedelta(minutes=5))
            )
        dispatcher.reconcile_live_runs()  # Ray never received it: submitted again
        second = worker_headers(ray)
        assert second != first
        assert post_status(client, run_id, first, "running", attempt=1).status_code == 401
        assert post_status(client, run_id, second, "running", attempt=1).status_code == 200

    @pytest.mark.parametrize(
        ("ray_says", "outcome"),
        [
            (JobState(status="SUCCEEDED", message=""), "succeeded"),
            (JobState(status="FAILED", message="exit code 1"), "failed"),
            (JobState(status="STOPPED", message="by operator"), "failed"),
        ],
    )
    def test_a_finished_runs_token_is_refused(
        self,
        client: TestClient,
        run_id: str,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        ray_says: JobState,
        outcome: str,
    ) -> None:
        worker = worker_headers(ray)
        ray.states[f"{run_id}-1"] = ray_says
        dispatcher.reconcile_live_runs()
        run = _run(session_factory, run_id)
        assert (run.status, run.callback_token_hash) == (outcome, None)
        assert post_status(client, run_id, worker, "running", attempt=1).status_code == 401

    def test_a_job_ray_took_although_the_submit_failed_still_reports_with_its_token(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        """A submit that timed out may have reached Ray: back in the queue, the attempt
        keeps its token, and the job's first report starts the run."""
        sent: list[str] = []

        def timed_out(**job: Any) -> None:
            sent.append(job_token(job))
            raise RayUnavailable("cannot reach Ray at http://ray.invalid: read timed out")

        monkeypatch.setattr(ray, "submit", timed_out)
        run_id = _create(client, auth, tmp_path)
        dispatcher.dispatch_queued_runs()
        assert _run(session_factory, run_id).status == "queued"
        assert post_status(client, run_id, bearer(sent[0]), "running", attempt=1).status_code == 200
        assert _run(session_factory, run_id).status == "running"


class TestEventsWhileRayIsAway:
    def test_retries_against_an_unreachable_ray_leave_one_event_counting_them(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr("app.services.dispatch.time.monotonic", lambda: now[0])
        run_id = _create(client, auth, tmp_path)
        ray.fail_with = RayUnavailable("cannot reach Ray at http://ray.invalid")
        tries = 12
        for _ in range(tries):
            dispatcher.dispatch_queued_runs()
            now[0] += 60.0  # past any backoff: every pass tries again
        assert _run(session_factory, run_id).status == "queued"
        # Its owner reads why it waits (not Ray's address, which the event keeps).
        assert client.get(f"/v1/runs/{run_id}", headers=auth).json()["queue"]["reason"] == (
            RAY_AWAY
        )

        events = [(e.status, e.message, e.repeats) for e in _events(session_factory, run_id)]
        assert events == [
            ("queued", "run created", 1),
            (
                "queued",
                "Ray unavailable, will retry: cannot reach Ray at http://ray.invalid",
                tries,
            ),
        ]

        ray.fail_with = None
        dispatcher.dispatch_queued_runs()
        events = [(e.status, e.message, e.repeats) for e in _events(session_factory, run_id)]
        assert events[2:] == [("starting", f"submitting Ray job {run_id}-1", 1)]

    def test_requests_object_addresses_do_not_split_the_count(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
        dispatcher: Dispatcher,
        ray: ScriptedRay,
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        now = [1000.0]
        monkeypatch.setattr("app.services.dispatch.time.monotonic", lambda: now[0])
        run_id = _create(client, auth, tmp_path)
        for address in ("0x7f3c2b1d5a90", "0x7f3c2b1d6f10"):
            ray.fail_with = RayUnavailable(
                "cannot reach Ray at http://ray.invalid: HTTPConnectionPool(host='ray.invalid', "
                f"port=8265): Max retries exceeded (Caused by NewConnectionError('<urllib3."
                f"connection.HTTPConnection object at {address}>: Failed to establish a new "
                "connection: [Errno 111] Connection refused'))"
            )
            dispatcher.dispatch_queued_runs()
            now[0] += 60.0
        *_, last = _events(session_factory, run_id)
        assert last.repeats == 2
        assert "HTTPConnection object>" in last.message
