"""/v1/runs: create, read and list runs, and read what they produced."""

from __future__ import annotations

import functools
import logging
from typing import Annotated, Any

import anyio.to_thread
from fastapi import (
    APIRouter,
    BackgroundTasks,
    Body,
    Header,
    Path,
    Query,
    Request,
    Response,
    Security,
    status,
)
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import AfterValidator
from sqlalchemy import Connection
from sqlalchemy.orm import Session
from sse_starlette import EventSourceResponse

from app.api import run_creation
from app.api.deps import (
    LOCAL_PRINCIPAL,
    BearerPresent,
    ClusterDep,
    CurrentPrincipal,
    DispatcherDep,
    HooksDep,
    JobsDep,
    Principal,
    ProfileSlotsDep,
    SessionDep,
    SettingsDep,
    app_state,
    bearer_token,
    read_as_caller,
    run_in_read_session,
    run_in_write_session,
    run_on_read_connection,
    unauthorized,
)
from app.cluster.ray_jobs import try_stop
from app.schemas.errors import error_responses
from app.schemas.run_view import (
    CheckpointList,
    CheckpointView,
    EventList,
    EventView,
    MetricList,
    MetricView,
    RunList,
    RunView,
    ValidationReport,
    json_response,
)
from app.schemas.security_schemes import api_key
from app.services import (
    data_plan,
    lifecycle,
    model_download,
    profiles,
    queue,
    run_data,
    run_logs,
    run_stream,
    runs,
)
from contract.bounds import INT32_MAX, INT64_MAX, refuse_nul
from contract.examples import RUN_REQUEST_EXAMPLES
from contract.run_request import RunRequest
from contract.statuses import RunStatus

log = logging.getLogger("tuneyard")

router = APIRouter(prefix="/v1/runs", tags=["runs"], dependencies=[Security(api_key)])

_UNAUTHORIZED = "Missing or invalid API key"
# FastAPI answers 400 for a body it cannot decode at all (JSON that is not UTF-8).
_UNREADABLE_BODY = "The body is not UTF-8 text"
_NOT_FOUND = "No such run (or not yours)"
_INVALID_PARAMETER = "A parameter breaks a rule; `detail` names it and the rule"
# FastAPI documents a 422 for every operation that takes parameters; give it the real shape.
_errors = error_responses({401: _UNAUTHORIZED, 404: _NOT_FOUND, 422: _INVALID_PARAMETER})

# Strings that reach a query refuse NUL, and numbers are bounded by their column, so that
# PostgreSQL never gets a value it would refuse (a 500): the client gets a 422 naming it.
# An id in the path is any text: one no run can have (a NUL, a megabyte) is a 404, as an
# unknown one is, and never reaches a query (app/storage/models.py `is_minted`).
RunId = Annotated[str, Path(description="The run's id, as `POST /v1/runs` returned it")]
# Cursors are short; the bound also keeps a hostile one from nesting deep enough to
# exhaust the recursion of the JSON decoder that reads the runs list's cursor.
Cursor = Annotated[
    str | None,
    Query(max_length=256, description="`next_cursor` from the previous page"),
    AfterValidator(refuse_nul),
]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=RunView,
    summary="Create a fine-tuning run",
    responses={
        200: {
            "model": RunView,
            "description": "An earlier run with the same Idempotency-Key and body",
        },
        **error_responses(
            {
                400: _UNREADABLE_BODY,
                401: _UNAUTHORIZED,
                409: "The Idempotency-Key was used with a different body",
                422: "The request breaks a rule; `detail` names each field and rule (a "
                "`priority` above the API key's max_priority, more GPUs than its max_gpus)",
                429: "The API key has max_queued_runs runs queued already",
            }
        ),
    },
)
async def create_run(
    body: Annotated[RunRequest, Body(openapi_examples=RUN_REQUEST_EXAMPLES)],
    request: Request,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    dispatcher: DispatcherDep,
    cluster: ClusterDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            max_length=255,
            description="Retry safely: the same key and body give the same run (200); "
            "the same key with another body is refused (409).",
        ),
    ] = None,
) -> Response:
    made = await run_creation.create_run(
        request,
        prepare=lambda session: runs.prepare_run(
            session,
            request=body,
            owner_id=principal.id,
            policy=app_state(request).policy,
            idempotency_key=idempotency_key,
            cluster=cluster,
        ),
        store=runs.store_run,
        dispatcher=dispatcher,
    )
    return json_response(
        RunView.of(made.run, queue_position=made.queue_position),
        status_code=201 if made.created else 200,
    )


