"""API keys: created by an operator (`tuneyard keys create`), sent as a Bearer token."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import ApiKey, new_id
from app.security import hash_secret, new_secret


def create_api_key(session: Session, *, name: str) -> tuple[ApiKey, str]:
    """The stored key and its secret; the secret is not kept and cannot be shown again."""
    secret = new_secret("ty")
    key = ApiKey(id=new_id("key"), name=name, key_hash=hash_secret(secret))
    session.add(key)
    session.flush()
    return key, secret


def find_api_key(session: Session, *, secret: str) -> ApiKey | None:
    return session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))
