"""Uploaded dataset files: received and checked, recorded, then published into storage.

An upload goes through three steps, in the order that leaves neither a file without its row
nor a row without its file:

1. `receive_upload` streams the file into `<id><suffix>.partial` in storage and checks every
   record. No transaction is open: a large file or a slow check holds no database lock.
2. `record_upload` inserts the row; the caller commits, and on any failure calls
   `discard_upload`, which removes the partial file.
3. `publish_upload` moves the partial file to its final name in storage, after the commit:
   a rename when storage is a local folder, an upload when it is an object store (then the
   partial file waits in a folder under TUNEYARD_HOME, `Settings.uploads_dir`).

Why commit before the rename, rather than rename and remove the file if the commit fails: a
process killed between the two steps then leaves a `.partial` file, which its name marks as
unfinished, and the row, if it was committed, says which way to settle it (`sweep_partials`).
Renaming first would leave a file that looks published and has no row, found only by listing
storage against the table. In the instant between commit and rename a row names a file not
there yet: nothing opens it then (a run reads the row's path, records and fields; its worker
opens the file only once the run is dispatched).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import BinaryIO, Literal, cast

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from app.errors import Conflict, NotFound, PayloadTooLarge, ValidationFailed, field_problem
from app.services.rules.file_checks import FINE_TUNE, RecordChecks, check_file, detect_purpose
from app.storage.lookups import find_file
from app.storage.models import File, Run, new_id
from contract.datasets import FILE_FORMATS, Purpose, file_format
from contract.statuses import TERMINAL_STATUSES
from contract.storage import Storage, StorageError

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
PARTIAL_SUFFIX = ".partial"
# A partial file left untouched this long belongs to no upload in progress: the longest step
# that does not write to it, checking every record of a 1 GiB file, takes minutes.
PARTIAL_MAX_AGE_S = 3600.0
# Listing the storage folder costs more as it fills; one look now and then is enough.
SWEEP_EVERY_S = 600.0
# The `files.filename` column's size.
MAX_FILENAME_CHARS = 255
_MAX_SUFFIX_CHARS = 16


@dataclass(frozen=True, slots=True)
class ReceivedUpload:
    """A checked upload in its partial file, not yet recorded."""

    id: str
    filename: str
    format: str
    bytes: int
    records: int
    fields: list[str]
    partial: Path
    final: str  # its location in storage
    # What it was checked for: the purpose asked for, or the one "fine-tune" resolved to.
    purpose: Purpose


# The checks for a purpose, as the route builds them from its form fields.
ChecksFor = Callable[[Purpose], RecordChecks]


def safe_filename(raw: str | None) -> str:
    """The client's name for a file, reduced to what is safe to store and show: the last
    component of either kind of path, without control or other unprintable characters (NUL
    is refused by PostgreSQL; bidi overrides disguise an extension), at most
    MAX_FILENAME_CHARS long with its extension kept. It is only ever shown: storage names
    files by their id."""
    name = re.split(r"[/\\]", raw or "")[-1]
    name = "".join(ch for ch in name if ch.isprintable()).strip()
    if name in {"", ".", ".."}:
        return "upload"
    if len(name) > MAX_FILENAME_CHARS:
        suffix = PurePath(name).suffix
        if len(suffix) > _MAX_SUFFIX_CHARS:
            suffix = ""
        name = name[: MAX_FILENAME_CHARS - len(suffix)] + suffix
    return name


def receive_upload(
    *,
    filename: str,
    stream: BinaryIO,
    storage_dir: Path,
    uploads_location: str,
    max_bytes: int,
    purpose: Purpose | Literal["fine-tune"],
    checks_for: ChecksFor,
) -> ReceivedUpload:
    """Copy `stream` into a partial file under `storage_dir` and check every record for
    `purpose` (OpenAI's "fine-tune": for the kind its first record is); on any problem the
    partial file is removed and the problem raised."""
    fmt = file_format(filename)
    if fmt is None:
        raise ValidationFailed(
            [
                field_problem(
                    "file",
                    f"{filename!r}: the file must end in one of {', '.join(sorted(FILE_FORMATS))}",
                )
            ]
        )
    file_id = new_id("file")
    storage_dir.mkdir(parents=True, exist_ok=True)
    # Only the server's id and one of FILE_FORMATS' suffixes make the name: nothing the
    # client sent can point it elsewhere.
    name = f"{file_id}{PurePath(filename).suffix.lower()}"
    partial = storage_dir / (name + PARTIAL_SUFFIX)
    try:
        size = _copy_limited(stream, partial, max_bytes)
        kind = (
            detect_purpose(partial, fmt=fmt.name)
            if purpose == FINE_TUNE
            else cast(Purpose, purpose)  # every other value the form takes is a Purpose
        )
        if kind is None:
            raise ValidationFailed(
                [
                    field_problem(
                        "file",
                        "a fine-tune file holds chat records ('messages'), preference pairs "
                        "('prompt', 'chosen', 'rejected') or prompt/completion pairs "
                        "('prompt', 'completion'); its first record is none of these",
                    )
                ]
            )
        report = check_file(partial, fmt=fmt.name, checks=checks_for(kind))
        if report.errors:
            more = [f"… and {report.more_errors} more"] if report.more_errors else []
            raise ValidationFailed(
                [field_problem("file", message) for message in report.errors + more]
            )
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return ReceivedUpload(
        id=file_id,
        filename=filename,
        format=fmt.name,
        bytes=size,
        records=report.records,
        fields=report.fields,
        partial=partial,
        final=f"{uploads_location}/{name}",
        purpose=kind,
    )


def record_upload(session: Session, *, upload: ReceivedUpload, owner_id: str) -> File:
    row = File(
        id=upload.id,
        owner_id=owner_id,
        filename=upload.filename,
        format=upload.format,
        purpose=upload.purpose,
        bytes=upload.bytes,
        records=upload.records,
        fields=upload.fields,
        path=upload.final,
    )
    session.add(row)
    session.flush()
    return row


def publish_upload(upload: ReceivedUpload, storage: Storage) -> None:
    """Move a recorded upload into place; call only once its row is committed."""
    storage.move_in(upload.partial, upload.final)


def discard_upload(upload: ReceivedUpload) -> None:
    """Remove an upload whose row was not committed."""
    upload.partial.unlink(missing_ok=True)


def get_file(session: Session, *, file_id: str, owner_id: str, for_update: bool = False) -> File:
    upload = find_file(session, file_id=file_id, owner_id=owner_id, for_update=for_update)
    if upload is None:
        raise NotFound(f"file {file_id} not found")
    return upload


MAX_PAGE = 100


def list_files(
    session: Session, *, owner_id: str, after: str | None, limit: int
) -> tuple[list[File], bool]:
    """The owner's files, newest first; `after` is the last file id of the previous page."""
    query = select(File).where(File.owner_id == owner_id)
    if after is not None:
        last = get_file(session, file_id=after, owner_id=owner_id)
        query = query.where(
            or_(
                File.created_at < last.created_at,
                and_(File.created_at == last.created_at, File.id < last.id),
            )
        )
    limit = max(1, min(limit, MAX_PAGE))
    rows = list(
        session.scalars(query.order_by(File.created_at.desc(), File.id.desc()).limit(limit + 1))
    )
    return rows[:limit], len(rows) > limit


def _sources(run: Run) -> tuple[str | None, str | None]:
    dataset = run.spec["dataset"]
    return dataset.get("source"), dataset.get("eval_source")


def delete_file(session: Session, *, file_id: str, owner_id: str) -> str:
    """Remove a file's row; returns its location, for the caller to remove once that commits.
    A file that a queued or live run reads is refused: the run would fail when it opens
    it. (A finished run keeps only the path: resuming it after the delete fails, saying
    the file is gone.)"""
    # Locked: a create storing a run that reads it (runs.store_run) finishes first, and its
    # run is among the live ones below; or it waits, and finds the file gone.
    upload = get_file(session, file_id=file_id, owner_id=owner_id, for_update=True)
    live = session.scalars(
        select(Run).where(Run.owner_id == owner_id, Run.status.not_in(TERMINAL_STATUSES))
    )
    users = [run.id for run in live if upload.path in _sources(run)]
    if users:
        raise Conflict(
            f"file {file_id} is read by run {users[0]}"
            + (f" and {len(users) - 1} more" if len(users) > 1 else "")
            + ", which has not finished; cancel it or wait for it to end"
        )
    session.delete(upload)
    session.flush()
    return upload.path


def remove_stored(storage: Storage, location: str) -> None:
    """Remove a deleted file's bytes; one that cannot be removed now is only logged (its
    row is gone: nothing reaches it any more)."""
    try:
        storage.delete(location)
    except StorageError as exc:
        log.warning("could not remove a deleted file's bytes: %s", exc)


_last_sweep: dict[Path, float] = {}


def sweep_partials_now_and_then(
    session: Session,
    *,
    storage_dir: Path,
    storage: Storage,
    uploads_location: str,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """`sweep_partials`, at most once per SWEEP_EVERY_S for each storage folder."""
    now = clock()
    last = _last_sweep.get(storage_dir)
    if last is not None and now - last < SWEEP_EVERY_S:
        return
    _last_sweep[storage_dir] = now
    sweep_partials(
        session, storage_dir=storage_dir, storage=storage, uploads_location=uploads_location
    )


def sweep_partials(
    session: Session,
    *,
    storage_dir: Path,
    storage: Storage,
    uploads_location: str,
    older_than_s: float = PARTIAL_MAX_AGE_S,
) -> None:
    """Settle partial files that uploads interrupted by a crash left behind: publish those
    whose row was committed, remove the others."""
    if not storage_dir.is_dir():
        return
    cutoff = time.time() - older_than_s
    for partial in storage_dir.glob(f"*{PARTIAL_SUFFIX}"):
        try:
            if partial.stat().st_mtime > cutoff:
                continue
            file_id = partial.name.split(".", 1)[0]
            name = partial.name.removesuffix(PARTIAL_SUFFIX)
            recorded = session.get(File, file_id) is not None
            if recorded:
                storage.move_in(partial, f"{uploads_location}/{name}")
                log.info("published %s, whose upload stopped after its commit", name)
            else:
                partial.unlink(missing_ok=True)
                log.info("removed %s, left by an unfinished upload", partial.name)
        except FileNotFoundError:
            continue  # settled meanwhile by another process's sweep


def _copy_limited(stream: BinaryIO, target: Path, max_bytes: int) -> int:
    size = 0
    with target.open("wb") as out:
        while chunk := stream.read(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise PayloadTooLarge(
                    f"the file is larger than the {max_bytes}-byte limit "
                    "(TUNEYARD_MAX_UPLOAD_BYTES)"
                )
            out.write(chunk)
    return size