@router.post(
    "/validate",
    response_model=ValidationReport,
    summary="Validate a run request without creating it",
    description=(
        "Every check `POST /v1/runs` makes, with nothing stored, and more: where the "
        "sequence length is left to the data or packing is on, the data is read and "
        "tokenized as the worker would (the data plan). Returns every problem at once, the "
        "DeepSpeed config the worker would use, and an estimate of the cost. "
        "With `profile: true`, a valid request is also trained for `profile_steps` real "
        "steps on the cluster, with its resources, and `profile` reports what was measured "
        "(step time, tokens/s, peak memory per worker, the run's estimated wall time and "
        "cost); the answer then takes as long as loading the model and those steps. A "
        "profile that cannot run or fails answers 200 with `profile.error`. A profile runs "
        "on the cluster as a run does: it is refused (429, naming the rule) while the API "
        "key is at its max_queued_runs, max_running_runs or max_gpus, already runs a "
        "profile (one at a time), or the service runs TUNEYARD_MAX_CONCURRENT_PROFILES."
    ),
    responses=error_responses(
        {
            400: _UNREADABLE_BODY,
            401: _UNAUTHORIZED,
            422: "The body is missing or not JSON (a body that breaks rules gets a report)",
            429: "A profile was asked for, and the API key or the service has no room for one",
        }
    ),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/ValidateRequest"}}
            },
        }
    },
)
async def validate_run(
    body: Annotated[Any, Body(openapi_examples=RUN_REQUEST_EXAMPLES)],
    request: Request,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    cluster: ClusterDep,
    jobs: JobsDep,
    profile_slots: ProfileSlotsDep,
) -> ValidationReport:
    # Validation only reads, so it takes a read session, on a worker thread (it reads files),
    # and gives it back before a profile: a profile's minute on the cluster holds no
    # connection, no thread and no SQLite write lock, so no other request waits on it.
    def check(session: Session) -> runs.RequestValidation:
        return runs.validate_run_request(
            session,
            body=body,
            owner_id=principal.id,
            policy=app_state(request).policy,
            cluster=cluster,
        )

    validation = await run_in_read_session(request, check, blocking=True)
    if validation.checked is not None:
        # Counting packed data, or choosing an unset seq_length, runs the worker's own data
        # preparation for seconds: after the session, waiting for a slot on the loop.
        plan = await data_plan.plan_for(principal.id, validation.checked.spec)
        validation = await anyio.to_thread.run_sync(runs.with_data_plan, validation, plan)
    if validation.profile is None or validation.spec is None:
        return validation.report
    with profile_slots.hold(principal.id) as profile_id:
        measured = await profiles.profile_request(
            validation.spec,
            steps=validation.profile.profile_steps,
            total_steps=validation.total_steps,
            settings=settings,
            jobs=jobs,
            disconnected=request.is_disconnected,
            job_id=profile_id,
        )
    return validation.report.model_copy(update={"profile": measured})


@router.get(
    "",
    dependencies=[BearerPresent],
    response_model=RunList,
    summary="List runs, newest first",
    description="Filter by `status` and by metadata with `metadata.<key>=<value>` parameters.",
    responses=error_responses({401: _UNAUTHORIZED, 422: _INVALID_PARAMETER}),
)
async def list_runs(
    request: Request,
    status_filter: Annotated[
        RunStatus | None,
        Query(
            alias="status",
            description="Only runs in this status. `queued` lists them in the order the "
            "scheduler will take them (priority, fair share between API keys, age); "
            "every other listing is newest first.",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=runs.MAX_PAGE)] = 20,
    cursor: Cursor = None,
) -> Response:
    # Like status polling: the key checked and the page read on one connection, on the
    # event loop on SQLite (read_as_caller), and the page serialized once (json_response).
    metadata = {
        key.removeprefix("metadata."): value
        for key, value in request.query_params.items()
        if key.startswith("metadata.")
    }

    def read(session: Session, principal: Principal) -> Response:
        rows, next_cursor = runs.list_runs(
            session,
            owner_id=principal.id,
            status=status_filter,
            metadata=metadata,
            limit=limit,
            cursor=cursor,
        )
        positions = queue.queue_positions(session, rows)
        return json_response(
            RunList(
                data=[RunView.of(r, queue_position=positions.get(r.id)) for r in rows],
                next_cursor=next_cursor,
            )
        )

    return await read_as_caller(request, read)


