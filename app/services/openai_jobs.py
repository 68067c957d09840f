"""OpenAI fine-tuning jobs on top of tuneyard's runs: a job request becomes a run request
(the same validation, the same run), and a run reads back as a job, its events and its
checkpoints in OpenAI's shapes.

What OpenAI's names resolve to, documented in the README and the OpenAPI document:
- `training_file` is the dataset (`dataset.source`), its format the one its upload was
  checked for; `validation_file` is `dataset.eval_source`.
- `n_epochs` is `training.epochs` ("auto": tuneyard's default, 1).
- `batch_size` is the global batch, rows per optimizer step: `batch_size_per_worker` (1
  unless the extension sets it) x data-parallel workers x gradient_accumulation_steps, so
  it must be a multiple of the first two ("auto": one row per worker, no accumulation).
- `learning_rate_multiplier` scales a base learning rate of 1e-5 for full fine-tuning and
  1e-4 with LoRA ("auto": 1).
- DPO's `beta` ("auto": 0.1, TRL's default).
- Reinforcement is tuneyard's grpo on a file of prompts: `grader` as given;
  `compute_multiplier` scales the completions sampled per prompt ("auto": 8, TRL's
  num_generations); `batch_size` counts prompts; `eval_interval` is
  `training.eval_every_n_steps` ("auto": at the end); `reasoning_effort` and `eval_samples`
  are accepted and ignored, each with an event saying so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from pydantic import ValidationError as PydanticValidationError
from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from app.errors import NotFound, ValidationFailed, field_problem, problems_from_pydantic
from app.schemas.openai_shapes import (
    CheckpointMetrics,
    Job,
    JobCheckpoint,
    JobCreate,
    JobError,
    JobEvent,
    OpenAIDpoHyperparameters,
    OpenAIHyperparameters,
    OpenAIReinforcementHyperparameters,
)
from app.schemas.run_view import RunView, as_utc
from app.services import lifecycle, runs
from app.services.placement import ClusterView
from app.services.rules.run_rules import RequestPolicy
from app.storage.lookups import find_file
from app.storage.models import Checkpoint, Event, Metric, Run
from contract.callbacks import EventType
from contract.deepspeed_config import global_batch_size
from contract.run_request import RunDefinition, RunRequest
from contract.statuses import RunStatus

BASE_LEARNING_RATE = 1e-5
BASE_LEARNING_RATE_LORA = 1e-4
DEFAULT_BETA = 0.1
# Completions per prompt at compute_multiplier 1 ("auto"): TRL's num_generations default.
DEFAULT_GENERATIONS = 8
# The run request's groups (and scheduling fields) the `tuneyard` extension field may set.
EXTENSION_GROUPS = frozenset(
    {"task", "dataset", "method", "lora", "training", "deepspeed", "resources",
     "checkpointing", "fault_tolerance", "priority", "preemptible"}
)  # fmt: skip
# The groups that are objects in a run request (the rest are values: task, priority, ...).
OBJECT_GROUPS = EXTENSION_GROUPS - {"task", "priority", "preemptible"}
# The dataset format each upload purpose was checked for.
_FORMAT_OF_PURPOSE = {
    "text": "text",
    "prompt_completion": "prompt_completion",
    "chat": "chat",
    "preference": "preference",
    "prompt": "prompt",
    "sequence_classification": "text",
}
# tuneyard's field names as OpenAI's request names them, for errors' `param`.
_PARAM_OF_FIELD = {
    "dataset.source": "training_file",
    "dataset.eval_source": "validation_file",
    "dataset.format": "training_file",
    "method.type": "method.type",
    "training.epochs": "hyperparameters.n_epochs",
    "training.seed": "seed",
    "training.learning_rate": "hyperparameters.learning_rate_multiplier",
    "method.dpo.beta": "method.dpo.hyperparameters.beta",
    "method.grpo.grader": "method.reinforcement.grader",
    "method.grpo.num_generations": "method.reinforcement.hyperparameters.compute_multiplier",
    "training.eval_every_n_steps": "method.reinforcement.hyperparameters.eval_interval",
}
_STATUS = {
    RunStatus.QUEUED: "queued",
    RunStatus.STARTING: "running",
    RunStatus.RUNNING: "running",
    RunStatus.PREEMPTING: "running",
    # The stop is asked for and the job will train no further: what OpenAI shows at once.
    RunStatus.CANCELLING: "cancelled",
    RunStatus.SUCCEEDED: "succeeded",
    RunStatus.FAILED: "failed",
    RunStatus.CANCELLED: "cancelled",
}


def prepare_job(
    session: Session,
    *,
    job: JobCreate,
    owner_id: str,
    policy: RequestPolicy,
    cluster: ClusterView | None,
) -> runs.NewRun:
    """The run for an OpenAI job request, checked on a read session (`runs.prepare_run`);
    every problem raised at once, named by the request's own parameter."""
    request = run_request_for(session, job, owner_id=owner_id)
    with _named_as_params():
        return runs.prepare_run(
            session,
            request=request,
            owner_id=owner_id,
            policy=policy,
            cluster=cluster,
        )


