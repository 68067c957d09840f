"""/v1/files: upload a dataset file (jsonl, csv, parquet), checked before it is stored."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import anyio
import anyio.to_thread
from fastapi import (
    APIRouter,
    BackgroundTasks,
    Form,
    Path,
    Query,
    Request,
    Security,
    UploadFile,
    status,
)
from pydantic import AfterValidator

from app.api.body_limit import UploadLimitedRoute
from app.api.deps import (
    CurrentPrincipal,
    SessionDep,
    SettingsDep,
    run_in_read_session,
    run_in_write_session,
)
from app.api.openai_compat import speaks_openai
from app.schemas.errors import ErrorResponse, error_responses
from app.schemas.file_view import FileList, FileView
from app.schemas.openai_shapes import FileDeleted, OpenAIError, OpenAIFile, OpenAIFileList
from app.schemas.security_schemes import api_key
from app.services import files
from app.services.rules.file_checks import FINE_TUNE, RecordChecks, checks_for
from app.storage.models import File
from contract.bounds import refuse_nul
from contract.datasets import Purpose

router = APIRouter(
    prefix="/v1/files",
    tags=["files"],
    dependencies=[Security(api_key)],
    route_class=UploadLimitedRoute,
)

_UNAUTHORIZED = "Missing or invalid API key"

T = TypeVar("T")


def _errors(descriptions: dict[int, str]) -> dict[int | str, dict[str, Any]]:
    """Both clients call these routes, each getting its own error shape
    (app/api/openai_compat.py); OpenAI's get a broken rule as a 400, as OpenAI answers it."""
    if 422 in descriptions:
        descriptions = {400: "A parameter or the body breaks a rule", **descriptions}
    return error_responses(descriptions, model=ErrorResponse | OpenAIError)


# Any text: an id no file can have (a NUL, which PostgreSQL refuses in text, a megabyte) is
# a 404, as an unknown one is, and never reaches a query (app/storage/models.py `is_minted`).
FileId = Annotated[str, Path(description="The file's id, as `POST /v1/files` returned it")]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=FileView | OpenAIFile,
    summary="Upload a dataset file",
    description=(
        "Every record is parsed and checked for the fields its `purpose` needs before the "
        "file is stored; use the returned id as a run's `dataset.source`. Purposes match "
        "a run's task and dataset.format: text, prompt_completion, sequence_classification, "
        "chat (OpenAI-style `messages`, .jsonl or .parquet) and preference (`prompt`, "
        "`chosen`, `rejected`)."
    ),
    responses=_errors(
        {
            400: "The multipart body cannot be parsed",
            401: _UNAUTHORIZED,
            413: "Larger than TUNEYARD_MAX_UPLOAD_BYTES",
            422: "The file or a form field breaks a rule; each message gives the line or row",
        }
    ),
)
async def upload_file(
    request: Request,
    file: UploadFile,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    purpose: Annotated[Purpose | Literal["fine-tune"], Form()] = "text",
    text_field: Annotated[str, Form(min_length=1)] = "text",
    text_pair_field: Annotated[str | None, Form()] = None,
    label_field: Annotated[str, Form(min_length=1)] = "label",
    prompt_field: Annotated[str, Form(min_length=1)] = "prompt",
    completion_field: Annotated[str, Form(min_length=1)] = "completion",
    messages_field: Annotated[str, Form(min_length=1)] = "messages",
    chosen_field: Annotated[str, Form(min_length=1)] = "chosen",
    rejected_field: Annotated[str, Form(min_length=1)] = "rejected",
) -> FileView | OpenAIFile:
    # No SessionDep: its write transaction (and on SQLite the one writer's lock) would be
    # held while the file is copied and checked. Only the insert runs in a transaction.
    def checks(kind: Purpose) -> RecordChecks:
        # OpenAI's reinforcement records (found by "fine-tune") hold the prompt in messages.
        openai_prompts = kind == "prompt" and purpose == FINE_TUNE
        return checks_for(
            kind,
            text_field=text_field,
            text_pair_field=text_pair_field,
            label_field=label_field,
            prompt_field=messages_field if openai_prompts else prompt_field,
            completion_field=completion_field,
            messages_field=messages_field,
            chosen_field=chosen_field,
            rejected_field=rejected_field,
        )

    storage_dir = settings.uploads_dir
    # Files first, the database only to read: a blocking read.
    await run_in_read_session(
        request,
        lambda session: files.sweep_partials_now_and_then(
            session,
            storage_dir=storage_dir,
            storage=settings.storage,
            uploads_location=settings.uploads_location,
        ),
        blocking=True,
    )
    received = await anyio.to_thread.run_sync(
        lambda: files.receive_upload(
            filename=files.safe_filename(file.filename),
            stream=file.file,
            storage_dir=storage_dir,
            uploads_location=settings.uploads_location,
            max_bytes=settings.max_upload_bytes,
            purpose=purpose,
            checks_for=checks,
        )
    )
    # Shielded: a cancellation between the commit and the rename would leave the row
    # without its file until the next sweep.
    with anyio.CancelScope(shield=True):
        try:
            row = await run_in_write_session(
                request,
                lambda session: files.record_upload(
                    session, upload=received, owner_id=principal.id
                ),
            )
        except BaseException:
            files.discard_upload(received)
            raise
        await anyio.to_thread.run_sync(files.publish_upload, received, settings.storage)
    return _view(request, row)


