"""Every rule a run request must meet before any compute is spent, reported all at once.

The schema (types, ranges, unknown fields) is checked by pydantic in
contract/run_request.py; this module checks what lies between fields and what needs
the file system, the uploaded files or the model's own config. Each problem names the
field it is about and says the rule in words a user can act on.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import field_problem
from app.services.rules.adapter_sizes import adapter_parameters, linear_weights
from app.services.rules.evaluation_rules import evaluation_problems
from app.services.rules.file_checks import (
    FileReport,
    Opener,
    RecordChecks,
    RecordProblem,
    check_records,
    checks_for,
)
from app.services.rules.grader_rules import (
    item_roots,
    missing_item_fields,
    record_item_problem,
    runnable_problems,
)
from app.services.rules.judge_rules import Judge, check_judges, resolved_grader
from app.services.rules.model_files import (
    chat_template_of,
    safetensors_headers,
    trainable_model_types,
)
from app.services.rules.path_rules import allowed_local_path, export_problem
from app.services.rules.tracking_rules import (
    TrackingConfig,
    key_tracking_problems,
    tracking_problems,
)
from app.services.rules.webhook_rules import WebhookConfig, webhook_problems
from app.storage.lookups import find_file
from app.storage.models import RUN_ID, Checkpoint, File, Run
from contract.datasets import (
    FILE_FORMATS,
    fields_read_by,
    file_format,
    is_local_source,
    is_uploaded,
    local_split_problem,
    purpose_of,
)
from contract.graders.models import AnyGrader
from contract.records import is_conversational
from contract.run_request import GrpoMethod, RunDefinition, RunRequest
from contract.seq_length import completion_room, max_positions_of, seq_length_cap
from contract.steps import StepPlan, examples_used
from contract.storage import Storage, StorageError, is_uri

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
    # Method grpo: the score_model graders' models, resolved (app/services/rules/judge_rules.py).
    judges: list[Judge] = field(default_factory=list)

    # The seq_length the worker will choose where the request leaves it unset, as
    # app/services/data_plan.py predicts it; None: not known here.
    seq_length: int | None = None

    # Whether the model's tokenizer brings a chat template, where the data may need one;
    # None: not read here (a hub model, an export in object storage: the cluster reads
    # those), or no need.
    model_has_chat_template: bool | None = None
    # Where the data read here first gives a prompt as chat messages ("line 2 of p.jsonl").
    messages_at: str | None = None

    @property
    def resolved(self) -> RunDefinition:
        return RunDefinition.of_resolved(self.spec)

    def plan_examples(self, definition: RunDefinition, examples: int) -> None:
        """The plan for `examples` training examples per epoch, or the problem of data
        that gives no whole step."""
        try:
            self.plan = StepPlan.for_examples(definition, examples=examples)
        except ValueError as exc:
            self.problems.append(field_problem("training.batch_size_per_worker", str(exc)))

    @property
    def costed(self) -> RunDefinition:
        """The resolved definition at the seq_length its costs are counted at: the
        request's, the one the worker will choose, or, not known, the most it can be."""
        spec = self.resolved
        if spec.training.seq_length is not None:
            return spec
        length = self.seq_length or max(
            seq_length_cap(self.model_config) - completion_room(spec), 2
        )
        training = spec.training.model_copy(update={"seq_length": length})
        return spec.model_copy(update={"training": training})


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """What a request's checks need of the service's settings, handed to them
    (`Settings.request_policy`). `roots`: where local sources may be; a `SourceRoots` also
    names the folders inside them that are refused (the service's own: path_rules.py)."""

    roots: Sequence[Path]
    webhooks: WebhookConfig = field(default_factory=WebhookConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    # Whether the operator turned Python graders on (a grpo run's grader may be one).
    python_graders: bool = False


def check_run_request(
    session: Session, request: RunRequest, *, owner_id: str, policy: RequestPolicy
) -> CheckedRequest:
    checked = CheckedRequest(problems=cross_field_problems(request), spec=request.worker_fields())
    if is_run_id(request.model):
        _check_model_from_run(session, request, checked, owner_id=owner_id)
    else:
        _check_model(request, checked, policy.roots)
    _check_dataset(session, request, checked, owner_id=owner_id, allowed_roots=policy.roots)
    if problem := chat_template_problem(request, checked):
        checked.problems.append(problem)
    checked.problems.extend(webhook_problems(request, policy.webhooks))
    checked.problems.extend(tracking_problems(request, policy.tracking))
    if isinstance(request.method, GrpoMethod):
        _check_graders(session, request.method, checked, owner_id=owner_id, policy=policy)
    checked.problems.extend(
        key_tracking_problems(session, request, owner_id=owner_id, spec=checked.spec)
    )
    examples = _examples_of_records(request, checked.dataset_records)
    if not checked.problems and examples is not None:
        checked.plan_examples(request, examples)
    return checked


def _check_graders(
    session: Session,
    method: GrpoMethod,
    checked: CheckedRequest,
    *,
    owner_id: str,
    policy: RequestPolicy,
) -> None:
    """What of the grader this service cannot run, and its judges' models, resolved."""
    field = "method.grpo.grader"
    checked.problems.extend(
        runnable_problems(method.grader, field, python_graders=policy.python_graders)
    )
    judges, problems = check_judges(
        method.grader,
        field,
        roots=policy.roots,
        export_of=lambda run_id: exported_model(session, run_id, owner_id=owner_id),
    )
    checked.problems.extend(problems)
    checked.judges = judges
    if judges:
        resolved_grader(checked.spec["method"]["grader"], judges)


def _examples_of_records(request: RunRequest, records: int | None) -> int | None:
    """The examples of an uploaded file (each record is one) counted as the worker counts
    them, unless packing makes the count depend on the token count."""
    if records is None or request.training.packing:
        return None
    return examples_used(records, request.dataset.max_samples)


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
    # A local or uploaded file has one split, "train" (sliced as "train[:90%]"); eval_split
    # names a split of eval_source when there is one.
    for name, source in (("split", data.source), ("eval_split", data.eval_source or data.source)):
        value = getattr(data, name)
        local = is_local_source(source) or is_uploaded(source)
        if value is not None and local and (problem := local_split_problem(name, value)):
            add(f"dataset.{name}", problem)
    problems.extend(method_problems(req))
    problems.extend(evaluation_problems(req))
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


def method_problems(req: RunRequest) -> list[Problem]:
    """Chat and preference data, DPO and LoRA: which combinations train. (Classification
    takes format 'text' only, which keeps chat, preference and so dpo to causal LMs.)"""
    problems: list[Problem] = []
    data, method = req.dataset, req.method

    def add(name: str, message: str) -> None:
        problems.append(field_problem(name, message))

    if method.type == "grpo":
        if data.format != "prompt":
            add(
                "method.type",
                f"grpo samples completions of prompts: it needs dataset.format 'prompt', "
                f"got {data.format!r}",
            )
        if req.training.packing:
            add("training.packing", "packing does not apply to grpo: each prompt is one row")
        if req.deepspeed.tensor_parallel_size > 1:
            add(
                "deepspeed.tensor_parallel_size",
                "grpo does not run with AutoTP yet (its ranks would sample apart what their "
                "tensor-parallel peers must see alike); use ZeRO (stages 0-3, with offload)",
            )
    elif data.format == "prompt":
        add(
            "dataset.format",
            'format \'prompt\' is for method {"type": "grpo"}, which samples the '
            "completions; to learn given completions use 'prompt_completion'",
        )
    if method.type == "dpo":
        if data.format != "preference":
            add(
                "method.type",
                f"dpo learns from preference pairs: it needs dataset.format 'preference', "
                f"got {data.format!r}",
            )
        if req.training.packing:
            add("training.packing", "packing does not apply to dpo: each pair is one example")
    elif data.format == "preference":
        add(
            "dataset.format",
            'format \'preference\' is for method {"type": "dpo"}; for supervised fine-tuning '
            "use 'chat' or 'prompt_completion'",
        )
    if data.chat_template is not None and data.format not in ("chat", "preference", "prompt"):
        add(
            "dataset.chat_template",
            "chat_template applies to formats 'chat', 'preference' and 'prompt', got "
            f"{data.format!r}",
        )
    if req.lora is not None and req.deepspeed.tensor_parallel_size > 1:
        add("lora", LORA_WITH_AUTOTP)
    return problems


LORA_WITH_AUTOTP = (
    "LoRA does not combine with deepspeed.tensor_parallel_size > 1: DeepSpeed's AutoTP "
    "shards the model's Linear layers by name, and peft wraps them (q_proj becomes "
    "q_proj.base_layer beside lora_A/lora_B), so they would not be sharded as a whole; "
    "use ZeRO (stages 0-3, with offload if memory is short) to spread a LoRA run"
)


# -- the model ----------------------------------------------------------------------------


def is_run_id(value: str) -> bool:
    return RUN_ID.fullmatch(value) is not None


def _check_model_from_run(
    session: Session, request: RunRequest, checked: CheckedRequest, *, owner_id: str
) -> None:
    """`model` names one of the caller's earlier runs: train from its exported full model
    (a DPO run after an SFT run, say). The path is the service's own, so no root applies."""
    exported, why = exported_model(session, request.model, owner_id=owner_id)
    if exported is None:
        checked.problems.append(field_problem("model", why or f"no run {request.model!r}"))
        return
    if is_uri(exported):
        _read_stored_model_config(exported, request, checked)
        return
    # Checked when it was recorded; checked again, as links may have been added since.
    if problem := export_problem(exported):
        checked.problems.append(field_problem("model", f"run {request.model}'s export: {problem}"))
        return
    _read_model_config(Path(exported), request, checked)


def exported_model(
    session: Session, run_id: str, *, owner_id: str
) -> tuple[str | None, str | None]:
    """Where the caller's run `run_id` exported its full model, and None; or None and why
    it has none to give."""
    run = session.get(Run, run_id)
    if run is None or run.owner_id != owner_id:
        return None, f"no run {run_id!r}"
    exported = session.scalars(
        select(Checkpoint.path)
        .where(Checkpoint.run_id == run.id, Checkpoint.kind == "hf")
        .order_by(Checkpoint.id.desc())
        .limit(1)
    ).first()
    if exported is not None:
        return exported, None
    adapter_only = session.scalars(
        select(Checkpoint.id).where(Checkpoint.run_id == run.id, Checkpoint.kind == "adapter")
    ).first()
    why = (
        "exported only a LoRA adapter: start from a full model, i.e. a run with "
        "lora.export 'merged' or 'both'"
        if adapter_only is not None
        else f"has no exported model (status {run.status!r}; export_hf may be off)"
    )
    return None, f"run {run.id} {why}"


def _read_stored_model_config(location: str, request: RunRequest, checked: CheckedRequest) -> None:
    """An export in object storage: its config is read there (the worker copies the
    folder to its nodes when it trains from it)."""
    try:
        config = json.loads(Storage(location).read_bytes(f"{location}/config.json"))
    except (StorageError, ValueError) as exc:
        checked.problems.append(field_problem("model", f"cannot read the export's config: {exc}"))
        return
    checked.spec["model"] = location
    checked.model_config = config
    checked.problems.extend(model_config_problems(config, request))


def _check_model(request: RunRequest, checked: CheckedRequest, roots: Sequence[Path]) -> None:
    value = request.model
    if not is_local_source(value):
        return  # a hub id (the schema checked its shape): the cluster resolves it
    path, message = allowed_local_path(value, roots)
    if message:
        checked.problems.append(field_problem("model", message))
        return
    assert path is not None
    _read_model_config(path, request, checked)


def _read_model_config(path: Path, request: RunRequest, checked: CheckedRequest) -> None:
    config_file = path / "config.json"
    if not config_file.is_file():
        checked.problems.append(
            field_problem(
                "model",
                f"local model {request.model!r} has no config.json: give a save_pretrained folder",
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
    if request.dataset.format in CHAT_FORMATS and request.dataset.chat_template is None:
        checked.model_has_chat_template = chat_template_of(path) is not None
    checked.problems.extend(model_config_problems(config, request))
    if problem := lora_target_problem(path, request):
        checked.problems.append(problem)


# The formats whose prompts are text or chat messages, and those whose records may hold
# chat messages at all: messages are rendered with a chat template.
PROMPT_FORMATS = ("prompt", "preference")
CHAT_FORMATS = ("chat", *PROMPT_FORMATS)


def lora_target_problem(folder: Path, req: RunRequest) -> Problem | None:
    """LoRA target_modules that name no linear layer of the model (peft would refuse them
    on the cluster); None where the checkpoint's tensors are not readable here."""
    if req.lora is None or isinstance(req.lora.target_modules, str):
        return None
    linears = linear_weights(safetensors_headers(folder))
    if not linears or adapter_parameters(linears, req.lora) > 0:
        return None
    names = sorted({module.rsplit(".", 1)[-1] for module, _, _ in linears})
    return field_problem(
        "lora.target_modules",
        f"{req.lora.target_modules} name no linear layer of the model; its linear layers "
        f"are named {', '.join(names[:16])}{', ...' if len(names) > 16 else ''} (or use "
        "'all-linear')",
    )


def chat_template_problem(req: RunRequest, checked: CheckedRequest) -> Problem | None:
    """Chat messages are rendered with a chat template: the request's, or the model's own.
    Chat data is all messages; a prompt (formats 'prompt' and 'preference') is text or
    messages, and needs one where the records read here give messages. (A hub model's
    tokenizer is the cluster's to read; there the worker refuses it.)"""
    ds = req.dataset
    if ds.chat_template is not None or checked.model_has_chat_template is not False:
        return None
    if ds.format == "chat":
        what = "format 'chat' renders conversations with a chat template"
    elif ds.format in PROMPT_FORMATS and checked.messages_at is not None:
        what = (
            f"{checked.messages_at} gives its prompt (dataset.prompt_field "
            f"{ds.prompt_field!r}) as chat messages, which format {ds.format!r} renders with "
            "a chat template"
        )
    else:
        return None
    return field_problem(
        "dataset.chat_template",
        f"{what}, and the tokenizer of model {req.model!r} has none: give "
        "dataset.chat_template (a Jinja template, e.g. ChatML's)",
    )


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

    max_positions = max_positions_of(config)
    seq_length = req.training.seq_length
    if max_positions is not None and (problem := completion_room_problem(req, max_positions)):
        problems.append(problem)
    elif max_positions is not None and seq_length is not None and seq_length > max_positions:
        problems.append(
            field_problem(
                "training.seq_length",
                f"seq_length ({seq_length}) exceeds the model's maximum positions "
                f"({max_positions})",
            )
        )
    return problems


# The shortest prompt length the worker chooses for an unset seq_length
# (worker/data/preparation.py `prepare_training`, contract/seq_length.py).
SHORTEST_CHOSEN_PROMPT = 2


def completion_room_problem(req: RunRequest, max_positions: int) -> Problem | None:
    """Method grpo: a prompt and its completion share the model's positions. With
    training.seq_length set, prompts take up to that many; unset, the worker gives them
    what max_completion_tokens leaves, at least SHORTEST_CHOSEN_PROMPT."""
    room = completion_room(req)
    seq_length = req.training.seq_length
    prompt = SHORTEST_CHOSEN_PROMPT if seq_length is None else seq_length
    if not room or prompt + room <= max_positions:
        return None
    positions = (
        f"the model's maximum positions ({max_positions}), which a prompt and its completion share"
    )
    if seq_length is None:
        return field_problem(
            "method.grpo.max_completion_tokens",
            f"max_completion_tokens ({room}) leaves no room for a prompt in {positions}: at "
            f"most {max_positions - prompt} completion tokens fit, and those with prompts of "
            f"{prompt} tokens; the prompts get the positions it leaves",
        )
    prompts_fit = (
        f"prompts of at most {max_positions - room} tokens fit with it"
        if room < max_positions
        else "it alone takes every position"
    )
    if seq_length >= max_positions:
        return field_problem(
            "training.seq_length",
            f"seq_length ({seq_length}) leaves no room for a completion in {positions}: with "
            f"max_completion_tokens ({room}), {prompts_fit}",
        )
    return field_problem(
        "method.grpo.max_completion_tokens",
        f"max_completion_tokens ({room}) and prompts of up to {seq_length} tokens "
        f"(training.seq_length) exceed {positions}: at most {max_positions - seq_length} "
        f"completion tokens fit with prompts of {seq_length}, or {prompts_fit}",
    )


# -- the dataset --------------------------------------------------------------------------


def _check_dataset(
    session: Session,
    request: RunRequest,
    checked: CheckedRequest,
    *,
    owner_id: str,
    allowed_roots: Sequence[Path],
) -> None:
    for key in ("source", "eval_source"):
        source = getattr(request.dataset, key)
        if source is not None:
            _check_source(
                session,
                request,
                checked,
                key=key,
                source=source,
                owner_id=owner_id,
                allowed_roots=allowed_roots,
            )


def _check_source(
    session: Session,
    request: RunRequest,
    checked: CheckedRequest,
    *,
    key: str,
    source: str,
    owner_id: str,
    allowed_roots: Sequence[Path],
) -> None:
    """One of the dataset's sources (`key`: "source" or "eval_source"): an uploaded file
    of the caller's, a local path inside the roots, or a hub id; resolved in the spec."""
    name = f"dataset.{key}"
    if is_uploaded(source):
        upload = _owned_upload(session, source, owner_id=owner_id)
        if upload is None:
            checked.problems.append(_no_upload(name, source))
            return
        checked.spec["dataset"][key] = upload.path
        if key == "source":
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
        graded = isinstance(request.method, GrpoMethod) and bool(item_roots(request.method.grader))
        if isinstance(request.method, GrpoMethod):
            for lacking in missing_item_fields(request.method.grader, upload.fields):
                graded = False  # no record has it: said once, not line by line
                checked.problems.append(
                    field_problem(
                        "method.grpo.grader",
                        f"the grader reads {{{{item.{lacking}}}}}, but {name} ({source}) "
                        f"has no field {lacking!r}; its fields are {upload.fields}",
                    )
                )
        # Checked whole for its purpose when it arrived; what only this run asks of each
        # record (the grader's fields, whether prompts need a chat template) is read here.
        if not missing and (graded or _template_question_open(request, checked)):
            checked.problems.extend(
                sampled_record_problems(
                    lambda: _open_stored(upload.path),
                    upload.format,
                    request,
                    checked,
                    label=f"uploaded file {source}",
                    field=name,
                    total=upload.records,
                    grade=graded,
                )
            )
        return
    if not is_local_source(source):
        return  # a hub id (the schema checked its shape): the cluster resolves it
    path, message = allowed_local_path(source, allowed_roots)
    if message is None and path is not None and path.is_file() and file_format(path) is None:
        message = f"dataset file {path.name!r} must be one of {', '.join(sorted(FILE_FORMATS))}"
    if message:
        checked.problems.append(field_problem(name, message))
        return
    assert path is not None
    checked.spec["dataset"][key] = str(path)
    fmt = file_format(path) if path.is_file() else None
    if fmt is not None:
        checked.problems.extend(
            sampled_record_problems(
                lambda: path.open("rb"), fmt.name, request, checked, label=path.name, field=name
            )
        )


def _template_question_open(req: RunRequest, checked: CheckedRequest) -> bool:
    """Whether the records must say if a prompt is chat messages: the model's tokenizer
    has no chat template, the request gives none, and no record read so far said it."""
    return (
        req.dataset.format in PROMPT_FORMATS
        and checked.model_has_chat_template is False
        and checked.messages_at is None
    )


def _open_stored(location: str) -> BinaryIO:
    """An uploaded file's bytes from its start, where storage keeps it: a folder, or an
    object store (read as far as the records checked, not fetched whole)."""
    if not is_uri(location):
        return Path(location).open("rb")
    try:
        storage = Storage(location)
        return io.BufferedReader(storage.fs.open_input_file(storage.fs_path(location)))
    except StorageError as exc:
        raise OSError(str(exc)) from exc


def uploads_gone(session: Session, request: RunRequest, *, owner_id: str) -> list[Problem]:
    """The uploaded files the request reads that are no longer there: checked again when
    the run is stored, since its files were checked on a read before (a delete in between
    found no run reading them). A lookup by key each, no file I/O."""
    problems = []
    for key in ("source", "eval_source"):
        source = getattr(request.dataset, key)
        # Locked: a delete waits for this transaction, and then finds the new run.
        if (
            source is not None
            and is_uploaded(source)
            and _owned_upload(session, source, owner_id=owner_id, lock=True) is None
        ):
            problems.append(_no_upload(f"dataset.{key}", source))
    return problems


def _owned_upload(
    session: Session, file_id: str, *, owner_id: str, lock: bool = False
) -> File | None:
    """The caller's uploaded file with this id; None if there is none, or it is another's."""
    return find_file(session, file_id=file_id, owner_id=owner_id, for_update=lock)


def _no_upload(name: str, file_id: str) -> Problem:
    return field_problem(name, f"no uploaded file {file_id!r}")


# Records of a local chat, preference or prompt file read at validation: enough to catch a
# file of the wrong shape at once, while a large file still validates in well under a
# second. An upload is checked whole when it arrives (app/services/files.py); what a run
# asks of each record beyond that (its grader's fields) is read from as many.
SAMPLED_RECORDS = 1_000
SAMPLED_ERRORS = 5


def _and_graded(rule: RecordProblem, grader: AnyGrader) -> RecordProblem:
    """A record rule that also asks for every field the grader reads."""

    def problem(record: dict[str, Any]) -> str | None:
        return rule(record) or record_item_problem(grader, record)

    return problem


def sampled_record_problems(
    open_file: Opener,
    fmt: str,
    req: RunRequest,
    checked: CheckedRequest,
    *,
    label: str,
    field: str = "dataset.source",
    total: int | None = None,
    grade: bool = True,
) -> list[Problem]:
    """The first records of a file (`label` names it). A chat, preference or prompt file's
    are checked by the rules an upload for that format is checked by and, for a grpo run
    (unless not `grade`), for every field its grader reads, each problem with its line;
    where a prompt is chat messages is noted in `checked.messages_at`. Any other file's
    must hold the fields the run reads (`sampled_fields_problems`). `total`: the records
    the file holds, where known."""
    ds = req.dataset
    if ds.format not in CHAT_FORMATS:
        return sampled_fields_problems(open_file, fmt, req, label=label, field=field, total=total)
    checks = checks_for(
        purpose_of(req.task, ds.format),
        messages_field=ds.messages_field,
        prompt_field=ds.prompt_field,
        chosen_field=ds.chosen_field,
        rejected_field=ds.rejected_field,
    )
    if grade and isinstance(req.method, GrpoMethod) and checks.record_problem is not None:
        checks = replace(
            checks,
            record_problem=_and_graded(checks.record_problem, req.method.grader),
        )

    def note_messages(where: str, record: dict[str, Any]) -> None:
        if checked.messages_at is None and is_conversational(record.get(ds.prompt_field)):
            checked.messages_at = f"{where} of {label}"

    visit = note_messages if ds.format in PROMPT_FORMATS else None
    report = check_records(open_file, fmt=fmt, checks=checks, limit=SAMPLED_RECORDS, visit=visit)
    return _sampled_report(report, label=label, field=field, data_format=ds.format, total=total)


def sampled_fields_problems(
    open_file: Opener,
    fmt: str,
    req: RunRequest,
    *,
    label: str,
    field: str,
    total: int | None = None,
) -> list[Problem]:
    """A text, prompt/completion or classification file: its first records read, and each
    field the run reads must be among their fields (the worker fails on a field no record
    has, on the cluster). Values are the worker's to take as they come, as it always has:
    a missing or empty text reads as empty, and what tokenizes too short is left out."""
    report = check_records(open_file, fmt=fmt, checks=RecordChecks(), limit=SAMPLED_RECORDS)
    if report.errors:  # not readable as its format, or no records
        return _sampled_report(
            report, label=label, field=field, data_format=req.dataset.format, total=total
        )
    read = f"its first {SAMPLED_RECORDS:,} records" if report.limited else "its records"
    return [
        field_problem(
            field,
            f"{label} has no field {wanted.name!r} ({wanted.setting} names it) in {read}; "
            f"its fields are {report.fields}",
        )
        for wanted in fields_read_by(req.task, req.dataset)
        if wanted.name not in report.fields
    ]


def _sampled_report(
    report: FileReport, *, label: str, field: str, data_format: str, total: int | None
) -> list[Problem]:
    shown = report.errors[:SAMPLED_ERRORS]
    more = len(report.errors) - len(shown) + report.more_errors
    problems = [
        field_problem(field, f"{label} is not {data_format} data: {error}") for error in shown
    ]
    # A problem past the records read here is the worker's to find: said where it applies.
    bound = ""
    if problems and report.limited:
        of = f" of its {total:,}" if total is not None else ""
        bound = f" (the first {SAMPLED_RECORDS:,}{of} records were checked here)"
    if more:
        problems.append(field_problem(field, f"{label}: ... and {more} more{bound}"))
    elif bound:
        problems[-1]["message"] += bound
    return problems
