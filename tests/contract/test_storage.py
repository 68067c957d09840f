"""Storage on a local folder and on a real S3-compatible server (moto, on loopback):
the same calls, the same results; locations are paths or URIs as users see them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from contract.storage import Storage, StorageError, scheme_problem
from tests.conftest import S3Server


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "storage"))
    server: S3Server = request.getfixturevalue("s3_env")
    return Storage(f"s3://{server.create_bucket()}/team/tuneyard")


def _folder(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "config.json").write_text('{"a": 1}')
    (root / "sub" / "weights.bin").write_bytes(bytes(range(256)) * 9000)
    return root


def test_a_folder_goes_in_and_comes_back_whole(storage: Storage, tmp_path: Path) -> None:
    local = _folder(tmp_path / "model")
    location = storage.join("run_1", "export")
    storage.put(local, location)
    assert [(f.name, f.size) for f in storage.files(location)] == [
        ("config.json", 8),
        ("sub/weights.bin", 256 * 9000),
    ]
    assert storage.read_bytes(f"{location}/config.json") == b'{"a": 1}'
    assert b"".join(storage.read_chunks(f"{location}/sub/weights.bin", 1000)) == (
        bytes(range(256)) * 9000
    )
    copy = storage.fetch(location, tmp_path / "copy")
    assert (copy / "sub" / "weights.bin").read_bytes() == bytes(range(256)) * 9000
    assert storage.exists(location) and storage.folders(storage.join("run_1")) == ["export"]


def test_a_local_folder_is_listed_and_read_without_following_links(tmp_path: Path) -> None:
    """What a run wrote in its folder may link anywhere on this machine: a link is neither
    listed nor read, nor is anything but a regular file (issue 39: a model download sent
    a link's target)."""
    storage = Storage(str(tmp_path / "storage"))
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "key.txt").write_text("private")
    export = _folder(tmp_path / "storage" / "run_1" / "export")
    (export / "key.txt").symlink_to(secret / "key.txt")
    (export / "sub" / "linked").symlink_to(secret)
    os.mkfifo(export / "pipe")
    (export.parent / "linked-export").symlink_to(export)
    location = storage.join("run_1", "export")

    assert [f.name for f in storage.files(location)] == ["config.json", "sub/weights.bin"]
    assert storage.files(storage.join("run_1", "linked-export")) == []
    # A file swapped for a link after it was listed is not read either.
    with pytest.raises(StorageError, match=r"key\.txt"):
        storage.read_bytes(f"{location}/key.txt")


def test_put_replaces_what_was_there(storage: Storage, tmp_path: Path) -> None:
    location = storage.join("run_1", "export")
    storage.put(_folder(tmp_path / "first"), location)
    second = tmp_path / "second"
    second.mkdir()
    (second / "only.txt").write_text("x")
    storage.put(second, location)
    assert [f.name for f in storage.files(location)] == ["only.txt"]


def test_delete_removes_a_folder_or_a_file_and_tolerates_neither(
    storage: Storage, tmp_path: Path
) -> None:
    location = storage.join("run_1", "export")
    storage.put(_folder(tmp_path / "model"), location)
    storage.delete(f"{location}/config.json")
    assert [f.name for f in storage.files(location)] == ["sub/weights.bin"]
    storage.delete(location)
    assert not storage.exists(location) and storage.files(location) == []
    storage.delete(location)  # nothing there: no error


def test_move_in_publishes_a_local_file(storage: Storage, tmp_path: Path) -> None:
    local = tmp_path / "file_1.jsonl.partial"
    local.write_text('{"text": "hi"}\n')
    storage.move_in(local, storage.join("files", "file_1.jsonl"))
    assert not local.exists()
    assert storage.read_bytes(storage.join("files", "file_1.jsonl")) == b'{"text": "hi"}\n'


def test_locations_outside_storage_are_refused(storage: Storage) -> None:
    for outside in (storage.root + "-other/x", storage.join("..", "x"), "/etc/passwd"):
        assert not storage.contains(outside)
        with pytest.raises(StorageError, match="not inside storage"):
            storage.read_bytes(outside)


def test_ray_paths_become_the_locations_users_see(storage: Storage) -> None:
    # Ray Train reports a checkpoint's path in its filesystem: without the scheme on S3.
    location = storage.join("run_1", "checkpoint_step_00000003")
    fs_path = location.split("://", 1)[1] if storage.remote else location
    assert storage.location_of(fs_path) == location


def test_a_missing_bucket_is_an_error_that_names_the_location(s3_env: S3Server) -> None:
    with pytest.raises(StorageError, match="storage 's3://no-such-bucket-here/x'"):
        Storage("s3://no-such-bucket-here/x").check_reachable()


def test_schemes() -> None:
    assert scheme_problem("/shared/storage") is None
    assert scheme_problem("s3://bucket/prefix") is None
    assert scheme_problem("gs://bucket/prefix") is None
    assert scheme_problem("memory://x") is None  # an fsspec filesystem
    assert "no filesystem opens nosuch://" in (scheme_problem("nosuch://x") or "")


def test_an_fsspec_scheme_works_through_pyarrow(tmp_path: Path) -> None:
    storage = Storage("memory://tuneyard-test/storage")
    storage.put(_folder(tmp_path / "model"), storage.join("run_1"))
    assert [f.name for f in storage.files(storage.join("run_1"))] == [
        "config.json",
        "sub/weights.bin",
    ]
