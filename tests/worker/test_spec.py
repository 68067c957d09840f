"""worker/spec.py: the worker's typed view of a run, and its agreement with the service's schema."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from pydantic import BaseModel

from app.schemas import run_request as service
from worker import spec as worker
from worker.spec import SPEC_ENV, RunSpec

# What the dispatcher adds to the request (app/dispatch.py) and what stays with the service.
WORKER_ONLY_FIELDS = {"run_id", "attempt", "storage_path"}
SERVICE_ONLY_FIELDS = {"metadata"}

# Each group of the request as the service validates it and as the worker reads it.
GROUP_PAIRS = [
    (service.DatasetSpec, worker.DatasetSpec),
    (service.TrainingSpec, worker.TrainingSpec),
    (service.DeepSpeedSpec, worker.DeepSpeedSpec),
    (service.ResourcesSpec, worker.ResourcesSpec),
    (service.CheckpointingSpec, worker.CheckpointingSpec),
    (service.FaultToleranceSpec, worker.FaultToleranceSpec),
]

_REQUIRED = object()


def minimal_spec_dict(**overrides: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "run_id": "run_abc",
        "attempt": 2,
        "storage_path": "/srv/tuneyard/storage",
        "model": "/models/tiny-gpt2",
        "dataset": {"source": "/data/train.jsonl"},
    }
    data.update(overrides)
    return data


def full_spec_dict() -> dict[str, Any]:
    """Fields set away from their defaults, so a dropped or renamed field shows."""
    return {
        "run_id": "run_full",
        "attempt": 3,
        "storage_path": "/srv/storage",
        "model": "/models/m",
        "task": "causal_lm",
        "dataset": {
            "source": "/data/d.jsonl",
            "split": "validation",
            "config": "default",
            "text_field": "body",
            "text_pair_field": "pair",
            "label_field": "label",
            "format": "text",
            "eval_split": "test",
            "max_samples": 100,
        },
        "training": {
            "epochs": 3,
            "max_steps": 40,
            "learning_rate": 3e-4,
            "batch_size_per_worker": 4,
            "gradient_accumulation_steps": 2,
            "seq_length": 64,
            "lr_scheduler": "cosine",
            "warmup_steps": 5,
            "weight_decay": 0.1,
            "max_grad_norm": 0.5,
            "seed": 7,
            "packing": True,
            "gradient_checkpointing": True,
            "log_every_n_steps": 5,
        },
        "deepspeed": {
            "zero_stage": 2,
            "precision": "bf16",
            "offload_optimizer": "cpu",
            "offload_params": "none",
            "tensor_parallel_size": 2,
        },
        "resources": {
            "num_workers": 4,
            "use_gpu": True,
            "cpus_per_worker": 2.5,
            "gpus_per_worker": 0.5,
        },
        "checkpointing": {"every_n_steps": 10, "keep_last": 3, "export_hf": False},
        "fault_tolerance": {"max_failures": 4},
    }


def assert_includes(actual: dict[str, Any], expected: dict[str, Any], where: str = "") -> None:
    """Every value in `expected` is in `actual` (fields added later may be there too)."""
    for key, value in expected.items():
        assert key in actual, f"{where}{key} missing"
        if isinstance(value, dict):
            assert_includes(actual[key], value, f"{where}{key}.")
        else:
            assert actual[key] == value, f"{where}{key}"
            assert type(actual[key]) is type(value), f"{where}{key} type"


def pydantic_defaults(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        if info.is_required():
            out[name] = _REQUIRED
            continue
        value = info.get_default(call_default_factory=True)
        out[name] = value.model_dump() if isinstance(value, BaseModel) else value
    return out


def dataclass_defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            value = _REQUIRED
        out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


class TestRoundTrip:
    def test_full_spec_survives_to_dict_and_json(self) -> None:
        data = full_spec_dict()
        spec = RunSpec.from_dict(data)

        assert_includes(spec.to_dict(), data)
        again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
        assert again == spec
        assert isinstance(again.training, worker.TrainingSpec)
        assert again.training.learning_rate == 3e-4
        assert again.resources.gpus_per_worker == 0.5

    def test_minimal_spec_fills_defaults(self) -> None:
        spec = RunSpec.from_dict(minimal_spec_dict())

        assert spec.dataset.source == "/data/train.jsonl"
        assert spec.dataset.text_field == "text"
        assert spec.training == worker.TrainingSpec()
        assert spec.deepspeed.zero_stage == 3
        assert RunSpec.from_dict(spec.to_dict()) == spec

    def test_what_the_service_sends_is_read_back_unchanged(self) -> None:
        """The dispatcher's spec: the validated request with defaults, plus run identity."""
        request = service.RunRequest(
            model="/models/m",
            dataset={"source": "/data/d.jsonl"},
            training={"max_steps": 5},
            metadata={"team": "a"},
        )
        sent = {
            **request.worker_fields(),
            "run_id": "run_x",
            "attempt": 1,
            "storage_path": "/s",
        }

        spec = RunSpec.from_dict(json.loads(json.dumps(sent)))

        assert spec.to_dict() == sent
        assert spec.training.max_steps == 5

    def test_from_env_reads_the_spec(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv(SPEC_ENV, json.dumps(full_spec_dict()))
        assert RunSpec.from_env() == RunSpec.from_dict(full_spec_dict())

    def test_from_env_without_the_variable_names_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(SPEC_ENV, raising=False)
        with pytest.raises(RuntimeError, match=SPEC_ENV):
            RunSpec.from_env()


class TestValidation:
    def test_unknown_top_level_fields_are_named(self) -> None:
        data = minimal_spec_dict(learning_rat=0.1, metadata={"a": "b"})
        with pytest.raises(ValueError, match="unknown run spec fields") as err:
            RunSpec.from_dict(data)
        assert "learning_rat" in str(err.value)
        assert "metadata" in str(err.value)

    def test_unknown_group_field_is_named(self) -> None:
        data = minimal_spec_dict(dataset={"source": "/d.jsonl", "txt_field": "body"})
        # The group dataclass refuses it (TypeError today); what matters is that it is named.
        with pytest.raises((TypeError, ValueError), match="txt_field"):
            RunSpec.from_dict(data)

    def test_missing_required_field_is_refused(self) -> None:
        data = minimal_spec_dict()
        del data["model"]
        with pytest.raises(TypeError, match="model"):
            RunSpec.from_dict(data)

    def test_training_needs_epochs_or_max_steps(self) -> None:
        with pytest.raises(ValueError, match="epochs or max_steps"):
            worker.TrainingSpec(epochs=None, max_steps=None)
        with pytest.raises(ValueError, match="epochs or max_steps"):
            RunSpec.from_dict(minimal_spec_dict(training={"epochs": None}))

    @pytest.mark.parametrize(("epochs", "max_steps"), [(None, 10), (2, None), (2, 10)])
    def test_either_length_is_enough(self, epochs: int | None, max_steps: int | None) -> None:
        training = worker.TrainingSpec(epochs=epochs, max_steps=max_steps)
        assert (training.epochs, training.max_steps) == (epochs, max_steps)

    def test_zero_stage_outside_0_to_3_is_refused(self) -> None:
        with pytest.raises(ValueError, match="zero_stage"):
            RunSpec.from_dict(minimal_spec_dict(deepspeed={"zero_stage": 4}))

    def test_data_parallel_size_divides_workers_by_tensor_parallel(self) -> None:
        spec = RunSpec.from_dict(
            minimal_spec_dict(resources={"num_workers": 8}, deepspeed={"tensor_parallel_size": 2})
        )
        assert spec.data_parallel_size == 4


class TestDefaultsMatchTheService:
    """The worker does not import the service's pydantic models; this keeps them in step."""

    @pytest.mark.parametrize(
        ("service_model", "worker_cls"), GROUP_PAIRS, ids=[p[1].__name__ for p in GROUP_PAIRS]
    )
    def test_group_fields_and_defaults(
        self, service_model: type[BaseModel], worker_cls: type
    ) -> None:
        expected = pydantic_defaults(service_model)
        actual = dataclass_defaults(worker_cls)

        assert set(actual) == set(expected), "field names differ"
        for name, value in expected.items():
            assert actual[name] == value, f"{worker_cls.__name__}.{name}"
            assert type(actual[name]) is type(value), f"{worker_cls.__name__}.{name} type"

    def test_run_request_fields_and_defaults(self) -> None:
        expected = pydantic_defaults(service.RunRequest)
        actual = dataclass_defaults(RunSpec)
        for name in SERVICE_ONLY_FIELDS:
            del expected[name]
        for name in WORKER_ONLY_FIELDS:
            assert actual.pop(name) is _REQUIRED, f"RunSpec.{name} must be required"

        assert set(actual) == set(expected), "field names differ"
        for name, value in expected.items():
            assert actual[name] == value, f"RunSpec.{name}"
