"""The GPU checks' tests: a service on SQLite that allows the module's `dry_assets`."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.settings import Settings


@pytest.fixture
def database_url(sqlite_url: str) -> str:
    """SQLite only: these tests are about the benchmarks' requests, not the data layer."""
    return sqlite_url


@pytest.fixture
def settings(tmp_path: Path, database_url: str, dry_assets: tuple[Path, Path]) -> Settings:
    """The service's settings, allowing the folder of the module's dry-run assets."""
    home = tmp_path / "home"
    home.mkdir()
    return Settings(home=home, database_url=database_url, allowed_roots=str(dry_assets[0].parent))
