"""The run contract: what a client asks for (`RunRequest`) and what a worker trains from
(`RunSpec`, the same request plus which attempt and where it stores).

The only definition of the request. The service validates `POST /v1/runs` with it and
reads stored runs back into it; the worker parses its job's spec with it. It imports
neither torch nor the service, so it ships to the cluster beside the worker (runtime_env
py_modules) and validating a request never loads torch.

Every field but `model` and `dataset.source` has a default. Unknown fields are refused,
so a typo never silently falls back to a default. The rules between fields, and those
that need the file system or settings, live in app/services/rules/run_rules.py.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Annotated, Any, Literal, Self

import httpx
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)

from contract.bounds import INT32_MAX, refuse_nul
from contract.eval_metrics import Mode, default_mode, eval_metric_names
from contract.examples import (
    BERT_MRPC_ZERO3,
    DPO_LORA,
    GPT2_ZERO3,
    QWEN_AUTOTP,
    QWEN_CHAT_LORA,
)
from contract.graders.models import Grader
from contract.job_env import SPEC_ENV

_strict = ConfigDict(extra="forbid", allow_inf_nan=False)

# -- bounds ---------------------------------------------------------------------------------
# Each far above any real run. Integers also stay below 2**31 (INT32_MAX): steps, and counts
# derived from them, are stored in the database's INTEGER columns.
MAX_STEPS = 100_000_000
MAX_EPOCHS = 1_000
# A split, config or record field name: a name, not a document.
MAX_NAME_CHARS = 256
# Linux's PATH_MAX and NAME_MAX, in bytes: longer paths make the OS raise ENAMETOOLONG.
MAX_PATH_BYTES = 4095
MAX_PATH_COMPONENT_BYTES = 255

# A local source starts like a path; anything else is a hub id (or, for a dataset, an
# uploaded file's id). `~` is refused rather than expanded: whose home it would name (the
# service's, the worker's, any `~user`'s) is not the client's to choose.
LOCAL_SOURCE_PREFIXES = ("/", "./", "../")
# `scheme:/...`: http://, s3://, file:///x and file:/x alike.
_URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:/")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _name(value: str) -> str:
    """A name (split, field, metadata key): one line of printable text."""
    refuse_nul(value)
    if _CONTROL.search(value):
        raise ValueError("must not contain control characters (NUL, newline, tab, ...)")
    return value


# A split as the `datasets` library reads one (its arrow_reader's grammar): split names
# joined by "+", each with an optional slice of rows or percents, and a percent slice with
# an optional rounding. Checked here so that a malformed one is refused at the request, not
# on the cluster after the data was fetched.
_SPLIT_NAME = r"\w+(?:\.\w+)*"
_SPLIT_PART = re.compile(
    rf"^(?P<name>{_SPLIT_NAME})"
    r"(?:\[(?:(?P<start>-?[\d_]+)(?P<from_pct>%)?)?:(?:(?P<stop>-?[\d_]+)(?P<to_pct>%)?)?\])?"
    r"(?:\((?P<rounding>[^)]*)\))?$"
)
_SPLIT_JOIN = re.compile(r"\s*\+\s*")
SPLIT_ROUNDINGS = ("closest", "pct1_dropremainder")


def split_problem(value: str) -> str | None:
    """Why `value` is not a split `datasets` can read, or None."""
    for part in _SPLIT_JOIN.split(value):
        match = _SPLIT_PART.match(part)
        if match is None:
            return (
                f"{_shown(value)} is not a split: a name ('train', 'train_sft'), optionally "
                "sliced ('train[:1000]', 'train[10%:20%]'), several joined with '+'"
            )
        for bound, percent in (("start", match["from_pct"]), ("stop", match["to_pct"])):
            if match[bound] is None:
                continue
            try:
                number = int(match[bound])  # "1_000" as Python reads it; "_" is no number
            except ValueError:
                return f"{_shown(value)}: {match[bound]!r} is not a number of rows"
            if percent and abs(number) > 100:
                return f"{_shown(value)}: a percent bound lies between -100% and 100%"
        rounding = match["rounding"]
        if rounding is not None:
            if not (match["from_pct"] or match["to_pct"]):
                return f"{_shown(value)}: a rounding goes only with a percent slice"
            if rounding not in SPLIT_ROUNDINGS:
                return f"{_shown(value)}: the rounding is one of {', '.join(SPLIT_ROUNDINGS)}"
    return None


def _split(value: str, info: ValidationInfo) -> str:
    if info.context and info.context.get(RESOLVED_SPEC):
        # A stored run's split was taken when the run was made (before this rule, perhaps):
        # a rule tightened since must not make the run unreadable.
        return value
    if problem := split_problem(value):
        raise ValueError(problem)
    return value


def _shown(value: str, limit: int = 80) -> str:
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


def source_problem(value: str, *, uploads: bool = False) -> str | None:
    """Why `value` is neither a local path nor a hub id (the rule for `model` and
    `dataset.source`; with `uploads`, an uploaded file's id is a third form), or None.

    Only the shape: whether a path is inside the allowed roots is the service's to check."""
    try:
        _name(value)
    except ValueError as exc:
        return str(exc)
    other = ", or an uploaded file's id (POST /v1/files)" if uploads else ""
    if _URL.match(value):
        return (
            f"{_shown(value)} is a URL: tuneyard never fetches URLs; give a Hugging Face hub "
            f"id or a local path inside the allowed roots{other}"
        )
    if value.startswith("~"):
        return (
            f"{_shown(value)} starts with '~': home folders are not expanded, give an "
            "absolute path inside the allowed roots"
        )
    if value.startswith(LOCAL_SOURCE_PREFIXES):
        if len(value.encode("utf-8")) > MAX_PATH_BYTES:
            return f"a local path is at most {MAX_PATH_BYTES} bytes long"
        if any(len(part.encode("utf-8")) > MAX_PATH_COMPONENT_BYTES for part in value.split("/")):
            return (
                f"a path component (a name between slashes) is at most "
                f"{MAX_PATH_COMPONENT_BYTES} bytes long"
            )
        return None
    try:
        validate_repo_id(value)
    except HFValidationError as exc:
        # The hub's own rule; its message goes on to quote the value, which we show once.
        rule = str(exc).split(f": '{value}'")[0].rstrip(".")
        return (
            f"{_shown(value)} is neither a local path (absolute, or starting with ./ or ../) "
            f"nor a Hugging Face hub id ('name' or 'namespace/name'): {rule}"
        )
    return None


# The validation context of a spec the service resolved (RunSpec): its sources may be
# object-store URIs the service itself wrote there (an upload, an earlier run's export).
RESOLVED_SPEC = "resolved_spec"


def _resolved_uri(value: str, info: ValidationInfo) -> bool:
    return bool(info.context and info.context.get(RESOLVED_SPEC)) and "://" in value


def _model_source(value: str, info: ValidationInfo) -> str:
    if not _resolved_uri(value, info) and (problem := source_problem(value)):
        raise ValueError(problem)
    return value


def _dataset_source(value: str, info: ValidationInfo) -> str:
    if not _resolved_uri(value, info) and (problem := source_problem(value, uploads=True)):
        raise ValueError(problem)
    return value


Name = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_name)
]
Split = Annotated[Name, AfterValidator(_split)]
ModelSource = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_PATH_BYTES), AfterValidator(_model_source)
]
DatasetSource = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_PATH_BYTES),
    AfterValidator(_dataset_source),
]
# A Jinja template is a document: bounded, but far above any real one (Qwen2.5's is ~2.5 KB).
ChatTemplate = Annotated[
    str, StringConstraints(min_length=1, max_length=65_536), AfterValidator(refuse_nul)
]
# Metadata keys may be any printable text (quotes, accents, CJK): the filter finds them all.
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_name)]
MetadataValue = Annotated[str, StringConstraints(max_length=256), AfterValidator(refuse_nul)]


