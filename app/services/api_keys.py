"""API keys: created by an operator (`tuneyard keys create`), sent as a Bearer token, and
revoked by one (`tuneyard keys revoke`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, select
from sqlalchemy.orm import Session

from app.errors import Conflict, NotFound
from app.models import ApiKey, new_id, utcnow
from app.security import hash_secret, new_secret


def create_api_key(session: Session, *, name: str) -> tuple[ApiKey, str]:
    """The stored key and its secret; the secret is not kept and cannot be shown again."""
    secret = new_secret("ty")
    key = ApiKey(id=new_id("key"), name=name, key_hash=hash_secret(secret))
    session.add(key)
    session.flush()
    return key, secret


class LiveKey(NamedTuple):
    id: str
    name: str


_api_keys = cast(Table, ApiKey.__table__)
# Every request runs this (keys are never cached, so that a revocation holds at once): one
# statement built once, run on the connection, skips the ORM's per-query work, which cost
# more than the lookup itself.
_FIND_LIVE_KEY = select(_api_keys.c.id, _api_keys.c.name).where(
    _api_keys.c.key_hash == bindparam("key_hash"), _api_keys.c.revoked_at.is_(None)
)


def find_api_key(db: Session | Connection, *, secret: str) -> LiveKey | None:
    """The key this secret belongs to, unless it was revoked. On a connection of its own
    (the request's check), no session is begun and ended for it."""
    connection = db.connection() if isinstance(db, Session) else db
    row = connection.execute(_FIND_LIVE_KEY, {"key_hash": hash_secret(secret)}).first()
    return None if row is None else LiveKey(row.id, row.name)


def list_api_keys(session: Session) -> list[ApiKey]:
    """Every key, revoked ones included, oldest first."""
    return list(session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)))


def revoke_api_key(session: Session, *, ref: str) -> ApiKey:
    """Revoke the key with this id, or else the one live key with this name. Revoking a
    revoked key changes nothing (its first revocation time stays)."""
    key = session.get(ApiKey, ref, with_for_update=True)
    if key is None:
        named = list(
            session.scalars(
                select(ApiKey)
                .where(ApiKey.name == ref, ApiKey.revoked_at.is_(None))
                .with_for_update()
            )
        )
        if not named:
            raise NotFound(f"no API key with the id or live key with the name {ref!r}")
        if len(named) > 1:
            ids = ", ".join(k.id for k in named)
            raise Conflict(f"{len(named)} live keys are named {ref!r} ({ids}): revoke one by id")
        key = named[0]
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


@contextmanager
def _database(database_url: str) -> Iterator[Session]:
    """A transaction on the service's database outside any request (the CLI, the demo),
    brought to the current schema first, so this works before the first `serve`."""
    from app.db import make_engine, make_session_factory, transaction
    from app.migrate import upgrade_database

    upgrade_database(database_url)
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


def issue_api_key(database_url: str, *, name: str) -> str:
    """A new key's secret (`tuneyard keys create`, the demo)."""
    with _database(database_url) as session:
        _, secret = create_api_key(session, name=name)
    return secret


def api_keys_in(database_url: str) -> list[ApiKey]:
    """`tuneyard keys list`."""
    with _database(database_url) as session:
        return list_api_keys(session)


def revoke_api_key_in(database_url: str, *, ref: str) -> ApiKey:
    """`tuneyard keys revoke`: in effect from the next request on, in every process."""
    with _database(database_url) as session:
        return revoke_api_key(session, ref=ref)
