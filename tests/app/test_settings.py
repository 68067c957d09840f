"""Settings refuse configurations that would misbehave later, naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.settings import Settings


def test_storage_uri_is_refused_with_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"TUNEYARD_STORAGE_PATH.*mount the bucket"):
        Settings(home=tmp_path, storage_path="s3://bucket/tuneyard")


def test_storage_path_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNEYARD_STORAGE_PATH", str(tmp_path / "shared"))
    assert Settings(home=tmp_path).resolved_storage_path == tmp_path / "shared"


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

    from app.cli import ExitCode, app

    env = {"TUNEYARD_HOME": str(tmp_path), "TUNEYARD_STORAGE_PATH": "s3://bucket/x"}
    result = CliRunner().invoke(app, ["serve"], env=env)
    assert result.exit_code == ExitCode.USAGE
    assert "invalid TUNEYARD_STORAGE_PATH" in result.stderr
    assert not (tmp_path / "tuneyard.db").exists()  # refused before touching anything
