"""Request dependencies as `Annotated` aliases, so routes declare what they need by type."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.errors import Unauthorized
from app.services.api_keys import find_api_key
from app.settings import Settings


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    """The request owns the transaction: commit when the route returns, roll back on error."""
    with request.app.state.session_factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


SettingsDep = Annotated[Settings, Depends(get_settings)]
# scope="function": commit before the response is sent, so a client never reads stale data.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def bearer_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling; `id` None when auth is disabled (a single-user, loopback service)."""

    id: str | None
    name: str


def get_principal(request: Request, session: SessionDep, settings: SettingsDep) -> Principal:
    if settings.auth == "disabled":
        return Principal(id=None, name="anonymous")
    token = bearer_token(request)
    key = find_api_key(session, secret=token) if token else None
    if key is None:
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>'")
    return Principal(id=key.id, name=key.name)


CurrentPrincipal = Annotated[Principal, Depends(get_principal)]