@router.get("/{run_id}", response_model=RunView, summary="Get one run", responses=_errors)
async def get_run(run_id: RunId, request: Request) -> Response:
    # The hot path of every poller: one statement reads the run and checks the caller's key
    # (no cache: a revoked key is refused at once), on a plain connection, in one trip (a
    # thread's, except on SQLite); the view serialized once, there (see json_response). No
    # dependencies beyond the path: each costs a step of FastAPI's on every poll.
    keyed = app_state(request).settings.auth != "disabled"
    secret = bearer_token(request) if keyed else None
    if keyed and not secret:
        raise unauthorized()

    def read(connection: Connection) -> Response:
        if secret is None:
            run = runs.read_run(connection, run_id=run_id, owner_id=LOCAL_PRINCIPAL)
        elif (found := runs.read_run_with_key(connection, run_id=run_id, secret=secret)) is None:
            raise unauthorized()
        else:
            run = found
        return json_response(RunView.of(run, queue_position=runs.queue_position(connection, run)))

    return await run_on_read_connection(request, read)


@router.get(
    "/{run_id}/metrics",
    dependencies=[BearerPresent],
    response_model=MetricList,
    summary="A run's metrics",
    responses=_errors,
)
async def list_metrics(
    run_id: RunId,
    request: Request,
    name: Annotated[str | None, Query(max_length=64), AfterValidator(refuse_nul)] = None,
    after_step: Annotated[int | None, Query(ge=-1, le=INT32_MAX)] = None,
    limit: Annotated[int, Query(ge=1, le=run_data.MAX_METRICS_PAGE)] = 1000,
    cursor: Cursor = None,
) -> Response:
    # What dashboards and trackers poll: read as list_runs is.
    def read(session: Session, principal: Principal) -> Response:
        run = runs.get_run(session, run_id=run_id, owner_id=principal.id)
        rows, next_cursor = run_data.list_metrics(
            session, run=run, name=name, after_step=after_step, limit=limit, cursor=cursor
        )
        return json_response(
            MetricList(data=[MetricView.of(m) for m in rows], next_cursor=next_cursor)
        )

    return await read_as_caller(request, read)


@router.get(
    "/{run_id}/checkpoints",
    response_model=CheckpointList,
    summary="A run's checkpoints (DeepSpeed and exported HF models)",
    responses=_errors,
)
def list_checkpoints(
    run_id: RunId, session: SessionDep, principal: CurrentPrincipal
) -> CheckpointList:
    run = runs.get_run(session, run_id=run_id, owner_id=principal.id)
    listed = run_data.list_checkpoints(session, run=run)
    pruned = run_data.pruned_checkpoints(listed, definition=run.definition)
    best = (run.result or {}).get("best_checkpoint_id")
    return CheckpointList(
        data=[CheckpointView.of(c, pruned=c.id in pruned, best=c.id == best) for c in listed]
    )