def _view(request: Request, row: File) -> FileView | OpenAIFile:
    """tuneyard's view of a file, or OpenAI's for its clients (app/api/openai_compat.py)."""
    return OpenAIFile.of(row) if speaks_openai(request) else FileView.of(row)


@router.get(
    "",
    response_model=FileList | OpenAIFileList,
    summary="List your uploaded files",
    description="Newest first. `after` (or `cursor`): the last id of the previous page. "
    "OpenAI's SDKs get OpenAI's file objects.",
    responses=_errors(
        {
            401: _UNAUTHORIZED,
            404: "`after` names no file of yours",
            422: "A parameter breaks a rule; `detail` names it and the rule",
        }
    ),
)
def list_files(
    request: Request,
    session: SessionDep,
    principal: CurrentPrincipal,
    after: Annotated[str | None, Query(max_length=64), AfterValidator(refuse_nul)] = None,
    cursor: Annotated[
        str | None,
        Query(max_length=64, description="The same as `after`"),
        AfterValidator(refuse_nul),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=files.MAX_PAGE)] = 20,
    purpose: Annotated[str | None, Query(max_length=32)] = None,
) -> FileList | OpenAIFileList:
    # `purpose` filters nothing: every file here is a fine-tuning dataset (OpenAI's SDK
    # sends purpose="fine-tune").
    rows, has_more = files.list_files(
        session, owner_id=principal.id, after=after or cursor, limit=limit
    )
    last = rows[-1].id if rows else None
    if speaks_openai(request):
        return OpenAIFileList(
            data=[OpenAIFile.of(r) for r in rows],
            has_more=has_more,
            first_id=rows[0].id if rows else None,
            last_id=last,
        )
    return FileList(
        data=[FileView.of(r) for r in rows],
        has_more=has_more,
        next_cursor=last if has_more else None,
    )


@router.delete(
    "/{file_id}",
    response_model=FileDeleted,
    summary="Delete an uploaded file that no unfinished run reads",
    responses=_errors(
        {
            401: _UNAUTHORIZED,
            404: "No such file (or not yours)",
            409: "A queued or running run reads the file",
            422: "A parameter breaks a rule; `detail` names it and the rule",
        }
    ),
)
def delete_file(
    file_id: FileId,
    session: SessionDep,
    principal: CurrentPrincipal,
    background: BackgroundTasks,
    settings: SettingsDep,
) -> FileDeleted:
    location = files.delete_file(session, file_id=file_id, owner_id=principal.id)
    # Background tasks run after the request's commit: the row goes first, the bytes after
    # it, so a crash in between leaves only unreferenced bytes, never a row without its file.
    background.add_task(files.remove_stored, settings.storage, location)
    return FileDeleted(id=file_id, deleted=True)


@router.get(
    "/{file_id}",
    response_model=FileView | OpenAIFile,
    summary="Get an uploaded file's record",
    responses=_errors(
        {
            401: _UNAUTHORIZED,
            404: "No such file (or not yours)",
            422: "A parameter breaks a rule; `detail` names it and the rule",
        }
    ),
)
def get_file(
    file_id: FileId, request: Request, session: SessionDep, principal: CurrentPrincipal
) -> FileView | OpenAIFile:
    return _view(request, files.get_file(session, file_id=file_id, owner_id=principal.id))