class DatasetSpec(BaseModel):
    model_config = _strict

    source: DatasetSource = Field(
        description="A Hugging Face hub dataset id, an uploaded file's id, or a local "
        ".jsonl/.json/.csv/.parquet file or folder (an absolute path, or one starting with "
        "./ or ../) inside the allowed roots.",
    )
    split: Split = "train"
    config: Name | None = None
    text_field: Name = "text"
    text_pair_field: Name | None = None
    label_field: Name | None = None
    format: Literal["text", "prompt_completion", "chat", "preference", "prompt"] = Field(
        default="text",
        description="text: plain text, the loss on every token. prompt_completion: the loss "
        "on the completion only. chat: OpenAI-style conversations (`messages`), rendered with "
        "the model's chat template, the loss on assistant turns only. preference: `prompt`, "
        "`chosen` and `rejected` per record, for method dpo. prompt: a `prompt` per record "
        "(text, continued as it is, or messages ending with the user's turn, rendered with "
        "the chat template), for method grpo; its other fields are what the grader reads.",
    )
    # For format=prompt_completion (and preference): the loss is on the completion only.
    prompt_field: Name = "prompt"
    completion_field: Name = "completion"
    # For format=chat: the record field holding the list of messages.
    messages_field: Name = "messages"
    chat_template: ChatTemplate | None = Field(
        default=None,
        description="A Jinja chat template for a model whose tokenizer has none (format chat, "
        "or preference records given as messages); it wins over the model's own.",
    )
    # For format=preference: the preferred and the dispreferred answer.
    chosen_field: Name = "chosen"
    rejected_field: Name = "rejected"
    eval_split: Split | None = None
    eval_source: DatasetSource | None = Field(
        default=None,
        description="Evaluation examples from another file or dataset (the same forms as "
        "`source`; OpenAI's validation_file), read with the same fields and format; its "
        "split is eval_split, or 'train' (a local or uploaded file's only split).",
    )
    max_samples: int | None = Field(default=None, gt=0, le=INT32_MAX)

    def eval_wanted(self) -> tuple[str | None, str] | None:
        """Where evaluation reads from, as (source override or None, split); None if it
        does not."""
        if self.eval_source is not None:
            return self.eval_source, self.eval_split or "train"
        if self.eval_split is not None:
            return None, self.eval_split
        return None


