"""/v1/fine_tuning/jobs: OpenAI's fine-tuning API over tuneyard's runs, for clients written
against it (`OpenAI(base_url="http://<tuneyard>/v1", api_key=<tuneyard key>)`).

A job is a run: the same validation, dispatch and training; `GET /v1/runs/{id}` shows the
same run in tuneyard's terms. Errors come in OpenAI's shape (app/api/openai_compat.py).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Path, Query, Request, Response, Security
from pydantic import AfterValidator
from sqlalchemy.orm import Session

from app.api import run_creation
from app.api.deps import (
    ClusterDep,
    CurrentPrincipal,
    DispatcherDep,
    HooksDep,
    JobsDep,
    Principal,
    SessionDep,
    SettingsDep,
    app_state,
    read_as_caller,
    run_in_read_session,
    run_in_write_session,
)
from app.api.openai_compat import openai_responses
from app.cluster.ray_jobs import try_stop
from app.schemas.openai_shapes import (
    CheckpointPage,
    EventPage,
    Job,
    JobCreate,
    JobPage,
)
from app.schemas.run_view import json_response
from app.schemas.security_schemes import api_key
from app.services import lifecycle, openai_jobs, runs
from contract.bounds import refuse_nul

router = APIRouter(
    prefix="/v1/fine_tuning/jobs", tags=["fine-tuning (OpenAI)"], dependencies=[Security(api_key)]
)


_WORDS = {
    400: "The request breaks a rule: `error.param` names the first, `error.message` all",
    401: "Missing or invalid API key",
    404: "No such job (or not yours)",
    409: "The job is in a state that does not allow this",
    429: "The API key has max_queued_runs runs queued already",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return openai_responses({code: _WORDS[code] for code in codes})


# Any text: an id no job can have (a NUL, a megabyte) is a 404, as an unknown one is, and
# never reaches a query (app/storage/models.py `is_minted`).
JobId = Annotated[str, Path(description="The job's id, as creating it returned it")]
After = Annotated[
    str | None,
    Query(max_length=64, description="The id of the last item of the previous page"),
    AfterValidator(refuse_nul),
]


def _metadata_filter(request: Request) -> dict[str, str]:
    """OpenAI's SDKs send a metadata filter as `metadata[key]=value`."""
    found = {}
    for name, value in request.query_params.multi_items():
        if name.startswith("metadata[") and name.endswith("]"):
            found[name[len("metadata[") : -1]] = value
    return found


@router.post(
    "",
    response_model=Job,
    summary="Create a fine-tuning job (OpenAI)",
    description=openai_jobs.__doc__,
    responses=_errors(400, 401, 429),
)
async def create_fine_tuning_job(
    body: JobCreate,
    request: Request,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    dispatcher: DispatcherDep,
    cluster: ClusterDep,
) -> Response:
    made = await run_creation.create_run(
        request,
        prepare=lambda session: openai_jobs.prepare_job(
            session,
            job=body,
            owner_id=principal.id,
            policy=app_state(request).policy,
            cluster=cluster,
        ),
        store=lambda session, new: (openai_jobs.store_job(session, new, job=body), True),
        dispatcher=dispatcher,
    )
    return json_response(openai_jobs.job_view(made.run, trained_tokens=None))


