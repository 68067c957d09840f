"""`POST /v1/runs/validate` with `profile: true`: the request it takes, the job it submits,
what it makes of the job's answer, and the whole run's time and cost.

Ray is the scripted stand-in of the dispatch tests, playing the profile's job: it writes what
a real one writes (worker/profile.py) where the job was told to. The real job, on a real
cluster, is tests/e2e/test_profile.py's.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from app.cluster.ray_jobs import JobState
from app.main import create_app
from app.schemas.profile import ProfileView
from app.services import profiles
from app.settings import Settings
from contract.job_env import CALLBACK_URL_ENV, PROFILE_ENV, SPEC_ENV, TOKEN_ENV
from contract.run_request import ResourcesSpec, RunSpec
from contract.storage import Storage
from tests.app.test_dispatch import ScriptedRay
from tests.factories import run_request

MEASURED: dict[str, Any] = {
    "steps": 4,
    "warmup_steps": 2,
    "steps_measured": 2,
    "step_time_seconds": 0.5,
    "step_times_seconds": [0.4, 0.6],
    "tokens_per_second": 1000.0,
    "samples_per_second": 8.0,
    "startup_seconds": 20.0,
    "workers": [
        {
            "rank": 0,
            "node_id": "n1",
            "peak_device_memory_bytes": None,
            "peak_host_memory_bytes": 600 << 20,
        },
        {
            "rank": 1,
            "node_id": "n1",
            "peak_device_memory_bytes": None,
            "peak_host_memory_bytes": 610 << 20,
        },
    ],
}


class ProfilingRay(ScriptedRay):
    """Plays the profile's job: on submission it writes `result` where the job was told to
    (None: nothing), and then reports `final` (None: running until stopped)."""

    def __init__(self, storage: Storage) -> None:
        super().__init__()
        self.storage = storage
        self.result: dict[str, Any] | None = MEASURED
        self.final: str | None = "SUCCEEDED"
        self.deleted: list[str] = []

    def submit(
        self,
        *,
        submission_id: str,
        entrypoint: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str] | None = None,
    ) -> None:
        super().submit(
            submission_id=submission_id,
            entrypoint=entrypoint,
            runtime_env=runtime_env,
            metadata=metadata,
        )
        options = json.loads(runtime_env["env_vars"][PROFILE_ENV])
        if self.result is not None:
            local = Path(self.storage.root) / "written.json"
            local.write_text(json.dumps(self.result))
            self.storage.move_in(local, options["result"])
        # What Ray Train makes for the run name: the service must delete it.
        (Path(self.storage.root) / submission_id).mkdir(parents=True)
        if self.final is not None:
            self.states[submission_id] = JobState(status=self.final, message="job ended")

    def stop(self, submission_id: str) -> None:
        super().stop(submission_id)
        self.states[submission_id] = JobState(status="STOPPED", message="stopped")

    def delete(self, submission_id: str) -> None:
        self.deleted.append(submission_id)
        self.states[submission_id] = None  # Ray no longer knows it


@pytest.fixture(autouse=True)
def quick_ray_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray's job manager looks at a job every second; this Ray's never writes behind."""
    monkeypatch.setattr(profiles, "RAY_MONITOR_PERIOD_S", 0.01)


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: profiles store nothing."""
    return sqlite_url


@pytest.fixture
def ray(settings: Settings) -> ProfilingRay:
    return ProfilingRay(settings.storage)


@pytest.fixture
def priced(settings: Settings) -> Settings:
    return settings.model_copy(update={"gpu_hour_price": 2.5, "gpu_hour_currency": "EUR"})


@pytest.fixture
def client(priced: Settings, ray: ProfilingRay) -> Iterator[TestClient]:
    app = create_app(priced, start_background=False)
    with TestClient(app) as test_client:
        app.state.tuneyard.jobs = ray
        yield test_client


def _validate(client: TestClient, auth: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    response = client.post("/v1/runs/validate", json=body, headers=auth)
    assert response.status_code == 200, response.text
    report: dict[str, Any] = response.json()
    return report


class TestRequest:
    def test_create_run_refuses_profile_as_an_unknown_field(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        body = {**run_request(tmp_path), "profile": True, "profile_steps": 4}
        response = client.post("/v1/runs", json=body, headers=auth)
        assert response.status_code == 422
        assert {p["field"] for p in response.json()["detail"]} == {"profile", "profile_steps"}

    @pytest.mark.parametrize("steps", [1, 51, "many"])
    def test_profile_steps_out_of_bounds_is_a_problem_and_runs_nothing(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        ray: ProfilingRay,
        steps: Any,
    ) -> None:
        body = {**run_request(tmp_path), "profile": True, "profile_steps": steps}
        report = _validate(client, auth, body)
        assert report["valid"] is False
        assert [e["field"] for e in report["errors"]] == ["profile_steps"]
        assert report["profile"] is None
        assert ray.submitted == []

    def test_an_invalid_request_is_not_profiled(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, ray: ProfilingRay
    ) -> None:
        body = run_request(tmp_path, deepspeed={"zero_stage": 0, "offload_optimizer": "cpu"})
        report = _validate(client, auth, {**body, "profile": True})
        assert report["valid"] is False
        assert report["errors"][0]["field"] == "deepspeed.offload_optimizer"
        assert report["profile"] is None
        assert ray.submitted == []

    def test_without_profile_nothing_runs(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, ray: ProfilingRay
    ) -> None:
        report = _validate(client, auth, run_request(tmp_path))
        assert report["valid"] is True and report["profile"] is None
        assert ray.submitted == []


class TestProfile:
    def test_submits_the_runs_own_job_and_reports_beside_the_estimate(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        ray: ProfilingRay,
        priced: Settings,
    ) -> None:
        body = run_request(tmp_path, training={"max_steps": 100})
        report = _validate(client, auth, {**body, "profile": True, "profile_steps": 4})
        assert report["valid"] is True and report["estimate"] is not None

        [job] = ray.submitted
        assert job["submission_id"].startswith("profile-")
        assert job["entrypoint"] == "python -m worker.profile"
        env = job["runtime_env"]["env_vars"]
        # The run's own spec, as the dispatcher would send it, under the profile's name.
        spec = RunSpec.model_validate_json(env[SPEC_ENV])
        assert spec.run_id == job["submission_id"]
        assert spec.storage_path == priced.storage.root
        assert spec.training.max_steps == 100
        assert spec.resources.num_workers == 2
        # No run, so no run token and nothing to call back.
        assert TOKEN_ENV not in env and CALLBACK_URL_ENV not in env
        options = json.loads(env[PROFILE_ENV])
        assert options["steps"] == 4 and options["warmup_steps"] == 2
        assert options["result"] == priced.storage.join("profiles", f"{job['submission_id']}.json")

        profile = report["profile"]
        assert profile["error"] is None
        assert profile["step_time_seconds"] == 0.5
        assert profile["tokens_per_second"] == 1000.0
        assert [w["peak_host_memory_bytes"] for w in profile["workers"]] == [600 << 20, 610 << 20]
        assert profile["total_steps"] == 100
        assert profile["estimated_total_seconds"] == pytest.approx(20.0 + 0.5 * 100)
        # A CPU run holds no GPU: it costs nothing at any GPU-hour price.
        assert (profile["gpus"], profile["estimated_cost"], profile["currency"]) == (0, 0.0, "EUR")

        # The job's JSON and its Ray Train folder are gone, and Ray forgot the job.
        assert not Path(options["result"]).exists()
        assert not (Path(priced.storage.root) / job["submission_id"]).exists()
        assert ray.deleted == [job["submission_id"]]

    def test_a_failed_profile_answers_with_the_workers_error(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, ray: ProfilingRay
    ) -> None:
        ray.result = {"error": {"code": "training_error", "message": "worker rank 0: OOM"}}
        ray.final = "FAILED"
        report = _validate(client, auth, {**run_request(tmp_path), "profile": True})
        assert report["valid"] is True
        profile = report["profile"]
        assert profile["error"] == {"code": "training_error", "message": "worker rank 0: OOM"}
        assert profile["step_time_seconds"] is None and profile["workers"] == []

    def test_a_job_that_wrote_nothing_answers_with_rays_account(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, ray: ProfilingRay
    ) -> None:
        ray.result, ray.final, ray.logs_text = None, "FAILED", "ModuleNotFoundError: worker"
        profile = _validate(client, auth, {**run_request(tmp_path), "profile": True})["profile"]
        assert profile["error"]["code"] == "profile_failed"
        assert "ModuleNotFoundError: worker" in profile["error"]["message"]

    def test_past_the_timeout_the_job_is_stopped_and_cleaned_up(
        self,
        settings: Settings,
        auth: dict[str, str],
        tmp_path: Path,
        ray: ProfilingRay,
    ) -> None:
        ray.result, ray.final = None, None  # runs until stopped
        app = create_app(
            settings.model_copy(update={"profile_timeout_s": 0.2}), start_background=False
        )
        with TestClient(app) as client:
            app.state.tuneyard.jobs = ray
            profile = _validate(client, auth, {**run_request(tmp_path), "profile": True})["profile"]
        assert profile["error"]["code"] == "profile_timeout"
        [job] = ray.submitted
        assert ray.stopped == [job["submission_id"]]
        assert ray.deleted == [job["submission_id"]]
        assert not (Path(settings.storage.root) / job["submission_id"]).exists()

    def test_without_ray_the_profile_says_so(
        self, settings: Settings, auth: dict[str, str], tmp_path: Path
    ) -> None:
        with TestClient(create_app(settings, start_background=False)) as client:
            report = _validate(client, auth, {**run_request(tmp_path), "profile": True})
        assert report["valid"] is True
        assert report["profile"]["error"]["code"] == "ray_unavailable"


class TestForget:
    def test_a_record_rays_monitor_writes_anew_is_deleted_again(self) -> None:
        """Ray's job manager writes a FAILED record for a job whose record is gone when it
        sees the job's supervisor exit: the service deletes until the record stays gone."""

        class RewritingRay(ScriptedRay):
            def __init__(self) -> None:
                super().__init__()
                self.deletes = 0

            def delete(self, submission_id: str) -> None:
                self.deletes += 1
                # The first delete lands before the monitor's last look, which rewrites it.
                rewritten = JobState(status="FAILED", message="supervisor died")
                self.states[submission_id] = rewritten if self.deletes == 1 else None

        ray = RewritingRay()
        jobs: Any = ray
        profiles._forget(jobs, "profile-1")
        assert ray.deletes == 2
        assert ray.state("profile-1") is None


