"""app/services/rules/model_files.py: what validation reads from files, not importing torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.services.rules.model_files import checkpoint_parameters, trainable_model_types


@pytest.mark.parametrize(
    ("task", "table"),
    [
        ("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
        ("sequence_classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
    ],
)
def test_the_registry_read_as_data_is_the_one_transformers_imports(task: str, table: str) -> None:
    from transformers.models.auto import modeling_auto

    assert trainable_model_types(task) == frozenset(getattr(modeling_auto, table))
    assert "llama" in (trainable_model_types(task) or ())


def test_parameters_are_counted_from_the_safetensors_headers(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert checkpoint_parameters(tiny_llama_dir) == sum(p.numel() for p in model.parameters())


def test_a_folder_without_safetensors_has_no_count(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    assert checkpoint_parameters(tmp_path) is None
