"""/v1/files: upload a dataset file (jsonl, csv, parquet), checked before it is stored."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request, Security, UploadFile, status

from app.api.deps import CurrentPrincipal, SessionDep, SettingsDep
from app.errors import PayloadTooLarge
from app.schemas.errors import error_responses
from app.schemas.file_view import FileView
from app.schemas.security_schemes import api_key
from app.services import files
from contract.datasets import Purpose, required_fields

router = APIRouter(prefix="/v1/files", tags=["files"], dependencies=[Security(api_key)])

_UNAUTHORIZED = "Missing or invalid API key"


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=FileView,
    summary="Upload a dataset file",
    description=(
        "Every record is parsed and checked for the fields its `purpose` needs before the "
        "file is stored; use the returned id as a run's `dataset.source`."
    ),
    responses=error_responses(
        {
            400: "The multipart body cannot be parsed",
            401: _UNAUTHORIZED,
            413: "Larger than TUNEYARD_MAX_UPLOAD_BYTES",
            422: "The file or a form field breaks a rule; each message gives the line or row",
        }
    ),
)
def upload_file(
    request: Request,
    file: UploadFile,
    session: SessionDep,
    settings: SettingsDep,
    principal: CurrentPrincipal,
    purpose: Annotated[Purpose, Form()] = "text",
    text_field: Annotated[str, Form(min_length=1)] = "text",
    text_pair_field: Annotated[str | None, Form()] = None,
    label_field: Annotated[str, Form(min_length=1)] = "label",
    prompt_field: Annotated[str, Form(min_length=1)] = "prompt",
    completion_field: Annotated[str, Form(min_length=1)] = "completion",
) -> FileView:
    declared = int(request.headers.get("content-length") or 0)
    # Multipart framing adds a little; anything far beyond the limit is refused unread.
    if declared > settings.max_upload_bytes + 64 * 1024:
        raise PayloadTooLarge(
            f"the upload is larger than the {settings.max_upload_bytes}-byte limit "
            "(TUNEYARD_MAX_UPLOAD_BYTES)"
        )
    required = required_fields(
        purpose,
        text_field=text_field,
        prompt_field=prompt_field,
        completion_field=completion_field,
        label_field=label_field,
        text_pair_field=text_pair_field,
    )
    upload = files.store_upload(
        session,
        owner_id=principal.id,
        filename=file.filename or "upload",
        stream=file.file,
        storage_dir=settings.resolved_storage_path / "files",
        max_bytes=settings.max_upload_bytes,
        purpose=purpose,
        required=[f.name for f in required],
        label_field=label_field if purpose == "sequence_classification" else None,
    )
    return FileView.of(upload)


@router.get(
    "/{file_id}",
    response_model=FileView,
    summary="Get an uploaded file's record",
    responses=error_responses(
        {
            401: _UNAUTHORIZED,
            404: "No such file (or not yours)",
            422: "A parameter breaks a rule; `detail` names it and the rule",
        }
    ),
)
def get_file(file_id: str, session: SessionDep, principal: CurrentPrincipal) -> FileView:
    return FileView.of(files.get_file(session, file_id=file_id, owner_id=principal.id))
