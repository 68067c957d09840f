"""Runs: create, read and list. Services flush; the caller's transaction commits."""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from pydantic import TypeAdapter
from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import (
    ColumnElement,
    Connection,
    Select,
    Table,
    and_,
    bindparam,
    exists,
    func,
    inspect,
    or_,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.errors import (
    Conflict,
    NotFound,
    ValidationFailed,
    field_problem,
    problems_from_pydantic,
)
from app.schemas.profile import ValidateRequest
from app.schemas.run_view import RunFields, ValidationReport
from app.security import hash_secret
from app.services import data_plan, estimates, lifecycle, queue
from app.services.api_keys import find_api_key
from app.services.placement import ClusterView
from app.services.rules.run_rules import (
    CheckedRequest,
    Problem,
    RequestPolicy,
    check_run_request,
    uploads_gone,
)
from app.services.rules.tracking_rules import key_tracking_problems
from app.storage.models import RUN_ID, ApiKey, Run, is_minted, new_id
from contract.run_request import MetadataKey, MetadataValue, RunRequest
from contract.statuses import RunStatus
from contract.storage import Storage

MAX_PAGE = 100


@dataclass(frozen=True, slots=True)
class NewRun:
    """A run request checked, ready to store (`prepare_run`, then `store_run`)."""

    request: RunRequest
    owner_id: str
    request_hash: str
    idempotency_key: str | None
    # None when an earlier run with the same Idempotency-Key answers the request.
    checked: CheckedRequest | None


def prepare_run(
    session: Session,
    *,
    request: RunRequest,
    owner_id: str,
    policy: RequestPolicy,
    idempotency_key: str | None = None,
    cluster: ClusterView | None = None,
) -> NewRun:
    """Every check of a new run that reads files (the model's config, the dataset) or the
    cluster, on a read session: the caller does this before `store_run`'s transaction, so
    that none of that I/O holds a write lock (SQLite's is one for the whole service).
    Raises ValidationFailed naming every problem."""
    request_hash = _request_hash(request)
    repeat = idempotency_key is not None and (
        _find_idempotent(session, owner_id, idempotency_key, request_hash) is not None
    )
    checked = None
    if not repeat:
        checked = check_run_request(session, request, owner_id=owner_id, policy=policy)
        if cluster is not None:
            checked.problems.extend(
                cluster.problems(
                    request.resources, tensor_parallel_size=request.deepspeed.tensor_parallel_size
                )
            )
        if checked.problems:
            raise ValidationFailed(checked.problems)
    return NewRun(request, owner_id, request_hash, idempotency_key, checked)


def store_run(session: Session, new: NewRun) -> tuple[Run, bool]:
    """The new run and True; or, for a repeated Idempotency-Key, the earlier run and False.
    What could change since `prepare_run` is checked again here, under the write: the
    key's quotas, the Idempotency-Key, and that the uploaded files it reads still exist."""
    if new.idempotency_key is not None:
        earlier = _find_idempotent(session, new.owner_id, new.idempotency_key, new.request_hash)
        if earlier is not None:
            return earlier, False
    if new.checked is None:  # the earlier run was there when the request was checked
        raise Conflict(
            f"the run of Idempotency-Key {new.idempotency_key!r} is gone; send the request "
            "again with a new key"
        )
    if problems := uploads_gone(session, new.request, owner_id=new.owner_id):
        raise ValidationFailed(problems)
    spec = new.checked.spec
    gpus = queue.asked_gpus(spec)
    priority = queue.check_submission(
        session,
        owner_id=new.owner_id,
        priority=_asked_priority(new.request),
        gpus=gpus,
        preemptible=new.request.preemptible,
    )
    run = Run(
        id=new_id("run"),
        owner_id=new.owner_id,
        status=RunStatus.QUEUED,
        attempt=1,
        spec=spec,
        run_metadata=dict(new.request.metadata),
        step=0,
        latest_metrics={},
        idempotency_key=new.idempotency_key,
        request_hash=new.request_hash,
        priority=priority,
        preemptible=new.request.preemptible,
        gpus=gpus,
    )
    try:
        # A savepoint: if a concurrent request with the same key won, only this insert undoes.
        with session.begin_nested():
            session.add(run)
    except IntegrityError:
        if new.idempotency_key is None:
            raise
        earlier = _find_idempotent(session, new.owner_id, new.idempotency_key, new.request_hash)
        if earlier is None:
            raise
        return earlier, False
    lifecycle.enqueue(session, run)
    return run, True


def _asked_priority(request: RunRequest) -> int | None:
    """The priority the request names; None when it leaves it to the key's default."""
    return request.priority if "priority" in request.model_fields_set else None


@dataclass(frozen=True, slots=True)
class RequestValidation:
    report: ValidationReport
    # Set only for a valid request that asks for a profile: what to measure, and how long.
    profile: ValidateRequest | None = None
    spec: dict[str, Any] | None = None
    total_steps: int | None = None
    # A valid request whose data is still to be counted (`with_data_plan`), outside the
    # database session: counting may take seconds.
    checked: CheckedRequest | None = None
    asked: ValidateRequest | None = None


def validate_run_request(
    session: Session,
    *,
    body: Any,
    owner_id: str,
    policy: RequestPolicy,
    cluster: ClusterView | None = None,
) -> RequestValidation:
    """Every check a create makes (`prepare_run`, `store_run`), with nothing stored, plus
    what the run would cost. The body may ask for a profile too (app/services/profiles.py
    runs it)."""
    try:
        asked = ValidateRequest.model_validate(body)
    except PydanticValidationError as exc:
        return _refused(problems_from_pydantic(exc.errors()))
    request = asked.run_request()
    checked = check_run_request(session, request, owner_id=owner_id, policy=policy)
    if cluster is not None:
        checked.problems.extend(
            cluster.problems(
                request.resources, tensor_parallel_size=request.deepspeed.tensor_parallel_size
            )
        )
    if not checked.problems:
        try:
            queue.check_submission(
                session,
                owner_id=owner_id,
                priority=_asked_priority(request),
                gpus=queue.asked_gpus(checked.spec),
                preemptible=request.preemptible,
                queuing=False,
            )
        except ValidationFailed as exc:
            checked.problems.extend(exc.detail)
    if checked.problems:
        return _refused(checked.problems)
    if asked.profile:
        # A profile is a run on the cluster now: the key's limits hold for it too (429).
        queue.check_profile(session, owner_id=owner_id, gpus=queue.asked_gpus(checked.spec))
    if data_plan.needed(checked.spec):
        pending = ValidationReport(valid=True, errors=[], resolved=None, estimate=None)
        return RequestValidation(pending, checked=checked, asked=asked)
    return _costed(checked, asked, plan=None)


def with_data_plan(validation: RequestValidation, plan: data_plan.DataPlan) -> RequestValidation:
    """A valid request's validation completed with what its data comes to (packed rows, the
    seq_length the worker will choose; app/services/data_plan.py), and its costs."""
    if validation.checked is None or validation.asked is None:
        return validation
    checked = validation.checked
    if plan.problem is not None:
        checked.problems.append(
            field_problem(
                "dataset.source", f"preparing the data as the worker will fails: {plan.problem}"
            )
        )
    elif plan.examples is not None:
        checked.plan_examples(checked.resolved, plan.examples)
    if checked.problems:
        return _refused(checked.problems)
    checked.seq_length = plan.seq_length
    return _costed(checked, validation.asked, plan=plan)


def _refused(problems: list[Problem]) -> RequestValidation:
    return RequestValidation(
        ValidationReport(valid=False, errors=problems, resolved=None, estimate=None)
    )


def _costed(
    checked: CheckedRequest, asked: ValidateRequest, *, plan: data_plan.DataPlan | None
) -> RequestValidation:
    resolved = estimates.resolve(checked)
    if plan is not None:
        resolved["data_notes"] = plan.notes
        if plan.unknown_because is not None:
            resolved["data_unknown_because"] = plan.unknown_because
    report = ValidationReport(
        valid=True, errors=[], resolved=resolved, estimate=estimates.estimate(checked)
    )
    if not asked.profile:
        return RequestValidation(report)
    return RequestValidation(
        report, profile=asked, spec=checked.spec, total_steps=resolved["total_steps"]
    )


def _request_hash(request: RunRequest) -> str:
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _find_idempotent(session: Session, owner_id: str, key: str, request_hash: str) -> Run | None:
    earlier = session.scalar(
        select(Run).where(Run.owner_id == owner_id, Run.idempotency_key == key)
    )
    if earlier is not None and earlier.request_hash != request_hash:
        raise Conflict(
            f"Idempotency-Key {key!r} was already used for run {earlier.id} with a different "
            "request body; use a new key for a new request"
        )
    return earlier


def get_run(session: Session, *, run_id: str, owner_id: str, for_update: bool = False) -> Run:
    run = None
    if is_minted(RUN_ID, run_id):  # an id no run can have is not looked up
        run = session.get(Run, run_id, with_for_update=for_update)
    # Another principal's run is indistinguishable from a missing one.
    if run is None or run.owner_id != owner_id:
        raise NotFound(f"run {run_id} not found")
    return run


# Every column of `runs`, labelled with its attribute's name (`metadata` → `run_metadata`);
# built once, so that SQLAlchemy finds it compiled in its cache at once.
_READ_RUN = select(*(attr.columns[0].label(attr.key) for attr in inspect(Run).column_attrs)).where(
    Run.id == bindparam("run_id")
)


def read_run(db: Session | Connection, *, run_id: str, owner_id: str) -> RunFields:
    """`get_run` for a caller that only reads: the run's columns as a row, which `RunView.of`
    and `queue_position` take as they take a `Run`. Status polling is the service's busiest
    request, and loading an ORM object costs more than the query itself."""
    if not is_minted(RUN_ID, run_id):
        raise NotFound(f"run {run_id} not found")
    connection = db.connection() if isinstance(db, Session) else db
    row = connection.execute(_READ_RUN, {"run_id": run_id}).one_or_none()
    if row is None or row.owner_id != owner_id:
        raise NotFound(f"run {run_id} not found")
    fields: RunFields = row
    return fields


_api_keys = cast(Table, ApiKey.__table__)
# `_READ_RUN` of a run the key with this hash owns, while it is live: status polling's one
# statement, which checks the caller's key as it reads (a revoked key is refused at once).
_READ_RUN_WITH_KEY = _READ_RUN.join(_api_keys, _api_keys.c.id == Run.owner_id).where(
    _api_keys.c.key_hash == bindparam("key_hash"), _api_keys.c.revoked_at.is_(None)
)


def read_run_with_key(connection: Connection, *, run_id: str, secret: str) -> RunFields | None:
    """`read_run` for the holder of the API key `secret`, checked in the same statement:
    None when the key is not a live one; NotFound when the run is not its own."""
    params = {"run_id": run_id, "key_hash": hash_secret(secret)}
    # An id no run can have is not looked up; the key is, so that a bad key is still a 401.
    row = (
        connection.execute(_READ_RUN_WITH_KEY, params).one_or_none()
        if is_minted(RUN_ID, run_id)
        else None
    )
    if row is not None:
        fields: RunFields = row
        return fields
    if find_api_key(connection, secret=secret) is None:
        return None
    raise NotFound(f"run {run_id} not found")


def list_runs(
    session: Session,
    *,
    owner_id: str,
    status: RunStatus | None,
    metadata: dict[str, str],
    limit: int,
    cursor: str | None,
) -> tuple[list[Run], str | None]:
    """Newest first. The cursor is the (created_at, id) of the last row seen, so pages stay
    correct while new runs are created in front of them."""
    query = select(Run).where(Run.owner_id == owner_id)
    if status is not None:
        query = query.where(Run.status == status)
    if problems := _metadata_filter_problems(metadata):
        raise ValidationFailed(problems)
    dialect = session.get_bind().dialect.name
    for key, value in metadata.items():
        query = query.where(_metadata_equals(dialect, key, value))
    if cursor and status != RunStatus.QUEUED:
        created_at, run_id = _decode_cursor(cursor)
        query = query.where(
            or_(Run.created_at < created_at, and_(Run.created_at == created_at, Run.id < run_id))
        )
    limit = max(1, min(limit, MAX_PAGE))
    if status == RunStatus.QUEUED:
        return _list_queue(session, query, limit=limit, cursor=cursor)
    rows = list(
        session.scalars(query.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1))
    )
    next_cursor = encode_cursor(rows[limit - 1]) if len(rows) > limit else None
    return rows[:limit], next_cursor


