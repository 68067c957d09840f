"""Every rule a run request must meet before any compute is spent, reported all at once.

The schema (types, ranges, unknown fields) is checked by pydantic in
contract/run_request.py; this module checks what lies between fields and what needs
the file system, the uploaded files or the model's own config. Each problem names the
field it is about and says the rule in words a user can act on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from app.errors import field_problem
from app.models import File
from app.services.model_files import trainable_model_types
from contract.datasets import (
    FILE_FORMATS,
    fields_read_by,
    file_format,
    is_local_source,
    is_uploaded,
    local_split_problem,
)
from contract.run_request import RunDefinition, RunRequest
from contract.steps import StepPlan, examples_used

_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")

Problem = dict[str, str]


@dataclass(slots=True)
class CheckedRequest:
    """The outcome of checking a request: its problems, or the spec the worker will get."""

    problems: list[Problem]
    # What is stored as the run's spec: the request with local paths resolved and an
    # uploaded file's id replaced by its path; metadata stays with the run.
    spec: dict[str, Any]
    model_config: dict[str, Any] | None = None
    dataset_records: int | None = None
    # The worker's own step count, where the service can know it (see _step_plan).
    plan: StepPlan | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def resolved(self) -> RunDefinition:
        return RunDefinition.model_validate(self.spec)


def check_run_request(
    session: Session, request: RunRequest, *, owner_id: str, allowed_roots: list[Path]
) -> CheckedRequest:
    checked = CheckedRequest(problems=cross_field_problems(request), spec=request.worker_fields())
    _check_model(request, checked, allowed_roots)
    _check_dataset(session, request, checked, owner_id=owner_id, allowed_roots=allowed_roots)
    if not checked.problems:
        try:
            checked.plan = _step_plan(request, checked.dataset_records)
        except ValueError as exc:
            checked.problems.append(field_problem("training.batch_size_per_worker", str(exc)))
    return checked


def _step_plan(request: RunRequest, records: int | None) -> StepPlan | None:
    """The examples of an uploaded file (each record is one) counted as the worker counts
    them, unless packing makes the count depend on the token count. Raises ValueError when
    the data gives no whole step."""
    if records is None or request.training.packing:
        return None
    examples = examples_used(records, request.dataset.max_samples)
    return StepPlan.for_examples(request, examples=examples)


def cross_field_problems(req: RunRequest) -> list[Problem]:
    problems: list[Problem] = []
    ds, res, tr, data = req.deepspeed, req.resources, req.training, req.dataset

    def add(name: str, message: str) -> None:
        problems.append(field_problem(name, message))

    if res.num_workers % ds.tensor_parallel_size:
        add(
            "deepspeed.tensor_parallel_size",
            f"tensor_parallel_size ({ds.tensor_parallel_size}) * data-parallel size must equal "
            f"num_workers ({res.num_workers}): num_workers must be a multiple of it",
        )
    if ds.offload_params != "none" and ds.zero_stage != 3:
        add("deepspeed.offload_params", f"offload_params needs zero_stage 3, got {ds.zero_stage}")
    if ds.offload_optimizer != "none" and ds.zero_stage == 0:
        add("deepspeed.offload_optimizer", "offload_optimizer needs zero_stage 1, 2 or 3, got 0")
    if ds.precision == "fp16" and not res.use_gpu:
        add(
            "deepspeed.precision",
            "fp16 needs a GPU (resources.use_gpu=true); on CPU use bf16, fp32 or auto",
        )
    if res.gpus_per_worker is not None and not res.use_gpu:
        add("resources.gpus_per_worker", "gpus_per_worker needs resources.use_gpu=true")
    if tr.max_steps is not None and tr.warmup_steps > tr.max_steps:
        add(
            "training.warmup_steps",
            f"warmup_steps ({tr.warmup_steps}) exceeds max_steps ({tr.max_steps})",
        )
    if is_local_source(data.source) or is_uploaded(data.source):
        for name in ("split", "eval_split"):
            value = getattr(data, name)
            if value is not None and (problem := local_split_problem(name, value)):
                add(f"dataset.{name}", problem)
    if req.task == "sequence_classification":
        if data.label_field is None:
            add("dataset.label_field", "task sequence_classification needs dataset.label_field")
        if data.format != "text":
            add("dataset.format", "task sequence_classification takes format 'text'")
        if tr.packing:
            add("training.packing", "packing applies to causal_lm only")
    else:
        for name in ("label_field", "text_pair_field"):
            if getattr(data, name) is not None:
                add(f"dataset.{name}", f"{name} applies to task sequence_classification only")
    return problems


# -- the model ----------------------------------------------------------------------------


def _check_model(request: RunRequest, checked: CheckedRequest, roots: list[Path]) -> None:
    value = request.model
    if _URL.match(value):
        checked.problems.append(
            field_problem("model", f"{value!r} is a URL; give a hub id or a local path")
        )
        return
    if not is_local_source(value):
        return  # a hub id: the cluster resolves it
    path, message = _allowed_local_path(value, roots)
    if message:
        checked.problems.append(field_problem("model", message))
        return
    assert path is not None
    config_file = path / "config.json"
    if not config_file.is_file():
        checked.problems.append(
            field_problem(
                "model", f"local model {value!r} has no config.json: give a save_pretrained folder"
            )
        )
        return
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        checked.problems.append(field_problem("model", f"cannot read {config_file}: {exc}"))
        return
    checked.spec["model"] = str(path)
    checked.model_config = config
    checked.problems.extend(model_config_problems(config, request))


def model_config_problems(config: dict[str, Any], req: RunRequest) -> list[Problem]:
    """What the model's config.json says about this request."""
    problems: list[Problem] = []
    model_type = config.get("model_type")
    trainable = trainable_model_types(req.task)
    if trainable is not None and model_type not in trainable:
        problems.append(
            field_problem(
                "model", f"model type {model_type!r} cannot be trained for task {req.task!r}"
            )
        )

    tp = req.deepspeed.tensor_parallel_size
    heads = config.get("num_attention_heads") or config.get("n_head")
    kv_heads = config.get("num_key_value_heads") or heads
    for label, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % tp:
            problems.append(
                field_problem(
                    "deepspeed.tensor_parallel_size",
                    f"the model has {count} {label}, which tensor_parallel_size ({tp}) must divide",
                )
            )

    max_positions = (
        config.get("max_position_embeddings") or config.get("n_positions") or config.get("n_ctx")
    )
    if isinstance(max_positions, int) and req.training.seq_length > max_positions:
        problems.append(
            field_problem(
                "training.seq_length",
                f"seq_length ({req.training.seq_length}) exceeds the model's maximum positions "
                f"({max_positions})",
            )
        )
    return problems