class TrainingSpec(BaseModel):
    model_config = _strict

    epochs: int | None = Field(default=1, gt=0, le=MAX_EPOCHS)
    max_steps: int | None = Field(
        default=None,
        gt=0,
        le=MAX_STEPS,
        description="Optimizer steps; when set, it wins over epochs.",
    )
    learning_rate: float = Field(default=1e-5, gt=0, le=1)
    batch_size_per_worker: int = Field(default=1, gt=0, le=4096)
    gradient_accumulation_steps: int = Field(default=1, gt=0, le=4096)
    seq_length: int | None = Field(
        default=None,
        gt=1,
        le=1_048_576,
        description="Tokens per example (or per packed row). Unset: chosen from the training "
        "data when the run starts, the longest tokenized example rounded up to a multiple of "
        "64 and at most the model's maximum positions; the run's events say what was chosen "
        "and how many examples it truncated, and `/v1/runs/validate` predicts it for local "
        "and uploaded files.",
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(default=0.01, ge=0, le=1)
    decay_bias_and_norm: bool = Field(
        default=False,
        description="Apply weight_decay to biases and norm weights too. Off by default, as "
        "in Hugging Face's Trainer; on gives one optimizer parameter group, as DeepSpeed's "
        "config-defined optimizer does.",
    )
    # 0 turns clipping off; norms beyond this clip nothing a real run produces.
    max_grad_norm: float = Field(default=1.0, ge=0, le=1_000)
    seed: int = Field(default=42, ge=0, le=INT32_MAX)
    packing: bool = False
    gradient_checkpointing: bool = False
    log_every_n_steps: int = Field(default=1, gt=0, le=MAX_STEPS)
    # With dataset.eval_split: evaluate every N steps (None → only at the end).
    eval_every_n_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)

    @model_validator(mode="after")
    def _needs_a_length(self) -> TrainingSpec:
        if self.epochs is None and self.max_steps is None:
            raise ValueError("set training.epochs or training.max_steps")
        return self