def _list_queue(
    session: Session, query: Select[Any], *, limit: int, cursor: str | None
) -> tuple[list[Run], str | None]:
    """The caller's queued runs in the order the scheduler will take them. The cursor is
    the place after the page's last run: a queue's order changes as runs start, so a later
    page is the queue as it is by then."""
    offset = _decode_offset(cursor) if cursor else 0
    mine = {run.id: run for run in session.scalars(query)}
    ordered = [mine[q.id] for q in queue.ordered_queue(session) if q.id in mine]
    page = ordered[offset : offset + limit]
    more = len(ordered) > offset + limit
    return page, _encode_offset(offset + limit) if more else None


def _encode_offset(offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps(["queue", offset]).encode()).decode()


def _decode_offset(cursor: str) -> int:
    try:
        kind, offset = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        if kind != "queue" or not isinstance(offset, int) or isinstance(offset, bool):
            raise ValueError("not a queue cursor")
        if offset < 0:
            raise ValueError("not a queue cursor")
        return offset
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValidationFailed(
            [{"field": "cursor", "message": "cursor is not one this service issued"}]
        ) from exc


_METADATA_KEY: TypeAdapter[str] = TypeAdapter(MetadataKey)
_METADATA_VALUE: TypeAdapter[str] = TypeAdapter(MetadataValue)


