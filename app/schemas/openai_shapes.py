"""OpenAI's fine-tuning API shapes, as its official SDKs read and write them: the job
request, and the job, event, checkpoint, file and list objects tuneyard answers with.

Field names and value types follow OpenAI's API reference (and the `openai` package's own
types): timestamps are Unix seconds, ids are strings, lists are `{"object": "list", "data",
"has_more"}` pages whose next page is `after=<last id>`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from app.schemas.run_view import as_utc
from app.storage.models import File
from contract.bounds import refuse_nul
from contract.graders.models import Grader
from contract.run_request import MetadataKey, MetadataValue

_strict = ConfigDict(extra="forbid", allow_inf_nan=False)

Auto = Literal["auto"]


class OpenAIHyperparameters(BaseModel):
    """OpenAI's hyperparameters; "auto" resolves to tuneyard's documented defaults
    (app/services/openai_jobs.py)."""

    model_config = _strict

    n_epochs: Auto | Annotated[int, Field(gt=0, le=1_000)] = "auto"
    batch_size: Auto | Annotated[int, Field(gt=0, le=1_048_576)] = "auto"
    learning_rate_multiplier: Auto | Annotated[float, Field(gt=0, le=1_000)] = "auto"


class OpenAIDpoHyperparameters(OpenAIHyperparameters):
    beta: Auto | Annotated[float, Field(gt=0, le=100)] = "auto"


class OpenAIReinforcementHyperparameters(OpenAIHyperparameters):
    """OpenAI's reinforcement hyperparameters, resolved in app/services/openai_jobs.py."""

    compute_multiplier: Auto | Annotated[float, Field(gt=0, le=32)] = "auto"
    eval_interval: Auto | Annotated[int, Field(gt=0, le=1_000_000)] = "auto"
    eval_samples: Auto | Annotated[int, Field(gt=0, le=1_000)] = "auto"
    reasoning_effort: Literal["default", "low", "medium", "high"] = "default"


class OpenAIReinforcementMethod(BaseModel):
    model_config = _strict

    grader: Grader
    hyperparameters: OpenAIReinforcementHyperparameters = Field(
        default_factory=OpenAIReinforcementHyperparameters
    )
    # OpenAI's structured-output schema for the sampled answers: no equivalent here.
    response_format: dict[str, Any] | None = None


class OpenAISupervisedMethod(BaseModel):
    model_config = _strict

    hyperparameters: OpenAIHyperparameters = Field(default_factory=OpenAIHyperparameters)


class OpenAIDpoMethod(BaseModel):
    model_config = _strict

    hyperparameters: OpenAIDpoHyperparameters = Field(default_factory=OpenAIDpoHyperparameters)


class OpenAIMethod(BaseModel):
    model_config = _strict

    type: Literal["supervised", "dpo", "reinforcement"]
    supervised: OpenAISupervisedMethod | None = None
    dpo: OpenAIDpoMethod | None = None
    reinforcement: OpenAIReinforcementMethod | None = None


FileId = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class JobCreate(BaseModel):
    """`POST /v1/fine_tuning/jobs`: OpenAI's request, plus the one extension field
    `tuneyard` for what OpenAI has no name for."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    model: str = Field(
        min_length=1,
        max_length=4095,
        description="A Hugging Face hub id, a local model folder inside the allowed roots, "
        "or an earlier run's id (its exported model).",
    )
    training_file: FileId = Field(description="An uploaded file's id (POST /v1/files).")
    validation_file: FileId | None = None
    hyperparameters: OpenAIHyperparameters | None = Field(
        default=None, description="OpenAI's older place for them; `method` wins."
    )
    method: OpenAIMethod | None = None
    # Stored with the job: PostgreSQL's text holds no NUL.
    suffix: (
        Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(refuse_nul)]
        | None
    ) = None
    seed: int | None = Field(default=None, ge=0, le=2**31 - 1)
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    integrations: list[dict[str, Any]] | None = None
    tuneyard: dict[str, Any] | None = Field(
        default=None,
        description="tuneyard's run request groups beyond OpenAI's fields, merged into the "
        "run: `lora`, `deepspeed`, `resources`, `training`, `checkpointing`, "
        "`fault_tolerance`, `dataset` (e.g. `chat_template`) and `method` (the method's own "
        "settings, e.g. grpo's `max_completion_tokens`), and the scheduling fields "
        "`priority` and `preemptible`. With the OpenAI SDK: "
        '`extra_body={"tuneyard": {...}}`.',
    )


class JobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class Job(BaseModel):
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    id: str
    created_at: int
    finished_at: int | None
    model: str
    fine_tuned_model: str | None
    organization_id: str
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    training_file: str
    validation_file: str | None
    result_files: list[str]
    trained_tokens: int | None
    estimated_finish: int | None
    error: JobError | None
    seed: int
    user_provided_suffix: str | None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None


class JobEvent(BaseModel):
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    id: str
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    type: Literal["message", "metrics"] = "message"
    data: dict[str, Any] | None = None


class CheckpointMetrics(BaseModel):
    step: float | None = None
    train_loss: float | None = None
    valid_loss: float | None = None
    full_valid_loss: float | None = None


class JobCheckpoint(BaseModel):
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    id: str
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: CheckpointMetrics


class OpenAIFile(BaseModel):
    object: Literal["file"] = "file"
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["fine-tune"] = "fine-tune"
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    # tuneyard's fields where they do not clash with OpenAI's: what the records were
    # checked as (tuneyard's `purpose`), and what the check found.
    dataset_format: str
    format: str
    records: int
    fields: list[str]

    @classmethod
    def of(cls, f: File) -> OpenAIFile:
        created = as_utc(f.created_at)
        assert created is not None
        return cls(
            id=f.id,
            bytes=f.bytes,
            created_at=int(created.timestamp()),
            filename=f.filename,
            dataset_format=f.purpose,
            format=f.format,
            records=f.records,
            fields=f.fields,
        )


class OpenAIFileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIFile]
    has_more: bool
    first_id: str | None
    last_id: str | None


class FileDeleted(BaseModel):
    object: Literal["file"] = "file"
    id: str
    deleted: bool


class JobPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[Job]
    has_more: bool


class EventPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobEvent]
    has_more: bool


class CheckpointPage(BaseModel):
    object: Literal["list"] = "list"
    data: list[JobCheckpoint]
    has_more: bool
    first_id: str | None
    last_id: str | None


class OpenAIErrorBody(BaseModel):
    message: str
    type: str = Field(examples=["invalid_request_error"])
    param: str | None = Field(examples=["training_file"])
    code: str | None = Field(examples=["validation_error"])


class OpenAIError(BaseModel):
    """The error shape OpenAI's SDKs parse: `openai.BadRequestError` and the others carry
    `message`, `param` and `code` from it."""

    error: OpenAIErrorBody