def store_job(session: Session, new: runs.NewRun, *, job: JobCreate) -> Run:
    """`runs.store_run` for a job that `prepare_job` checked, with nothing stored when it
    fails."""
    with _named_as_params():
        run, _ = runs.store_run(session, new)
    run.openai_job = {
        "model": job.model,
        "training_file": job.training_file,
        "validation_file": job.validation_file,
        "suffix": job.suffix,
    }
    for note in job_notes(job):
        lifecycle.record_event(session, run, type=EventType.MESSAGE, message=note)
    return run


@contextmanager
def _named_as_params() -> Iterator[None]:
    try:
        yield
    except ValidationFailed as exc:
        raise ValidationFailed([_as_param(p) for p in exc.detail]) from exc


def run_request_for(session: Session, job: JobCreate, *, owner_id: str) -> RunRequest:
    problems: list[dict[str, str]] = []
    ext = dict(job.tuneyard or {})
    for key in sorted(set(ext) - EXTENSION_GROUPS):
        problems.append(
            field_problem(
                f"tuneyard.{key}",
                f"unknown group {key!r}; the extension takes {', '.join(sorted(EXTENSION_GROUPS))}",
            )
        )
    if job.integrations:
        problems.append(
            field_problem("integrations", "tuneyard has no integrations; leave integrations out")
        )
    for key in sorted(OBJECT_GROUPS & set(ext)):
        # null is the run request's own "none" (`lora: null`: a full fine-tune).
        if ext[key] is not None and not isinstance(ext[key], dict):
            problems.append(
                field_problem(f"tuneyard.{key}", f"must be an object, like the run request's {key}")
            )
    own = _group(ext, "dataset")
    for key, param in (("source", "training_file"), ("eval_source", "validation_file")):
        if key in own:
            # The job's files are its data: another source would train on what the job
            # does not name (and may not be the caller's upload at all).
            problems.append(
                field_problem(
                    f"tuneyard.dataset.{key}",
                    f"a job's data is its {param}; give the uploaded file's id there",
                )
            )
    method, hyper = _method_and_hyperparameters(job, problems)
    upload = find_file(session, file_id=job.training_file, owner_id=owner_id)
    if upload is None:
        problems.append(field_problem("training_file", f"no uploaded file {job.training_file!r}"))
    groups = {k: dict(v) if isinstance(v, dict) else v for k, v in ext.items()}
    dataset = {
        "source": job.training_file,
        **({"format": _FORMAT_OF_PURPOSE.get(upload.purpose, "text")} if upload else {}),
        **({"eval_source": job.validation_file} if job.validation_file else {}),
        **_group(groups, "dataset"),
    }
    if upload is not None and upload.purpose == "sequence_classification":
        groups.setdefault("task", "sequence_classification")
        dataset.setdefault("label_field", "label")
    if method["type"] == "grpo" and upload is not None:
        dataset.setdefault("prompt_field", _prompt_field(upload.fields))
    training = _group(groups, "training")
    lora = groups.get("lora")
    _resolve_hyperparameters(hyper, training, groups, lora=lora is not None, problems=problems)
    if isinstance(hyper, OpenAIReinforcementHyperparameters) and hyper.eval_interval != "auto":
        training.setdefault("eval_every_n_steps", hyper.eval_interval)
    if job.seed is not None:
        training["seed"] = job.seed
    # The method's own settings that OpenAI has no name for (grpo's max_completion_tokens,
    # temperature, beta, ...); its type is OpenAI's `method.type`.
    extra_method = {k: v for k, v in _group(groups, "method").items() if k != "type"}
    body: dict[str, Any] = {
        **groups,
        "model": job.model,
        "dataset": dataset,
        "training": training,
        "method": {**method, **extra_method},
        "metadata": job.metadata or {},
    }
    try:
        request = RunRequest.model_validate(body)
    except PydanticValidationError as exc:
        problems.extend(problems_from_pydantic(exc.errors()))
        request = None
    if problems or request is None:
        raise ValidationFailed([_as_param(p) for p in problems])
    return request


