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


def issue_api_key(database_url: str, *, name: str) -> str:
    """A new key's secret, outside any request (`tuneyard keys create`, the demo): the
    database is brought to the current schema first, so this works before the first
    `serve`."""
    from app.db import make_engine, make_session_factory, transaction
    from app.migrate import upgrade_database

    upgrade_database(database_url)
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            _, secret = create_api_key(session, name=name)
    finally:
        engine.dispose()
    return secret