@router.get(
    "/{run_id}/events",
    response_model=EventList,
    summary="A run's status changes and notable happenings, oldest first",
    responses=_errors,
)
def list_events(
    run_id: RunId,
    session: SessionDep,
    principal: CurrentPrincipal,
    after: Annotated[
        int | None, Query(ge=0, le=INT64_MAX, description="Only events with a larger id")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EventList:
    run = runs.get_run(session, run_id=run_id, owner_id=principal.id)
    return EventList(
        data=[
            EventView.of(e)
            for e in run_data.list_events(session, run=run, after=after, limit=limit)
        ]
    )


@router.post(
    "/{run_id}/cancel",
    response_model=RunView,
    summary="Cancel a run",
    description="Queued → cancelled; live → cancelling, then cancelled once Ray confirms. "
    "Repeating it is harmless.",
    responses={**_errors, **error_responses({409: "The run already finished"})},
)
def cancel_run(
    run_id: RunId,
    session: SessionDep,
    principal: CurrentPrincipal,
    jobs: JobsDep,
    background: BackgroundTasks,
    hooks: HooksDep,
) -> RunView:
    run = runs.get_run(session, run_id=run_id, owner_id=principal.id, for_update=True)
    stop = lifecycle.request_cancel(session, run, hooks=hooks)
    if stop is not None and jobs is not None:
        # After the commit: Ray is asked only once `cancelling` is stored (and the
        # reconciler asks again if this attempt cannot reach Ray).
        background.add_task(try_stop, jobs, stop)
    return RunView.of(run)


@router.post(
    "/{run_id}/resume",
    response_model=RunView,
    summary="Resume a failed or cancelled run from its latest checkpoint",
    responses={
        **_errors,
        **error_responses(
            {
                409: "The run is not failed or cancelled",
                429: "The API key has max_queued_runs runs queued already",
            }
        ),
    },
)
async def resume_run(
    run_id: RunId,
    request: Request,
    principal: CurrentPrincipal,
    dispatcher: DispatcherDep,
    background: BackgroundTasks,
    settings: SettingsDep,
) -> RunView:
    # Whether its data is still there reads storage (object storage: the network): on a
    # read of its own, before the write that resumes it, which holds no lock while waiting.
    await run_in_read_session(
        request,
        lambda session: runs.check_inputs_exist(
            runs.get_run(session, run_id=run_id, owner_id=principal.id), storage=settings.storage
        ),
        blocking=True,
    )

    def resume(session: Session) -> RunView:
        run = runs.get_run(session, run_id=run_id, owner_id=principal.id, for_update=True)
        runs.resume_run(session, run)
        return RunView.of(run, queue_position=runs.queue_position(session, run))

    view = await run_in_write_session(request, resume)
    if dispatcher is not None:
        background.add_task(dispatcher.wake)
    return view


@router.get(
    "/{run_id}/model",
    summary="Download the run's exported model (a tar of the Hugging Face folder)",
    description="The folder `from_pretrained` loads (a LoRA run's adapter, as its export "
    "says), streamed from storage as a tar archive of the folder's files: "
    "`curl ... | tar -x -C my-model`, or `tuneyard download RUN DEST`.",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "A tar archive of the export folder's files",
            # octet-stream, not application/x-tar: the type generated clients (and
            # openapi-python-client) read as a file; the name says what it holds.
            "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}
            },
        },
        **error_responses(
            {
                401: _UNAUTHORIZED,
                404: "No such run (or not yours), or its export is gone from storage",
                409: "The run has no exported model (yet)",
                422: _INVALID_PARAMETER,
                503: "Storage cannot be read now",
            },
            non_json_route=True,
        ),
    },
)
async def get_model(
    run_id: RunId, request: Request, principal: CurrentPrincipal, settings: SettingsDep
) -> StreamingResponse:
    # The run looked up on a read; its files listed in storage after, holding no session.
    run = await run_in_read_session(
        request, lambda session: runs.get_run(session, run_id=run_id, owner_id=principal.id)
    )
    location, files = await anyio.to_thread.run_sync(
        model_download.model_files, run, settings.storage
    )
    return StreamingResponse(
        model_download.tar_chunks(settings.storage, location, files),
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{run.id}-model.tar"'},
    )


@router.get(
    "/{run_id}/logs",
    dependencies=[BearerPresent],
    summary="The Ray job's log text",
    response_class=PlainTextResponse,
    responses=error_responses(
        {
            401: _UNAUTHORIZED,
            404: _NOT_FOUND,
            422: _INVALID_PARAMETER,
            503: "Ray cannot be reached, or this service is not attached to it",
        },
        non_json_route=True,
    ),
)
async def get_logs(
    run_id: RunId,
    request: Request,
    jobs: JobsDep,
    tail: Annotated[int | None, Query(ge=1, le=100_000, description="Last N lines")] = None,
) -> PlainTextResponse:
    # The run read under a database slot; the log from Ray (no timeout in its client) on
    # threads of Ray's own, holding none.
    run = await read_as_caller(
        request,
        lambda session, principal: runs.get_run(session, run_id=run_id, owner_id=principal.id),
    )
    text = await anyio.to_thread.run_sync(
        functools.partial(run_logs.read_logs, run, jobs=jobs, tail=tail),
        limiter=app_state(request).ray_calls,
    )
    return PlainTextResponse(text)


@router.get(
    "/{run_id}/events/stream",
    summary="Server-Sent Events: the run's events and metrics as they arrive",
    description="Reconnect with `Last-Event-ID` to continue without loss. "
    "The stream ends with an `end` event once the run is terminal.",
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "`event` and `metric` events, then `end`",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(
            {
                401: _UNAUTHORIZED,
                404: _NOT_FOUND,
                422: "Last-Event-ID is not an id this stream sent",
            },
            non_json_route=True,
        ),
    },
)
def stream_events(
    run_id: RunId,
    request: Request,
    session: SessionDep,
    principal: CurrentPrincipal,
    last_event_id: Annotated[
        str | None, Header(description="The `id` of the last event received, to resume after it")
    ] = None,
) -> EventSourceResponse:
    runs.get_run(session, run_id=run_id, owner_id=principal.id)
    cursor = run_stream.StreamCursor.parse(last_event_id)
    # Each poll a read of its own under the request's admission, not a thread outside it.
    stream = run_stream.stream_run(
        lambda read: run_in_read_session(request, read, blocking=True), run_id, cursor
    )
    return EventSourceResponse(stream, ping=15)
