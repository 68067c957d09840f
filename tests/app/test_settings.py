"""Settings refuse configurations that would misbehave later, naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings


def test_storage_path_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEYARD_STORAGE_PATH", str(tmp_path / "shared"))
    settings = Settings(home=tmp_path)
    assert settings.storage.root == str(tmp_path / "shared")
    assert not settings.storage.remote
    # On a local folder, uploads are received where they are kept.
    assert settings.uploads_dir == tmp_path / "shared" / "files"


class TestObjectStorage:
    def test_an_s3_uri_is_storage_and_uploads_wait_under_home(self, tmp_path: Path) -> None:
        settings = Settings(home=tmp_path, storage_path="s3://bucket/tuneyard/")
        assert settings.storage.remote and settings.storage.root == "s3://bucket/tuneyard"
        assert settings.uploads_location == "s3://bucket/tuneyard/files"
        assert settings.uploads_dir == tmp_path / "uploads"

    def test_a_scheme_nothing_opens_is_refused_naming_the_setting(self, tmp_path: Path) -> None:
        with pytest.raises(ValidationError, match=r"TUNEYARD_STORAGE_PATH: no filesystem opens"):
            Settings(home=tmp_path, storage_path="nosuchscheme://bucket/x")

    def test_options_in_the_uri_are_refused_with_where_they_go(self, tmp_path: Path) -> None:
        with pytest.raises(ValidationError, match=r"AWS_ENDPOINT_URL"):
            Settings(home=tmp_path, storage_path="s3://bucket/x?endpoint_override=h:9000")

    def test_jobs_get_the_object_stores_credentials(self, tmp_path: Path) -> None:
        environ = {
            "AWS_ENDPOINT_URL": "http://minio:9000",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "AWS_UNRELATED": "x",
        }
        remote = Settings(home=tmp_path, storage_path="s3://bucket/x")
        assert remote.resolved_job_env(environ) == {
            "AWS_ENDPOINT_URL": "http://minio:9000",
            "AWS_ACCESS_KEY_ID": "id",
            "AWS_SECRET_ACCESS_KEY": "secret",
        }
        # A local folder needs none: the service's credentials stay its own.
        assert Settings(home=tmp_path).resolved_job_env(environ) == {}


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    monkeypatch.setenv("TUNEYARD_LOG_FORMAT", fmt)
    assert Settings(home=tmp_path).log_format == fmt


def test_unknown_log_format_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEYARD_LOG_FORMAT", "xml")
    with pytest.raises(ValidationError, match="log_format"):
        Settings(home=tmp_path)


def test_serve_refuses_bad_settings_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from app.cli.commands import ExitCode, app

    env = {"TUNEYARD_HOME": str(tmp_path), "TUNEYARD_STORAGE_PATH": "nosuchscheme://bucket/x"}
    result = CliRunner().invoke(app, ["serve"], env=env)
    assert result.exit_code == ExitCode.USAGE
    assert "invalid TUNEYARD_STORAGE_PATH" in result.stderr
    assert not (tmp_path / "tuneyard.db").exists()  # refused before touching anything


class TestPlacementSettings:
    def test_defaults(self, tmp_path: Path) -> None:
        settings = Settings(home=tmp_path)
        assert settings.cluster_autoscales is False
        assert settings.placement_timeout_s == 600

    def test_from_the_environment(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("TUNEYARD_CLUSTER_AUTOSCALES", "true")
        monkeypatch.setenv("TUNEYARD_PLACEMENT_TIMEOUT_S", "45")
        settings = Settings(home=tmp_path)
        assert settings.cluster_autoscales is True
        assert settings.placement_timeout_s == 45

    def test_a_timeout_of_zero_is_refused(self, tmp_path: Path) -> None:
        with pytest.raises(ValidationError, match="placement_timeout_s"):
            Settings(home=tmp_path, placement_timeout_s=0)


class TestJobEnvironmentSettings:
    def test_job_env_is_json_and_passthrough_forwards_names_and_globs(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(
            "TUNEYARD_JOB_ENV", '{"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_GID_INDEX": 3}'
        )
        monkeypatch.setenv("TUNEYARD_JOB_ENV_PASSTHROUGH", "HF_TOKEN, NCCL_*")
        settings = Settings(home=tmp_path)
        environ = {
            "HF_TOKEN": "hf_secret",
            "NCCL_DEBUG": "INFO",
            "NCCL_SOCKET_IFNAME": "ens5",  # the explicit TUNEYARD_JOB_ENV value wins
            "HOME": "/root",
            "TUNEYARD_HOME": "/srv/tuneyard",
        }
        assert settings.resolved_job_env(environ) == {
            "HF_TOKEN": "hf_secret",
            "NCCL_DEBUG": "INFO",
            "NCCL_SOCKET_IFNAME": "eth0",
            "NCCL_IB_GID_INDEX": "3",
        }

    def test_nothing_is_forwarded_by_default(self, tmp_path: Path) -> None:
        assert Settings(home=tmp_path).resolved_job_env({"HF_TOKEN": "hf_secret"}) == {}

    @pytest.mark.parametrize(
        ("variable", "value", "reason"),
        [
            ("TUNEYARD_JOB_ENV", '{"TUNEYARD_RUN_SPEC": "{}"}', "a variable tuneyard sets"),
            (
                "TUNEYARD_JOB_ENV",
                '{"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "5"}',
                "TUNEYARD_PLACEMENT_TIMEOUT_S sets",
            ),
            ("TUNEYARD_JOB_ENV", '{"RAY_AUTH_TOKEN": "x"}', "connection to Ray"),
            ("TUNEYARD_JOB_ENV", '{"NCCL_DEBUG": ["INFO"]}', "must be a string"),
            ("TUNEYARD_JOB_ENV", "NCCL_DEBUG=INFO", "must be a JSON object"),
            ("TUNEYARD_JOB_ENV_PASSTHROUGH", "HF_TOKEN,TUNEYARD_*", "a variable tuneyard sets"),
            ("TUNEYARD_JOB_ENV_PASSTHROUGH", "RAY_AUTH_*", "connection to Ray"),
            ("TUNEYARD_JOB_ENV_PASSTHROUGH", "*", "every variable of the service"),
            ("TUNEYARD_JOB_ENV_PASSTHROUGH", "NCCL-*", "not a variable name"),
        ],
    )
    def test_tuneyards_own_variables_and_bad_values_are_refused_naming_the_variable(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        variable: str,
        value: str,
        reason: str,
    ) -> None:
        from typer.testing import CliRunner

        from app.cli.commands import ExitCode, app

        monkeypatch.setenv(variable, value)
        with pytest.raises(ValidationError, match=reason):
            Settings(home=tmp_path)
        result = CliRunner().invoke(app, ["serve"], env={"TUNEYARD_HOME": str(tmp_path)})
        assert result.exit_code == ExitCode.USAGE
        assert f"invalid {variable}:" in result.stderr
        assert reason in " ".join(result.stderr.split())

    def test_a_malformed_job_env_is_refused_without_echoing_its_values(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("TUNEYARD_JOB_ENV", '{"HF_TOKEN": "hf_do_not_print_me"')
        with pytest.raises(ValidationError) as raised:
            Settings(home=tmp_path)
        assert "must be a JSON object" in str(raised.value)
        assert "hf_do_not_print_me" not in str(raised.value)


class TestSourceRoots:
    def test_the_default_roots_hold_the_storage_but_refuse_it(self, tmp_path: Path) -> None:
        # $TUNEYARD_HOME holds the storage path: without `refused`, any tenant could train
        # on another's upload or export by naming its path.
        settings = Settings(home=tmp_path / "home")
        roots = settings.resolved_allowed_roots
        uploads, storage = settings.uploads_dir, Path(settings.storage.root)
        assert settings.home_dir in roots and storage.is_relative_to(settings.home_dir)
        assert roots.refused == {
            uploads: "uploads",
            storage: "storage",
            settings.ray_state_dir: "state",
        }

    def test_configured_roots_refuse_the_storage_too(self, tmp_path: Path) -> None:
        settings = Settings(
            home=tmp_path / "home", storage_path=tmp_path / "shared", allowed_roots=str(tmp_path)
        )
        roots = settings.resolved_allowed_roots
        assert list(roots) == [tmp_path.resolve()]
        shared = (tmp_path / "shared").resolve()
        assert list(roots.refused.items())[:2] == [
            (shared / "files", "uploads"),
            (shared, "storage"),
        ]


def test_python_graders_are_refused_where_they_cannot_be_sandboxed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap, prlimit or taskset on it
    with pytest.raises(ValidationError) as raised:
        Settings(python_graders=True)
    assert "TUNEYARD_PYTHON_GRADERS" in str(raised.value)
    assert "apt-get install bubblewrap" in str(raised.value)
    assert Settings(python_graders=False).python_graders is False