def _prompt_field(fields: Sequence[str]) -> str:
    """Where an upload of prompts holds them: OpenAI's reinforcement records in `messages`,
    tuneyard's in `prompt`."""
    return "messages" if "messages" in fields and "prompt" not in fields else "prompt"


def job_notes(job: JobCreate) -> list[str]:
    """What the job asked that tuneyard accepts and does not act on: said in its events."""
    method = job.method
    if method is None or method.reinforcement is None:
        return []
    hyper = method.reinforcement.hyperparameters
    notes = []
    if hyper.reasoning_effort != "default":
        notes.append(
            f"reasoning_effort {hyper.reasoning_effort!r} is accepted and ignored: it applies "
            "to OpenAI's reasoning models; tuneyard samples up to "
            "method.max_completion_tokens tokens"
        )
    if hyper.eval_samples not in ("auto", 1):
        notes.append(
            f"eval_samples {hyper.eval_samples} is accepted and ignored: tuneyard's "
            "eval_reward scores one greedy completion of each validation prompt"
        )
    return notes


def _group(groups: dict[str, Any], name: str) -> dict[str, Any]:
    value = groups.get(name, {})
    return dict(value) if isinstance(value, dict) else {}


def _method_and_hyperparameters(
    job: JobCreate, problems: list[dict[str, str]]
) -> tuple[dict[str, Any], OpenAIHyperparameters | OpenAIReinforcementHyperparameters]:
    method = job.method
    if method is None:
        return {"type": "sft"}, job.hyperparameters or OpenAIHyperparameters()
    if method.type == "reinforcement":
        rl = method.reinforcement
        if rl is None:
            problems.append(
                field_problem(
                    "method.reinforcement",
                    "method.type 'reinforcement' needs method.reinforcement with its grader",
                )
            )
            return {"type": "sft"}, OpenAIHyperparameters()
        if rl.response_format is not None:
            problems.append(
                field_problem(
                    "method.reinforcement.response_format",
                    "tuneyard samples completions as plain text; leave response_format out "
                    "(a grader reads JSON answers as {{sample.output_json.<field>}})",
                )
            )
        hyper = rl.hyperparameters
        multiplier = 1.0 if hyper.compute_multiplier == "auto" else hyper.compute_multiplier
        return {
            "type": "grpo",
            "grader": rl.grader.model_dump(mode="json", exclude_none=True),
            # More compute is more completions sampled per prompt, the group compared.
            "num_generations": max(2, round(DEFAULT_GENERATIONS * multiplier)),
        }, hyper
    if method.type == "dpo":
        dpo = method.dpo.hyperparameters if method.dpo else OpenAIDpoHyperparameters()
        beta = DEFAULT_BETA if dpo.beta == "auto" else dpo.beta
        return {"type": "dpo", "beta": beta}, dpo
    supervised = method.supervised.hyperparameters if method.supervised else None
    return {"type": "sft"}, supervised or job.hyperparameters or OpenAIHyperparameters()


