"""API keys: created by an operator (`tuneyard keys create`), sent as a Bearer token, and
revoked by one (`tuneyard keys revoke`). Each has a webhook signing secret of its own
(app/services/webhooks.py), shown when the key is made and when it is replaced
(`tuneyard keys rotate-webhook-secret`)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, select
from sqlalchemy.orm import Session

from app.errors import Conflict, NotFound, ValidationFailed, field_problem
from app.security import hash_secret, new_secret
from app.storage.models import ApiKey, new_id, utcnow
from contract.bounds import INT32_MAX

# A key's share of the cluster (app/services/queue.py and scheduling.py apply them); None
# is no limit. `tuneyard keys create/update` set them.
LIMITS = ("max_running_runs", "max_queued_runs", "max_gpus", "max_priority")
# What a key's runs may ask for beyond its share, set alike (None: the default rule, see
# ApiKey): preemptible false (app/services/queue.py), and where they track
# (app/services/rules/tracking_rules.py).
PERMISSIONS = ("allow_non_preemptible", "tracking_prefix", "wandb_entity")
# A limit's or a permission's value.
KeySetting = int | bool | str | None
# An update's value that lifts a limit (or a permission's setting).
UNLIMITED = "none"
# A tracking prefix or W&B entity: a name both MLflow and W&B take as the start of theirs
# (W&B's refuse / \ # ? % :), short enough to leave room after it.
_TRACKING_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def limit_problems(limits: Mapping[str, KeySetting]) -> list[dict[str, str]]:
    """What is wrong with these limits and permissions, each naming its own; [] when
    nothing is."""
    problems = []
    for name, value in limits.items():
        if name not in LIMITS and name not in PERMISSIONS:
            known = ", ".join((*LIMITS, *PERMISSIONS))
            problems.append(field_problem(name, f"not a limit or a permission: they are {known}"))
        elif value is None:
            continue
        elif name in PERMISSIONS:
            if (problem := _permission_problem(name, value)) is not None:
                problems.append(field_problem(name, problem))
        elif not isinstance(value, int) or isinstance(value, bool):
            problems.append(field_problem(name, f"must be a whole number, not {value!r}"))
        elif name == "max_priority" and not 0 <= value <= 100:
            problems.append(
                field_problem(name, f"must be within 0..100, as a priority is; not {value}")
            )
        elif not 0 <= value <= INT32_MAX:  # a column every database holds
            problems.append(field_problem(name, f"must be within 0..{INT32_MAX}, not {value}"))
    return problems


def _permission_problem(name: str, value: KeySetting) -> str | None:
    if name == "allow_non_preemptible":
        return None if isinstance(value, bool) else f"must be true or false, not {value!r}"
    if not isinstance(value, str) or _TRACKING_NAME.fullmatch(value) is None:
        return (
            f"must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or a "
            f"digit; not {value!r}"
        )
    return None


def _set_limits(key: ApiKey, limits: Mapping[str, KeySetting]) -> None:
    if problems := limit_problems(limits):
        raise ValidationFailed(problems)
    for name, value in limits.items():
        setattr(key, name, value)


def new_webhook_secret() -> str:
    return new_secret("whsec")


def create_api_key(
    session: Session, *, name: str, limits: Mapping[str, KeySetting] | None = None
) -> tuple[ApiKey, str]:
    """The stored key and its secret; the secret is not kept and cannot be shown again. The
    key's webhook signing secret is (`key.webhook_secret`): it signs, so it is kept."""
    secret = new_secret("ty")
    key = ApiKey(
        id=new_id("key"),
        name=name,
        key_hash=hash_secret(secret),
        webhook_secret=new_webhook_secret(),
    )
    _set_limits(key, limits or {})
    session.add(key)
    session.flush()
    return key, secret


def update_api_key(session: Session, *, ref: str, limits: Mapping[str, KeySetting]) -> ApiKey:
    """Change the limits named in `limits` (None lifts one) of the key with this id, or of
    the one live key with this name. Runs already queued or running stay; the scheduler
    applies the new limits from its next pass, in every replica."""
    key = _find_key(session, ref)
    _set_limits(key, limits)
    session.flush()
    return key


def rotate_webhook_secret(session: Session, *, ref: str) -> tuple[ApiKey, str]:
    """Replace the webhook signing secret of the key with this id, or of the one live key
    with this name: the key and its new secret. Deliveries sent from now on, retries of
    earlier ones included, are signed with it."""
    key = _find_key(session, ref)
    key.webhook_secret = new_webhook_secret()
    session.flush()
    return key, key.webhook_secret


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
    key = _find_key(session, ref)
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.flush()
    return key


def _find_key(session: Session, ref: str) -> ApiKey:
    """The key with this id, or else the one live key with this name, locked."""
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
            raise Conflict(f"{len(named)} live keys are named {ref!r} ({ids}): name one by id")
        key = named[0]
    return key


@contextmanager
def _database(database_url: str) -> Iterator[Session]:
    """A transaction on the service's database outside any request (the CLI, the demo),
    brought to the current schema first, so this works before the first `serve`."""
    from app.storage.db import make_engine, make_session_factory, transaction
    from app.storage.migrate import upgrade_database

    upgrade_database(database_url)
    engine = make_engine(database_url)
    try:
        with transaction(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


class IssuedKey(NamedTuple):
    secret: str  # the API key itself
    webhook_secret: str  # signs the webhooks of its runs


def issue_api_key(
    database_url: str, *, name: str, limits: Mapping[str, KeySetting] | None = None
) -> IssuedKey:
    """A new key's secrets (`tuneyard keys create`, the demo)."""
    with _database(database_url) as session:
        key, secret = create_api_key(session, name=name, limits=limits)
        assert key.webhook_secret is not None
        return IssuedKey(secret, key.webhook_secret)


def rotate_webhook_secret_in(database_url: str, *, ref: str) -> tuple[ApiKey, str]:
    """`tuneyard keys rotate-webhook-secret`."""
    with _database(database_url) as session:
        return rotate_webhook_secret(session, ref=ref)


def update_api_key_in(database_url: str, *, ref: str, limits: Mapping[str, KeySetting]) -> ApiKey:
    """`tuneyard keys update`."""
    with _database(database_url) as session:
        return update_api_key(session, ref=ref, limits=limits)


def api_keys_in(database_url: str) -> list[ApiKey]:
    """`tuneyard keys list`."""
    with _database(database_url) as session:
        return list_api_keys(session)


def revoke_api_key_in(database_url: str, *, ref: str) -> ApiKey:
    """`tuneyard keys revoke`: in effect from the next request on, in every process."""
    with _database(database_url) as session:
        return revoke_api_key(session, ref=ref)