class DeepSpeedSpec(BaseModel):
    model_config = _strict

    zero_stage: Literal[0, 1, 2, 3] = 3
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    offload_optimizer: Literal["none", "cpu"] = "none"
    offload_params: Literal["none", "cpu"] = "none"
    # At most resources.num_workers, which it must divide.
    tensor_parallel_size: int = Field(default=1, gt=0, le=1024)


class ResourcesSpec(BaseModel):
    model_config = _strict

    num_workers: int = Field(default=2, gt=0, le=1024)
    use_gpu: bool = False
    # Ray accounts resources in units of 1e-4: a smaller share is a request for nothing.
    cpus_per_worker: float = Field(default=1, ge=1e-4, le=1024)
    gpus_per_worker: int | None = Field(
        default=None,
        ge=1,
        # More than any one node holds: a worker's GPUs are all on its node.
        le=64,
        description="Whole GPUs per worker (default 1 with use_gpu). Each rank drives one "
        "device; more than one reserves the others for it (e.g. memory headroom).",
    )
    cpu_threads_per_worker: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Threads each worker's torch and OpenMP use (DeepSpeed's CPU Adam runs "
        "on them when the optimizer is offloaded). Unset: cpus_per_worker on CPU runs; on "
        "GPU runs the node's cores shared evenly among its GPUs, since Ray would otherwise "
        "give each rank one thread.",
    )

    @field_validator("gpus_per_worker", mode="before")
    @classmethod
    def _whole_gpus(cls, value: Any) -> Any:
        # pydantic would say only "not a valid integer"; the reason matters here.
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(
                f"gpus_per_worker must be a whole number of GPUs (>= 1), got {value}: a "
                "fraction would put two ranks on one device, which DeepSpeed and NCCL do "
                "not support"
            )
        return int(value) if isinstance(value, float) else value


class CheckpointingSpec(BaseModel):
    model_config = _strict

    every_n_steps: int | None = Field(default=None, gt=0, le=MAX_STEPS)
    keep_last: int = Field(
        default=2,
        gt=0,
        le=1_000,
        description="How many DeepSpeed checkpoints stay in storage: the newest ones; with a "
        "best metric (best_metric, early_stopping or export.from 'best'), the best ones by "
        "it, as Ray Train's CheckpointConfig(num_to_keep, checkpoint_score_attribute) keeps "
        "them. The latest is always kept, for resume.",
    )
    export_hf: bool = True
    best_metric: Name | None = Field(
        default=None,
        description="An evaluation metric (eval_loss, eval_accuracy, ...) that ranks the "
        "checkpoints: the best one is marked in the checkpoints list and kept whatever "
        "keep_last says. Unset: early_stopping's metric, or eval_loss (eval_reward for "
        "method grpo) with export.from 'best'. Needs evaluation; a checkpoint is then saved "
        "at every evaluation.",
    )
    best_mode: Mode | None = Field(
        default=None,
        description="min or max: which way best_metric improves. Unset: min for losses and "
        "perplexity, max for anything else.",
    )


class EarlyStoppingSpec(BaseModel):
    """Stop when evaluation stops improving: after `patience` evaluations in a row that do
    not beat the best so far by more than `min_delta` (Hugging Face's EarlyStoppingCallback
    with its early_stopping_threshold)."""

    model_config = _strict

    metric: Name = Field(
        default="eval_loss",
        description="An evaluation metric of the run's task and method: eval_loss, "
        "eval_perplexity; eval_accuracy, eval_f1 for classification; for dpo eval_loss and "
        "eval_rewards/accuracies, eval_rewards/margins, ...; for grpo eval_reward (its "
        "default there: a grpo run has no eval_loss).",
    )
    mode: Mode | None = Field(
        default=None,
        description="min or max: which way the metric improves. Unset: min for losses and "
        "perplexity, max for anything else.",
    )
    patience: int = Field(default=3, ge=1, le=10_000)
    min_delta: float = Field(default=0.0, ge=0, le=1e9)

    @property
    def resolved_mode(self) -> Mode:
        return self.mode or default_mode(self.metric)


