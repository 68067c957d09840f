"""fp32 means fp32: a checkpoint saved in bf16 (as Qwen2.5 and Llama 3 ship) trained with
`precision: fp32` trains and exports in fp32. transformers 5 loads a checkpoint in its own
dtype unless told otherwise, which made such a run train in bf16, silently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.cli.tiny_assets import write_jsonl_dataset
from tests.e2e.conftest import Service
from tests.e2e.helpers import assert_export_matches_engine, assert_succeeded

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_models_root: Path, tiny_model_dir: Path) -> Path:
    folder = tiny_models_root / "gpt2-bf16"
    if not (folder / "config.json").is_file():
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(
            folder
        )
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    return folder


def test_a_bf16_checkpoint_trained_in_fp32_under_zero3_exports_fp32(
    service: Service, bf16_checkpoint: Path
) -> None:
    data = write_jsonl_dataset(service.data_dir / "news-precision.jsonl", rows=64, seed=9)
    run = service.wait_terminal(
        service.submit(
            {
                "model": str(bf16_checkpoint),
                "dataset": {"source": str(data)},
                "training": {"max_steps": 2, "batch_size_per_worker": 4, "seq_length": 32},
                "deepspeed": {"zero_stage": 3, "precision": "fp32"},
                "resources": {"num_workers": 2},
            }
        )["id"]
    )
    assert_succeeded(service, run)

    export = Path(run["output"]["model_path"])
    assert json.loads((export / "config.json").read_text())["dtype"] == "float32"
    weights = load_file(export / "model.safetensors")
    assert {str(t.dtype) for t in weights.values()} == {"torch.float32"}
    # fp32 to rounding: the export check's fp32 tolerance applies.
    model = assert_export_matches_engine(run, auto=AutoModelForCausalLM)
    assert model.dtype == torch.float32
