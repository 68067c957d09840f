"""A hub id never loads a folder of the same name from the job's working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.data.sources import refuse_shadowed_hub_id


def test_a_hub_id_shadowed_by_a_relative_folder_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "outside" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"model 'outside/model' is a hub id.*absolute path"):
        refuse_shadowed_hub_id("model", "outside/model")


def test_hub_ids_and_local_paths_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    refuse_shadowed_hub_id("model", "outside/model")  # nothing of that name here
    (tmp_path / "data").mkdir()
    refuse_shadowed_hub_id("dataset.source", str(tmp_path / "data"))
    refuse_shadowed_hub_id("dataset.source", "./data")
