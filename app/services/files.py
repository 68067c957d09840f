"""Uploaded dataset files: streamed to storage, checked, then recorded."""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from app.errors import NotFound, PayloadTooLarge, ValidationFailed, field_problem
from app.models import File, new_id
from app.services.file_checks import check_file
from contract.datasets import FILE_FORMATS, Purpose, file_format

_CHUNK = 1 << 20


def store_upload(
    session: Session,
    *,
    owner_id: str,
    filename: str,
    stream: BinaryIO,
    storage_dir: Path,
    max_bytes: int,
    purpose: Purpose,
    required: list[str],
    label_field: str | None,
) -> File:
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
    final = storage_dir / f"{file_id}{Path(filename).suffix.lower()}"
    partial = final.with_name(final.name + ".partial")
    try:
        size = _copy_limited(stream, partial, max_bytes)
        report = check_file(partial, fmt=fmt.name, required=required, label_field=label_field)
        if report.errors:
            more = [f"… and {report.more_errors} more"] if report.more_errors else []
            raise ValidationFailed(
                [field_problem("file", message) for message in report.errors + more]
            )
        partial.rename(final)
    finally:
        partial.unlink(missing_ok=True)
    upload = File(
        id=file_id,
        owner_id=owner_id,
        filename=Path(filename).name[:255],
        format=fmt.name,
        purpose=purpose,
        bytes=size,
        records=report.records,
        fields=report.fields,
        path=str(final),
    )
    session.add(upload)
    session.flush()
    return upload


def get_file(session: Session, *, file_id: str, owner_id: str) -> File:
    upload = session.get(File, file_id)
    if upload is None or upload.owner_id != owner_id:
        raise NotFound(f"file {file_id} not found")
    return upload


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
