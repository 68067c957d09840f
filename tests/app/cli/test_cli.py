"""The `tuneyard` CLI against a real HTTP server (uvicorn in a thread) on a real database.

Ray is the scripted stand-in from the dispatch tests; worker progress is posted to the
real callback endpoints, the way the worker posts it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from app.cli.commands import ExitCode, app
from app.main import create_app
from app.ports import free_port
from app.services import profiles
from app.settings import Settings
from contract.job_env import PROFILE_ENV
from tests.app.conftest import HTTP_TIMEOUT_S, served
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.app.test_profiles import ProfilingRay
from tests.app.worker_calls import bearer, job_token, run_location
from tests.conftest import make_api_key
from tests.factories import run_request


@dataclass
class LiveService:
    url: str
    key: str
    ray: ScriptedRay
    settings: Settings
    session_factory: sessionmaker[Session]

    def cli(self, *args: str, key: str | None = None) -> Any:
        """Run the CLI in-process; the result has exit_code, stdout and stderr."""
        env = {"TUNEYARD_URL": self.url, "TUNEYARD_API_KEY": key or self.key, "COLUMNS": "200"}
        return CliRunner().invoke(app, list(args), env=env, catch_exceptions=False)

    def dispatch(self) -> str:
        """Dispatch queued runs to the scripted Ray; the last one's worker token."""
        dispatch_to(self.ray, self.settings, self.session_factory)
        return job_token(self.ray.submitted[-1])

    def worker_post(self, run_id: str, token: str, what: str, body: dict[str, Any]) -> None:
        response = httpx.post(
            f"{self.url}/v1/internal/runs/{run_id}/{what}",
            json={"attempt": 1, **body},
            headers=bearer(token),
            timeout=HTTP_TIMEOUT_S,
        )
        assert response.status_code == 200, response.text


@pytest.fixture
def live(settings: Settings, session_factory: sessionmaker[Session]) -> Iterator[LiveService]:
    api = create_app(settings, start_background=False)
    ray = ScriptedRay()
    api.state.tuneyard.jobs = ray
    with served(api) as url:
        yield LiveService(
            url=url,
            key=make_api_key(session_factory),
            ray=ray,
            settings=settings,
            session_factory=session_factory,
        )


@pytest.fixture
def unused_tcp_port() -> int:
    return free_port()


def write_spec(root: Path, name: str = "spec.yaml", **overrides: Any) -> Path:
    path = root / name
    path.write_text(yaml.safe_dump(run_request(root, **overrides)))
    return path


def _now() -> str:
    return datetime.now(UTC).isoformat()


