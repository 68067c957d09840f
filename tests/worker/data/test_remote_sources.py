"""Sources in object storage (an upload, an earlier run's export) are copied once per
node, complete or not at all, and the spec the worker trains from points at the copy."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from contract.run_request import RunRequest, RunSpec
from contract.storage import Storage
from tests.conftest import S3Server
from worker.data.remote_sources import local_copy, with_local_sources


def test_a_folder_is_copied_once_however_many_ranks_ask(
    s3_env: S3Server, tmp_path: Path, tiny_model_dir: Path
) -> None:
    storage = Storage(f"s3://{s3_env.create_bucket()}/t")
    location = storage.join("run_1", "export")
    storage.put(tiny_model_dir, location)
    cache = tmp_path / "cache"
    copies: list[str] = []
    ranks = [
        threading.Thread(target=lambda: copies.append(local_copy(location, root=cache)))
        for _ in range(4)
    ]
    for rank in ranks:
        rank.start()
    for rank in ranks:
        rank.join()
    assert len(set(copies)) == 1
    copy = Path(copies[0])
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        p.name for p in tiny_model_dir.iterdir()
    )
    # Nothing half-copied is left beside it.
    assert [p.name for p in copy.parent.iterdir() if p.name.startswith(".partial")] == []


def test_local_paths_and_hub_ids_are_left_alone(tmp_path: Path) -> None:
    assert local_copy("/data/train.jsonl", root=tmp_path) == "/data/train.jsonl"
    assert local_copy("gpt2", root=tmp_path) == "gpt2"
    assert list(tmp_path.iterdir()) == []


def test_the_spec_points_at_the_copies(
    s3_env: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path
) -> None:
    monkeypatch.setenv("TUNEYARD_SOURCE_CACHE", str(tmp_path / "cache"))
    storage = Storage(f"s3://{s3_env.create_bucket()}/t")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a"}\n')
    storage.put(data, storage.join("files", "file_1.jsonl"))
    storage.put(tiny_model_dir, storage.join("run_1", "export"))
    request = RunRequest.model_validate({"model": "gpt2", "dataset": {"source": "file_1"}})
    spec = RunSpec.for_attempt(
        {
            **request.worker_fields(),
            "model": storage.join("run_1", "export"),
            "dataset": {
                **request.worker_fields()["dataset"],
                "source": storage.join("files", "file_1.jsonl"),
            },
        },
        run_id="run_2",
        attempt=1,
        storage_path=storage.root,
    )
    local = with_local_sources(spec)
    assert Path(local.dataset.source).read_text() == '{"text": "a"}\n'
    assert (Path(local.model) / "config.json").is_file()
    # Exports name the model as the run gave it, not this node's temporary copy.
    assert local.given_model == spec.model == storage.join("run_1", "export")
    assert local.storage_path == storage.root  # checkpoints still go to storage