class ExportSpec(BaseModel):
    """Which weights the final export (checkpointing.export_hf) holds."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, serialize_by_alias=True)

    from_: Literal["best", "last"] = Field(
        default="last",
        alias="from",
        description="last: the weights at the end of training; best: those of the best "
        "checkpoint by checkpointing.best_metric (or early_stopping.metric, or eval_loss; "
        "eval_reward for method grpo).",
    )


# Events a webhook may ask for. Terminal statuses, each checkpoint saved (DeepSpeed or an
# export), and an early stop (before the run's `run.succeeded`).
WEBHOOK_EVENTS = (
    "run.succeeded",
    "run.failed",
    "run.cancelled",
    "run.checkpoint",
    "run.early_stopped",
)
WebhookEvent = Literal[
    "run.succeeded", "run.failed", "run.cancelled", "run.checkpoint", "run.early_stopped"
]
TERMINAL_WEBHOOK_EVENTS: list[WebhookEvent] = ["run.succeeded", "run.failed", "run.cancelled"]
MAX_URL_CHARS = 2048


# A host as a URL names it: a DNS name's labels (IDNs as httpx writes them, xn--...).
_HOST_NAME = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)(\.(?!-)[a-z0-9_-]{1,63}(?<!-))*\.?$")


def webhook_url_problem(value: str) -> str | None:
    """Why `value` is not a URL a webhook can be POSTed to, as httpx (the deliverer's client)
    parses it, or None. The URL only: where it may point is the service's rule
    (app/services/rules/webhook_addresses.py), which needs its settings and DNS."""
    if not re.match(r"^https?://[^/?#\s]+", value, flags=re.IGNORECASE):
        return (
            f"{_shown(value)} is not an http:// or https:// URL: webhooks are delivered by "
            "HTTP POST"
        )
    try:
        url = httpx.URL(value)
    except (httpx.InvalidURL, ValueError) as exc:  # e.g. http://a:b/ (a port that is no number)
        return f"{_shown(value)} is not a URL the service can send to: {exc}"
    if url.userinfo:
        # Not shown: it is a password. A receiver checks the signature instead.
        return (
            "the URL carries credentials (user:password@), which tuneyard does not send: "
            "every delivery is signed (Tuneyard-Signature), so check that instead"
        )
    if url.port is not None and not 1 <= url.port <= 65535:
        return f"{_shown(value)}: port {url.port} is not within 1..65535"
    # The host as it goes on the wire: an IDN's punycode (httpx's `host` decodes it).
    if not _is_host(url.raw_host.decode("ascii", "replace")):
        return f"{_shown(value)}: {url.host!r} is neither a host name nor an IP address"
    return None


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return len(host) <= 253 and bool(_HOST_NAME.match(host))


def _webhook_url(value: str, info: ValidationInfo) -> str:
    _name(value)
    if info.context and info.context.get(RESOLVED_SPEC):
        # A stored run's URL was checked when the run was made; a rule tightened since must
        # not make the run unreadable (the deliverer records a URL it cannot send to).
        return value
    if problem := webhook_url_problem(value):
        raise ValueError(problem)
    return value


WebhookUrl = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_URL_CHARS), AfterValidator(_webhook_url)
]


class WebhookSpec(BaseModel):
    """Where to POST a signed notification (header Tuneyard-Signature), and for which
    events."""

    model_config = _strict

    url: WebhookUrl = Field(
        description="An http:// or https:// URL without credentials, at a public address "
        "(or on a network the operator allows: TUNEYARD_WEBHOOK_ALLOWED_NETWORKS), checked "
        "when the run is made and on every delivery."
    )
    events: list[WebhookEvent] = Field(
        default_factory=lambda: list(TERMINAL_WEBHOOK_EVENTS),
        min_length=1,
        max_length=len(WEBHOOK_EVENTS),
        description="Any of " + ", ".join(WEBHOOK_EVENTS) + "; default: the terminal ones.",
    )


class MlflowTracking(BaseModel):
    """Log the run to MLflow, on the tracking server the service is configured with
    (TUNEYARD_MLFLOW_TRACKING_URI)."""

    model_config = _strict

    experiment: Name = "tuneyard"
    run_name: Name | None = Field(default=None, description="Unset: the tuneyard run's id.")


class WandbTracking(BaseModel):
    """Log the run to Weights & Biases; mode 'offline' writes to local files only, for
    clusters without internet (`wandb sync` uploads them later)."""

    model_config = _strict

    project: Name = "tuneyard"
    entity: Name | None = None
    run_name: Name | None = Field(default=None, description="Unset: the tuneyard run's id.")
    mode: Literal["online", "offline"] = "online"


class TrackingSpec(BaseModel):
    model_config = _strict

    mlflow: MlflowTracking | None = None
    wandb: WandbTracking | None = None


class FaultToleranceSpec(BaseModel):
    """Two budgets for two kinds of failure; a resume by request counts against neither."""

    model_config = _strict

    max_failures: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Inside one Ray job: how many times Ray Train restarts the worker group "
        "from the latest checkpoint after a worker dies (Ray's FailureConfig.max_failures).",
    )
    max_resubmits: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Across jobs: how many new attempts (new Ray jobs, resuming from the "
        "latest checkpoint) the service starts when Ray loses a job or the cluster fails "
        "under it. Counted anew after a resume by request.",
    )


class SftMethod(BaseModel):
    """Supervised fine-tuning: next-token loss on the learned tokens (the default)."""

    model_config = _strict

    type: Literal["sft"] = "sft"


class DpoMethod(BaseModel):
    """Direct preference optimisation (Rafailov et al. 2023) on format=preference records,
    against the starting model as reference (under LoRA: the base, adapter disabled)."""

    model_config = _strict

    type: Literal["dpo"]
    beta: float = Field(
        default=0.1,
        gt=0,
        le=100,
        description="How far the policy may move from the reference: the temperature of the "
        "implicit reward, as in TRL's DPOConfig.beta.",
    )


class GrpoMethod(BaseModel):
    """Group-relative policy optimisation (DeepSeekMath, Shao et al. 2024) as TRL's
    GRPOTrainer defines it: each prompt's `num_generations` completions, sampled from the
    current policy and scored by `grader`, learn from their reward relative to their
    group's. Defaults are TRL's. `training.batch_size_per_worker` counts prompts, as
    OpenAI's reinforcement `batch_size` does: a micro-batch trains on batch_size_per_worker
    * num_generations completions, and a group never spans micro-batches or ranks."""

    model_config = _strict

    type: Literal["grpo"]
    grader: Grader = Field(
        description="What scores a completion: one of OpenAI's grader objects (string_check, "
        "text_similarity, python, score_model, multi), reading the completion as "
        "{{sample.output_text}} and the record's fields as {{item.<field>}}. A score_model "
        "grader's model (a hub id, a local folder or an earlier run) is loaded on each "
        "training rank and answers on its device."
    )
    num_generations: int = Field(
        default=8,
        ge=2,
        le=256,
        description="Completions sampled per prompt: the group whose rewards are compared.",
    )
    max_completion_tokens: int = Field(
        default=256, ge=1, le=131_072, description="The longest completion sampled."
    )
    temperature: float = Field(
        default=1.0, gt=0, le=10, description="Sampling temperature of the completions."
    )
    beta: float = Field(
        default=0.0,
        ge=0,
        le=100,
        description="Weight of the KL term to the starting model (0: none, and no reference "
        "model is kept, as TRL's default).",
    )
    epsilon: float = Field(
        default=0.2, gt=0, lt=1, description="The policy ratio's clip range, 1 ± epsilon."
    )
    epsilon_high: float | None = Field(
        default=None,
        gt=0,
        le=10,
        description="The upper clip bound, 1 + epsilon_high, when it differs (DAPO's "
        "clip-higher); unset: epsilon.",
    )
    loss_type: Literal["dapo", "grpo"] = Field(
        default="dapo",
        description="dapo: every completion token of the step weighs the same (TRL's "
        "default); grpo: each completion's token mean, averaged over completions.",
    )


Method = Annotated[SftMethod | DpoMethod | GrpoMethod, Field(discriminator="type")]

# `target_modules`: a module name suffix as peft matches it ("q_proj"), never a path.
TargetModule = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_name)
]

# Tagged by the value's shape, so an error names `target_modules.list.0` (or `.name`), not
# pydantic's internal type names.
TargetModules = Annotated[
    Annotated[Literal["all-linear"], Tag("name")] | Annotated[list[TargetModule], Tag("list")],
    Discriminator(lambda value: "list" if isinstance(value, list) else "name"),
]


class LoraSpec(BaseModel):
    """Low-rank adapters (peft's LoRA) in place of full fine-tuning: only the adapters
    train, the base weights stay frozen."""

    model_config = _strict

    r: int = Field(default=16, gt=0, le=4096, description="The adapters' rank.")
    alpha: float = Field(
        default=32, gt=0, le=1_000_000, description="Scaling: updates are scaled by alpha / r."
    )
    dropout: float = Field(default=0.05, ge=0, lt=1)
    target_modules: TargetModules = Field(
        default="all-linear",
        description="'all-linear' (every linear layer but the output head, as peft does), or "
        "module names such as ['q_proj', 'v_proj'].",
    )
    export: Literal["adapter", "merged", "both"] = Field(
        default="adapter",
        description="adapter: adapter_config.json + weights for peft's "
        "PeftModel.from_pretrained on the base model; merged: a full model with the adapters "
        "folded in; both.",
    )

    @field_validator("target_modules")
    @classmethod
    def _some_modules(cls, value: Any) -> Any:
        if isinstance(value, list) and not 1 <= len(value) <= 256:
            raise ValueError("target_modules lists 1 to 256 module names, or is 'all-linear'")
        return value


class RunDefinition(BaseModel):
    """What a run trains: everything a request says but its metadata. Stored as the run's
    `spec`, with local paths resolved and an uploaded file's id replaced by its path."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, protected_namespaces=())

    model: ModelSource = Field(
        description="A Hugging Face hub model id, or a local model folder (an absolute path, "
        "or one starting with ./ or ../) inside the allowed roots."
    )
    task: Literal["causal_lm", "sequence_classification"] = "causal_lm"
    dataset: DatasetSpec
    method: Method = Field(
        default_factory=SftMethod,
        description='{"type": "sft"} (the default), {"type": "dpo", "beta": 0.1}, as in '
        'OpenAI\'s fine-tuning `method` object, or {"type": "grpo", "grader": {...}} '
        "(reinforcement fine-tuning, OpenAI's `reinforcement`).",
    )
    lora: LoraSpec | None = Field(
        default=None, description="Train LoRA adapters; absent for full fine-tuning."
    )
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpointing: CheckpointingSpec = Field(default_factory=CheckpointingSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    early_stopping: EarlyStoppingSpec | None = Field(
        default=None,
        description="Stop after `patience` evaluations without improvement; the run ends "
        "succeeded, with the reason in its events and result. Needs dataset.eval_split or "
        "eval_source and training.eval_every_n_steps.",
    )
    export: ExportSpec = Field(default_factory=ExportSpec)
    webhooks: list[WebhookSpec] = Field(
        default_factory=list,
        max_length=8,
        description="Signed HTTP notifications of this run's events.",
    )
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers to log the run to (needs tuneyard's mlflow or wandb "
        "extra installed on the service and the cluster).",
    )

    @property
    def data_parallel_size(self) -> int:
        return self.resources.num_workers // self.deepspeed.tensor_parallel_size

    @model_validator(mode="after")
    def _early_stopping_on_a_metric_the_run_has(self) -> RunDefinition:
        # early_stopping.metric's default, eval_loss, is no metric of method grpo: left
        # unset, it is the method's first (eval_reward there, eval_loss everywhere else).
        es = self.early_stopping
        if es is not None and "metric" not in es.model_fields_set:
            es.metric = self.primary_eval_metric
        return self

    @property
    def primary_eval_metric(self) -> str:
        """The evaluation metric that ranks checkpoints when the request names none."""
        return eval_metric_names(task=self.task, method=self.method.type)[0]

    @property
    def best_criterion(self) -> tuple[str, Mode] | None:
        """The metric and direction that rank this run's checkpoints, or None: explicit
        (checkpointing.best_metric), else early stopping's, else the method's first
        evaluation metric (eval_loss; eval_reward for grpo) when the export is to come from
        the best checkpoint."""
        ck = self.checkpointing
        if ck.best_metric is not None:
            return ck.best_metric, ck.best_mode or default_mode(ck.best_metric)
        if self.early_stopping is not None:
            return self.early_stopping.metric, self.early_stopping.resolved_mode
        if self.export.from_ == "best":
            metric = self.primary_eval_metric
            return metric, ck.best_mode or default_mode(metric)
        return None

    @classmethod
    def of_resolved(cls, spec: dict[str, Any]) -> RunDefinition:
        """A spec the service resolved (a stored run's): its sources may be URIs in storage."""
        return RunDefinition.model_validate(spec, context={RESOLVED_SPEC: True})


DEFAULT_PRIORITY = 50
# A request's fields that the service keeps beside the run's definition (its own columns).
SERVICE_FIELDS = frozenset({"metadata", "priority", "preemptible"})


class RunRequest(RunDefinition):
    """A fine-tuning run as a client asks for it (`POST /v1/runs`)."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        protected_namespaces=(),
        json_schema_extra={
            "examples": [GPT2_ZERO3, QWEN_AUTOTP, BERT_MRPC_ZERO3, QWEN_CHAT_LORA, DPO_LORA]
        },
    )

    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)
    priority: int = Field(
        default=DEFAULT_PRIORITY,
        ge=0,
        le=100,
        description="Higher runs first. Within a priority the API key with fewer running "
        "runs and GPUs goes first, then the oldest. An API key may be limited to a "
        "`max_priority` (a 422 names it).",
    )
    preemptible: bool = Field(
        default=True,
        description="Whether a run of higher priority that cannot be placed may stop this "
        "one: it saves a checkpoint at the step it is on, goes back to the queue with a "
        "`preempted` event, and later resumes from there as a new attempt that no failure "
        "budget counts. `false` is an API key's permission: a key capped by `max_priority` "
        "has it only if its operator grants it (a 422 names it).",
    )

    def worker_fields(self) -> dict[str, Any]:
        """The run's definition as stored. Metadata and the scheduling fields are kept
        beside it, with the service: the worker has no use for them."""
        return self.model_dump(mode="json", exclude=set(SERVICE_FIELDS))


class RunSpec(RunDefinition):
    """One attempt of a run as its worker trains it: the run's definition, and which
    attempt and where its checkpoints and exports go (added by the dispatcher)."""

    run_id: Name
    attempt: int = Field(ge=1, le=INT32_MAX)
    # Set by the worker when `model` is its node's copy of a model in object storage: the
    # name the run was given, which exports name as their base (never a node-local path).
    model_name: str | None = None
    storage_path: Annotated[
        str, StringConstraints(max_length=MAX_PATH_BYTES), AfterValidator(_name)
    ]

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        kwargs["context"] = {**(kwargs.get("context") or {}), RESOLVED_SPEC: True}
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        kwargs["context"] = {**(kwargs.get("context") or {}), RESOLVED_SPEC: True}
        return super().model_validate_json(json_data, **kwargs)

    @property
    def given_model(self) -> str:
        """The model as the run named it: a hub id, a local folder or a URI."""
        return self.model_name or self.model

    @classmethod
    def for_attempt(
        cls, worker_fields: dict[str, Any], *, run_id: str, attempt: int, storage_path: str
    ) -> RunSpec:
        # Webhooks are the service's to deliver, and their URLs may carry tokens: they stay
        # out of the job, whose environment Ray's dashboard shows.
        fields = {k: v for k, v in worker_fields.items() if k != "webhooks"}
        return cls.model_validate(
            {**fields, "run_id": run_id, "attempt": attempt, "storage_path": storage_path}
        )

    @classmethod
    def from_env(cls) -> RunSpec:
        raw = os.environ.get(SPEC_ENV)
        if not raw:
            raise RuntimeError(f"{SPEC_ENV} is not set: this entry point runs as a tuneyard job")
        return cls.model_validate_json(raw)