class TestSubmit:
    def test_yaml_spec_creates_a_run_listed_with_its_metadata(
        self, live: LiveService, tmp_path: Path
    ) -> None:
        spec = write_spec(tmp_path, metadata={"team": "nlp"})
        result = live.cli("submit", str(spec))
        assert result.exit_code == ExitCode.OK, result.stderr
        run_id = result.stdout.strip()
        assert run_id.startswith("run_")

        status = live.cli("status", run_id, "--json")
        assert json.loads(status.stdout)["status"] == "queued"
        assert run_id in live.cli("list", "--metadata", "team=nlp").stdout
        assert run_id not in live.cli("list", "--metadata", "team=vision").stdout
        assert run_id in live.cli("list", "--status", "queued").stdout

    def test_json_spec_from_stdin_with_idempotency_key(
        self, live: LiveService, tmp_path: Path
    ) -> None:
        body = json.dumps(run_request(tmp_path))
        env = {"TUNEYARD_URL": live.url, "TUNEYARD_API_KEY": live.key}
        first = CliRunner().invoke(
            app, ["submit", "-", "--idempotency-key", "k1"], input=body, env=env
        )
        again = CliRunner().invoke(
            app, ["submit", "-", "--idempotency-key", "k1"], input=body, env=env
        )
        assert first.exit_code == again.exit_code == ExitCode.OK
        assert first.stdout == again.stdout

    def test_invalid_spec_is_refused_with_each_rule_and_nothing_stored(
        self, live: LiveService, tmp_path: Path
    ) -> None:
        spec = write_spec(
            tmp_path,
            deepspeed={"zero_stage": 1, "offload_params": "cpu", "tensor_parallel_size": 2},
            resources={"num_workers": 3},
        )
        result = live.cli("submit", str(spec))
        assert result.exit_code == ExitCode.REFUSED
        assert "offload_params" in result.stderr
        assert "tensor_parallel_size" in result.stderr
        assert json.loads(live.cli("list", "--json").stdout) == []

    def test_unreadable_spec_is_a_usage_error(self, live: LiveService, tmp_path: Path) -> None:
        missing = live.cli("submit", str(tmp_path / "nope.yaml"))
        assert missing.exit_code == ExitCode.USAGE
        assert "cannot read the spec" in missing.stderr
        (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
        not_a_mapping = live.cli("submit", str(tmp_path / "list.yaml"))
        assert not_a_mapping.exit_code == ExitCode.USAGE


class TestValidate:
    def test_valid_spec_shows_resolved_config(self, live: LiveService, tmp_path: Path) -> None:
        result = live.cli("validate", str(write_spec(tmp_path)), "--json")
        assert result.exit_code == ExitCode.OK, result.stderr
        report = json.loads(result.stdout)
        assert report["valid"] is True
        assert report["resolved"]["deepspeed_config"]["zero_optimization"]["stage"] == 2
        assert json.loads(live.cli("list", "--json").stdout) == []  # nothing created

    def test_invalid_spec_exits_3_naming_the_field(self, live: LiveService, tmp_path: Path) -> None:
        spec = write_spec(tmp_path, deepspeed={"tensor_parallel_size": 2})
        spec_text = yaml.safe_load(spec.read_text())
        spec_text["resources"]["num_workers"] = 3
        spec.write_text(yaml.safe_dump(spec_text))
        result = live.cli("validate", str(spec))
        assert result.exit_code == ExitCode.REFUSED
        assert "tensor_parallel_size" in result.stderr


class TestValidateProfile:
    @pytest.fixture
    def profiling(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        monkeypatch: pytest.MonkeyPatch,
    ) -> Iterator[LiveService]:
        """A service whose Ray plays a profile's job (tests/app/test_profiles.py)."""
        monkeypatch.setattr(profiles, "RAY_MONITOR_PERIOD_S", 0.01)
        priced = settings.model_copy(update={"gpu_hour_price": 3.0})
        api = create_app(priced, start_background=False)
        ray = ProfilingRay(priced.storage)
        api.state.tuneyard.jobs = ray
        with served(api) as url:
            yield LiveService(
                url=url,
                key=make_api_key(session_factory),
                ray=ray,
                settings=priced,
                session_factory=session_factory,
            )

    def test_measured_numbers_beside_the_static_estimate(
        self, profiling: LiveService, tmp_path: Path
    ) -> None:
        spec = write_spec(tmp_path, training={"max_steps": 100})
        result = profiling.cli("validate", str(spec), "--profile", "--profile-steps", "4")
        assert result.exit_code == ExitCode.OK, result.stderr
        [job] = profiling.ray.submitted
        assert json.loads(job["runtime_env"]["env_vars"][PROFILE_ENV])["steps"] == 4
        table = {
            line.split("│")[1].strip(): [cell.strip() for cell in line.split("│")[2:4]]
            for line in result.stdout.splitlines()
            if line.count("│") == 4
        }
        assert "measured (2 of 4 steps)" in result.stdout
        assert table["total steps"] == ["100", "-"]
        assert table["step time"] == ["-", "0.5 s"]
        assert table["tokens/s"] == ["-", "1,000.0"]
        # 20 s of start-up, then 100 steps of 0.5 s.
        assert table["wall time of the run"] == ["-", "1:10"]
        assert table["cost"] == ["-", "0.00 USD"]  # a CPU run holds no GPU
        assert table["peak host memory / worker"][1] == "r0 600.0 MiB, r1 610.0 MiB"
        assert table["peak device memory / worker"][1] == "-"

    def test_a_failed_profile_exits_1_with_its_error(
        self, profiling: LiveService, tmp_path: Path
    ) -> None:
        ray = profiling.ray
        assert isinstance(ray, ProfilingRay)
        ray.result = {"error": {"code": "training_error", "message": "worker rank 1: OOM"}}
        result = profiling.cli("validate", str(write_spec(tmp_path)), "--profile")
        assert result.exit_code == ExitCode.RUN_FAILED
        assert "training_error: worker rank 1: OOM" in result.stderr


class TestErrors:
    def test_unknown_run_exits_4(self, live: LiveService) -> None:
        for command in ("status", "watch", "cancel", "resume", "checkpoints", "logs"):
            result = live.cli(command, "run_doesnotexist")
            assert result.exit_code == ExitCode.NOT_FOUND, (command, result.stderr)

    def test_wrong_key_exits_7_and_says_how_to_fix(self, live: LiveService) -> None:
        result = live.cli("list", key="sk_wrong")
        assert result.exit_code == ExitCode.UNAUTHORIZED
        assert "TUNEYARD_API_KEY" in result.stderr

    def test_unreachable_service_exits_6(self, unused_tcp_port: int) -> None:
        env = {"TUNEYARD_URL": f"http://127.0.0.1:{unused_tcp_port}", "TUNEYARD_API_KEY": "x"}
        result = CliRunner().invoke(app, ["list"], env=env)
        assert result.exit_code == ExitCode.UNREACHABLE
        assert "cannot reach tuneyard" in result.stderr


class TestControl:
    def test_cancel_then_resume(self, live: LiveService, tmp_path: Path) -> None:
        run_id = live.cli("submit", str(write_spec(tmp_path))).stdout.strip()
        cancelled = live.cli("cancel", run_id)
        assert cancelled.exit_code == ExitCode.OK
        assert "cancelled" in cancelled.stdout
        resumed = live.cli("resume", run_id)
        assert resumed.exit_code == ExitCode.OK
        assert "queued (attempt 2)" in resumed.stdout
        assert live.cli("resume", run_id).exit_code == ExitCode.REFUSED  # not failed/cancelled

    def test_checkpoints_and_logs(self, live: LiveService, tmp_path: Path) -> None:
        run_id = live.cli("submit", str(write_spec(tmp_path))).stdout.strip()
        token = live.dispatch()
        live.worker_post(run_id, token, "status", {"status": "running"})
        path = run_location(live.settings, run_id, "step-5")
        live.worker_post(
            run_id,
            token,
            "checkpoints",
            {"step": 5, "path": path, "kind": "deepspeed", "metrics": {}},
        )
        table = live.cli("checkpoints", run_id)
        assert table.exit_code == ExitCode.OK
        assert "step-5" in table.stdout
        assert json.loads(live.cli("checkpoints", run_id, "--json").stdout)[0]["step"] == 5

        live.ray.logs_text = "line 1\nline 2\nline 3\n"
        assert live.cli("logs", run_id, "--tail", "2").stdout == "line 2\nline 3"
        live.worker_post(run_id, token, "status", {"status": "succeeded"})
        assert "stopped   completed" in live.cli("status", run_id).stdout
        followed = live.cli("logs", run_id, "--follow", "--interval", "0.1")
        assert followed.exit_code == ExitCode.OK
        assert followed.stdout == "line 1\nline 2\nline 3\n"


class TestWatch:
    def _watch_in_background(self, live: LiveService, run_id: str) -> subprocess.Popen[str]:
        """A real `tuneyard watch` process, so it sees the run change while it polls."""
        env = {
            **os.environ,
            "TUNEYARD_URL": live.url,
            "TUNEYARD_API_KEY": live.key,
            "COLUMNS": "200",
        }
        return subprocess.Popen(
            [sys.executable, "-m", "app", "watch", run_id, "--interval", "0.2"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def test_follows_progress_to_success(self, live: LiveService, tmp_path: Path) -> None:
        run_id = live.cli("submit", str(write_spec(tmp_path))).stdout.strip()
        watcher = self._watch_in_background(live, run_id)
        token = live.dispatch()
        live.worker_post(run_id, token, "status", {"status": "running"})
        for step in range(1, 6):
            live.worker_post(
                run_id,
                token,
                "metrics",
                {
                    "points": [
                        {"step": step, "name": "loss", "value": 3.0 - step / 10, "time": _now()},
                        {"step": step, "name": "tokens_per_second", "value": 900, "time": _now()},
                    ],
                    "progress": {"step": step, "total_steps": 5},
                },
            )
            time.sleep(0.3)
        assert watcher.poll() is None  # still watching a running run
        live.worker_post(run_id, token, "status", {"status": "succeeded"})
        stdout, stderr = watcher.communicate(timeout=60)
        assert watcher.returncode == ExitCode.OK, stderr
        assert "succeeded" in stdout
        assert "step 5/5" in stderr and "loss 2.5000" in stderr and "900 tok/s" in stderr
        assert "submitting Ray job" in stderr  # the run's events are shown as they come

    def test_failed_run_exits_1_with_the_error(self, live: LiveService, tmp_path: Path) -> None:
        run_id = live.cli("submit", str(write_spec(tmp_path))).stdout.strip()
        token = live.dispatch()
        live.worker_post(
            run_id,
            token,
            "status",
            {
                "status": "failed",
                "error": {"code": "training_error", "message": "out of memory at step 3"},
            },
        )
        result = live.cli("watch", run_id)
        assert result.exit_code == ExitCode.RUN_FAILED
        assert "out of memory at step 3" in result.stdout

    def test_cancelled_run_exits_5(self, live: LiveService, tmp_path: Path) -> None:
        run_id = live.cli("submit", str(write_spec(tmp_path)), "--json").stdout
        run_id = json.loads(run_id)["id"]
        live.cli("cancel", run_id)
        assert live.cli("watch", run_id).exit_code == ExitCode.RUN_CANCELLED


class TestKeys:
    def keys(self, settings: Settings, *args: str) -> Any:
        env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url, "COLUMNS": "200"}
        return CliRunner().invoke(app, ["keys", *args], env=env, catch_exceptions=False)

    def test_list_shows_each_key_and_which_are_revoked(self, settings: Settings) -> None:
        created = self.keys(settings, "create", "--name", "ci-bot")
        assert created.exit_code == ExitCode.OK
        self.keys(settings, "create", "--name", "alice")
        listed = json.loads(self.keys(settings, "list", "--json").stdout)
        assert [k["name"] for k in listed] == ["ci-bot", "alice"]
        assert all(k["revoked_at"] is None for k in listed)
        secret = created.stdout.strip()
        assert all(secret not in json.dumps(k) for k in listed)  # never shown again

        revoked = self.keys(settings, "revoke", listed[0]["id"])
        assert revoked.exit_code == ExitCode.OK, revoked.stderr
        assert listed[0]["id"] in revoked.stdout

        table = self.keys(settings, "list").stdout
        lines = {
            name: line
            for line in table.splitlines()
            for name in ("ci-bot", "alice")
            if name in line
        }
        for column in ("id", "name", "created", "revoked"):
            assert column in table
        assert listed[0]["id"] in lines["ci-bot"] and listed[1]["id"] in lines["alice"]
        again = json.loads(self.keys(settings, "list", "--json").stdout)
        revoked_at = again[0]["revoked_at"][:19].replace("T", " ")
        assert revoked_at in lines["ci-bot"]
        assert again[1]["created_at"][:19].replace("T", " ") in lines["alice"]
        assert lines["alice"].count(":") == 2  # created, and no revoked time
        assert again[0]["revoked_at"] is not None and again[1]["revoked_at"] is None


class TestKeyLimits:
    """`tuneyard keys create/update/list` with an API key's share of the cluster."""

    LIMITS = ("max_running_runs", "max_queued_runs", "max_gpus", "max_priority")

    @pytest.fixture
    def settings(self, tmp_path: Path, database_url: str) -> Settings:
        # Only the database matters to these commands: no model, no server.
        return Settings(home=tmp_path, database_url=database_url)

    def keys(self, settings: Settings, *args: str) -> Any:
        env = {"TUNEYARD_DATABASE_URL": settings.resolved_database_url, "COLUMNS": "200"}
        return CliRunner().invoke(app, ["keys", *args], env=env, catch_exceptions=False)

    def listed(self, settings: Settings) -> dict[str, dict[str, Any]]:
        result = self.keys(settings, "list", "--json")
        assert result.exit_code == ExitCode.OK, result.stderr
        return {
            k["name"]: {n: k[n] for n in ("id", *self.LIMITS)} for k in json.loads(result.stdout)
        }

    def test_create_with_limits_and_list_shows_them(self, settings: Settings) -> None:
        created = self.keys(
            settings,
            "create",
            "--name",
            "sweeps",
            "--max-running-runs",
            "2",
            "--max-queued-runs",
            "20",
            "--max-gpus",
            "8",
            "--max-priority",
            "60",
        )
        assert created.exit_code == ExitCode.OK, created.stderr
        assert created.stdout.strip().startswith("ty")  # the secret, shown once
        self.keys(settings, "create", "--name", "on-call")

        keys = self.listed(settings)
        assert {n: keys["sweeps"][n] for n in self.LIMITS} == {
            "max_running_runs": 2,
            "max_queued_runs": 20,
            "max_gpus": 8,
            "max_priority": 60,
        }
        assert all(keys["on-call"][n] is None for n in self.LIMITS)

        table = self.keys(settings, "list").stdout
        for column in ("running runs", "queued runs", "gpus", "priority"):
            assert column in table
        cells = {
            name: [cell.strip() for cell in line.split("│")[-5:-1]]
            for line in table.splitlines()
            for name in ("sweeps", "on-call")
            if name in line
        }
        assert cells == {"sweeps": ["2", "20", "8", "60"], "on-call": ["-", "-", "-", "-"]}

    def test_update_changes_only_the_limits_given_and_none_lifts_one(
        self, settings: Settings
    ) -> None:
        self.keys(settings, "create", "--name", "sweeps", "--max-gpus", "8", "--max-priority", "60")
        key_id = self.listed(settings)["sweeps"]["id"]

        updated = self.keys(settings, "update", "sweeps", "--max-running-runs", "3")
        assert updated.exit_code == ExitCode.OK, updated.stderr
        assert f"{key_id} (sweeps): max_running_runs 3, max_gpus 8, max_priority 60" in (
            updated.stdout
        )

        lifted = self.keys(settings, "update", key_id, "--max-gpus", "none")
        assert lifted.exit_code == ExitCode.OK, lifted.stderr
        assert self.listed(settings)["sweeps"] == {
            "id": key_id,
            "max_running_runs": 3,
            "max_queued_runs": None,
            "max_gpus": None,
            "max_priority": 60,
        }

    @pytest.mark.parametrize(
        ("flag", "value", "exit_code", "says"),
        [
            ("--max-priority", "101", ExitCode.REFUSED, "max_priority: must be within 0..100"),
            ("--max-gpus", "-1", ExitCode.REFUSED, "max_gpus: must be within 0..2147483647"),
            # Past what PostgreSQL's INTEGER column holds (an overflow traceback before).
            ("--max-gpus", "3000000000", ExitCode.REFUSED, "max_gpus: must be within 0.."),
            ("--max-running-runs", "two", ExitCode.USAGE, "is not a whole number or 'none'"),
        ],
    )
    def test_an_invalid_limit_is_refused_and_nothing_changes(
        self, settings: Settings, flag: str, value: str, exit_code: int, says: str
    ) -> None:
        self.keys(settings, "create", "--name", "sweeps", "--max-priority", "60")
        before = self.listed(settings)

        updated = self.keys(settings, "update", "sweeps", flag, value)
        assert updated.exit_code == exit_code
        assert says in " ".join(updated.stderr.split())
        assert self.listed(settings) == before

        created = self.keys(settings, "create", "--name", "another", flag, value)
        assert created.exit_code == exit_code
        assert "another" not in self.listed(settings)

    def test_updating_a_key_that_does_not_exist_exits_4(self, settings: Settings) -> None:
        self.keys(settings, "create", "--name", "sweeps")
        result = self.keys(settings, "update", "nobody", "--max-gpus", "1")
        assert result.exit_code == ExitCode.NOT_FOUND
        assert "no API key with the id or live key with the name 'nobody'" in result.stderr

    def test_permissions_are_set_shown_and_lifted_as_limits_are(self, settings: Settings) -> None:
        created = self.keys(
            settings,
            "create",
            "--name",
            "sweeps",
            "--max-priority",
            "60",
            "--allow-non-preemptible",
            "--tracking-prefix",
            "sweeps-",
            "--wandb-entity",
            "acme",
        )
        assert created.exit_code == ExitCode.OK, created.stderr
        self.keys(settings, "create", "--name", "on-call")
        permissions = ("allow_non_preemptible", "tracking_prefix", "wandb_entity")

        def shown() -> dict[str, dict[str, Any]]:
            listed = json.loads(self.keys(settings, "list", "--json").stdout)
            return {k["name"]: {n: k[n] for n in permissions} for k in listed}

        assert shown() == {
            "sweeps": {
                "allow_non_preemptible": True,
                "tracking_prefix": "sweeps-",
                "wandb_entity": "acme",
            },
            "on-call": dict.fromkeys(permissions),
        }
        table = self.keys(settings, "list").stdout
        for column in ("non-preemptible", "tracking prefix", "wandb entity"):
            assert column in table
        rows = {line.split("│")[2].strip(): line for line in table.splitlines() if "│" in line}
        assert "sweeps-" in rows["sweeps"] and "acme" in rows["sweeps"]
        assert "unless capped" in rows["on-call"]

        updated = self.keys(
            settings, "update", "sweeps", "--no-allow-non-preemptible", "--wandb-entity", "none"
        )
        assert updated.exit_code == ExitCode.OK, updated.stderr
        assert 'allow_non_preemptible false, tracking_prefix "sweeps-"' in updated.stdout
        assert shown()["sweeps"] == {
            "allow_non_preemptible": False,
            "tracking_prefix": "sweeps-",
            "wandb_entity": None,
        }

        refused = self.keys(settings, "update", "sweeps", "--tracking-prefix", "team/b")
        assert refused.exit_code == ExitCode.REFUSED
        assert "tracking_prefix: must be 1 to 64 letters" in " ".join(refused.stderr.split())
        assert shown()["sweeps"]["tracking_prefix"] == "sweeps-"
