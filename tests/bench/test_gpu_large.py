"""bench/gpu_large.py without a GPU: the model's size, the request it submits, the service's
estimate it reads, and the band it judges the measured peak by. Its dry run trains for real
(`python -m bench.gpu_large --dry-run`, a service and a run: too long for the suite)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bench import gpu_check, gpu_large
from bench.gpu_check import CheckSettings
from bench.gpu_large import LARGE_MODEL
from contract.run_request import RunRequest

DRY = gpu_large.settings_for(dry_run=True)
GPU = gpu_large.settings_for(dry_run=False)
GIB = 1 << 30


def test_the_model_is_about_one_and_a_half_billion_parameters() -> None:
    vocab, h, i, layers = 512, LARGE_MODEL.hidden_size, LARGE_MODEL.intermediate_size, 30
    config = gpu_check.llama_config(LARGE_MODEL, vocab_size=vocab, max_positions=2048)
    facts = gpu_check.facts_of(config)
    expected = layers * (4 * h * h + 3 * h * i + 2 * h) + 2 * vocab * h + h
    assert facts.parameters == expected
    assert 1.45e9 < facts.parameters < 1.6e9
    assert LARGE_MODEL.hidden_size // LARGE_MODEL.num_heads == 128


@pytest.mark.parametrize("settings", [DRY, GPU], ids=["dry", "gpu"])
def test_the_request_is_zero3_with_checkpointing_at_its_sequence_length(
    tmp_path: Path, settings: CheckSettings
) -> None:
    body = gpu_large.run_request(tmp_path / "model", tmp_path / "data.jsonl", settings=settings)
    request = RunRequest.model_validate(body)
    assert request.deepspeed.zero_stage == 3
    assert request.training.gradient_checkpointing is True
    assert request.training.packing is True
    assert request.training.seq_length == settings.seq_length
    assert request.resources.num_workers == 1
    assert request.resources.use_gpu is settings.use_gpu
    assert request.deepspeed.precision == ("bf16" if settings.use_gpu else "fp32")


def test_gpu_defaults_are_the_issues_shape() -> None:
    assert (GPU.seq_length, GPU.precision, GPU.use_gpu) == (2048, "bf16", True)
    # As many tokens a step as the 0.5B check's 8 x 1024.
    assert GPU.batch_size * GPU.seq_length == 8 * 1024
    assert GPU.dataset_rows() * 8 >= GPU.steps * GPU.batch_size * GPU.seq_length
    assert GPU.warmup_steps < GPU.steps


@pytest.mark.parametrize(
    ("measured", "estimate", "inside"),
    [(8, 10, True), (12.5, 10, True), (10, 10, True), (7.9, 10, False), (12.6, 10, False)],
)
def test_the_band_is_point_8_to_1_25_of_the_estimate(
    measured: float, estimate: float, inside: bool
) -> None:
    assert gpu_large.within_band(measured, estimate) is inside


def test_no_estimate_is_never_within_the_band() -> None:
    assert gpu_large.within_band(1.0, 0) is False


def test_a_refused_request_or_a_missing_estimate_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="refused"):
        gpu_large.estimated_peak({"valid": False, "errors": ["model"]}, on_gpu=True)
    with pytest.raises(RuntimeError, match="no memory estimate"):
        gpu_large.estimated_peak(
            {"valid": True, "estimate": {"memory_per_worker": None}}, on_gpu=True
        )


def test_the_row_names_where_the_peak_was_measured() -> None:
    row = gpu_large.table_row(
        parameters=1_520_000_000,
        tokens_per_second=30_000.0,
        util=0.42,
        measured=30 * GIB,
        estimate=25 * GIB,
        memory_kind="gpu_allocated",
    )
    assert row["parameters"] == "1,520,000,000"
    assert row["MFU"] == "42.0%"
    assert row["peak GPU (GiB)"] == "30.00"
    assert row["estimated GPU (GiB)"] == "25.00"
    assert row["measured / estimate"] == "1.20"
    cpu = gpu_large.table_row(
        parameters=1,
        tokens_per_second=1.0,
        util=None,
        measured=None,
        estimate=GIB,
        memory_kind="rss",
    )
    assert (cpu["MFU"], cpu["peak RSS (GiB)"], cpu["measured / estimate"]) == ("n/a", "n/a", "n/a")


@pytest.fixture(scope="module")
def dry_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return gpu_large.build_assets(tmp_path_factory.mktemp("gpu-large") / "assets", DRY)


def test_the_service_estimates_the_dry_runs_request(
    client: TestClient, auth: dict[str, str], dry_assets: tuple[Path, Path]
) -> None:
    model, data = dry_assets
    body = gpu_large.run_request(model, data, settings=DRY)
    report = client.post("/v1/runs/validate", json=body, headers=auth).json()
    peak = gpu_large.estimated_peak(report, on_gpu=False)
    memory = report["estimate"]["memory_per_worker"]
    assert memory["gradient_checkpointing"] is True
    assert peak == memory["peak"]["host"] > 0
    assert memory["peak"]["device"] == 0  # a CPU run keeps nothing on a device


def _header_only_checkpoint(folder: Path, config: object) -> None:
    """A safetensors file of the model's tensor names, shapes and dtype (bf16, as
    build_llama saves it) and no data: all the service's estimate reads of a model."""
    import json
    import struct

    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        module = AutoModelForCausalLM.from_config(config)
    header: dict[str, object] = {}
    offset = 0
    for name, tensor in module.state_dict().items():
        size = 2 * tensor.numel()
        header[name] = {
            "dtype": "BF16",
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)


def test_by_the_services_estimate_the_gpu_run_fits_an_80_gb_gpu(tmp_path: Path) -> None:
    """The check's own request, costed as /v1/runs/validate costs it (the files' headers,
    the resolved DeepSpeed config): what it will be measured against on the GPU."""
    from app.services.estimates import ModelFacts, memory_per_worker
    from contract.deepspeed_config import resolve_deepspeed_config
    from contract.run_request import RunDefinition

    config = gpu_check.llama_config(LARGE_MODEL, vocab_size=512, max_positions=GPU.seq_length)
    folder = tmp_path / "llama-1.5b"
    _header_only_checkpoint(folder, config)
    model = ModelFacts.read(folder, config.to_dict())
    assert model is not None and 1.45e9 < model.parameters < 1.6e9
    body = gpu_large.run_request(folder, tmp_path / "data.jsonl", settings=GPU)
    spec = RunDefinition.model_validate(RunRequest.model_validate(body).worker_fields())
    ds_config = resolve_deepspeed_config(spec, hidden_size=LARGE_MODEL.hidden_size)
    memory = memory_per_worker(spec, model, ds_config)
    device = memory["peak"]["device"]
    # Model states alone are 16 bytes a parameter (bf16 weights and gradients, fp32 master
    # and Adam's two moments, one worker: nothing partitioned away); the rest is smaller.
    assert 16 * model.parameters < device < 40 * GIB, device / GIB
    assert memory["gradient_checkpointing"] is True
    assert memory["lines"]["optimizer_step_temporaries"]["device"] == 0  # fused AdamW