@router.get(
    "",
    response_model=JobPage,
    summary="List fine-tuning jobs (OpenAI)",
    description="Newest first; filter with `metadata[key]=value`.",
    responses=_errors(400, 401),
)
def list_fine_tuning_jobs(
    request: Request,
    session: SessionDep,
    principal: CurrentPrincipal,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> JobPage:
    page, has_more = openai_jobs.list_jobs(
        session,
        owner_id=principal.id,
        after=after,
        limit=limit,
        metadata=_metadata_filter(request),
    )
    tokens = openai_jobs.trained_tokens(session, page)
    return JobPage(
        data=[openai_jobs.job_view(r, trained_tokens=tokens.get(r.id)) for r in page],
        has_more=has_more,
    )


@router.get(
    "/{job_id}",
    response_model=Job,
    summary="Retrieve a fine-tuning job (OpenAI)",
    responses=_errors(400, 401, 404),
)
async def get_fine_tuning_job(job_id: JobId, request: Request) -> Job:
    # What the SDK's clients poll: key and job read on one connection (read_as_caller).
    def read(session: Session, caller: Principal) -> Job:
        run = openai_jobs.get_job(session, job_id=job_id, owner_id=caller.id)
        tokens = openai_jobs.trained_tokens(session, [run])
        return openai_jobs.job_view(run, trained_tokens=tokens.get(run.id))

    return await read_as_caller(request, read)


@router.post(
    "/{job_id}/cancel",
    response_model=Job,
    summary="Cancel a fine-tuning job (OpenAI)",
    responses=_errors(400, 401, 404, 409),
)
def cancel_fine_tuning_job(
    job_id: JobId,
    session: SessionDep,
    principal: CurrentPrincipal,
    jobs: JobsDep,
    background: BackgroundTasks,
    hooks: HooksDep,
) -> Job:
    run = openai_jobs.get_job(session, job_id=job_id, owner_id=principal.id, for_update=True)
    stop = lifecycle.request_cancel(session, run, hooks=hooks)
    if stop is not None and jobs is not None:
        background.add_task(try_stop, jobs, stop)  # after the commit, as cancel_run does
    return openai_jobs.job_view(run, trained_tokens=None)


@router.post(
    "/{job_id}/pause",
    response_model=Job,
    summary="Pause a fine-tuning job (OpenAI): stop it, keeping its checkpoints",
    description="tuneyard stops the run as a cancel does (status `cancelled`); `resume` "
    "continues it from its latest checkpoint.",
    responses=_errors(400, 401, 404, 409),
)
def pause_fine_tuning_job(
    job_id: JobId,
    session: SessionDep,
    principal: CurrentPrincipal,
    jobs: JobsDep,
    background: BackgroundTasks,
    hooks: HooksDep,
) -> Job:
    return cancel_fine_tuning_job(job_id, session, principal, jobs, background, hooks)


@router.post(
    "/{job_id}/resume",
    response_model=Job,
    summary="Resume a paused, cancelled or failed fine-tuning job (OpenAI)",
    description="A new attempt from the latest checkpoint; the job is `queued` again.",
    responses=_errors(400, 401, 404, 409),
)
async def resume_fine_tuning_job(
    job_id: JobId,
    request: Request,
    principal: CurrentPrincipal,
    dispatcher: DispatcherDep,
    background: BackgroundTasks,
    settings: SettingsDep,
) -> Job:
    # As POST /v1/runs/{id}/resume: storage read first, on a read; then the write.
    await run_in_read_session(
        request,
        lambda session: runs.check_inputs_exist(
            openai_jobs.get_job(session, job_id=job_id, owner_id=principal.id),
            storage=settings.storage,
        ),
        blocking=True,
    )

    def resume(session: Session) -> Job:
        run = openai_jobs.get_job(session, job_id=job_id, owner_id=principal.id, for_update=True)
        runs.resume_run(session, run)
        return openai_jobs.job_view(run, trained_tokens=None)

    job = await run_in_write_session(request, resume)
    if dispatcher is not None:
        background.add_task(dispatcher.wake)
    return job


@router.get(
    "/{job_id}/events",
    response_model=EventPage,
    summary="List a fine-tuning job's events (OpenAI)",
    description="Newest first: status changes and the worker's messages.",
    responses=_errors(400, 401, 404),
)
def list_fine_tuning_events(
    job_id: JobId,
    session: SessionDep,
    principal: CurrentPrincipal,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> EventPage:
    run = openai_jobs.get_job(session, job_id=job_id, owner_id=principal.id)
    events, has_more = openai_jobs.list_job_events(session, run=run, after=after, limit=limit)
    return EventPage(data=events, has_more=has_more)


@router.get(
    "/{job_id}/checkpoints",
    response_model=CheckpointPage,
    summary="List a fine-tuning job's checkpoints (OpenAI)",
    description="Newest first: DeepSpeed checkpoints and the exported model (and adapter), "
    "each `fine_tuned_model_checkpoint` a path or URI `from_pretrained` (or peft) loads "
    "for exports.",
    responses=_errors(400, 401, 404),
)
def list_fine_tuning_checkpoints(
    job_id: JobId,
    session: SessionDep,
    principal: CurrentPrincipal,
    after: After = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> CheckpointPage:
    run = openai_jobs.get_job(session, job_id=job_id, owner_id=principal.id)
    data, has_more = openai_jobs.list_job_checkpoints(session, run=run, after=after, limit=limit)
    return CheckpointPage(
        data=data,
        has_more=has_more,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
    )