def _resolve_hyperparameters(
    hyper: OpenAIHyperparameters,
    training: dict[str, Any],
    groups: dict[str, Any],
    *,
    lora: bool,
    problems: list[dict[str, str]],
) -> None:
    """OpenAI's hyperparameters into `training` (see the module's docstring)."""
    if hyper.n_epochs != "auto":
        training["epochs"] = hyper.n_epochs
    if hyper.learning_rate_multiplier != "auto":
        if "learning_rate" in training:
            problems.append(
                field_problem(
                    "hyperparameters.learning_rate_multiplier",
                    "give learning_rate_multiplier or tuneyard.training.learning_rate, not both",
                )
            )
        else:
            base = BASE_LEARNING_RATE_LORA if lora else BASE_LEARNING_RATE
            training["learning_rate"] = base * hyper.learning_rate_multiplier
    elif "learning_rate" not in training:
        training["learning_rate"] = BASE_LEARNING_RATE_LORA if lora else BASE_LEARNING_RATE
    if hyper.batch_size == "auto":
        return
    resources, deepspeed = _group(groups, "resources"), _group(groups, "deepspeed")
    workers = resources.get("num_workers", 2)
    tp = deepspeed.get("tensor_parallel_size", 1)
    per_worker = training.get("batch_size_per_worker", 1)
    if not all(isinstance(v, int) and v > 0 for v in (workers, tp, per_worker)):
        return  # the run request's own checks name these
    rows = max(workers // tp, 1) * per_worker
    if hyper.batch_size % rows:
        problems.append(
            field_problem(
                "hyperparameters.batch_size",
                f"batch_size ({hyper.batch_size}) must be a multiple of data-parallel workers "
                f"({max(workers // tp, 1)}) x batch_size_per_worker ({per_worker}) = {rows}: "
                "each optimizer step takes the same number of rows from every worker",
            )
        )
        return
    training["gradient_accumulation_steps"] = hyper.batch_size // rows


def _as_param(problem: dict[str, str]) -> dict[str, str]:
    """A problem named by the OpenAI request's parameter where it has one: a field inside
    the grader (a multi grader's judge, `method.grpo.grader.graders.<key>.model`) by the
    grader's own parameter and the same path within it."""
    field = problem["field"]
    grader = "method.grpo.grader"
    if field.startswith(f"{grader}."):
        return field_problem(
            _PARAM_OF_FIELD[grader] + field.removeprefix(grader), problem["message"]
        )
    return field_problem(_PARAM_OF_FIELD.get(field, field), problem["message"])


# -- reading jobs back -------------------------------------------------------------------------


def job_view(run: Run, *, trained_tokens: int | None) -> Job:
    spec = run.definition
    asked = run.openai_job or {}
    view = RunView.of(run)
    status = _STATUS[RunStatus(run.status)]
    eta = view.progress.eta_seconds
    method: dict[str, Any]
    if spec.method.type == "dpo":
        method = {
            "type": "dpo",
            "dpo": {"hyperparameters": {**hyperparameters_of(spec), "beta": spec.method.beta}},
        }
    elif spec.method.type == "grpo":
        every = spec.training.eval_every_n_steps
        method = {
            "type": "reinforcement",
            "reinforcement": {
                "grader": spec.method.grader.model_dump(mode="json", exclude_none=True),
                "hyperparameters": {
                    **hyperparameters_of(spec),
                    "compute_multiplier": spec.method.num_generations / DEFAULT_GENERATIONS,
                    "eval_interval": every if every is not None else "auto",
                    "eval_samples": 1,
                    "reasoning_effort": "default",
                },
            },
        }
    else:
        method = {"type": "supervised", "supervised": {"hyperparameters": hyperparameters_of(spec)}}
    return Job(
        id=run.id,
        created_at=_unix(run.created_at),
        finished_at=_unix(run.finished_at) if run.finished_at else None,
        model=asked.get("model") or spec.model,
        fine_tuned_model=run.model_path if status == "succeeded" else None,
        organization_id=run.owner_id or "",
        status=status,
        hyperparameters=hyperparameters_of(spec),
        method=method,
        training_file=asked.get("training_file") or spec.dataset.source,
        validation_file=asked.get("validation_file") or spec.dataset.eval_source,
        result_files=[],
        trained_tokens=trained_tokens,
        estimated_finish=int(datetime.now(UTC).timestamp() + eta) if eta is not None else None,
        error=JobError(code=run.error_code, message=run.error_message or "", param=None)
        if run.error_code
        else None,
        seed=spec.training.seed,
        user_provided_suffix=asked.get("suffix"),
        metadata=run.run_metadata,
    )


def hyperparameters_of(spec: RunDefinition) -> dict[str, Any]:
    """The run's training settings in OpenAI's terms."""
    base = BASE_LEARNING_RATE_LORA if spec.lora is not None else BASE_LEARNING_RATE
    return {
        "n_epochs": spec.training.epochs if spec.training.max_steps is None else None,
        "batch_size": global_batch_size(spec),
        "learning_rate_multiplier": spec.training.learning_rate / base,
    }


def _unix(moment: datetime) -> int:
    utc = as_utc(moment)
    assert utc is not None
    return int(utc.timestamp())


def trained_tokens(session: Session, runs: Sequence[Run]) -> dict[str, int]:
    """Input tokens trained per ended run: the worker's per-step `tokens` metric summed over
    the steps, each step's value from the latest attempt that logged it (a resumed attempt
    re-trains the steps after its checkpoint). A live run has none: OpenAI documents
    `trained_tokens` as null while the job is still running."""
    run_ids = [run.id for run in runs if RunStatus(run.status).is_terminal()]
    if not run_ids:
        return {}
    latest = (
        select(Metric.run_id, Metric.step, func.max(Metric.attempt).label("attempt"))
        .where(Metric.name == "tokens", Metric.run_id.in_(run_ids))
        .group_by(Metric.run_id, Metric.step)
        .subquery()
    )
    query = (
        select(Metric.run_id, func.sum(Metric.value))
        .join(
            latest,
            and_(
                Metric.run_id == latest.c.run_id,
                Metric.step == latest.c.step,
                Metric.attempt == latest.c.attempt,
            ),
        )
        .where(Metric.name == "tokens")
        .group_by(Metric.run_id)
    )
    return {run_id: int(total or 0) for run_id, total in session.execute(query)}


def list_jobs(
    session: Session,
    *,
    owner_id: str,
    after: str | None,
    limit: int,
    metadata: dict[str, str],
) -> tuple[list[Run], bool]:
    """Newest first; `after` is the id of the last job of the previous page."""
    cursor = None
    if after is not None:
        cursor = runs.encode_cursor(runs.get_run(session, run_id=after, owner_id=owner_id))
    page, next_cursor = runs.list_runs(
        session, owner_id=owner_id, status=None, metadata=metadata, limit=limit, cursor=cursor
    )
    return page, next_cursor is not None


_EVENT_ID = re.compile(r"ftevent-([0-9]{1,18})")
# Events OpenAI's clients see as warnings: a run waiting for the cluster, data cut to fit,
# metrics an experiment tracker stopped taking.
_WARNINGS = frozenset(
    {EventType.WAITING_FOR_RESOURCES, EventType.DATA_FITTED, EventType.TRACKING_FAILED}
)
_CHECKPOINT_ID = re.compile(r"ftckpt-([0-9]{1,18})")


def list_job_events(
    session: Session, *, run: Run, after: str | None, limit: int
) -> tuple[list[JobEvent], bool]:
    """Newest first, as OpenAI lists them; `after` is the last event id seen."""
    query = select(Event).where(Event.run_id == run.id)
    if after is not None:
        query = query.where(Event.id < _cursor_id(after, _EVENT_ID, "after"))
    rows = list(session.scalars(query.order_by(Event.id.desc()).limit(limit + 1)))
    return [_event_view(e) for e in rows[:limit]], len(rows) > limit


def _event_view(event: Event) -> JobEvent:
    level = "info"
    if event.status == RunStatus.FAILED:
        level = "error"
    elif event.type in _WARNINGS:
        level = "warn"
    message = event.message or (f"status: {event.status}" if event.status else event.type)
    return JobEvent(
        id=f"ftevent-{event.id}",
        created_at=_unix(event.created_at),
        level=level,
        message=message,
        data={
            "type": event.type,
            "status": event.status,
            "attempt": event.attempt,
            # A startup_phase event's part of the start and its length (tuneyard's own).
            **(
                {"phase": event.phase, "duration_seconds": event.duration_seconds}
                if event.phase
                else {}
            ),
        },
    )


def list_job_checkpoints(
    session: Session, *, run: Run, after: str | None, limit: int
) -> tuple[list[JobCheckpoint], bool]:
    """The run's checkpoints and exports, newest first."""
    query = select(Checkpoint).where(Checkpoint.run_id == run.id)
    if after is not None:
        query = query.where(Checkpoint.id < _cursor_id(after, _CHECKPOINT_ID, "after"))
    rows = list(session.scalars(query.order_by(Checkpoint.id.desc()).limit(limit + 1)))
    return [_checkpoint_view(c) for c in rows[:limit]], len(rows) > limit


def _checkpoint_view(checkpoint: Checkpoint) -> JobCheckpoint:
    metrics = checkpoint.metrics or {}

    def number(name: str) -> float | None:
        value = metrics.get(name)
        return float(value) if isinstance(value, int | float) else None

    return JobCheckpoint(
        id=f"ftckpt-{checkpoint.id}",
        created_at=_unix(checkpoint.created_at),
        fine_tuned_model_checkpoint=checkpoint.path,
        fine_tuning_job_id=checkpoint.run_id,
        step_number=checkpoint.step,
        metrics=CheckpointMetrics(
            step=float(checkpoint.step),
            train_loss=number("loss"),
            valid_loss=number("eval_loss"),
            full_valid_loss=number("eval_loss"),
        ),
    )


def _cursor_id(value: str, pattern: re.Pattern[str], name: str) -> int:
    match = pattern.fullmatch(value)
    if match is None:
        raise ValidationFailed([field_problem(name, f"{value!r} is not an id this list returned")])
    return int(match.group(1))


def get_job(session: Session, *, job_id: str, owner_id: str, for_update: bool = False) -> Run:
    try:
        return runs.get_run(session, run_id=job_id, owner_id=owner_id, for_update=for_update)
    except NotFound as exc:
        raise NotFound(f"fine-tuning job {job_id} not found") from exc