def _metadata_filter_problems(metadata: dict[str, str]) -> list[dict[str, str]]:
    """A filter follows the rules of the metadata it looks for: a value no run can hold (a
    NUL, which PostgreSQL cannot even compare) is refused rather than sent to the database."""
    problems = []
    for key, value in metadata.items():
        name = f"metadata.{key}" if len(key) <= 64 else "metadata"
        for what, adapter, text in (("key", _METADATA_KEY, key), ("value", _METADATA_VALUE, value)):
            try:
                adapter.validate_python(text)
            except PydanticValidationError as exc:
                (rule,) = (p["message"] for p in problems_from_pydantic(exc.errors()[:1]))
                problems.append(field_problem(name, f"a metadata {what}: {rule}"))
    return problems


def _metadata_equals(dialect: str, key: str, value: str) -> ColumnElement[bool]:
    """metadata[key] == value, for any key. SQLite's JSON paths cannot name a key holding a
    double quote, and compare the stored text, where json.dumps wrote non-ASCII keys as
    \\u escapes; json_each yields every key decoded. PostgreSQL's ->> takes the key as a
    bound value and decodes the stored keys."""
    if dialect == "sqlite":
        entries = func.json_each(Run.run_metadata).table_valued("key", "value")
        return exists().where(entries.c.key == key, entries.c.value == value)
    return Run.run_metadata[key].as_string() == value