class TestRunEstimates:
    def test_total_is_start_up_then_every_step_at_the_measured_pace(self) -> None:
        total = profiles.estimated_total_seconds(
            startup_seconds=30.0, step_time_seconds=1.5, total_steps=1000
        )
        assert total == 30.0 + 1500.0
        unknown = profiles.estimated_total_seconds(
            startup_seconds=30.0, step_time_seconds=1.5, total_steps=None
        )
        assert unknown is None

    def test_cost_is_price_times_gpus_times_hours(self) -> None:
        gpus = profiles.gpus_of(
            ResourcesSpec(num_workers=4, use_gpu=True, gpus_per_worker=2, cpus_per_worker=1)
        )
        assert gpus == 8
        cost = profiles.estimated_cost(gpu_hour_price=2.5, gpus=gpus, total_seconds=5400)
        assert cost == pytest.approx(2.5 * 8 * 1.5)
        assert profiles.gpus_of(ResourcesSpec(num_workers=4, use_gpu=True)) == 4
        assert profiles.gpus_of(ResourcesSpec(num_workers=4, use_gpu=False)) == 0
        # No price configured, or no wall time: no cost at all, rather than a made-up one.
        assert profiles.estimated_cost(gpu_hour_price=None, gpus=8, total_seconds=5400) is None
        assert profiles.estimated_cost(gpu_hour_price=2.5, gpus=8, total_seconds=None) is None

    def test_a_gpu_runs_measurements_priced(self, priced: Settings) -> None:
        resources = ResourcesSpec(num_workers=2, use_gpu=True)
        shown = ProfileView(steps=4, warmup_steps=2, total_steps=7200)
        view = profiles.measured_view(
            MEASURED, shown=shown, total_steps=7200, resources=resources, settings=priced
        )
        assert view.estimated_total_seconds == 20.0 + 0.5 * 7200
        assert view.gpus == 2
        assert view.estimated_cost == pytest.approx(2.5 * 2 * (20.0 + 3600.0) / 3600)
        assert view.currency == "EUR"
