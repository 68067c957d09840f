"""A run's exported model as one tar stream, read from storage as it is sent.

A user gets the trained model without access to the cluster or the bucket: the archive
holds the export folder's files (config, safetensors, tokenizer; a LoRA run's adapter),
relative to the folder, so unpacking it anywhere gives a folder `from_pretrained` loads.
Nothing is staged: each file is read from storage in chunks while the response is sent,
so a 140 GB model costs the service no disk and little memory.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator

from app.errors import Conflict, NotFound
from app.services.rules.path_rules import run_location
from app.storage.models import Run
from contract.storage import Storage, StorageError, StoredFile

_BLOCK = tarfile.BLOCKSIZE


def model_files(run: Run, storage: Storage) -> tuple[str, list[StoredFile]]:
    """The run's export location and its files; raises what the route answers with when
    there is none to send."""
    location = run.model_path
    if not location:
        raise Conflict(
            f"run {run.id} has no exported model (status {run.status!r}; an export is written "
            "when a run with checkpointing.export_hf succeeds)"
        )
    if not storage.contains(location):
        raise Conflict(
            f"run {run.id}'s model is at {location!r}, outside this service's storage "
            "(TUNEYARD_STORAGE_PATH changed since?): read it from there"
        )
    if run_location(storage, run.id, location)[0] is None:
        # Recorded before the callback refused such paths (app/services/callbacks.py).
        raise Conflict(
            f"run {run.id}'s model is recorded at {location!r}, outside the run's own folder "
            "in storage: it is not served"
        )
    files = storage.files(location)  # a StorageError is answered 503 (error_handlers.py)
    if not files:
        raise NotFound(f"run {run.id}'s exported model is no longer in storage ({location})")
    return location, files


def tar_chunks(storage: Storage, location: str, files: list[StoredFile]) -> Iterator[bytes]:
    """A POSIX tar (pax headers, so any name length) of `files` under `location`."""
    for stored in files:
        info = tarfile.TarInfo(stored.name)
        info.size = stored.size
        info.mode = 0o644
        yield info.tobuf(format=tarfile.PAX_FORMAT)
        sent = 0
        for chunk in storage.read_chunks(f"{location}/{stored.name}"):
            sent += len(chunk)
            yield chunk
        if sent != stored.size:
            # The header promised another size: a truncated archive must not look whole.
            raise StorageError(
                f"{location}/{stored.name} changed while it was sent ({sent} bytes, "
                f"{stored.size} listed)"
            )
        if remainder := stored.size % _BLOCK:
            yield b"\0" * (_BLOCK - remainder)
    yield b"\0" * (2 * _BLOCK)  # the end-of-archive marker
