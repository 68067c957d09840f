"""The training request (`POST /v1/runs`): schema, defaults and the rules between fields.

Every field but `model` and `dataset.source` has a default. Unknown fields are refused,
so a typo never silently falls back to a default. The rules between fields, and those
that need the file system or settings, live in app/services/run_rules.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from app.schemas.run_examples import BERT_MRPC_ZERO3, GPT2_ZERO3, QWEN_AUTOTP

_strict = ConfigDict(extra="forbid", allow_inf_nan=False)

# Fields a client may be tempted to send back from a run object; the server owns them.
SERVER_OWNED_FIELDS = frozenset(
    {
        "id",
        "object",
        "status",
        "attempt",
        "owner",
        "owner_id",
        "ray_submission_id",
        "created_at",
        "started_at",
        "finished_at",
        "progress",
        "latest_metrics",
        "error",
        "output",
    }
)

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=256)]


class DatasetSpec(BaseModel):
    model_config = _strict

    source: str = Field(
        min_length=1,
        description="A hub dataset name, or a local .jsonl/.json/.csv/.parquet file or folder.",
    )
    split: str = "train"
    config: str | None = None
    text_field: str = Field(default="text", min_length=1)
    text_pair_field: str | None = None
    label_field: str | None = None
    format: Literal["text", "prompt_completion"] = "text"
    # For format=prompt_completion: the loss is on the completion tokens only.
    prompt_field: str = Field(default="prompt", min_length=1)
    completion_field: str = Field(default="completion", min_length=1)
    eval_split: str | None = None
    max_samples: int | None = Field(default=None, gt=0)


class TrainingSpec(BaseModel):
    model_config = _strict

    epochs: int | None = Field(default=1, gt=0)
    max_steps: int | None = Field(
        default=None, gt=0, description="Optimizer steps; when set, it wins over epochs."
    )
    learning_rate: float = Field(default=1e-5, gt=0, le=1)
    batch_size_per_worker: int = Field(default=1, gt=0, le=4096)
    gradient_accumulation_steps: int = Field(default=1, gt=0, le=4096)
    seq_length: int = Field(default=512, gt=1, le=1_048_576)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.01, ge=0)
    decay_bias_and_norm: bool = Field(
        default=False,
        description="Apply weight_decay to biases and norm weights too. Off by default, as "
        "in Hugging Face's Trainer; on gives one optimizer parameter group, as DeepSpeed's "
        "config-defined optimizer does.",
    )
    max_grad_norm: float = Field(default=1.0, ge=0)
    seed: int = Field(default=42, ge=0)
    packing: bool = False
    gradient_checkpointing: bool = False
    log_every_n_steps: int = Field(default=1, gt=0)
    # With dataset.eval_split: evaluate every N steps (None → only at the end).
    eval_every_n_steps: int | None = Field(default=None, gt=0)

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
    tensor_parallel_size: int = Field(default=1, gt=0)


class ResourcesSpec(BaseModel):
    model_config = _strict

    num_workers: int = Field(default=2, gt=0, le=1024)
    use_gpu: bool = False
    cpus_per_worker: float = Field(default=1, gt=0)
    gpus_per_worker: float | None = Field(default=None, gt=0)


class CheckpointingSpec(BaseModel):
    model_config = _strict

    every_n_steps: int | None = Field(default=None, gt=0)
    keep_last: int = Field(default=2, gt=0)
    export_hf: bool = True


class FaultToleranceSpec(BaseModel):
    model_config = _strict

    max_failures: int = Field(default=1, ge=0, le=100)


class RunRequest(BaseModel):
    """A fine-tuning run as a client asks for it."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        protected_namespaces=(),
        json_schema_extra={"examples": [GPT2_ZERO3, QWEN_AUTOTP, BERT_MRPC_ZERO3]},
    )

    model: str = Field(min_length=1, description="A hub model id or a local model folder.")
    task: Literal["causal_lm", "sequence_classification"] = "causal_lm"
    dataset: DatasetSpec
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    checkpointing: CheckpointingSpec = Field(default_factory=CheckpointingSpec)
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    metadata: dict[MetadataKey, MetadataValue] = Field(default_factory=dict, max_length=16)

    def worker_fields(self) -> dict[str, Any]:
        """The part of the request the worker trains from (metadata stays with the service)."""
        return self.model_dump(mode="json", exclude={"metadata"})
