"""Rows looked up by id for their owner: another key's row is as absent as none, and an id
no row can have is not looked up at all (`is_minted`: a NUL or an odd length never reaches
the database)."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.storage.models import FILE_ID, File, is_minted


def find_file(
    session: Session, *, file_id: str, owner_id: str, for_update: bool = False
) -> File | None:
    """The owner's file with this id; None if there is none, or it is another's. An id no
    file can have is not looked up (app/storage/models.py `is_minted`)."""
    if not is_minted(FILE_ID, file_id):
        return None
    upload = session.get(File, file_id, with_for_update=for_update)
    return upload if upload is not None and upload.owner_id == owner_id else None
