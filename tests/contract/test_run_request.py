"""contract/run_request.py: the one definition of a run, read by the service and the worker."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from contract.job_env import SPEC_ENV
from contract.run_request import RunRequest, RunSpec


def _request(**overrides: Any) -> dict[str, Any]:
    return {"model": "/models/m", "dataset": {"source": "/data/d.jsonl"}, **overrides}


def _spec(**overrides: Any) -> RunSpec:
    return RunSpec.for_attempt(
        RunRequest.model_validate(_request(**overrides)).worker_fields(),
        run_id="run_x",
        attempt=2,
        storage_path="/srv/storage",
    )


class TestWhatTheWorkerReceives:
    def test_the_stored_request_plus_its_attempt_round_trips_through_json(self) -> None:
        spec = _spec(training={"max_steps": 5, "learning_rate": 3e-4}, deepspeed={"zero_stage": 2})
        again = RunSpec.model_validate_json(spec.model_dump_json())
        assert again == spec
        assert (again.run_id, again.attempt, again.storage_path) == ("run_x", 2, "/srv/storage")
        assert again.training.max_steps == 5

    def test_metadata_stays_with_the_service(self) -> None:
        request = RunRequest.model_validate(_request(metadata={"team": "a"}))
        assert "metadata" not in request.worker_fields()

    def test_from_env_reads_the_spec(self, monkeypatch: pytest.MonkeyPatch) -> None:
        spec = _spec()
        monkeypatch.setenv(SPEC_ENV, spec.model_dump_json())
        assert RunSpec.from_env() == spec

    def test_from_env_without_the_variable_names_it(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(SPEC_ENV, raising=False)
        with pytest.raises(RuntimeError, match=SPEC_ENV):
            RunSpec.from_env()

    def test_a_spec_without_its_attempt_is_refused(self) -> None:
        with pytest.raises(ValidationError, match="run_id"):
            RunSpec.model_validate({"model": "/m", "dataset": {"source": "/d"}})

    def test_data_parallel_size_divides_workers_by_tensor_parallel(self) -> None:
        spec = _spec(resources={"num_workers": 8}, deepspeed={"tensor_parallel_size": 2})
        assert spec.data_parallel_size == 4


class TestFaultToleranceBudgets:
    def test_both_budgets_have_defaults(self) -> None:
        budgets = RunRequest.model_validate(_request()).fault_tolerance
        assert (budgets.max_failures, budgets.max_resubmits) == (1, 1)

    def test_max_failures_is_still_accepted_as_the_in_job_budget(self) -> None:
        budgets = RunRequest.model_validate(
            _request(fault_tolerance={"max_failures": 3})
        ).fault_tolerance
        assert (budgets.max_failures, budgets.max_resubmits) == (3, 1)

    def test_the_stored_specs_of_older_runs_still_load(self) -> None:
        old = RunRequest.model_validate(_request()).worker_fields()
        old["fault_tolerance"] = {"max_failures": 2}
        assert RunRequest.model_validate(old).fault_tolerance.max_resubmits == 1


class TestRefused:
    @pytest.mark.parametrize(
        "body",
        [
            _request(learning_rat=0.1),
            _request(dataset={"source": "/d.jsonl", "txt_field": "body"}),
            _request(deepspeed={"zero_stage": 4}),
            _request(training={"epochs": None}),
        ],
    )
    def test_unknown_or_out_of_range_fields(self, body: dict[str, Any]) -> None:
        with pytest.raises(ValidationError):
            RunRequest.model_validate(body)

    @pytest.mark.parametrize(("epochs", "max_steps"), [(None, 10), (2, None), (2, 10)])
    def test_either_length_is_enough(self, epochs: int | None, max_steps: int | None) -> None:
        training = RunRequest.model_validate(
            _request(training={"epochs": epochs, "max_steps": max_steps})
        ).training
        assert (training.epochs, training.max_steps) == (epochs, max_steps)

    @pytest.mark.parametrize("gpus", [0.5, 1.5, 0.25])
    def test_a_fraction_of_a_gpu_is_refused_with_the_reason(self, gpus: float) -> None:
        with pytest.raises(ValidationError) as caught:
            RunRequest.model_validate(
                _request(resources={"use_gpu": True, "gpus_per_worker": gpus})
            )
        (error,) = caught.value.errors()
        assert error["loc"] == ("resources", "gpus_per_worker")
        assert "whole number" in error["msg"] and "two ranks on one device" in error["msg"]

    @pytest.mark.parametrize(("given", "kept"), [(1, 1), (2.0, 2), (8, 8)])
    def test_whole_gpus_are_accepted(self, given: float, kept: int) -> None:
        resources = RunRequest.model_validate(
            _request(resources={"use_gpu": True, "gpus_per_worker": given})
        ).resources
        assert resources.gpus_per_worker == kept and isinstance(resources.gpus_per_worker, int)

    def test_zero_gpus_and_zero_threads_are_refused(self) -> None:
        for resources in ({"gpus_per_worker": 0}, {"cpu_threads_per_worker": 0}):
            with pytest.raises(ValidationError):
                RunRequest.model_validate(_request(resources=resources))


def test_the_contract_imports_neither_torch_nor_the_service() -> None:
    """It ships to the cluster without the service, and validation must not load torch."""
    code = (
        "import sys, contract.run_request, contract.datasets, contract.steps, contract.job_env;"
        "print(sorted(m for m in ('torch', 'app', 'worker', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []
