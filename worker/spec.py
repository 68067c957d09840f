"""The worker's typed view of a run: what the service sends, checked again on arrival.

The worker ships to the cluster on its own (runtime_env py_modules), so it does not import
the service's pydantic models; tests/worker/test_spec.py keeps the two in step.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

SPEC_ENV = "TUNEYARD_RUN_SPEC"
TOKEN_ENV = "TUNEYARD_RUN_TOKEN"
CALLBACK_URL_ENV = "TUNEYARD_CALLBACK_URL"


@dataclass(kw_only=True, slots=True)
class DatasetSpec:
    source: str
    split: str = "train"
    config: str | None = None
    text_field: str = "text"
    text_pair_field: str | None = None
    label_field: str | None = None
    format: str = "text"
    prompt_field: str = "prompt"
    completion_field: str = "completion"
    eval_split: str | None = None
    max_samples: int | None = None


@dataclass(kw_only=True, slots=True)
class TrainingSpec:
    epochs: int | None = 1
    max_steps: int | None = None
    learning_rate: float = 1e-5
    batch_size_per_worker: int = 1
    gradient_accumulation_steps: int = 1
    seq_length: int = 512
    lr_scheduler: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.01
    decay_bias_and_norm: bool = False
    max_grad_norm: float = 1.0
    seed: int = 42
    packing: bool = False
    gradient_checkpointing: bool = False
    log_every_n_steps: int = 1
    eval_every_n_steps: int | None = None

    def __post_init__(self) -> None:
        if self.max_steps is None and self.epochs is None:
            raise ValueError("training needs epochs or max_steps")


@dataclass(kw_only=True, slots=True)
class DeepSpeedSpec:
    zero_stage: int = 3
    precision: str = "auto"
    offload_optimizer: str = "none"
    offload_params: str = "none"
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")


@dataclass(kw_only=True, slots=True)
class ResourcesSpec:
    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1
    gpus_per_worker: float | None = None


@dataclass(kw_only=True, slots=True)
class CheckpointingSpec:
    every_n_steps: int | None = None
    keep_last: int = 2
    export_hf: bool = True


@dataclass(kw_only=True, slots=True)
class FaultToleranceSpec:
    max_failures: int = 1


@dataclass(kw_only=True, slots=True)
class RunSpec:
    """Everything one attempt of a run needs; JSON-serialisable both ways."""

    run_id: str
    attempt: int
    storage_path: str
    model: str
    task: str = "causal_lm"
    dataset: DatasetSpec
    training: TrainingSpec = field(default_factory=TrainingSpec)
    deepspeed: DeepSpeedSpec = field(default_factory=DeepSpeedSpec)
    resources: ResourcesSpec = field(default_factory=ResourcesSpec)
    checkpointing: CheckpointingSpec = field(default_factory=CheckpointingSpec)
    fault_tolerance: FaultToleranceSpec = field(default_factory=FaultToleranceSpec)

    @property
    def data_parallel_size(self) -> int:
        return self.resources.num_workers // self.deepspeed.tensor_parallel_size

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSpec:
        groups = {
            "dataset": DatasetSpec,
            "training": TrainingSpec,
            "deepspeed": DeepSpeedSpec,
            "resources": ResourcesSpec,
            "checkpointing": CheckpointingSpec,
            "fault_tolerance": FaultToleranceSpec,
        }
        unknown = set(data) - {f.name for f in fields(cls)}
        for name, group in groups.items():
            value = data.get(name)
            if name in data and not isinstance(value, dict):
                raise ValueError(f"run spec field {name!r} must be an object")
            if isinstance(value, dict):
                unknown |= {f"{name}.{k}" for k in set(value) - {f.name for f in fields(group)}}
        if unknown:
            raise ValueError(f"unknown run spec fields: {sorted(unknown)}")
        kwargs = {k: (groups[k](**v) if k in groups else v) for k, v in data.items()}
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        def convert(obj: Any) -> Any:
            if hasattr(obj, "__dataclass_fields__"):
                return {f.name: convert(getattr(obj, f.name)) for f in fields(obj)}
            return obj

        result: dict[str, Any] = convert(self)
        return result

    @classmethod
    def from_env(cls) -> RunSpec:
        raw = os.environ.get(SPEC_ENV)
        if not raw:
            raise RuntimeError(f"{SPEC_ENV} is not set: this entry point runs as a tuneyard job")
        return cls.from_dict(json.loads(raw))
