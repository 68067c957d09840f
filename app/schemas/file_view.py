"""What clients read about an uploaded file."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from app.schemas.run_view import as_utc
from app.storage.models import File


class FileView(BaseModel):
    object: str = "file"
    id: str
    filename: str
    format: str
    purpose: str
    bytes: int
    records: int
    fields: list[str]
    created_at: datetime
    # OpenAI's file fields where they do not clash with tuneyard's: every stored file was
    # checked whole, and none expires.
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @classmethod
    def of(cls, f: File) -> FileView:
        return cls(
            id=f.id,
            filename=f.filename,
            format=f.format,
            purpose=f.purpose,
            bytes=f.bytes,
            records=f.records,
            fields=f.fields,
            created_at=as_utc(f.created_at),
        )


class FileList(BaseModel):
    object: str = "list"
    data: list[FileView]
    has_more: bool
    next_cursor: str | None
