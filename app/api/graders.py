"""/v1/fine_tuning/alpha/graders: OpenAI's routes for trying a grader before a run uses it
(`client.fine_tuning.alpha.graders.run(...)` and `.validate(...)`). A grader is checked in
full by its model (contract/graders/models.py); one that cannot run on this service is
refused here as it would be when a run names it."""

from __future__ import annotations

import functools

import anyio
import anyio.to_thread
from fastapi import APIRouter, Request, Security

from app.api.body_limit import GraderBodyLimitedRoute
from app.api.deps import AppState, CurrentPrincipal, app_state
from app.api.openai_compat import openai_responses
from app.errors import TooManyRequests, ValidationFailed
from app.schemas.grader_shapes import GraderRun, GraderRunResult, GraderValidate, GraderValidated
from app.schemas.security_schemes import api_key
from app.services.rules.grader_rules import python_graders_in, runnable_problems
from contract.graders import grading
from contract.graders.models import AnyGrader

router = APIRouter(
    prefix="/v1/fine_tuning/alpha/graders",
    tags=["fine-tuning (OpenAI)"],
    dependencies=[Security(api_key)],
    route_class=GraderBodyLimitedRoute,
)

_RESPONSES = openai_responses(
    {
        400: "The grader breaks a rule: `error.param` names the field, `error.message` the rule",
        401: "Missing or invalid API key",
    }
)


def _refuse_unrunnable(grader: AnyGrader, state: AppState) -> bool:
    """Whether `grader` runs Python; a 400 where this service does not run Python graders."""
    problems = runnable_problems(grader, "grader", python_graders=state.graders.python is not None)
    if problems:
        raise ValidationFailed(problems)
    return bool(python_graders_in(grader, "grader"))


@router.post(
    "/run",
    response_model=GraderRunResult,
    summary="Run a grader (OpenAI)",
    description="Grades `model_sample` against `item` as a run would grade one completion. "
    "Python graders, where an operator turned them on, run sandboxed with OpenAI's limits "
    "(2 minutes, 2 GB, 1 CPU, no network); a few at a time, past which a 429.",
    responses={
        **_RESPONSES,
        **openai_responses(
            {429: "As many Python graders as this service runs at once are running"}
        ),
    },
)
async def run_grader(
    body: GraderRun, request: Request, principal: CurrentPrincipal
) -> dict[str, object]:
    state = app_state(request)
    runs_python = _refuse_unrunnable(body.grader, state)
    work = functools.partial(
        grading.grade, body.grader, body.model_sample, body.item, state.graders
    )
    if not runs_python:
        # CPU work (BLEU, ROUGE...): on a worker thread, never the event loop, and on
        # threads of its own, so that many grades at once never hold every thread the
        # service's other routes run on. (Each grade is bounded: contract/graders/
        # similarity.py and templates.py refuse texts that would take long.)
        return (await anyio.to_thread.run_sync(work, limiter=state.grading_threads)).as_openai()
    limiter = state.python_graders
    try:
        limiter.acquire_nowait()  # taken here, so two requests never both see it free
    except anyio.WouldBlock:
        raise TooManyRequests(
            f"{limiter.total_tokens:g} Python graders are running already; try again later"
        ) from None
    try:
        return (await anyio.to_thread.run_sync(work)).as_openai()
    finally:
        limiter.release()


@router.post(
    "/validate",
    response_model=GraderValidated,
    summary="Validate a grader (OpenAI)",
    description="The grader as this service reads it, or a 400 naming what is wrong.",
    responses=_RESPONSES,
)
def validate_grader(
    body: GraderValidate, request: Request, principal: CurrentPrincipal
) -> GraderValidated:
    _refuse_unrunnable(body.grader, app_state(request))
    return GraderValidated(grader=body.grader)
