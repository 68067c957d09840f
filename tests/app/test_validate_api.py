"""POST /v1/runs/validate: the same checks, nothing stored, the resolved config and costs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from app.settings import Settings
from app.storage.models import Run
from contract.deepspeed_config import resolve_deepspeed_config
from contract.run_request import RunSpec
from tests.app.test_dispatch import ScriptedRay, dispatch_to
from tests.factories import run_request
from worker.training.loop import model_hidden_size

MODES: dict[str, dict[str, Any]] = {
    "zero0": {"zero_stage": 0},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero2-offload-optimizer": {"zero_stage": 2, "offload_optimizer": "cpu"},
    "zero3-offload-all": {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "zero3-bf16": {"zero_stage": 3, "precision": "bf16"},
    "autotp-zero1": {"zero_stage": 1, "tensor_parallel_size": 2},
    "autotp-zero3": {"zero_stage": 3, "tensor_parallel_size": 2},
}


def _tiny_request(tmp_path: Path, tiny_model_dir: Path, **overrides: Any) -> dict[str, Any]:
    return run_request(tmp_path, model=str(tiny_model_dir), **overrides)


class TestValidate:
    @pytest.mark.parametrize("mode", sorted(MODES))
    def test_resolved_config_is_exactly_what_the_worker_builds(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        tiny_model_dir: Path,
        settings: Settings,
        session_factory: sessionmaker[Session],
        mode: str,
    ) -> None:
        body = _tiny_request(tmp_path, tiny_model_dir, deepspeed=MODES[mode])
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        assert report["valid"] is True, report["errors"]

        # Now create and dispatch it, and build the config the way the worker does.
        client.post("/v1/runs", json=body, headers=auth)
        ray = dispatch_to(ScriptedRay(), settings, session_factory)
        spec = RunSpec.model_validate(
            json.loads(ray.submitted[0]["runtime_env"]["env_vars"]["TUNEYARD_RUN_SPEC"])
        )
        # Bucket sizes included: the worker sizes them from the model's hidden size.
        assert report["resolved"]["deepspeed_config"] == resolve_deepspeed_config(
            spec, hidden_size=model_hidden_size(spec)
        )
        zero = report["resolved"]["deepspeed_config"]["zero_optimization"]
        assert zero["stage"] == MODES[mode]["zero_stage"]
        if MODES[mode].get("offload_optimizer") == "cpu":
            assert zero["offload_optimizer"]["device"] == "cpu"
        if MODES[mode].get("offload_params") == "cpu":
            assert zero["offload_param"]["device"] == "cpu"

    def test_batch_sizes_and_steps(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        body = _tiny_request(
            tmp_path,
            tiny_model_dir,
            training={
                "batch_size_per_worker": 4,
                "gradient_accumulation_steps": 3,
                "max_steps": 7,
                "seq_length": 32,
            },
            resources={"num_workers": 2},
        )
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        resolved = report["resolved"]
        assert resolved["global_batch_size"] == 4 * 3 * 2
        assert resolved["deepspeed_config"]["train_batch_size"] == 24
        assert resolved["total_steps"] == 7
        assert resolved["precision"] == "fp32"  # auto on CPU
        assert report["estimate"]["tokens_per_step"] == 24 * 32

    def test_estimate_counts_the_models_parameters(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        real = sum(p.numel() for p in model.parameters())
        estimates = {}
        for stage in (0, 1, 2, 3):
            body = _tiny_request(tmp_path, tiny_model_dir, deepspeed={"zero_stage": stage})
            report = client.post("/v1/runs/validate", json=body, headers=auth).json()
            assert report["estimate"]["parameters"] == real
            estimates[stage] = report["estimate"]["model_states_bytes_per_worker"]
        # fp32 Adam on CPU: 4 + 4 + 8 bytes per parameter, partitioned over 2 data-parallel ranks.
        assert estimates[0]["total"] == 16 * real
        assert estimates[1]["total"] == (4 + 4 + 4) * real
        assert estimates[2]["total"] == (4 + 2 + 4) * real
        assert estimates[3]["total"] == 8 * real

    def test_offload_moves_bytes_off_the_device(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        body = _tiny_request(
            tmp_path,
            tiny_model_dir,
            deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
        )
        states = client.post("/v1/runs/validate", json=body, headers=auth).json()["estimate"][
            "model_states_bytes_per_worker"
        ]
        assert states["offloaded_to_cpu"] == states["optimizer_states"] + states["parameters"]
        assert states["on_device"] == states["gradients"]

    def test_estimate_breaks_memory_down_for_a_local_model(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        body = _tiny_request(tmp_path, tiny_model_dir, deepspeed={"zero_stage": 3})
        report = client.post("/v1/runs/validate", json=body, headers=auth).json()
        zero = report["resolved"]["deepspeed_config"]["zero_optimization"]
        # The tiny GPT-2's n_embd is 32: buckets sized from it, not DeepSpeed's 5e8.
        assert zero["reduce_bucket_size"] == 32 * 32
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 32 * 32)
        assert zero["stage3_param_persistence_threshold"] == 10 * 32

        estimate = report["estimate"]
        memory = estimate["memory_per_worker"]
        assert {
            "runtime",
            "parameters",
            "persistent_parameters",
            "gathered_parameters",
            "gradients",
            "optimizer_states",
            "optimizer_step_temporaries",
            "fp32_master_copy",
            "zero_buckets",
            "activations",
            "load_time_peak",
        } <= set(memory["lines"])
        lines = memory["lines"]
        # A CPU run: host memory only.
        assert all(line["device"] == 0 for line in lines.values())
        assert lines["zero_buckets"]["host"] == 4 * zero["reduce_bucket_size"]
        parameters = estimate["parameters"]
        assert lines["parameters"]["host"] == 4 * parameters // 2  # partitioned over 2
        assert lines["fp32_master_copy"]["host"] == 4 * parameters // 2
        training = sum(v["host"] for k, v in lines.items() if k != "load_time_peak")
        assert memory["peak"]["total"] == memory["peak"]["host"] >= training
        assert memory["gradient_checkpointing"] is False
        # The keys clients already read are still there.
        assert estimate["model_states_bytes_per_worker"]["total"] > 0
        assert estimate["tokens_per_step"] == 2 * 2 * 32

    def test_gradient_checkpointing_lowers_the_activations_line(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        activations = {}
        for checkpointing in (False, True):
            body = _tiny_request(
                tmp_path,
                tiny_model_dir,
                training={"gradient_checkpointing": checkpointing, "seq_length": 128},
            )
            memory = client.post("/v1/runs/validate", json=body, headers=auth).json()["estimate"][
                "memory_per_worker"
            ]
            activations[checkpointing] = memory["lines"]["activations"]["host"]
        assert activations[True] < activations[False]

    def test_no_breakdown_for_a_model_without_safetensors(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path
    ) -> None:
        report = client.post("/v1/runs/validate", json=run_request(tmp_path), headers=auth).json()
        assert report["valid"] is True
        assert report["estimate"]["memory_per_worker"] is None
        assert report["estimate"]["parameters"] is None
        zero = report["resolved"]["deepspeed_config"]["zero_optimization"]
        assert "reduce_bucket_size" not in zero  # no hidden size: DeepSpeed's defaults

    def test_total_steps_from_an_uploaded_files_records(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, tiny_model_dir: Path
    ) -> None:
        lines = "".join(json.dumps({"text": f"line {i} here"}) + "\n" for i in range(100))
        file_id = client.post(
            "/v1/files", files={"file": ("d.jsonl", lines.encode())}, headers=auth
        ).json()["id"]
        body = _tiny_request(
            tmp_path,
            tiny_model_dir,
            dataset={"source": file_id},
            training={"max_steps": None, "epochs": 3, "batch_size_per_worker": 5},
        )
        resolved = client.post("/v1/runs/validate", json=body, headers=auth).json()["resolved"]
        assert resolved["steps_per_epoch"] == 100 // (5 * 2)
        assert resolved["total_steps"] == 3 * 10

    def test_problems_come_back_as_a_report_not_an_error(
        self,
        client: TestClient,
        auth: dict[str, str],
        tmp_path: Path,
        session_factory: sessionmaker[Session],
    ) -> None:
        body = run_request(tmp_path, training={"learning_rate": "fast", "bogus": 1})
        response = client.post("/v1/runs/validate", json=body, headers=auth)
        assert response.status_code == 200
        report = response.json()
        assert report["valid"] is False
        assert {e["field"] for e in report["errors"]} == {
            "training.learning_rate",
            "training.bogus",
        }
        assert report["resolved"] is None

        rules = run_request(tmp_path, deepspeed={"zero_stage": 0, "offload_optimizer": "cpu"})
        report = client.post("/v1/runs/validate", json=rules, headers=auth).json()
        assert report["valid"] is False
        assert report["errors"][0]["field"] == "deepspeed.offload_optimizer"
        with session_factory() as session:
            assert session.scalar(select(func.count()).select_from(Run)) == 0

    @pytest.mark.parametrize("cpus", [5e-324, 1e-5, 0])
    def test_a_vanishing_cpu_share_is_a_field_error_not_a_500(
        self, client: TestClient, auth: dict[str, str], tmp_path: Path, cpus: float
    ) -> None:
        # schemathesis found 5e-324: the placement rule divided a node's CPUs by it and
        # turned infinity into an integer.
        body = run_request(tmp_path, resources={"num_workers": 1, "cpus_per_worker": cpus})
        response = client.post("/v1/runs/validate", json=body, headers=auth)
        assert response.status_code == 200, response.text
        report = response.json()
        assert report["valid"] is False
        assert [e["field"] for e in report["errors"]] == ["resources.cpus_per_worker"]

    def test_needs_an_api_key(self, client: TestClient, tmp_path: Path) -> None:
        assert client.post("/v1/runs/validate", json=run_request(tmp_path)).status_code == 401


def test_validating_a_request_does_not_load_torch(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The service validates with the contract, the safetensors headers and transformers'
    registry read as data: a fresh service process answers /validate without torch."""
    import subprocess
    import sys

    body = _tiny_request(tmp_path, tiny_model_dir)
    script = f"""
import json, sys
from fastapi.testclient import TestClient
from app.main import create_app
from app.settings import Settings

settings = Settings(home={str(tmp_path / "fresh")!r}, auth="disabled",
                    allowed_roots={f"{tmp_path}:{tiny_model_dir}"!r})
with TestClient(create_app(settings, start_background=False)) as client:
    report = client.post("/v1/runs/validate", json={body!r}).json()
print(json.dumps({{"valid": report["valid"], "parameters": report["estimate"]["parameters"],
                  "torch": "torch" in sys.modules}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=Path.cwd()
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["valid"] is True
    assert result["parameters"] > 0
    assert result["torch"] is False