def encode_cursor(run: Run) -> str:
    raw = json.dumps([run.created_at.isoformat(), run.id])
    return base64.urlsafe_b64encode(raw.encode()).decode()


def _decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        created_at, run_id = json.loads(base64.urlsafe_b64decode(cursor.encode()))
        if not isinstance(created_at, str) or not isinstance(run_id, str) or "\x00" in run_id:
            raise ValueError("not a cursor")
        return datetime.fromisoformat(created_at), run_id
    # RecursionError: a forged cursor of deeply nested JSON.
    except (ValueError, TypeError, RecursionError) as exc:
        raise ValidationFailed(
            [{"field": "cursor", "message": "cursor is not one this service issued"}]
        ) from exc


def queue_position(db: Session | Connection, run: RunFields) -> int | None:
    """1 for the next run to dispatch; None once it left the queue."""
    return queue.queue_positions(db, [run]).get(run.id)


def check_inputs_exist(run: Run, *, storage: Storage) -> None:
    """Conflict when a file the run reads is gone (an upload deleted since, say): resumed,
    its worker would only fail at once on the cluster. Reads storage: not in a write."""
    dataset = run.spec["dataset"]
    for key in ("source", "eval_source"):
        path = dataset.get(key)
        gone = (
            not storage.exists(path)
            if path and storage.contains(path)
            else bool(path and path.startswith("/") and not Path(path).exists())
        )
        if gone:
            raise Conflict(
                f"run {run.id} reads dataset.{key} {path!r}, which no longer exists (an "
                "uploaded file deleted since?); create a new run with the data"
            )


def resume_run(session: Session, run: Run) -> None:
    """`lifecycle.resume`, within the key's limits (`check_inputs_exist` first, on a read)."""
    if run.run_status in (RunStatus.FAILED, RunStatus.CANCELLED):
        # (Any other status is refused by lifecycle.resume with 409, before any limit.)
        queue.check_submission(
            session,
            owner_id=run.owner_id or "",
            priority=run.priority,
            gpus=queue.asked_gpus(run.spec),
            preemptible=run.preemptible,
        )
        # The key's tracking destinations may have been pinned since the run was made.
        owner = run.owner_id or ""
        if problems := key_tracking_problems(session, run.definition, owner_id=owner):
            raise ValidationFailed(problems)
    lifecycle.resume(session, run)