# -- the dataset --------------------------------------------------------------------------


def _check_dataset(
    session: Session,
    request: RunRequest,
    checked: CheckedRequest,
    *,
    owner_id: str,
    allowed_roots: list[Path],
) -> None:
    source = request.dataset.source
    name = "dataset.source"
    if is_uploaded(source):
        upload = session.get(File, source)
        if upload is None or upload.owner_id != owner_id:
            checked.problems.append(field_problem(name, f"no uploaded file {source!r}"))
            return
        checked.spec["dataset"]["source"] = upload.path
        checked.dataset_records = upload.records
        fields = fields_read_by(request.task, request.dataset)
        missing = [f.name for f in fields if f.name not in upload.fields]
        if missing:
            checked.problems.append(
                field_problem(
                    name,
                    f"uploaded file {source} has no field {missing[0]!r}; "
                    f"its fields are {upload.fields}",
                )
            )
        return
    if _URL.match(source):
        checked.problems.append(
            field_problem(
                name, f"{source!r} is a URL; give a hub dataset, a local path or a file id"
            )
        )
        return
    if not is_local_source(source):
        return
    path, message = _allowed_local_path(source, allowed_roots)
    if message is None and path is not None and path.is_file() and file_format(path) is None:
        message = f"dataset file {path.name!r} must be one of {', '.join(sorted(FILE_FORMATS))}"
    if message:
        checked.problems.append(field_problem(name, message))
        return
    checked.spec["dataset"]["source"] = str(path)


def _allowed_local_path(value: str, roots: list[Path]) -> tuple[Path | None, str | None]:
    path = Path(value).expanduser()
    if not path.exists():
        return None, f"local path {value!r} does not exist"
    # resolve() follows symlinks and '..', so neither can step outside an allowed root.
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root) for root in roots):
        listed = ", ".join(str(r) for r in roots)
        return None, (
            f"local path {value!r} is outside the allowed roots ({listed}); "
            "see TUNEYARD_ALLOWED_ROOTS"
        )
    return resolved, None
